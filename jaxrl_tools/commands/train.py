"""`jaxrl-tools train`: SFT (if enabled), then RL with checkpoints."""

from jaxrl_tools import run as runs
from jaxrl_tools.commands.common import SMOKE_HELP

HELP = "SFT (if enabled) then RL, with checkpoints; resumes a killed run"
RUNS_MODEL = True


def add_arguments(p) -> None:
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint (same as trainer.resume=true)",
    )
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def run(cfg, args) -> None:
    summary = runs.train(cfg)
    print({k: v for k, v in summary["final_metrics"].items() if not k.startswith("time")})
