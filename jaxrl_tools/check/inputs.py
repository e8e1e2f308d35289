"""Checks of what a run reads: the model and tokenizer folders, the data files line by line, SFT
traces, and prompt lengths through the chat template."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from jaxrl_tools import data, envs, models, prompts, sharding
from jaxrl_tools.check.setup import build_tools, tools_schema
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.datasets import prepare
from jaxrl_tools.demo import grid_games, task
from jaxrl_tools.demo.tokenizer import build_mismatch, build_tokenizer

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "Qwen/Qwen2.5-7B"
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5")


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
    """The architecture of `model.tiny` with the tokenizer's vocabulary (as `run.setup_model`)."""
    tiny = dataclasses.asdict(cfg.model.tiny)
    tiny.pop("seed")
    return models.ModelConfig(
        **tiny,
        vocab_size=vocab_size,
        attention_bias=tiny["model_type"] == "qwen2",
        qk_norm=tiny["model_type"] == "qwen3",
    )


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


def _model_files(path: Path) -> list[str]:
    found = [p.name for g in _WEIGHT_GLOBS for p in path.glob(g)]
    if (path / "config.json").is_file():
        found.append("config.json")
    return sorted(found)


def check_tokenizer(cfg: RunConfig) -> str:
    """The tokenizer folder holds a tokenizer, or may have one built into it.

    A tokenizer is built only for a tiny model (`model.path: null`), only with `tokenizer.build`,
    and never into a folder that holds a model; a folder built earlier is reused only when it
    was built with this config's `vocab_size` and `seed`.

    Returns:
      "load" or "build".
    """
    t = cfg.tokenizer
    path = Path(cfg.tokenizer_path)
    field = "tokenizer.path" if t.path is not None else "model.path (tokenizer.path is null)"
    if (path / "tokenizer.json").is_file():
        if cfg.model.path is None and t.build:
            extra = len(task.tokenizer_texts(cfg))
            mismatch = build_mismatch(
                path, vocab_size=t.vocab_size, seed=t.seed, n_extra_texts=extra
            )
            if mismatch is not None:
                raise ConfigError(f"tokenizer.path={path} {mismatch}")
        return "load"
    if cfg.model.path is not None:
        raise ConfigError(
            f"no tokenizer.json in {path} ({field}): point tokenizer.path at the model's "
            "tokenizer folder (tokenizers are built only for a tiny model, model.path: null)"
        )
    if not t.build:
        raise ConfigError(
            f"no tokenizer.json in tokenizer.path={path}: set tokenizer.build=true to build "
            "one there, or point tokenizer.path at a tokenizer folder"
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"tokenizer.path={path} is a file: give a folder for the tokenizer")
    if path.is_dir():
        held = _model_files(path)
        if held:
            raise ConfigError(
                f"tokenizer.path={path} holds model files ({', '.join(held[:3])}): a tokenizer "
                "is built only into a folder of its own; set tokenizer.path to a new folder, "
                "e.g. runs/<run_name>/tokenizer"
            )
    return "build"


def open_tokenizer(cfg: RunConfig):
    """The run's tokenizer: loaded, or built (after `check_tokenizer` allows it). In a
    multi-process job process 0 builds it and the others wait for it (one folder on shared
    storage: processes building it at once would race)."""
    if not sharding.is_multiprocess():
        return _open_tokenizer(cfg)
    tokenizer = _open_tokenizer(cfg) if sharding.is_main_process() else None
    sharding.agree(None)  # a barrier: process 0's tokenizer is on disk
    return tokenizer if tokenizer is not None else _open_tokenizer(cfg)


def _open_tokenizer(cfg: RunConfig):
    if check_tokenizer(cfg) == "build":
        t = cfg.tokenizer
        return build_tokenizer(
            cfg.tokenizer_path,
            vocab_size=t.vocab_size,
            seed=t.seed,
            texts=task.tokenizer_texts(cfg),
        )
    return prompts.load_tokenizer(cfg.tokenizer_path)


# -------------------------------------------------------------------------------------- data


def _missing(field: str, path: str) -> ConfigError:
    """A recipe's file that is not there: what it is and the `prepare` command that makes it."""
    hint = prepare.missing_hint(path)
    return ConfigError(f"{field}: {hint}" if hint else f"{field}: data file not found: {path}")


def _read(cfg: RunConfig, split: str) -> data.RecordSource:
    field = f"data.{split}_files"
    for path in getattr(cfg.data, f"{split}_files"):
        if not Path(path).is_file():
            raise _missing(field, path)
    try:
        return data.record_source(cfg.data, split)
    except data.DataError as e:
        msg = str(e)
        if re.search(r":\d+: ", msg) and not cfg.data.skip_bad_lines:
            msg += " (fix the line, or set data.skip_bad_lines=true to skip bad lines)"
        raise ConfigError(f"{field}: {msg}") from None


def env_records(cfg: RunConfig, split: str) -> list[dict]:
    """The episodes of the `env` section as prompt records ("train" or held-out "eval" seeds).
    An environment that cannot be made from its kwargs (a ValueError) is a config error."""
    try:
        return envs.Episodes.from_section(cfg.env).split_records(cfg.env, split)
    except ValueError as e:
        raise ConfigError(f"env.kwargs {dict(cfg.env.kwargs)} for {cfg.env.name!r}: {e}") from e


