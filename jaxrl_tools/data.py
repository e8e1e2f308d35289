"""Prompt data: jsonl / parquet records -> a grain pipeline with resumable iterator state, and
SFT trace files (rendering prompts is `prompts`).

A record holds a prompt (a string or a list of chat messages), a ground truth and optionally
its tool set:

    {"prompt": "What is 4821 * 397?", "ground_truth": "1913937", "tools": ["python"]}

    source = RecordSource(["train.jsonl"], skip_bad_lines=True)
    loader = PromptLoader(source, batch_size=8, seed=0)
    batch = next(loader)                       # a list of 8 normalised records
    state = loader.get_state()                 # save with the checkpoint ...
    loader.set_state(state)                    # ... and a resumed run sees the same data

Bad input (a bad JSON line, a missing field) is a `DataError` naming the file and line, or,
with `skip_bad_lines=True`, a logged warning; the count is `source.num_skipped`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grain
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

_MAX_LOGGED = 20  # bad lines logged one by one; the rest only counted


class DataError(ValueError):
    """Malformed input data; the message names the file and line (or row)."""


@dataclass(frozen=True)
class SkippedLine:
    file: str
    line: int  # 1-based line (jsonl) or row (parquet)
    reason: str


def read_json_lines(path: Path):
    """(line number, parsed value or None, error or None) for each non-blank line of a JSON
    lines file. A line that is not UTF-8, not JSON, or holds a string no UTF-8 text can (an
    unpaired surrogate escape such as "\\ud800", which tokenizers refuse) is an error."""
    with path.open("rb") as fh:
        for n, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1})"
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield n, None, f"bad JSON ({e.msg} at column {e.colno})"
                continue
            where = _unencodable(row)
            if where is not None:
                yield n, None, f"{where} holds an unpaired surrogate escape (not valid unicode)"
                continue
            yield n, row, None


def _unencodable(value: Any, where: str = "the line") -> str | None:
    """Where in a parsed JSON value a string (or key) cannot be UTF-8 text, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _unencodable(v, f"{where}[{i}]")) is not None:
                return found
    elif isinstance(value, dict):
        for k, v in value.items():
            at = f"field {k!r}" if where == "the line" else f"{where}[{k!r}]"
            if (found := _unencodable(k, at) or _unencodable(v, at)) is not None:
                return found
    return None


def _check_messages(msgs: Any) -> str | None:
    if not isinstance(msgs, list) or not msgs:
        return "must be a non-empty string or a non-empty list of chat messages"
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            return f"message {i} must be a mapping with 'role' and 'content'"
        if m["role"] not in ("system", "user", "assistant", "tool"):
            return f"message {i} has unknown role {m['role']!r}"
    return None


