"""`jaxrl-tools check`: the whole run checked, nothing trained."""

from jaxrl_tools import check, plan, setup
from jaxrl_tools.commands import DEMO_CONFIG

HELP = (
    "check the whole run without training (model and tokenizer folders, data, prompt "
    "lengths, tools, mesh, batch split, output folders) and print what it would do"
)


def add_arguments(p) -> None:
    p.add_argument("--smoke", action="store_true", help="check the --smoke version of the run")


def run(cfg, args) -> None:
    summary = check.preflight(cfg)
    plan.check_fits(cfg, setup.make_mesh(cfg))
    what = (args.config or DEMO_CONFIG) + (" (--smoke)" if args.smoke else "")
    print(f"jaxrl-tools check: {what} is ready to run (nothing was trained)")
    print(check.format_summary(summary))