def check_data(
    cfg: RunConfig, *, needs_eval: bool = False, needs_train: bool = True
) -> dict[str, Sequence[dict]]:
    """The prompt records: generated (`data.task`) or read from the files, every line checked;
    a missing file of a downloadable benchmark (or search corpus) names the `jaxrl-tools prepare`
    command that makes it.

    Returns:
      {"train": records, "eval": records} ("eval" only when there is held-out data).

    Raises:
      ConfigError: a missing file, a bad line (file:line), no train data, or no eval data when
        the run evaluates (`needs_eval`, `trainer.eval_every`).
    """
    d = cfg.data
    for i, spec in enumerate(cfg.tools):  # a search tool's corpus is data too
        corpus = spec.config.get("corpus_path")
        if corpus and not Path(corpus).is_file():
            raise _missing(f"tools[{i}].config.corpus_path", corpus)
    out: dict[str, Sequence[dict]] = {}
    if cfg.env.name is not None:  # episodes replace the data files
        out["train"] = env_records(cfg, "train")
        out["eval"] = env_records(cfg, "eval")
    elif d.task is not None:
        out["train"] = task.task_records(d, cfg.rollout.protocol, "train")
        out["eval"] = task.task_records(d, cfg.rollout.protocol, "eval")
    else:
        if d.train_files:
            out["train"] = _read(cfg, "train")
        elif needs_train and cfg.trainer.steps > 0:
            raise ConfigError(
                "data.train_files is empty: give prompt files (jsonl or parquet, one record "
                f"per line with {d.prompt_key!r} and {d.answer_key!r}), or data.task="
                "tool_arithmetic for the generated demo task"
            )
        if d.eval_files:
            out["eval"] = _read(cfg, "eval")
        elif needs_eval or cfg.trainer.eval_every:
            why, fix = (
                ("the run evaluates", "")
                if needs_eval
                else (
                    f"trainer.eval_every={cfg.trainer.eval_every}",
                    ", or set trainer.eval_every=0",
                )
            )
            raise ConfigError(
                f"data.eval_files is empty but {why}: give held-out prompt files{fix}"
            )
    if "eval" in out and d.max_eval_records is not None:
        out["eval"] = list(out["eval"])[: d.max_eval_records]
    return out


def check_sft(cfg: RunConfig) -> int:
    """The SFT stage has traces (files read line by line, or generated) that fill its batches.

    Returns:
      The number of traces (0 when SFT is off).
    """
    s, d = cfg.sft, cfg.data
    if not s.enabled:
        return 0
    if s.train_files:
        try:
            n = len(data.load_sft_traces(s.train_files))
        except data.DataError as e:
            raise ConfigError(f"sft.train_files: {e}") from None
        if s.max_traces is not None:
            n = min(n, s.max_traces)
    elif cfg.env.name is not None:
        if not grid_games.is_grid_game(cfg.env.name):
            games = [n for n in envs.env_names() if grid_games.is_grid_game(n)]
            raise ConfigError(
                f"sft.enabled with generated traces needs a grid game (env.name in {games}), "
                f"not {cfg.env.name!r}: give sft.train_files, or set sft.enabled=false"
            )
        n = s.num_traces
    elif d.task is not None:
        # function_calling traces answer in ToolRL's format, whatever the protocol
        if d.task == "tool_arithmetic" and cfg.rollout.protocol not in task.TRACE_PROTOCOLS:
            raise ConfigError(
                f"sft.enabled with generated traces needs rollout.protocol in "
                f"{list(task.TRACE_PROTOCOLS)}, not {cfg.rollout.protocol!r}: give "
                "sft.train_files, change the protocol, or set sft.enabled=false"
            )
        n = s.num_traces
    else:
        raise ConfigError(
            "sft.enabled=true needs sft.train_files (trace files), or data.task or env.name "
            "(generated traces): give trace files, or set sft.enabled=false"
        )
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


def _lengths(cfg: RunConfig, tokenizer, records: Sequence[dict], schema) -> list[int]:
    out = []
    for rec in records:
        try:
            out.append(len(prompts.encode_prompt(tokenizer, rec, schema, cfg.data.system_prompt)))
        except data.DataError as e:
            raise ConfigError(f"{_record_name(rec)}: {e}") from None
    return out


def check_prompt_lengths(
    cfg: RunConfig, tokenizer, records: dict[str, Sequence[dict]], schema=None
) -> dict[str, dict]:
    """Every prompt, rendered with the chat template and its tools, fits `rollout.max_prompt_len`
    (with `data.drop_long_prompts`, longer ones are counted: the loaders drop them).

    Returns:
      Per split: {"count", "longest", "longest_name", "dropped"}.
    """
    limit = cfg.rollout.max_prompt_len
    out = {}
    for split, recs in records.items():
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


def fit_prompts(cfg: RunConfig, records: Sequence[dict], split: str = "train") -> Sequence[dict]:
    """The records the run uses: with `data.drop_long_prompts`, those whose rendered prompt
    fits `rollout.max_prompt_len` (the dropped ones are counted in the log); else all."""
    if not cfg.data.drop_long_prompts:
        return records
    tokenizer = prompts.load_tokenizer(cfg.tokenizer_path)
    schema = tools_schema(cfg, build_tools(cfg))
    lengths = _lengths(cfg, tokenizer, records, schema)
    kept, dropped = prompts.fit_prompts(records, lengths, cfg.rollout.max_prompt_len)
    if not kept:
        raise ConfigError(
            f"all {len(records)} {split} prompts are longer than rollout.max_prompt_len="
            f"{cfg.rollout.max_prompt_len} tokens: raise rollout.max_prompt_len"
        )
    if dropped:
        log.warning(
            "dropped %d of %d %s prompts longer than rollout.max_prompt_len=%d tokens "
            "(data.drop_long_prompts)",
            len(dropped),
            len(records),
            split,
            cfg.rollout.max_prompt_len,
        )
    return kept