@dataclass
class RecordSource:
    """A random-access source (grain-compatible: `__len__`, `__getitem__`) of prompt records.

    All files are read and validated up front so that bad lines are found (and skipped) before
    shuffling, and a given index always names the same record.

    Args:
      files: .jsonl / .json (one object per line) or .parquet files, read in order.
      prompt_key, answer_key, tools_key: field names in the files.
      skip_bad_lines: skip (and log and count) bad lines instead of raising `DataError`.
      require_answer: a record without `answer_key` is bad.

    Each item is a dict: prompt, ground_truth, tools (list or None), source ("file:line"),
    index, meta (the record's other fields).
    """

    files: Sequence[str | os.PathLike]
    prompt_key: str = "prompt"
    answer_key: str = "ground_truth"
    tools_key: str = "tools"
    skip_bad_lines: bool = False
    require_answer: bool = True
    records: list[dict] = field(init=False, repr=False)
    skipped: list[SkippedLine] = field(init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.files, str | os.PathLike):
            self.files = [self.files]
        if not self.files:
            raise DataError("RecordSource: no files given")
        self.records, self.skipped = [], []
        for f in self.files:
            self._read_file(Path(f))
        if self.skipped:
            logger.warning(
                "skipped %d bad line(s) in %s", len(self.skipped), [str(f) for f in self.files]
            )
        if not self.records:
            raise DataError(f"no valid records in {[str(f) for f in self.files]}")

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        return self.records[index]

    def _read_file(self, path: Path) -> None:
        if not path.is_file():
            raise DataError(f"data file not found: {path}")
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            try:
                rows = pq.read_table(path).to_pylist()
            except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds
                raise DataError(f"{path}: cannot read parquet: {e}") from e
            for i, row in enumerate(rows, start=1):
                self._add(path, i, row, raw_error=None)
        elif suffix in (".jsonl", ".json", ".ndjson"):
            for i, row, err in read_json_lines(path):
                self._add(path, i, row, raw_error=err)
        else:
            raise DataError(f"{path}: unsupported data file type {suffix!r} (jsonl or parquet)")

    def _add(self, path: Path, line: int, row: Any, raw_error: str | None) -> None:
        err = raw_error or self._validate(row)
        if err is not None:
            where = f"{path}:{line}"
            if not self.skip_bad_lines:
                raise DataError(f"{where}: {err}")
            if len(self.skipped) < _MAX_LOGGED:
                logger.warning("skipping %s: %s", where, err)
            self.skipped.append(SkippedLine(str(path), line, err))
            return
        meta = {
            k: v
            for k, v in row.items()
            if k not in (self.prompt_key, self.answer_key, self.tools_key)
        }
        self.records.append(
            {
                "prompt": row[self.prompt_key],
                "ground_truth": row.get(self.answer_key),
                "tools": row.get(self.tools_key),
                "source": f"{path}:{line}",
                "index": len(self.records),
                "meta": meta,
            }
        )

    def _validate(self, row: Any) -> str | None:
        if not isinstance(row, Mapping):
            return f"expected a JSON object, got {type(row).__name__}"
        if self.prompt_key not in row or row[self.prompt_key] is None:
            return f"missing field {self.prompt_key!r} (fields: {sorted(row)})"
        prompt = row[self.prompt_key]
        if isinstance(prompt, str):
            if not prompt.strip():
                return f"field {self.prompt_key!r} is empty"
        else:
            msg = _check_messages(prompt)
            if msg is not None:
                return f"field {self.prompt_key!r} {msg}"
        if self.require_answer and (self.answer_key not in row or row[self.answer_key] is None):
            return f"missing field {self.answer_key!r} (fields: {sorted(row)})"
        tools = row.get(self.tools_key)
        if tools is not None and not isinstance(tools, list):
            return f"field {self.tools_key!r} must be a list, got {type(tools).__name__}"
        return None


def make_dataset(
    source: Sequence[Any],
    *,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    drop_remainder: bool = True,
    mix: Sequence[tuple[int, float]] | None = None,
) -> grain.MapDataset:
    """source -> shuffle(seed) -> repeat(num_epochs; reshuffled each epoch) -> batch (lists).
    (`PromptLoader` runs it over `range(len(records))` and reads the records of each batch.)

    Args:
      source: a random-access source (e.g. `RecordSource`).
      batch_size: records per batch.
      seed: shuffle seed.
      shuffle: shuffle (False: file order).
      num_epochs: passes over the data; None repeats forever.
      drop_remainder: drop a last incomplete batch (only matters with finite epochs).
      mix: (size, weight) of consecutive parts of `source` (its files): each part is shuffled
        (seed + its index) and repeated on its own, and the parts are interleaved in proportion
        to their weights, deterministically (grain's mix), forever (num_epochs must be None).

    Returns:
      A grain MapDataset whose elements are lists of `batch_size` records.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if mix is not None:
        if num_epochs is not None or sum(n for n, _ in mix) != len(source):
            raise ValueError("mix: parts must cover the source, and repeat forever")
        parts, start = [], 0
        for i, (n, _) in enumerate(mix):
            part = grain.MapDataset.source(source).slice(slice(start, start + n))
            parts.append((part.shuffle(seed=seed + i) if shuffle else part).repeat(None))
            start += n
        ds = grain.MapDataset.mix(parts, [w for _, w in mix])
        return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    return ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)


class PromptLoader:
    """An iterator of record batches with saveable state (grain DatasetIterator state).

    The pipeline runs over record indices; a batch's records are read at the end, so a process
    of a multi-process job reads only its own slice of each batch (`shard`) and the slices are
    gathered into the batch every process sees. The state is the same in every process.

    Args:
      source: a random-access source.
      batch_size, seed, shuffle, num_epochs, drop_remainder, mix: see `make_dataset`.
      num_threads: grain read threads (0: read in the calling thread; records are in memory
        already, and threads would compete with the trainer for CPU).
      shard: (index, count): read the index-th of `count` contiguous slices of every batch.
      gather: gather(my_records) -> every shard's records in shard order (a collective, e.g.
        `sharding.distributed.agree`); required when count > 1.
    """

    def __init__(
        self,
        source: Sequence[Any],
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        drop_remainder: bool = True,
        num_threads: int = 0,
        shard: tuple[int, int] = (0, 1),
        gather: Callable[[list], list[list]] | None = None,
        mix: Sequence[tuple[int, float]] | None = None,
    ):
        index, count = shard
        if not 0 <= index < count:
            raise ValueError(f"shard {shard}: the index must be in 0..count-1")
        if count > 1 and gather is None:
            raise ValueError(f"shard {shard}: reading a slice of each batch needs `gather`")
        self.source = source
        self.batch_size = batch_size
        self.shard, self._gather = (index, count), gather
        self.dataset = make_dataset(
            range(len(source)),
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            num_epochs=num_epochs,
            drop_remainder=drop_remainder,
            mix=mix,
        )
        read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=num_threads * 4)
        self._it = iter(self.dataset.to_iter_dataset(read))

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        indices = next(self._it)
        index, count = self.shard
        n = len(indices)
        mine = [self.source[i] for i in indices[index * n // count : (index + 1) * n // count]]
        if count == 1:
            return mine
        return [record for part in self._gather(mine) for record in part]

    def get_state(self) -> dict:
        """JSON-serialisable position (save it with the checkpoint)."""
        return dict(self._it.get_state())

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a state returned by `get_state` (of a loader built the same way)."""
        self._it.set_state(dict(state))


