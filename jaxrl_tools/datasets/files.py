"""The rows of a benchmark file a user downloaded, read and written: .parquet, .jsonl / .json
or .jsonl.gz in (streamed), .jsonl or .parquet out (`prepare`, `retool_coldstart`)."""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from jaxrl_tools.data import DataError


def read_rows(path: Path) -> Iterator[tuple[str, Mapping]]:
    """("file:row", row) of a .parquet, .jsonl / .json (objects, one per line, or one array)
    or .jsonl.gz file, streamed (parquet by record batches)."""
    if not path.is_file():
        raise DataError(f"input file not found: {path}")
    for where, row in _rows(path):
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    name = path.name.lower()
    if name.endswith(".parquet"):
        try:
            parquet = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises many kinds
            raise DataError(f"{path}: cannot read parquet: {e}") from None
        n = 0
        for batch in parquet.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                n += 1
                yield f"{path}:{n}", row
        return
    if not name.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")):
        raise DataError(f"{path}: unsupported input type (parquet, jsonl, json or jsonl.gz)")
    opener = gzip.open if name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        first = fh.readline()
        if first.lstrip().startswith(b"["):  # one JSON array
            try:
                rows = json.loads(first + fh.read())
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: bad JSON ({e.msg} at line {e.lineno})") from None
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 (byte {e.start + 1})") from None
            yield from ((f"{path}:{i}", row) for i, row in enumerate(rows, 1))
            return
        for i, line in enumerate(itertools.chain([first], fh), 1):
            if line.strip():
                try:
                    yield f"{path}:{i}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: bad JSON ({e.msg})") from None
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{i}: not UTF-8 (byte {e.start + 1})") from None


def write_records(records: Iterable[dict], output: Path) -> int:
    """Writes records as .jsonl (streamed) or .parquet; returns their count."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".partial")  # a failed run leaves no half file
    n = 0
    try:
        if output.suffix == ".parquet":
            rows = list(records)
            if not rows:
                raise DataError("no records to write")
            pq.write_table(pa.Table.from_pylist(rows), tmp)
            n = len(rows)
        else:
            with tmp.open("w", encoding="utf-8") as fh:
                for r in records:
                    fh.write(json.dumps(r, ensure_ascii=False) + "\n")
                    n += 1
            if not n:
                raise DataError("no records to write")
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
