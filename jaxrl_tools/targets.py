"""The accelerators `jaxrl-tools plan` compiles for without one: their figures, their compilers.

XLA compiles for a GPU or a TPU on a machine that has neither ("deviceless" / ahead-of-time):
`jax.experimental.topologies.get_topology_desc` gives compile-only devices of a target (a TPU
slice from libtpu, GPUs from the CUDA plugin and a `stream_executor.GpuTargetConfigProto`), and
`jax.jit(f).lower(...).compile()` on a mesh over them runs that accelerator's own compiler: its
fusion, layouts, buffer assignment, collectives. `plan` reads the executable's
`memory_analysis()` (`plan.plan_target`) and, from its HLO, the work of one step (`hlo_cost`).

Neither compiler is in the core install (the CPU compiler's estimate is): `toolchain(platform)`
says whether one is, and how to install it (`pip install 'jaxrl-tools[aot-tpu]'` / `[aot-gpu]`).
libtpu and the CUDA plugin are imported only by `target_devices`.

`ACCELERATORS`: per-device HBM, dense bf16 peak and HBM bandwidth from the vendors' published
figures (each entry's `source`), and the GPU's device description the compiler is given.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import re

INSTALL = {
    "tpu": "pip install 'jaxrl-tools[aot-tpu]'",
    "cuda": "pip install 'jaxrl-tools[aot-gpu]'",
}
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

# The GpuDeviceInfoProto of a Hopper GH100 SXM5 part (compute capability 9.0): NVIDIA's H100
# datasheet (132 SMs on the SXM5 board, 1,980 MHz max boost, 50 MB L2) and the CUDA C
# Programming Guide's table for compute capability 9.0 (228 KiB shared memory per SM, 227 KiB
# per block opted in, 48 KiB by default, 64K 32-bit registers per SM and per block, 2,048
# threads per SM, 1,024 per block, warps of 32; 128 FP32 cores per SM: the Hopper whitepaper).
# The field set is XLA's (xla/stream_executor/device_description.proto); the H200 is the same
# GH100 with HBM3e.
_GH100 = dict(
    threads_per_block_limit=1024,
    threads_per_warp=32,
    shared_memory_per_block=48 * 1024,
    shared_memory_per_core=228 * 1024,
    threads_per_core_limit=2048,
    core_count=132,
    fpus_per_core=128,
    block_dim_limit_x=2**31 - 1,
    block_dim_limit_y=65535,
    block_dim_limit_z=65535,
    l2_cache_size=50 * 2**20,
    clock_rate_ghz=1.98,
    shared_memory_per_block_optin=227 * 1024,
    registers_per_core_limit=65536,
    registers_per_block_limit=65536,
    compute_capability=(9, 0),
)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator `plan` knows, per device (a GPU, a TPU chip).

    Attributes:
      name: the `--accelerator` name.
      platform: "cuda" or "tpu" (`jax.experimental.topologies.get_topology_desc`'s).
      label: how it is called in what `plan` prints.
      hbm_bytes: the device memory a plan must fit in.
      peak_flops: dense bf16 matmul FLOP/s.
      hbm_bandwidth: HBM bytes/s.
      default_topology: the slice compiled for when neither the mesh nor the command names one.
      source: where the figures come from.
      chips_per_host: devices per host of a multi-host slice (`--hosts`).
      topologies: TPU: chips -> the slice shape of that many chips (libtpu's topology names).
      gpu: GPU: the device description given to XLA:GPU (`gpu_target_config`).
    """

    name: str
    platform: str
    label: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    default_topology: str
    source: str
    chips_per_host: int = 8
    topologies: dict[int, str] | None = None
    gpu: dict | None = None

    @property
    def compiler(self) -> str:
        """The compiler that produces this target's figures, as `plan` labels them."""
        if self.platform == "tpu":
            return f"TPU compiler ({self.name})"
        return f"XLA:GPU (deviceless, {self.label})"

    def topology_for(self, devices: int) -> str | None:
        """The slice of `devices` devices (None: no such slice)."""
        if self.platform == "cuda":
            if devices <= self.chips_per_host:
                return f"1x1x{devices}"
            hosts, rest = divmod(devices, self.chips_per_host)
            return None if rest else f"1x{hosts}x{self.chips_per_host}"
        shape = (self.topologies or {}).get(devices)
        return None if shape is None else f"{self.name}:{shape}"

    def floor_s(self, cost: Cost) -> float:
        """The roofline floor of `cost` on one device: max(FLOPs / peak, bytes / bandwidth)."""
        return max(cost.flops / self.peak_flops, cost.bytes / self.hbm_bandwidth)