def record_source(data_cfg, split: str = "train") -> RecordSource:
    """The records of a `config.DataSection`'s train or eval files (read and checked now)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    files = data_cfg.train_files if split == "train" else data_cfg.eval_files
    return RecordSource(
        list(files),
        prompt_key=data_cfg.prompt_key,
        answer_key=data_cfg.answer_key,
        tools_key=data_cfg.tools_key,
        skip_bad_lines=data_cfg.skip_bad_lines,
    )


def loader_from_config(
    data_cfg, split: str = "train", *, source: Sequence[Any] | None = None, **overrides
) -> PromptLoader:
    """A PromptLoader from a `config.DataSection` (split "train": shuffled, repeated;
    "eval": file order, one pass, the last partial batch kept).

    Args:
      data_cfg: the data section.
      split: "train" or "eval".
      source: the records (default: `record_source(data_cfg, split)`), e.g. generated ones or
        those left by `fit_prompts`.
      **overrides: PromptLoader arguments.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if source is None:
        source = record_source(data_cfg, split)
    if split == "train":
        kw = dict(
            batch_size=data_cfg.batch_size,
            seed=data_cfg.shuffle_seed,
            num_epochs=data_cfg.num_epochs,
        )
    else:
        kw = dict(
            batch_size=data_cfg.eval_batch_size, shuffle=False, num_epochs=1, drop_remainder=False
        )
    kw.update(overrides)
    return PromptLoader(source, **kw)


def load_sft_traces(
    files: Sequence[str | os.PathLike], render: Callable[[dict], list] | None = None
) -> list[list[list[Any]]]:
    """SFT traces from jsonl files: {"segments": [[text, trainable], ...]} per line, or a prompt
    record with its whole response ({"prompt", "response"}, e.g. ReTool's cold start), which
    `render` (row -> segments: the run's chat template) turns into segments."""
    out = []
    for path in files:
        if not Path(path).is_file():
            raise DataError(f"SFT trace file not found: {path}")
        for n, row, err in read_json_lines(Path(path)):
            if err is not None:
                raise DataError(f"{path}:{n}: {err}")
            if isinstance(row, dict) and "segments" in row:
                out.append(row["segments"])
            elif isinstance(row, dict) and {"prompt", "response"} <= set(row):
                if render is None:
                    raise DataError(f"{path}:{n}: a prompt and response trace needs a tokenizer")
                out.append(render(row))
            else:
                raise DataError(
                    f"{path}:{n}: not a JSON object with 'segments', or with 'prompt' and "
                    "'response'"
                )
    return out


__all__ = [
    "DataError",
    "SkippedLine",
    "RecordSource",
    "make_dataset",
    "PromptLoader",
    "record_source",
    "loader_from_config",
    "load_sft_traces",
]
