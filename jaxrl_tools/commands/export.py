"""`jaxrl-tools export`: a checkpoint's policy as a Hugging Face folder or a GGUF file."""

from jaxrl_tools import run as runs

HELP = "write a checkpoint's policy as a Hugging Face folder or a GGUF file"


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="a new folder (hf) or a new FILE.gguf")
    p.add_argument("--step", type=int)
    p.add_argument(
        "--format",
        choices=runs.EXPORT_FORMATS,
        default="hf",
        help="hf: a Hugging Face folder; gguf-f16 / gguf-q8_0 / gguf-bf16 / gguf-f32: one GGUF "
        "file with the tokenizer and chat template (llama.cpp; the [gguf] extra)",
    )


def run(cfg, args) -> None:
    print(f"exported to {runs.export(cfg, args.out, args.step, args.format)}")