_TPU_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TPU_3D = {
    1: "1x1x1",
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
}
_GCP = "Google Cloud TPU docs, docs.cloud.google.com/tpu/docs/"

ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "h100-80g",
            "cuda",
            "H100 80GB",
            hbm_bytes=80 * 10**9,
            peak_flops=989e12,
            hbm_bandwidth=3.35e12,
            default_topology="1x1x8",
            source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s, "
            "BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense)",
            gpu=dict(_GH100, memory_bandwidth=3.35e12, device_description="NVIDIA H100 80GB HBM3"),
        ),
        Accelerator(
            "h200",
            "cuda",
            "H200 141GB",
            hbm_bytes=141 * 10**9,
            peak_flops=989e12,
            hbm_bandwidth=4.8e12,
            default_topology="1x1x8",
            source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s, "
            "BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense)",
            gpu=dict(_GH100, memory_bandwidth=4.8e12, device_description="NVIDIA H200"),
        ),
        Accelerator(
            "v5e",
            "tpu",
            "TPU v5e",
            hbm_bytes=16 * 2**30,
            peak_flops=197e12,
            hbm_bandwidth=819e9,
            default_topology="v5e:2x2",
            source=_GCP + "v5e: 197 TFLOPs bf16 per chip, HBM2 16 GB at 819 GBps",
            chips_per_host=4,
            topologies=_TPU_2D,
        ),
        Accelerator(
            "v5p",
            "tpu",
            "TPU v5p",
            hbm_bytes=95 * 2**30,
            peak_flops=459e12,
            hbm_bandwidth=2765e9,
            default_topology="v5p:2x2x1",
            source=_GCP + "v5p: 459 TFLOPs bf16 per chip, HBM2e 95 GB at 2765 GBps",
            chips_per_host=4,
            topologies=_TPU_3D,
        ),
        Accelerator(
            "v6e",
            "tpu",
            "TPU v6e",
            hbm_bytes=32 * 2**30,
            peak_flops=918e12,
            hbm_bandwidth=1638e9,
            default_topology="v6e:2x2",
            source=_GCP + "v6e: 918 TFLOPs bf16 per chip, HBM 32 GB at 1638 GBps",
            chips_per_host=4,
            topologies=_TPU_2D,
        ),
    )
}


