"""The work of one run of a compiled executable on one device, from its optimised HLO: matmul
FLOPs and HBM bytes, each loop's body counted once per iteration (`hlo_cost`)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

from jaxrl_tools.targets import hlo
from jaxrl_tools.targets.hlo import Instr


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one run of an executable computes and moves on one device.

    flops: matmul FLOPs (dots, convolutions, cuBLAS GEMMs and cuDNN attention: 2 per
      multiply-add; elementwise work is not counted, nor a matmul the compiler wrote as a
      multiply and a reduction, e.g. a one-row matrix-vector product on TPU).
    bytes: HBM bytes read and written by its kernels (fusions, collectives, copies; reads of
      a slice of an operand count the slice), each loop's body once per iteration.
    unknown_loops: loops whose trip count could not be read (counted once).
    conditionals: conditionals in the program, each counted at its costlier branch (e.g. the
      chunked attention's test for a block above the causal diagonal: all blocks counted).
    collective_bytes: the part of `bytes` moved by collectives (all-gather, all-reduce,
      reduce-scatter, all-to-all, collective-permute): the traffic that crosses devices.
    """

    flops: float
    bytes: float
    unknown_loops: int = 0
    conditionals: int = 0
    collective_bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.unknown_loops + other.unknown_loops,
            self.conditionals + other.conditionals,
            self.collective_bytes + other.collective_bytes,
        )

    def __mul__(self, n: float) -> Cost:
        return dataclasses.replace(
            self,
            flops=self.flops * n,
            bytes=self.bytes * n,
            collective_bytes=self.collective_bytes * n,
        )


_ZERO = Cost(0.0, 0.0)


