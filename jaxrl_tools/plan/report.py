"""What `plan` reports: a run's per-device memory against its device, and each step's roofline
floor on an accelerator (`Floor`, from the compiled program's work: `targets.hlo_cost`)."""

from __future__ import annotations

import dataclasses

from jaxrl_tools import targets
from jaxrl_tools.plan.memory import Memory, describe


@dataclasses.dataclass(frozen=True)
class Floor:
    """The roofline floor of one run of a compiled function on one device of an accelerator:
    its matmul FLOPs at the peak bf16 rate, or its HBM bytes at the peak bandwidth, whichever
    takes longer (`targets.Accelerator.floor_s`)."""

    cost: targets.Cost
    seconds: float
    bound: str  # "compute" or "memory"

    @classmethod
    def of(cls, cost: targets.Cost, accelerator: targets.Accelerator) -> Floor:
        compute = cost.flops / accelerator.peak_flops
        memory = cost.bytes / accelerator.hbm_bandwidth
        return cls(cost, max(compute, memory), "compute" if compute >= memory else "memory")


PER_STEP = {"update": "RL step", "decode": "decode step (one token per slot)"}


def floors(compiled: dict, accelerator: targets.Accelerator) -> dict[str, Floor]:
    """Each compiled function's floor per run on `accelerator`, from its optimised HLO."""
    return {
        name: Floor.of(targets.hlo_cost(c.as_text()), accelerator) for name, c in compiled.items()
    }


def format_seconds(s: float) -> str:
    if s >= 1000:
        return f"{s:,.0f} s"
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _amount(x: float, unit: str) -> str:
    for scale, prefix in (
        (1e18, "E"),
        (1e15, "P"),
        (1e12, "T"),
        (1e9, "G"),
        (1e6, "M"),
        (1e3, "k"),
    ):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A run's per-device memory and what it is compared with.

    Attributes:
      figures: Memory of the RL step ("update") and the decode step, per device.
      totals: each phase's bytes per device with what stays allocated meanwhile
        (`phase_totals`): what must fit.
      mesh: (data, fsdp, tensor).
      hbm: the device memory it must fit in (None: not known, e.g. a CPU host).
      micro_batch_size: the config's rows per micro-batch (all devices).
      largest_micro_batch: the largest power-of-two multiple of the config's data-parallel
        width that fits (None when not searched).
      rollout_mesh: the decode step's own mesh (`rollout.mesh`), or None (`mesh`).
      compiler: the compiler whose figures these are (None: the host's, unlabelled).
      accelerator: the accelerator judged against (floors' peak rates), or None.
      floors: each function's roofline floor per run on `accelerator`, or None.
      notes: lines printed first (e.g. why the CPU compiler's estimate stands in).
      topology: the slice compiled for (a target's), or None.
    """

    figures: dict[str, Memory]
    totals: dict[str, int]
    mesh: tuple[int, int, int]
    hbm: int | None
    micro_batch_size: int
    largest_micro_batch: int | None = None
    rollout_mesh: tuple[int, int, int] | None = None
    compiler: str | None = None
    accelerator: targets.Accelerator | None = None
    floors: dict[str, Floor] | None = None
    notes: tuple[str, ...] = ()
    topology: str | None = None

    @property
    def peak(self) -> int:
        return max(self.totals.values())

    @property
    def fits(self) -> bool:
        return self.hbm is None or self.peak <= self.hbm

    def lines(self) -> list[str]:
        d, f, t = self.mesh
        on = (
            ""
            if self.rollout_mesh is None
            else f", decode on {'x'.join(map(str, self.rollout_mesh))}"
        )
        out = list(self.notes)
        if self.compiler is not None:
            on_slice = "" if self.topology is None else f" for {self.topology}"
            out.append(f"figures of the {self.compiler}{on_slice}:")
        out.append(f"mesh {d}x{f}x{t} (data x fsdp x tensor){on}, per device:")
        out += ["  " + line for line in describe(self.figures, self.hbm, self.totals)]
        if self.largest_micro_batch is not None:
            out.append(
                f"largest optim.micro_batch_size that fits: {self.largest_micro_batch} "
                f"(configured: {self.micro_batch_size})"
            )
        if self.floors and self.accelerator is not None:
            a = self.accelerator
            out.append(
                f"roofline floor per device on {a.label} ({a.peak_flops / 1e12:,.0f} TFLOP/s "
                f"bf16, {a.hbm_bandwidth / 1e12:.3g} TB/s HBM), of "
                f"{'the program above' if self.compiler else 'the host compiler program'}:"
            )
            for name, fl in self.floors.items():
                c = fl.cost
                notes = ""
                if c.collective_bytes:
                    notes += f" ({_amount(c.collective_bytes, 'B')} of it by collectives)"
                if c.unknown_loops:
                    notes += f"; {c.unknown_loops} loops counted once"
                if c.conditionals:
                    notes += f"; {c.conditionals} conditionals at their costlier branch"
                out.append(
                    f"  {name:<9} {format_seconds(fl.seconds)} per {PER_STEP.get(name, 'run')}, "
                    f"{fl.bound}-bound: {_amount(c.flops, 'FLOP')}, "
                    f"{_amount(c.bytes, 'B')} of HBM traffic{notes}"
                )
        return out
