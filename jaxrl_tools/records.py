"""Where a run's records come from, once: a registry of record sources.

A run's prompts come from one of three sources, chosen by its config: the episodes of an
environment (`env.name`), a generated task (`data.task`), or jsonl / parquet files
(`data.train_files`, `data.eval_files`). Each source gives a split's records, the SFT traces it
can generate, the texts a tiny model's tokenizer is trained on, and the words `check` prints.

    recs = records(cfg, "train")                                  # the source's records
    loader = train_loader(cfg, tokenizer, sampler.tools_schema)   # fitted, batched, sharded
    evals = eval_records(cfg, tokenizer, sampler.tools_schema)
    traces = sft_traces(cfg, tokenizer)                           # sft.train_files, or generated

The tokenizer is opened once by the caller (`setup.setup_tokenizer`) and passed in. Errors are
the sources' own (`data.DataError`, a ValueError); `check` words them as config errors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import jax

from jaxrl_tools import curation, data, envs, prompts, sharding
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.registry import Registry
from jaxrl_tools.tasks import function_calling, grid_games, tool_arithmetic, when_to_call
from jaxrl_tools.tools import get_parser
from jaxrl_tools.tools.search import iter_passages

log = logging.getLogger(__name__)

SPLITS = ("train", "eval")
CORPUS_TOKENIZER_TEXTS = 5_000  # passages of a search corpus the tokenizer reads, at most


class Source:
    """Where records come from. Subclasses are registered by name (`register_source`)."""

    name = ""

    def has(self, cfg: RunConfig, split: str) -> bool:
        """Whether the config gives records for `split` (files may give only one split)."""
        return True

    def files(self, cfg: RunConfig, split: str) -> tuple[str, ...]:
        """The files `split` is read from (none for generated records)."""
        return ()

    def field(self, cfg: RunConfig, split: str) -> str:
        """The config field an error of `records` names."""
        raise NotImplementedError

    def describe(self, cfg: RunConfig, split: str) -> str:
        """Where `split` comes from, in words (`check`'s summary)."""
        raise NotImplementedError

    def records(self, cfg: RunConfig, split: str) -> Sequence[dict]:
        """The records of `split` ("train" or "eval")."""
        raise NotImplementedError

    def tokenizer_texts(self, cfg: RunConfig) -> list[str]:
        """Texts a tiny model's tokenizer is trained on besides its own corpus: by default the
        first passages of a search tool's corpus (an entity's name is then a few tokens, which
        a tiny model can copy)."""
        return corpus_texts(cfg)

    def trace_error(self, cfg: RunConfig) -> str | None:
        """Why this source cannot generate SFT traces for `cfg` (None: it can)."""
        return None

    def sft_traces(self, cfg: RunConfig, tokenizer) -> list[list[list[Any]]]:
        """`sft.num_traces` generated traces as segment lists ([[text, trainable], ...])."""
        raise NotImplementedError


SOURCES: Registry[Source] = Registry("record source")  # its sources are in this module


def register_source(name: str) -> Callable[[type[Source]], type[Source]]:
    """Decorator: register a `Source` subclass (one instance) as `name`."""

    def deco(cls: type[Source]) -> type[Source]:
        cls.name = name
        SOURCES.add(name, cls())
        return cls

    return deco


def list_sources() -> list[str]:
    """The registered source names, sorted."""
    return SOURCES.names()


def get_source(name: str) -> Source:
    """The source registered as `name`; an unknown name is a ValueError naming the valid ones."""
    return SOURCES.get(name)


def source_name(cfg: RunConfig) -> str:
    """The source a config reads: its environment, else its verifiers taskset, else its
    generated task, else its files."""
    if cfg.env.name is not None:
        return "env"
    if cfg.data.verifiers is not None:
        return "verifiers"
    return "task" if cfg.data.task is not None else "files"


def source(cfg: RunConfig) -> Source:
    """The config's source (`source_name`)."""
    return get_source(source_name(cfg))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


# ---------------------------------------------------------------------------------- sources


@register_source("env")
class EnvSource(Source):
    """The episodes of the `env` section: one record per seed (held-out seeds for "eval")."""

    def field(self, cfg, split):
        return f"env.kwargs {dict(cfg.env.kwargs)} for {cfg.env.name!r}"

    def describe(self, cfg, split):
        return f"episodes of env {cfg.env.name}"

    def records(self, cfg, split):
        return envs.Episodes.from_section(cfg.env).split_records(cfg.env, split)

    def tokenizer_texts(self, cfg):  # a grid game's prompts and turns; none for the others
        return grid_games.tokenizer_texts(cfg.env) if grid_games.is_grid_game(cfg.env.name) else []

    def trace_error(self, cfg):
        if grid_games.is_grid_game(cfg.env.name):
            return None
        games = [n for n in envs.env_names() if grid_games.is_grid_game(n)]
        return (
            f"sft.enabled with generated traces needs a grid game (env.name in {games}), "
            f"not {cfg.env.name!r}: give sft.train_files, or set sft.enabled=false"
        )

    def sft_traces(self, cfg, tokenizer):
        return grid_games.sft_traces(cfg, tokenizer)


@register_source("task")
class TaskSource(Source):
    """A generated task (`data.task`): tool arithmetic or function calling."""

    def field(self, cfg, split):
        return f"data.task={cfg.data.task}"

    def describe(self, cfg, split):
        return f"generated {cfg.data.task}"

    def records(self, cfg, split):
        if cfg.data.task == "when_to_call":
            return when_to_call.task_records(cfg.data, split)
        return tool_arithmetic.task_records(cfg.data, cfg.rollout.protocol, split)

    def tokenizer_texts(self, cfg):  # the declarations (and requests and answers)
        if cfg.data.task == "when_to_call":
            return when_to_call.tokenizer_texts(cfg.data)
        if cfg.data.task == "function_calling":
            return function_calling.tokenizer_texts()
        return tool_arithmetic.tokenizer_texts(cfg.rollout.protocol) + super().tokenizer_texts(cfg)

    def trace_error(self, cfg):
        # function_calling traces answer in ToolRL's format, whatever the protocol
        if (
            cfg.data.task == "tool_arithmetic"
            and cfg.rollout.protocol not in tool_arithmetic.TRACE_PROTOCOLS
        ):
            return (
                f"sft.enabled with generated traces needs rollout.protocol in "
                f"{list(tool_arithmetic.TRACE_PROTOCOLS)}, not {cfg.rollout.protocol!r}: give "
                "sft.train_files, change the protocol, or set sft.enabled=false"
            )
        if cfg.data.task == "when_to_call" and cfg.rollout.protocol not in when_to_call.PROTOCOLS:
            return (
                f"sft.enabled with when_to_call traces needs rollout.protocol in "
                f"{list(when_to_call.PROTOCOLS)}, not {cfg.rollout.protocol!r}"
            )
        return None

    def sft_traces(self, cfg, tokenizer):
        if cfg.data.task == "when_to_call":
            return when_to_call.sft_traces(
                when_to_call.make_records(
                    cfg.sft.num_traces, cfg.data.shuffle_seed + 20_000, "train"
                ),
                tokenizer,
                cfg.sft,
                protocol=cfg.rollout.protocol,
                system_prompt=cfg.data.system_prompt,
                seed=cfg.data.shuffle_seed,
            )
        return tool_arithmetic.task_sft_traces(cfg.data, cfg.sft, cfg.rollout.protocol, tokenizer)


@register_source("files")
class FileSource(Source):
    """Prompt files (`data.train_files`, `data.eval_files`), read and checked line by line."""

    def has(self, cfg, split):
        return bool(self.files(cfg, split))

    def files(self, cfg, split):
        _check_split(split)
        return tuple(cfg.data.train_files if split == "train" else cfg.data.eval_files)

    def field(self, cfg, split):
        return f"data.{split}_files"

    def describe(self, cfg, split):
        return ", ".join(self.files(cfg, split))

    def records(self, cfg, split):
        return data.record_source(cfg.data, split)

    def trace_error(self, cfg):
        return (
            "sft.enabled=true needs sft.train_files (trace files), or data.task or env.name "
            "(generated traces): give trace files, or set sft.enabled=false"
        )


@register_source("verifiers")
class VerifiersSource(Source):
    """The tasks of a `verifiers` taskset (`data.verifiers`), one record each."""

    def has(self, cfg, split):
        return cfg.data.verifiers.get(split) is not None

    def field(self, cfg, split):
        return f"data.verifiers.{split}"

    def describe(self, cfg, split):
        return f"verifiers taskset {cfg.data.verifiers['taskset']!r} ({split})"

    def records(self, cfg, split):
        from jaxrl_tools.agents import verifiers_envs  # noqa: PLC0415 -- the [verifiers] extra

        return verifiers_envs.records(cfg.data.verifiers, split)

    def trace_error(self, cfg):
        return "sft.enabled=true with data.verifiers needs sft.train_files (trace files)"


def _response_renderer(cfg: RunConfig, tokenizer) -> Callable[[dict], list]:
    """How a {"prompt", "response"} SFT row becomes segments: the run's chat template, the
    protocol's inline observations left out of the loss. A chat protocol's observations are
    turns of their own, which one response string cannot hold: such rows are refused."""
    protocol = cfg.rollout.protocol
    parser = None if protocol == "none" else get_parser(protocol)
    if parser is not None and getattr(parser, "chat_role", None):

        def refuse(row: dict) -> list:
            raise data.DataError(
                f"a prompt and response trace needs an inline protocol (rollout.protocol "
                f"{protocol!r} answers calls in turns of their own): give segments instead"
            )

        return refuse
    pattern = None if parser is None else prompts.observation_pattern(parser.format_observation)
    return lambda row: prompts.trace_segments(tokenizer, row, cfg.data.system_prompt, pattern)


# ------------------------------------------------------------------------------ the run's use


def records(cfg: RunConfig, split: str) -> Sequence[dict]:
    """The records of `split` from the config's source ("eval": the first
    `data.max_eval_records`)."""
    _check_split(split)
    out = source(cfg).records(cfg, split)
    if split == "eval" and cfg.data.max_eval_records is not None:
        out = list(out)[: cfg.data.max_eval_records]
    return out


def fit_prompts(
    cfg: RunConfig, recs: Sequence[dict], split: str, tokenizer, tools_schema=None
) -> Sequence[dict]:
    """The records the run uses: with `data.drop_long_prompts`, those whose prompt (rendered
    with the chat template and `tools_schema`, as the sampler renders it) fits
    `rollout.max_prompt_len` (the dropped ones are counted in the log); else all."""
    if not cfg.data.drop_long_prompts:
        return recs
    limit, schema = cfg.rollout.max_prompt_len, tools_schema or None  # [] renders as None
    lengths = prompts.prompt_lengths(tokenizer, recs, schema, cfg.data.system_prompt)
    kept, dropped = prompts.fit_prompts(recs, lengths, limit)
    if not kept:
        raise ConfigError(
            f"all {len(recs)} {split} prompts are longer than rollout.max_prompt_len={limit} "
            "tokens: raise rollout.max_prompt_len"
        )
    if dropped:
        log.warning(
            "dropped %d of %d %s prompts longer than rollout.max_prompt_len=%d tokens "
            "(data.drop_long_prompts)",
            *(len(dropped), len(recs), split, limit),
        )
    return kept


def train_loader(cfg: RunConfig, tokenizer, tools_schema=None) -> data.PromptLoader:
    """The prompts of the RL steps, shuffled and repeated (`fit_prompts` applied; with
    `data.curriculum`, in its order instead). In a multi-process job each process reads its
    slice of every batch; all see the batch."""
    fitted = fit_prompts(cfg, records(cfg, "train"), "train", tokenizer, tools_schema)
    loader_kw: dict = {}
    if jax.process_count() > 1:
        loader_kw.update(shard=(jax.process_index(), jax.process_count()), gather=sharding.agree)
    if cfg.data.curriculum is not None:  # every epoch in the curriculum's order, not shuffled
        order = curation.curriculum_order(fitted, cfg.data.curriculum)
        fitted, loader_kw["shuffle"] = [fitted[i] for i in order], False
    if cfg.data.train_weights is not None:
        loader_kw["mix"] = file_mix(fitted, cfg.data.train_files, cfg.data.train_weights)
    return data.loader_from_config(cfg.data, "train", source=fitted, **loader_kw)


def file_mix(recs: Sequence[dict], files: Sequence[str], weights: Sequence[float]) -> list:
    """(records, weight) of each training file, in order, for `data.train_weights` (records
    are in file order; "source" is "file:line")."""
    counts = dict.fromkeys((str(Path(f)) for f in files), 0)
    for rec in recs:
        counts[rec["source"].rsplit(":", 1)[0]] += 1
    for path, n in counts.items():
        if n == 0:
            raise ConfigError(
                f"data.train_weights: {path} has no prompt left (rollout.max_prompt_len "
                "dropped them all): give it a weight only if it has prompts"
            )
    return [(counts[str(Path(f))], float(w)) for f, w in zip(files, weights)]


def eval_records(cfg: RunConfig, tokenizer, tools_schema=None) -> list[dict]:
    """The held-out prompts (the first `data.max_eval_records`, `fit_prompts` applied)."""
    return list(fit_prompts(cfg, records(cfg, "eval"), "eval", tokenizer, tools_schema))


def sft_traces(cfg: RunConfig, tokenizer) -> list[list[list[Any]]]:
    """The SFT stage's traces: `sft.train_files` (the first `sft.max_traces`), else those the
    source generates (a ConfigError when it cannot: `Source.trace_error`)."""
    s = cfg.sft
    if s.train_files:
        return data.load_sft_traces(s.train_files, _response_renderer(cfg, tokenizer))[
            : s.max_traces
        ]
    src = source(cfg)
    error = src.trace_error(cfg)
    if error is not None:
        raise ConfigError(error)
    return src.sft_traces(cfg, tokenizer)


def corpus_texts(cfg: RunConfig) -> list[str]:
    """The first passages of each search tool's corpus, as text."""
    texts: list[str] = []
    for i, spec in enumerate(cfg.tools):
        corpus = spec.config.get("corpus_path")
        if corpus and Path(corpus).is_file():
            passages = islice(iter_passages(corpus), CORPUS_TOKENIZER_TEXTS)
            try:
                texts += [f"{p.title} {p.text}" for _, p in passages]
            except ValueError as e:  # a malformed line: file:line and what a passage needs
                raise ConfigError(f"tools[{i}].config.corpus_path: {e}") from None
    return texts


def tokenizer_texts(cfg: RunConfig) -> list[str]:
    """Text a tiny model's tokenizer is trained on besides its own corpus: a grid game's
    prompts and turns, the function-calling task's declarations, requests and answers, or the
    first passages of a search tool's corpus (so that a grid, a schema or an entity's name is a
    few tokens, which a tiny model can copy); none for the arithmetic task."""
    return source(cfg).tokenizer_texts(cfg)


__all__ = [
    "Source",
    "register_source",
    "list_sources",
    "get_source",
    "source_name",
    "source",
    "records",
    "fit_prompts",
    "train_loader",
    "eval_records",
    "sft_traces",
    "corpus_texts",
    "tokenizer_texts",
]
