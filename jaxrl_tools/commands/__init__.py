"""The subcommands of `jaxrl-tools`, one module each: `HELP` (its line in `--help`),
`add_arguments(parser)` and `run(cfg, args)` (the exit status, None for 0). `cli` builds the
parser from `COMMANDS` and handles what every command shares (the config, processes, errors).
`prepare` takes no config (`run(args)`); `RUNS_MODEL` commands get the compile cache."""

DEMO_CONFIG = "grpo_tool_math"  # the recipe of a command without --config
COMMANDS = (
    "demo",
    "train",
    "check",
    "plan",
    "serve",
    "sft",
    "eval",
    "pass_rate",
    "export",
    "repro",
    "prepare",
)


def command_name(module: str) -> str:
    """The subcommand a module implements (`pass_rate` -> `pass-rate`)."""
    return module.replace("_", "-")
