"""`jaxrl-tools eval`: held-out accuracy and tool statistics of a policy, or (--scripted) of
written model text played through the recipe without a model."""

from jaxrl_tools import run as runs
from jaxrl_tools.commands.common import add_policy_arguments, require_policy
from jaxrl_tools.config import ConfigError

HELP = "accuracy / pass@k and tool statistics on the eval data"
RUNS_MODEL = True


def add_arguments(p) -> None:
    add_policy_arguments(p, "evaluate")
    p.add_argument(
        "--scripted",
        metavar="FILE.jsonl",
        help="a dry run without a model: lines {prompt, ground_truth, turns: [model text, ...]} "
        "played through the recipe's protocol, tools, budgets and reward",
    )
    p.add_argument("--output", metavar="OUT.jsonl", help="with --scripted: the rows written")


def run(cfg, args) -> None:
    if args.scripted:
        return _scripted(cfg, args)
    require_policy(cfg, args, "evaluate")
    metrics = runs.evaluate_policy(cfg, from_checkpoint=args.checkpoint, step=args.step)
    for key, value in sorted(metrics.items()):
        if not key.startswith("_"):
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    return None


def _scripted(cfg, args) -> None:
    from jaxrl_tools.rollout.scripted import scripted_eval  # noqa: PLC0415

    if not args.output:
        raise ConfigError("eval --scripted FILE needs --output OUT.jsonl (the rows written)")
    rows = scripted_eval(cfg, args.scripted, args.output)
    mean = sum(r["reward"] for r in rows) / max(1, len(rows))
    print(
        f"jaxrl-tools eval --scripted: {len(rows)} responses, mean reward {mean:.4g}, "
        f"rows in {args.output} (no model was run)"
    )
