"""`jaxrl-tools demo`: the recipe's demo (SFT, RL, the report), once or per seed."""

from jaxrl_tools.commands.common import SMOKE_HELP
from jaxrl_tools.demo import seeds

HELP = "train a tiny policy to use the sandboxed Python tool (CPU, minutes)"
RUNS_MODEL = True


def add_arguments(p) -> None:
    p.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    p.add_argument(
        "--baseline-reward",
        help="also run RL from the same SFT policy with only this reward, and compare "
        "(e.g. `--config otc_tool_math --baseline-reward math`: OTC vs plain GRPO)",
    )
    p.add_argument(
        "--baseline-estimator",
        help="also run RL from the same SFT policy with this advantage estimator, and compare "
        "(e.g. `--config sokoban_gigpo_demo --baseline-estimator grpo`: GiGPO vs GRPO)",
    )
    p.add_argument(
        "--baseline-agent",
        help="also run RL from the same SFT policy with this rollout.agent, and compare "
        "(e.g. `rollout.protocol=qwen --baseline-agent jaxrl_tools.demo.agent:tool_math_agent`)",
    )
    p.add_argument(
        "--seeds",
        type=seeds.parse_seeds,
        help="run the demo once per seed (e.g. 0,1,2: trainer.seed, model.tiny.seed and "
        "data.shuffle_seed) and print its figure as a spread over them (seeds.md in log_dir)",
    )


def run(cfg, args) -> None:
    seeds.demo_seeds(
        cfg,
        args.seeds,
        baseline_reward=args.baseline_reward,
        baseline_estimator=args.baseline_estimator,
        baseline_agent=args.baseline_agent,
    )