class TargetUnavailable(RuntimeError):
    """The target's compiler is not installed, or would not give its devices (one line)."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    installed: bool
    detail: str  # what is installed, or the one-line install hint


def toolchain(platform: str) -> Toolchain:
    """Whether the deviceless compiler of `platform` ("tpu", "cuda") is installed (found, not
    imported)."""
    if platform == "tpu":
        found = importlib.util.find_spec("libtpu") is not None
        what = "libtpu"
    elif platform == "cuda":
        found = any(_find(name) for name in _CUDA_PLUGINS)
        what = "the jax CUDA plugin"
    else:
        raise ValueError(f"no deviceless compiler for platform {platform!r}")
    if found:
        return Toolchain(True, what)
    return Toolchain(False, f"{what} is not installed: {INSTALL[platform]}")


def _find(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the namespace package jax_plugins itself is absent
        return False


def gpu_target_config(accelerator: Accelerator | str) -> str:
    """The `stream_executor.GpuTargetConfigProto` (text form) XLA:GPU compiles against: the
    accelerator's device description, and the cuDNN and CUDA runtime versions of the installed
    CUDA plugin (what the program will run with)."""
    a = ACCELERATORS[accelerator] if isinstance(accelerator, str) else accelerator
    if a.gpu is None:
        raise ValueError(f"{a.name} is not a GPU")
    g = dict(a.gpu)
    major, minor = g.pop("compute_capability")
    description = g.pop("device_description")
    g["memory_bandwidth"] = int(g["memory_bandwidth"])
    g["device_memory_size"] = a.hbm_bytes
    fields = "".join(f"  {k}: {v}\n" for k, v in g.items())
    cudnn, runtime = _cuda_build_versions()
    return (
        f"gpu_device_info {{\n{fields}"
        f"  cuda_compute_capability {{\n    major: {major}\n    minor: {minor}\n  }}\n}}\n"
        f'platform_name: "CUDA"\n'
        f"dnn_version_info {{\n{_version(cudnn)}}}\n"
        f"runtime_version {{\n{_version(runtime)}}}\n"
        f'device_description_str: "{description}"\n'
    )


def _version(v: tuple[int, int, int]) -> str:
    return "".join(f"  {k}: {x}\n" for k, x in zip(("major", "minor", "patch"), v))


def _cuda_build_versions() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(cuDNN, CUDA runtime) versions the installed CUDA plugin was built against; (9.8.0,
    12.8.0) without one."""
    for pkg in ("jax_cuda13_plugin", "jax_cuda12_plugin"):
        try:
            v = importlib.import_module(f"{pkg}._versions")
        except ImportError:
            continue
        dnn, rt = v.cudnn_build_version(), v.cuda_runtime_build_version()  # 91200, 13000
        return (dnn // 10000, dnn // 100 % 100, dnn % 100), (rt // 1000, rt // 10 % 100, 0)
    return (9, 8, 0), (12, 8, 0)


def resolve_topology(
    accelerator: Accelerator, topology: str | None, hosts: int | None, devices: int | None
) -> str:
    """The slice to compile for: `topology` as given (a TPU's may omit its "v5p:" prefix),
    else `hosts` full hosts, else the one of `devices` devices (the mesh's), else the
    accelerator's default."""
    a = accelerator
    if topology:
        if a.platform == "tpu" and ":" not in topology:
            topology = f"{a.name}:{topology}"
        return topology
    if hosts:
        n = hosts * a.chips_per_host
        found = a.topology_for(n)
        if found is None:
            raise TargetUnavailable(
                f"--hosts {hosts}: no {a.label} slice of {n} chips is known; pass --topology"
            )
        return found
    return (a.topology_for(devices) if devices else None) or a.default_topology


def topology_devices(topology: str) -> int:
    """Devices of a topology string: the product of its dimensions."""
    return math.prod(int(x) for x in topology.split(":")[-1].lower().split("x"))


def target_devices(name: str, topology: str | None = None, hosts: int | None = None) -> list:
    """The compile-only devices of `topology` (default: the accelerator's) of accelerator
    `name`: what a mesh is built over to compile for it here.

    Raises:
      TargetUnavailable: the toolchain is not installed or gives no devices (one line).
    """
    a = ACCELERATORS[name]
    tc = toolchain(a.platform)
    if not tc.installed:
        raise TargetUnavailable(tc.detail)
    topology = resolve_topology(a, topology, hosts, None)
    return list(_devices(a.name, topology))


@functools.lru_cache(maxsize=16)
def _devices(name: str, topology: str) -> tuple:
    from jax.experimental import topologies  # noqa: PLC0415

    a = ACCELERATORS[name]
    prepare(a.platform)
    try:
        if a.platform == "tpu":
            # libtpu's default host is 2x2x1 chips: a smaller slice is one host of its size
            dims = [int(x) for x in topology.split(":")[-1].split("x")]
            small = {"chips_per_host_bounds": (dims + [1, 1])[:3]} if math.prod(dims) < 4 else {}
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **small)
        else:
            config = gpu_target_config(a)
            try:
                desc = topologies.get_topology_desc(
                    platform="cuda", topology=topology, target_config=config
                )
            except NotImplementedError:  # the plugin was not registered: see _register_cuda
                _register_cuda()
                desc = topologies.get_topology_desc(
                    platform="cuda", topology=topology, target_config=config
                )
    except TargetUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - libtpu / the plugin: any failure is one line
        message = " ".join(str(e).split())[:300]
        raise TargetUnavailable(
            f"{a.compiler} gave no devices for topology {topology!r}: {message}"
        ) from None
    return tuple(desc.devices)


