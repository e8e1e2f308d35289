"""`jaxrl-tools repro`: one update of `model.path` on a saved batch, against references."""

from jaxrl_tools.interop.repro import repro

HELP = (
    "one update of model.path on a saved batch (verl's fields, jaxrl_tools.interop): "
    "log-probs, advantages, loss, gradients, weights after one AdamW step; exit 1 past the "
    "tolerances"
)


def add_arguments(p) -> None:
    p.add_argument("--batch", required=True, help="parquet file of interop.save_batch / verl")
    p.add_argument(
        "--torch", action="store_true", help="also run the PyTorch reference and compare"
    )
    p.add_argument(
        "--trl", action="store_true", help="also run TRL's GRPO loss (pip install trl) and compare"
    )


def run(cfg, args) -> int:
    lines, ok = repro(cfg, args.batch, with_torch=args.torch, with_trl=args.trl)
    print("\n".join(lines))
    return 0 if ok else 1
