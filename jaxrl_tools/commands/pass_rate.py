"""`jaxrl-tools pass-rate`: each training prompt sampled k times; the prompts whose pass rate
is in a band written out (with the rate, for `data.curriculum`)."""

from pathlib import Path

from jaxrl_tools import curation
from jaxrl_tools.commands.common import add_policy_arguments, require_policy
from jaxrl_tools.config import ConfigError

HELP = (
    "sample each training prompt k times with the recipe's policy; write those whose pass "
    "rate is in a band (with the rate, for data.curriculum)"
)


def add_arguments(p) -> None:
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (k)")
    p.add_argument("--keep", default="0.1..0.9", help="LO..HI: the pass rates kept")
    p.add_argument("--output", required=True, help="the jsonl to write (data.train_files)")
    add_policy_arguments(p, "sample")
    p.add_argument(
        "--recheck",
        action="store_true",
        help="a second, fresh round: the zero-variance share over all and over kept prompts",
    )


def run(cfg, args) -> None:
    require_policy(cfg, args, "sample")
    band = curation.parse_band(args.keep)
    if args.samples < 2:
        raise ConfigError(f"--samples={args.samples}: a pass rate needs at least 2 samples")
    if Path(args.output).exists() or not Path(args.output).parent.is_dir():
        raise ConfigError(
            f"--output {args.output}: give a new file in an existing folder (nothing is "
            "overwritten)"
        )
    out = curation.run_pass_rate(
        cfg,
        samples=args.samples,
        band=band,
        output=args.output,
        from_checkpoint=args.checkpoint,
        step=args.step,
        recheck=args.recheck,
    )
    print(
        f"jaxrl-tools pass-rate: kept {out['kept']} of {out['prompts']} prompts with a pass rate "
        f"in {band[0]:g}..{band[1]:g} over {args.samples} samples -> {args.output}"
    )
    for key, value in out.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