def _register_cuda() -> None:
    """Registers the CUDA plugin for compiling only. On a host without a GPU its start-up check
    of the CUDA libraries fails (cuPTI needs a driver) and jax leaves the plugin unregistered;
    compiling needs none of them, so the check is skipped and the plugin registered again."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    for name in _CUDA_PLUGINS:
        if _find(name):
            try:
                importlib.import_module(name).initialize()
            except Exception as e:  # noqa: BLE001
                raise TargetUnavailable(
                    f"the jax CUDA plugin did not register: {' '.join(str(e).split())[:200]}"
                ) from None
            _run_plugin_callbacks("cuda")
            return
    raise TargetUnavailable(f"the jax CUDA plugin is not installed: {INSTALL['cuda']}")


def _run_plugin_callbacks(name: str) -> None:
    """What jax does for each plugin it discovers, for one registered late: the callbacks that
    register custom-call partitioners (`custom_partitioning`, e.g. cuDNN attention's) with it.
    jax has no public call for this; without it the partitioner finds no handler for the
    platform."""
    from jax._src import xla_bridge as xb  # noqa: PLC0415

    factory = getattr(xb, "_backend_factories", {}).get(name)
    c_api = getattr(factory, "c_api", None)
    if c_api is None:
        return
    with xb._plugin_callback_lock:
        for callback in list(getattr(xb, "_plugin_callbacks", [])):
            callback(c_api=c_api)


def prepare(platform: str) -> None:
    """Call before jax starts its backends (the first `jax.devices()`), in a process that will
    compile for `platform`: on a host without a GPU the CUDA plugin then registers (its library
    check skipped) instead of printing a traceback and staying unregistered; on a host without
    a TPU, libtpu loads in several processes at once (it holds /tmp/libtpu_lockfile, meant for
    the processes sharing a TPU: a second compiling process would be refused)."""
    if platform == "cuda":
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    elif platform == "tpu" and _tpu_chips() == 0:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _tpu_chips() -> int | None:
    """TPU chips attached to this host (None: unknown)."""
    try:
        from jax._src import hardware_utils  # noqa: PLC0415

        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except Exception:  # noqa: BLE001 - a private helper: unknown, and nothing is changed
        return None


# ------------------------------------------------------------------------------------------------
# The work of one run of a compiled executable, from its HLO


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
    """

    flops: float
    bytes: float
    unknown_loops: int = 0
    conditionals: int = 0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.unknown_loops + other.unknown_loops,
            self.conditionals + other.conditionals,
        )

    def __mul__(self, n: float) -> Cost:
        return Cost(self.flops * n, self.bytes * n, self.unknown_loops, self.conditionals)


_ZERO = Cost(0.0, 0.0)
_ITEM_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](\{[^}]*\})?")
_NAME = re.compile(r"%[\w.\-]+")
_NO_TRAFFIC = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "iota", "add-dependency", "domain",
}  # fmt: skip
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}  # write their updates into operand 0 (operands)


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    args: str  # the text between the opcode's parentheses (a parameter's index, a constant)
    attrs: str
    root: bool


def _arrays(shape: str) -> list[tuple[str, list[int], bool]]:
    """(dtype, dims, in HBM) of each array of a shape; a TPU layout's S(n), n > 0, is on-chip
    memory (VMEM, SMEM, sync flags), not HBM."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _ITEM_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append(([int(d) for d in dims.split(",") if d], dtype, not space or space[1] == "0"))
    return [(dtype, dims, hbm) for dims, dtype, hbm in out]


def _bytes(shape: str, hbm_only: bool = True) -> float:
    return sum(_ITEM_BYTES[t] * math.prod(d) for t, d, hbm in _arrays(shape) if hbm or not hbm_only)


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (a non-tuple: itself)."""
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for k, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(shape[start:k].strip())
            start = k + 1
    parts.append(shape[start:-1].strip())
    return [p for p in parts if p]


def _dims(shape: str) -> list[int]:
    arrays = _arrays(shape)
    return arrays[0][1] if arrays else []


def _close(text: str, opening: str, closing: str, depth: int = 0) -> int:
    """The index in `text` where the bracket open at `depth` (plus those opened in it) closes."""
    for k, ch in enumerate(text):
        depth += (ch == opening) - (ch == closing)
        if depth == 0:
            return k
    return len(text) - 1


def _split_instruction(line: str) -> _Instr | None:
    s = line.strip()
    root = s.startswith("ROOT ")
    if root:
        s = s[5:]
    if not s.startswith("%") or " = " not in s:
        return None
    name, rest = s.split(" = ", 1)
    # the shape: one array token, or a parenthesised tuple (layouts hold parentheses too)
    if rest.startswith("("):
        end = _close(rest, "(", ")")
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _close(rest, "(", ")", depth=1)
    args = rest[:end]
    return _Instr(name, shape, op.strip(), _NAME.findall(args), args, rest[end + 1 :], root)


