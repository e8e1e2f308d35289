"""`jaxrl-tools`: demo, train, sft, eval, export.

Every subcommand takes `--config` (a YAML file or a shipped recipe name) and dotted overrides
(`trainer.steps=10 optim.lr=1e-6`).
"""

import argparse
import logging
import sys
from pathlib import Path

DEMO_CONFIG = "grpo_tool_math"


def _load(args):
    from jaxrl_tools import configs
    from jaxrl_tools.config import load_config

    if getattr(args, "resume", False):
        args.overrides = [*args.overrides, "trainer.resume=true"]
    source = args.config or DEMO_CONFIG
    path = Path(source)
    if not path.is_file():
        path = configs.path(source)
    return load_config(path, args.overrides)


def _dispatch(args, cfg, run) -> None:
    if args.command == "demo":
        run.demo(cfg, baseline_reward=args.baseline_reward)
    elif args.command == "train":
        summary = run.train(cfg)
        print({k: v for k, v in summary["final_metrics"].items() if not k.startswith("time")})
    elif args.command == "sft":
        print(f"SFT model written to {run.sft_only(cfg, args.out)}")
    elif args.command == "eval":
        metrics = run.evaluate_policy(cfg, from_checkpoint=args.checkpoint, step=args.step)
        for key, value in sorted(metrics.items()):
            if not key.startswith("_"):
                print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    elif args.command == "export":
        print(f"exported to {run.export(cfg, args.out, args.step)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxrl-tools",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, help_text):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", help=f"YAML file or shipped recipe (default {DEMO_CONFIG})")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides")
        return p

    p = command("demo", "train a tiny policy to use the sandboxed Python tool (CPU, minutes)")
    p.add_argument(
        "--baseline-reward",
        help="also run RL from the same SFT policy with only this reward, and compare "
        "(e.g. `--config otc_tool_math --baseline-reward math`: OTC vs plain GRPO)",
    )
    p = command("train", "SFT (if enabled) then RL, with checkpoints; resumes a killed run")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint (same as trainer.resume=true)",
    )
    p = command("sft", "the SFT stage alone; writes a Hugging Face folder")
    p.add_argument("--out", required=True)
    p = command("eval", "accuracy / pass@k and tool statistics on the eval data")
    p.add_argument("--checkpoint", action="store_true", help="evaluate the run's checkpoint")
    p.add_argument("--step", type=int)
    p = command("export", "write a checkpoint's policy as a Hugging Face folder")
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int)
    args = parser.parse_args(argv)
    # orbax logs every checkpoint step at INFO through absl: keep the console for the run.
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from jaxrl_tools import run
    from jaxrl_tools.config import ConfigError

    try:
        _dispatch(args, _load(args), run)
    except (ConfigError, FileNotFoundError) as e:
        # A bad config, a run folder that does not fit it, or a recipe, data file or checkpoint
        # that is not there: the message names it; no traceback.
        print(f"jaxrl-tools: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
