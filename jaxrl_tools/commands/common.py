"""What several subcommands share: the --smoke option, the check of the policy they read."""

from jaxrl_tools import check, smoke
from jaxrl_tools.config import ConfigError

SMOKE_HELP = (
    "the same recipe with a tiny random model, 2 RL steps and small batches, in "
    f"{smoke.SMOKE_ROOT}/<run_name> (a CPU minute): does the recipe run?"
)


def add_policy_arguments(p, verb: str) -> None:
    """--checkpoint and --step: which policy `eval` and `pass-rate` read."""
    p.add_argument("--checkpoint", action="store_true", help=f"{verb} the run's checkpoint")
    p.add_argument("--step", type=int)


def require_policy(cfg, args, verb: str) -> None:
    """`eval` and `pass-rate` read a trained policy: `model.path`, or the run's checkpoint."""
    if not args.checkpoint and cfg.model.path is None:
        raise ConfigError(
            f"{args.command} without --checkpoint {verb}s model.path, and model.path is null (a "
            f"random tiny model): add --checkpoint to {verb} the run's checkpoint, or set "
            "model.path"
        )
    check.preflight_eval(cfg)