def _parse(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    """{computation name: instructions}, the entry computation's name."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            head = line.strip()
            if head.endswith("{") and ("->" in head or head.startswith(("%", "ENTRY"))):
                is_entry = head.startswith("ENTRY ")
                m = _NAME.search(head)
                current = m[0] if m else None
                if current is not None:
                    comps[current] = []
                    if is_entry:
                        entry = current
            elif head == "}":
                current = None
            continue
        if current is not None:
            instr = _split_instruction(line)
            if instr is not None:
                comps[current].append(instr)
    return comps, entry


class _Module:
    def __init__(self, text: str):
        self.comps, self.entry = _parse(text)
        self.instrs = {i.name: i for instrs in self.comps.values() for i in instrs}
        self.shapes = {name: i.shape for name, i in self.instrs.items()}
        self._memo: dict[str, Cost] = {}

    # -- flops
    def dot_flops(self, i: _Instr) -> float:
        lhs = _dims(self.shapes.get(i.operands[0], "")) if i.operands else []
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attrs)
        contracting = [int(x) for x in m[1].split(",") if x] if m else []
        k = math.prod(lhs[d] for d in contracting if d < len(lhs))
        return 2.0 * math.prod(_dims(i.shape)) * k

    def conv_flops(self, i: _Instr) -> float:
        """2 x the multiply-adds that meet a value: TPU writes batched matmuls as convolutions
        whose batch dimensions are spatial ones, the input dilated and padded by the window, so
        that most of a window's taps meet the inserted zeros (counted by XLA as work, not here).
        """
        if len(i.operands) < 2:
            return 0.0
        lhs, kernel = (_dims(self.shapes.get(o, "")) for o in i.operands[:2])
        out = _dims(i.shape)
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

    def custom_call_flops(self, i: _Instr) -> float:
        target = re.search(r'custom_call_target="([^"]+)"', i.attrs)
        target = target[1] if target else ""
        config = _backend_config(i.attrs)
        if target.startswith("__cublas"):
            dnums = (config.get("gemm_backend_config") or {}).get("dot_dimension_numbers", {})
            lhs = _dims(self.shapes.get(i.operands[0], ""))
            k = math.prod(lhs[int(d)] for d in dnums.get("lhs_contracting_dimensions", []))
            return 2.0 * math.prod(_dims(i.shape)) * k
        if target.startswith("__cudnn$fmha"):
            # q, k: [B, T, N, H], [B, S, Nkv, H] (jax's BTNH layout): QK^T and PV are 2 matmuls
            # of B N T S H multiply-adds; the backward 5 (with the recomputed scores); causal
            # masking skips half.
            q, k = (_dims(self.shapes.get(x, "")) for x in i.operands[:2])
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

    def _reads(self, instrs: list[_Instr], name: str, full: float) -> float:
        users = [i for i in instrs if name in i.operands]
        if not users:
            return 0.0
        total = 0.0
        for u in users:
            if u.op in _SLICING and u.operands[0] == name:
                total += _bytes(u.shape)
            elif u.op in _IN_PLACE and name in _in_place_targets(u):
                continue  # written in place, not read
            elif u.op == "bitcast":
                total += self._reads(instrs, u.name, full)
            elif u.op == "fusion":
                called = _called(u.attrs, "calls")
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
            return _bytes(shape)
        roots = [root]
        if root.op == "tuple":
            by_name = {i.name: i for i in instrs}
            roots = [by_name[o] for o in root.operands if o in by_name]
        total = 0.0
        for r in roots:
            if r.op in _IN_PLACE:
                total += sum(_bytes(self.shapes.get(u, "")) for u in _in_place_updates(r))
            else:
                total += _bytes(r.shape)
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
                f += sum(self.flops_in(c) for c in _called(i.attrs, "calls"))
        return f

    def instr_cost(self, i: _Instr) -> Cost:
        op = i.op
        if op in _NO_TRAFFIC or op.endswith("-done"):
            return _ZERO
        if op == "while":
            body = _called(i.attrs, "body")
            cond = _called(i.attrs, "condition")
            n, known = self.trip_count(i, cond[0] if cond else None)
            inner = sum((self.cost(c) for c in body + cond), _ZERO) * n
            return inner + Cost(0.0, 0.0, 0 if known else 1)
        if op in ("call", "async-start") or (op.endswith("-start") and "calls=" in i.attrs):
            return sum((self.cost(c) for c in _called(i.attrs, "calls", "to_apply")), _ZERO)
        if op == "conditional":
            branches = _called(i.attrs, "branch_computations", "true_computation",
                               "false_computation")  # fmt: skip
            costs = [self.cost(c) for c in branches]
            worst = max(costs, key=lambda c: (c.flops, c.bytes)) if costs else _ZERO
            return dataclasses.replace(worst, conditionals=worst.conditionals + 1)
        if op == "fusion":
            called = _called(i.attrs, "calls")
            comp = called[0] if called else ""
            reads = sum(
                self.param_read(comp, k, _bytes(self.shapes.get(o, "")))
                for k, o in enumerate(i.operands)
            )
            return Cost(self.flops_in(comp), reads + self.fusion_output(comp, i.shape))
        operand_bytes = sum(_bytes(self.shapes.get(o, "")) for o in i.operands)
        if op in _SLICING:
            return Cost(0.0, 2 * _bytes(i.shape))
        if op in _IN_PLACE:  # reads and writes the update, in place
            update = sum(_bytes(self.shapes.get(u, "")) for u in _in_place_updates(i))
            return Cost(0.0, 2 * update)
        if op.endswith("-start"):  # async: its shape is (source(s), destination(s), context...)
            parts = _tuple_elements(i.shape)
            if len(parts) < 2:
                return Cost(0.0, operand_bytes + _bytes(i.shape))
            if op in ("slice-start", "dynamic-slice-start"):  # a slice of the source is read
                moved = _bytes(parts[1], hbm_only=False)
                return Cost(0.0, moved * (bool(_bytes(parts[0])) + bool(_bytes(parts[1]))))
            if op == "copy-start":  # (destination, source, context)
                return Cost(0.0, _bytes(parts[0]) + _bytes(parts[1]))
            return Cost(0.0, _bytes(parts[0]) + _bytes(parts[1]))
        flops = 0.0
        if op == "dot":
            flops = self.dot_flops(i)
        elif op == "convolution":
            flops = self.conv_flops(i)
        elif op == "custom-call":
            flops = self.custom_call_flops(i)
            # a GEMM's workspace (s8[...]) is scratch, not traffic
            out = sum(
                _ITEM_BYTES[t] * math.prod(d) for t, d, hbm in _arrays(i.shape) if hbm and t != "s8"
            )
            return Cost(flops, operand_bytes + out)
        return Cost(flops, operand_bytes + _bytes(i.shape))

    def trip_count(self, i: _Instr, cond: str | None) -> tuple[int, bool]:
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
            body = _called(i.attrs, "body")
            body_root = next((x for x in self.comps.get(body[0], []) if x.root), None) if (
                body
            ) else None  # fmt: skip
            if body_root is not None and body_root.op == "tuple" and k < len(body_root.operands):
                nxt = self._through_copies(body_root.operands[k])
                if nxt is not None and nxt.op == "add":
                    steps = [self._constant(o) for o in nxt.operands]
                    step = next((x for x in steps if x), 1)
        return max(-(-(limit - init) // max(step, 1)), 0), True

    def _through_copies(self, name: str | None) -> _Instr | None:
        instr = self.instrs.get(name or "")
        while instr is not None and instr.op in ("copy", "convert", "bitcast") and instr.operands:
            instr = self.instrs.get(instr.operands[0])
        return instr

    def _constant(self, name_or_instr) -> int | None:
        c = name_or_instr if isinstance(name_or_instr, _Instr) else self._through_copies(
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


def _in_place_targets(i: _Instr) -> list[str]:
    """The operands a dynamic-update-slice or scatter writes into (in place)."""
    if i.op == "scatter":  # operands..., indices, updates...
        return i.operands[: (len(i.operands) - 1) // 2]
    return i.operands[:1]


def _in_place_updates(i: _Instr) -> list[str]:
    """What it writes: the updates (and reads: the indices are small)."""
    if i.op == "scatter":
        return i.operands[(len(i.operands) - 1) // 2 + 1 :]
    return i.operands[1:2]


def _called(attrs: str, *keys: str) -> list[str]:
    out = []
    for key in keys:
        m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", attrs)
        if m:
            out += _NAME.findall(m[1])
    return out


def _backend_config(attrs: str) -> dict:
    m = re.search(r"backend_config=(\{.*\})", attrs)
    if not m:
        return {}
    text = m[1]
    try:
        return json.loads(text[: _close(text, "{", "}") + 1])
    except ValueError:
        return {}


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