class _Module:
    def __init__(self, text: str):
        self.comps, self.entry = hlo.parse(text)
        self.instrs = {i.name: i for instrs in self.comps.values() for i in instrs}
        self.shapes = {name: i.shape for name, i in self.instrs.items()}
        self._memo: dict[str, Cost] = {}

    # -- flops
    def dot_flops(self, i: Instr) -> float:
        lhs = hlo.dims(self.shapes.get(i.operands[0], "")) if i.operands else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
        contracting = [int(x) for x in m[1].split(",") if x] if m else []
        k = math.prod(lhs[d] for d in contracting if d < len(lhs))
        return 2.0 * math.prod(hlo.dims(i.shape)) * k

    def conv_flops(self, i: Instr) -> float:
        """2 x the multiply-adds that meet a value: TPU writes batched matmuls as convolutions
        whose batch dimensions are spatial ones, the input dilated and padded by the window, so
        that most of a window's taps meet the inserted zeros (counted by XLA as work, not here).
        """
        if len(i.operands) < 2:
            return 0.0
        lhs, kernel = (hlo.dims(self.shapes.get(o, "")) for o in i.operands[:2])
        out = hlo.dims(i.shape)
        m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", i.attrs)
        if not m or len(m[1]) != len(lhs) or len(m[2]) != len(kernel) or len(m[3]) != len(out):
            return 0.0
        lhs_l, kernel_l, out_l = m[1], m[2], m[3]
        window = re.search(r"window=\{([^}]*)\}", i.attrs)
        fields = dict(f.split("=", 1) for f in (window[1].split() if window else []))
        spatial = sorted(c for c in kernel_l if c.isdigit())

        def per_dim(key: str, default: list[int]) -> list[int]:
            if key not in fields:
                return default
            return [int(x) for x in fields[key].split("x")]

        ones = [1] * len(spatial)
        size = per_dim("size", [kernel[kernel_l.index(c)] for c in spatial])
        stride, lhs_dilate = per_dim("stride", ones), per_dim("lhs_dilate", ones)
        rhs_dilate = per_dim("rhs_dilate", ones)
        pads = [tuple(map(int, p.split("_"))) for p in fields["pad"].split("x")] if (
            "pad" in fields
        ) else [(0, 0)] * len(spatial)  # fmt: skip
        macs = kernel[kernel_l.index("i")] * math.prod(
            out[out_l.index(c)] for c in "bf" if c in out_l
        )
        for k, c in enumerate(spatial):
            macs *= _valid_taps(
                lhs[lhs_l.index(c)], out[out_l.index(c)], size[k], stride[k], pads[k][0],
                lhs_dilate[k], rhs_dilate[k],
            )  # fmt: skip
        return 2.0 * macs

    def custom_call_flops(self, i: Instr) -> float:
        target = re.search(r'custom_call_target="([^"]+)"', i.attrs)
        target = target[1] if target else ""
        config = hlo.backend_config(i.attrs)
        if target.startswith("__cublas"):
            dnums = (config.get("gemm_backend_config") or {}).get("dot_dimension_numbers", {})
            lhs = hlo.dims(self.shapes.get(i.operands[0], ""))
            k = math.prod(lhs[int(d)] for d in dnums.get("lhs_contracting_dimensions", []))
            return 2.0 * math.prod(hlo.dims(i.shape)) * k
        if target.startswith("__cudnn$fmha"):
            # q, k: [B, T, N, H], [B, S, Nkv, H] (jax's BTNH layout): QK^T and PV are 2 matmuls
            # of B N T S H multiply-adds; the backward 5 (with the recomputed scores); causal
            # masking skips half.
            q, k = (hlo.dims(self.shapes.get(x, "")) for x in i.operands[:2])
            if len(q) != 4 or len(k) != 4:
                return 0.0
            B, T, N, H = q
            S = k[1]
            fmha = config.get("cudnn_fmha_backend_config") or {}
            causal = 0.5 if "CAUSAL" in str(fmha.get("mask_type", "")) else 1.0
            matmuls = 5 if "Backward" in target else 2
            return 2.0 * matmuls * B * N * T * S * H * causal
        m = re.search(r'"flops"\s*:\s*"?(\d+)', json.dumps(config))  # a Pallas cost estimate
        return float(m[1]) if m else 0.0

    # -- bytes of a fusion's operands: a parameter read only through slices reads the slices
    def param_read(self, comp: str, index: int, full: float) -> float:
        instrs = self.comps.get(comp, [])
        param = next(
            (i for i in instrs if i.op == "parameter" and i.args.strip() == str(index)), None
        )
        if param is None:
            return full
        return self._reads(instrs, param.name, full)

    def _reads(self, instrs: list[Instr], name: str, full: float) -> float:
        users = [i for i in instrs if name in i.operands]
        if not users:
            return 0.0
        total = 0.0
        for u in users:
            if u.op in hlo.SLICING and u.operands[0] == name:
                total += hlo.nbytes(u.shape)
            elif u.op in hlo.IN_PLACE and name in hlo.in_place_targets(u):
                continue  # written in place, not read
            elif u.op == "bitcast":
                total += self._reads(instrs, u.name, full)
            elif u.op == "fusion":
                called = hlo.called(u.attrs, "calls")
                if not called:
                    return full
                for pos, operand in enumerate(u.operands):
                    if operand == name:
                        total += self.param_read(called[0], pos, full)
            else:
                return full
        return min(total, full)

    def fusion_output(self, comp: str, shape: str) -> float:
        """Bytes a fusion writes: the update of a root dynamic-update-slice, else its output."""
        instrs = self.comps.get(comp, [])
        root = next((i for i in instrs if i.root), None)
        if root is None:
            return hlo.nbytes(shape)
        roots = [root]
        if root.op == "tuple":
            by_name = {i.name: i for i in instrs}
            roots = [by_name[o] for o in root.operands if o in by_name]
        total = 0.0
        for r in roots:
            if r.op in hlo.IN_PLACE:
                total += sum(hlo.nbytes(self.shapes.get(u, "")) for u in hlo.in_place_updates(r))
            else:
                total += hlo.nbytes(r.shape)
        return total

    # -- one computation's cost, its loops multiplied out
    def cost(self, comp: str) -> Cost:
        if comp in self._memo:
            return self._memo[comp]
        self._memo[comp] = _ZERO  # recursion guard
        total = _ZERO
        for i in self.comps.get(comp, []):
            total = total + self.instr_cost(i)
        self._memo[comp] = total
        return total

    def flops_in(self, comp: str) -> float:
        """Matmul FLOPs inside a fused computation (and the fusions nested in it)."""
        f = 0.0
        for i in self.comps.get(comp, []):
            if i.op == "dot":
                f += self.dot_flops(i)
            elif i.op == "convolution":
                f += self.conv_flops(i)
            elif i.op == "custom-call":
                f += self.custom_call_flops(i)
            elif i.op == "fusion":
                f += sum(self.flops_in(c) for c in hlo.called(i.attrs, "calls"))
        return f

    def instr_cost(self, i: Instr) -> Cost:
        cost = self._instr_cost(i)
        if i.op.removesuffix("-start") in hlo.COLLECTIVES:
            cost = dataclasses.replace(cost, collective_bytes=cost.bytes)
        return cost

    def _instr_cost(self, i: Instr) -> Cost:
        op = i.op
        if op in hlo.NO_TRAFFIC or op.endswith("-done"):
            return _ZERO
        if op == "while":
            body = hlo.called(i.attrs, "body")
            cond = hlo.called(i.attrs, "condition")
            n, known = self.trip_count(i, cond[0] if cond else None)
            inner = sum((self.cost(c) for c in body + cond), _ZERO) * n
            return inner + Cost(0.0, 0.0, 0 if known else 1)
        if op in ("call", "async-start") or (op.endswith("-start") and "calls=" in i.attrs):
            return sum((self.cost(c) for c in hlo.called(i.attrs, "calls", "to_apply")), _ZERO)
        if op == "conditional":
            branches = hlo.called(i.attrs, "branch_computations", "true_computation",
                               "false_computation")  # fmt: skip
            costs = [self.cost(c) for c in branches]
            worst = max(costs, key=lambda c: (c.flops, c.bytes)) if costs else _ZERO
            return dataclasses.replace(worst, conditionals=worst.conditionals + 1)
        if op == "fusion":
            called = hlo.called(i.attrs, "calls")
            comp = called[0] if called else ""
            reads = sum(
                self.param_read(comp, k, hlo.nbytes(self.shapes.get(o, "")))
                for k, o in enumerate(i.operands)
            )
            return Cost(self.flops_in(comp), reads + self.fusion_output(comp, i.shape))
        operand_bytes = sum(hlo.nbytes(self.shapes.get(o, "")) for o in i.operands)
        if op in hlo.SLICING:
            return Cost(0.0, 2 * hlo.nbytes(i.shape))
        if op in hlo.IN_PLACE:  # reads and writes the update, in place
            update = sum(hlo.nbytes(self.shapes.get(u, "")) for u in hlo.in_place_updates(i))
            return Cost(0.0, 2 * update)
        if op.endswith("-start"):  # async: its shape is (source(s), destination(s), context...)
            parts = hlo.tuple_elements(i.shape)
            if len(parts) < 2:
                return Cost(0.0, operand_bytes + hlo.nbytes(i.shape))
            if op in ("slice-start", "dynamic-slice-start"):  # a slice of the source is read
                moved = hlo.nbytes(parts[1], hbm_only=False)
                return Cost(0.0, moved * (bool(hlo.nbytes(parts[0])) + bool(hlo.nbytes(parts[1]))))
            if op == "copy-start":  # (destination, source, context)
                return Cost(0.0, hlo.nbytes(parts[0]) + hlo.nbytes(parts[1]))
            return Cost(0.0, hlo.nbytes(parts[0]) + hlo.nbytes(parts[1]))
        flops = 0.0
        if op == "dot":
            flops = self.dot_flops(i)
        elif op == "convolution":
            flops = self.conv_flops(i)
        elif op == "custom-call":
            flops = self.custom_call_flops(i)
            # a GEMM's workspace (s8[...]) is scratch, not traffic
            out = sum(
                hlo.ITEM_BYTES[t] * math.prod(d)
                for t, d, hbm in hlo.arrays(i.shape)
                if hbm and t != "s8"
            )
            return Cost(flops, operand_bytes + out)
        return Cost(flops, operand_bytes + hlo.nbytes(i.shape))

    def trip_count(self, i: Instr, cond: str | None) -> tuple[int, bool]:
        """(iterations of while loop `i`, whether they are known)."""
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attrs)
        if m:
            return int(m[1]), True
        # A counted loop (scan, fori_loop): the condition is `counter < N`, N a constant. The
        # TPU compiler's rewritten loops carry no trip count, and may start the counter past 0
        # (iterations peeled off) or step it by more than 1 (the body unrolled).
        instrs = self.comps.get(cond or "", [])
        root = next((x for x in instrs if x.root), None)
        if root is None or root.op != "compare" or len(root.operands) != 2:
            return 1, False
        a, b = (self._through_copies(o) for o in root.operands)
        if "direction=GT" in root.attrs:
            a, b = b, a
        elif "direction=LT" not in root.attrs:
            return 1, False
        limit = self._constant(b)
        if limit is None or a is None or a.op != "get-tuple-element":
            return 1, False
        index = re.search(r"index=(\d+)", a.attrs)
        init, step = 0, 1
        if index is not None:
            k = int(index[1])
            init = self._tuple_constant(i.operands[0] if i.operands else None, k, default=0)
            body = hlo.called(i.attrs, "body")
            body_root = next((x for x in self.comps.get(body[0], []) if x.root), None) if (
                body
            ) else None  # fmt: skip
            if body_root is not None and body_root.op == "tuple" and k < len(body_root.operands):
                nxt = self._through_copies(body_root.operands[k])
                if nxt is not None and nxt.op == "add":
                    steps = [self._constant(o) for o in nxt.operands]
                    step = next((x for x in steps if x), 1)
        return max(-(-(limit - init) // max(step, 1)), 0), True

    def _through_copies(self, name: str | None) -> Instr | None:
        instr = self.instrs.get(name or "")
        while instr is not None and instr.op in ("copy", "convert", "bitcast") and instr.operands:
            instr = self.instrs.get(instr.operands[0])
        return instr

    def _constant(self, name_or_instr) -> int | None:
        c = name_or_instr if isinstance(name_or_instr, Instr) else self._through_copies(
            name_or_instr
        )  # fmt: skip
        if c is not None and c.op == "constant" and re.fullmatch(r"-?\d+", c.args.strip()):
            return int(c.args)
        return None

    def _tuple_constant(self, name: str | None, k: int, default: int) -> int:
        t = self._through_copies(name)
        if t is None or t.op != "tuple" or k >= len(t.operands):
            return default
        value = self._constant(t.operands[k])
        return default if value is None else value


def _valid_taps(n_in: int, n_out: int, k: int, stride: int, pad_lo: int, dilate: int, rdil: int):
    """(output position, window tap) pairs of one spatial dimension whose input position holds
    a value (not padding, not a zero inserted by `dilate`)."""
    span = (n_in - 1) * dilate + 1
    total = 0
    for j in range(k):
        c = j * rdil - pad_lo  # input position of output o: o * stride + c
        lo = max(0, -(c // stride))  # the first o with o * stride + c >= 0
        hi = min(n_out - 1, (span - 1 - c) // stride)
        if hi < lo:
            continue
        if dilate == 1:
            total += hi - lo + 1
        elif (hi - lo + 1) <= 4096:
            total += sum((o * stride + c) % dilate == 0 for o in range(lo, hi + 1))
        else:
            total += (hi - lo + 1) / dilate
    return total


def hlo_cost(hlo_text: str) -> Cost:
    """The work of one run of a compiled executable on one device, from its optimised HLO
    (`compiled.as_text()`): matmul FLOPs and HBM bytes, every loop's body counted once per
    iteration. XLA's own `cost_analysis()` counts a loop's body once, whatever its trip count
    (a scan over 64 layers: 1/64 of the work), and XLA:GPU's deviceless executables have
    none."""
    module = _Module(hlo_text)
    if module.entry is None:
        return _ZERO
    return module.cost(module.entry)
