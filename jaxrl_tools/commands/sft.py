"""`jaxrl-tools sft`: the SFT stage alone, written as a Hugging Face folder."""

from jaxrl_tools import check
from jaxrl_tools import run as runs

HELP = "the SFT stage alone; writes a Hugging Face folder"
RUNS_MODEL = True


def add_arguments(p) -> None:
    p.add_argument("--out", required=True)


def run(cfg, args) -> None:
    check.check_new_output(args.out)
    check.preflight_sft(cfg)
    print(f"SFT model written to {runs.sft_only(cfg, args.out)}")
