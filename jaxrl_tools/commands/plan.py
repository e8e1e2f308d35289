"""`jaxrl-tools plan`: the run's memory per device, compiled on abstract shapes."""

from jaxrl_tools import plan, targets
from jaxrl_tools.config import ConfigError

HELP = (
    "per-device memory of the run's update, log-prob forward and decode step, compiled on "
    "abstract shapes (no weights), whether it fits, and the largest micro-batch that does"
)


def add_arguments(p) -> None:
    p.add_argument("--mesh", help="DxFxT (data x fsdp x tensor); default trainer.mesh")
    p.add_argument(
        "--accelerator",
        choices=sorted(targets.ACCELERATORS),
        help="compile with this accelerator's own compiler, without it (the [aot-gpu] / "
        "[aot-tpu] extras; else the CPU compiler's estimate), judge against its memory and "
        "print each step's roofline floor on it",
    )
    p.add_argument(
        "--topology",
        help="the slice to compile for: a TPU's (v5p:4x4x4, v5e:2x2) or GPUs' "
        "(PARTITIONSxHOSTSxGPUS, e.g. 1x4x8); default: the one of trainer.mesh's size",
    )
    p.add_argument("--hosts", type=int, help="or: this many full hosts of --accelerator")
    p.add_argument("--memory-gib", type=float, help="device memory to fit in, instead")


def mesh_shape(text: str) -> tuple[int, int, int]:
    try:
        d, f, t = (int(x) for x in text.lower().replace(" ", "").split("x"))
    except ValueError:
        raise ConfigError(f"--mesh must look like DxFxT (e.g. 1x8x1), got {text!r}") from None
    return d, f, t


def run(cfg, args) -> int:
    report = plan.plan_command(
        cfg,
        mesh_shape=mesh_shape(args.mesh) if args.mesh else None,
        mesh_name="--mesh" if args.mesh else "trainer.mesh",
        accelerator=args.accelerator,
        topology=args.topology,
        hosts=args.hosts,
        memory_gib=args.memory_gib,
    )
    print("\n".join(report.lines()))
    return 0 if report.fits else 1
