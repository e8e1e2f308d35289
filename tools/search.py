"""BM25 search over a local jsonl corpus (bm25s), formatted as Search-R1 formats passages.

Corpus lines: {"id", "title", "text"} or Search-R1's wiki format {"id", "contents"} where
`contents` is '"Title"\\ntext'. The index is built once, in a streaming pass (`build_index`),
and cached on disk under `cache_dir/bm25_v2_<sha256 of the corpus file>`; a changed corpus gets a
new index. Nothing holds the corpus in memory: the score matrix is memory-mapped and passages
are read from the corpus file by byte offset (`PassageStore`), so wiki-18's 21M passages fit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxrl_tools.tools.base import (
    Observation,
    Tool,
    register_tool,
    string_argument,
    truncate_middle,
)


def _bm25s():
    """bm25s, imported on first use: importing it runs a jax op, which would start jax's
    backend before a multi-process job could call `jax.distributed.initialize`."""
    import bm25s  # noqa: PLC0415  (see above)

    return bm25s


def corpus_hash(path: str | Path) -> str:
    """sha256 of the corpus file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Passage:
    id: str  # the line's "id" field, else its 0-based position in the corpus
    title: str
    text: str


def parse_passage(line: str | bytes, where: str, position: int) -> Passage:
    """One corpus line as a Passage; errors name `where` (file:line)."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte {e.start + 1} of the line)") from None
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a passage must be a JSON object")
    try:  # an unpaired surrogate escape ("\ud800") parses, but no tokenizer takes it
        json.dumps(d, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{where}: holds an unpaired surrogate escape (not valid unicode)"
        ) from None
    pid = str(d.get("id", position))
    if "contents" in d:
        title, _, text = str(d["contents"]).partition("\n")
        return Passage(pid, title.strip().strip('"'), text.strip())
    if "text" in d:
        return Passage(pid, str(d.get("title", "")), str(d["text"]))
    raise ValueError(f"{where}: passage needs 'contents' or 'text' (+ 'title')")


def iter_passages(path: str | Path):
    """(byte offset, Passage) per non-blank line, streamed (the corpus is never all in memory)."""
    with open(path, "rb") as fh:
        offset, n, position = 0, 0, 0
        for line in fh:
            n += 1
            if line.strip():
                yield offset, parse_passage(line, f"{path}:{n}", position)
                position += 1
            offset += len(line)


class PassageStore:
    """The passages of a jsonl corpus, read from disk on demand by their line's byte offset (an
    int64 array, memory-mapped): 21M wiki-18 passages cost 170 MB of offsets, not a list."""

    def __init__(self, path: str | Path, offsets: np.ndarray):
        self.path, self.offsets = Path(path), offsets
        self._fh = open(self.path, "rb")  # noqa: SIM115 - kept open for the store's lifetime

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> Passage:
        self._fh.seek(int(self.offsets[i]))
        return parse_passage(self._fh.readline(), f"{self.path} passage {i}", i)

    def __del__(self):
        self._fh.close()


def _tokenize(texts: list[str]) -> list[list[str]]:
    return _bm25s().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


# bm25s's defaults (Lucene's BM25), which the index files below must declare for bm25s to load.
BM25_PARAMS = dict(k1=1.5, b=0.75, delta=0.5, method="lucene", idf_method="lucene")


def _spill_chunk(texts, vocab: dict, df, lens: list, nnz: list, spill) -> np.ndarray:
    """Pass 1 on one chunk: each passage's (term id, tf) rows to `spill`, in passage order and
    term order within a passage; appends lengths and row counts; returns the updated df."""
    ids = [
        np.array([vocab.setdefault(t, len(vocab)) for t in d], np.int64) for d in _tokenize(texts)
    ]
    lens.append(np.array([len(d) for d in ids], np.int32))
    v = max(len(vocab), 1)
    doc = np.repeat(np.arange(len(ids), dtype=np.int64), lens[-1])
    key, tf = np.unique(doc * v + np.concatenate([*ids, np.zeros(0, np.int64)]), return_counts=True)
    term = key % v
    nnz.append(np.bincount(key // v, minlength=len(ids)).astype(np.int32))
    df = np.concatenate([df, np.zeros(len(vocab) - len(df), np.int64)])
    df += np.bincount(term, minlength=len(vocab))
    np.stack([term, tf], 1).astype(np.int32).tofile(spill)
    return df


def build_index(corpus_path: str | Path, out: str | Path, chunk_docs: int = 50_000) -> int:
    """Builds bm25s's index files for a jsonl corpus in two streaming passes, with memory
    bounded by the vocabulary and one chunk of passages (not the corpus).

    Pass 1 tokenizes `chunk_docs` passages at a time (bm25s's tokenizer, English stop words) and
    spills each passage's (term, tf) pairs to disk, counting document frequencies and lengths.
    Pass 2 scores each pair (Lucene BM25, bm25s's formula and dtypes: idf = ln(1 + (N - df +
    0.5)/(df + 0.5)), tf / (tf + k1 (1 - b + b |d|/avgdl))) and places it in the term-major (CSC)
    arrays by a counting sort (a term's column has exactly df entries), memory-mapped .npy files
    that `bm25s.BM25.load(out, mmap=True)` reads. Also writes `offsets.npy` (each passage's byte
    offset in the corpus).

    Returns:
      The number of passages.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab: dict[str, int] = {}
    df = np.zeros(0, np.int64)
    lens, nnz, offsets = [], [], []
    with open(out / "pairs.tmp", "wb") as spill:
        texts: list[str] = []
        for offset, p in iter_passages(corpus_path):
            offsets.append(offset)
            texts.append(f"{p.title} {p.text}")
            if len(texts) == chunk_docs:
                df = _spill_chunk(texts, vocab, df, lens, nnz, spill)
                texts = []
        if texts:
            df = _spill_chunk(texts, vocab, df, lens, nnz, spill)
    if not offsets:
        (out / "pairs.tmp").unlink()
        raise ValueError(f"{corpus_path}: empty corpus")
    np.save(out / "offsets.npy", np.array(offsets, np.int64))
    vocab[""] = len(vocab)  # bm25s's empty token: a column with no entries
    df = np.concatenate([df, [0]])
    lens_all, nnz_all = np.concatenate(lens), np.concatenate(nnz)
    n_docs, avg_len = len(lens_all), lens_all.mean()
    idf = np.log(1 + (n_docs - df + 0.5) / (df + 0.5)).astype(np.float32)
    indptr = np.concatenate([[0], np.cumsum(df)])
    total = int(indptr[-1])
    mm = np.lib.format.open_memmap
    data = mm(out / "data.csc.index.npy", "w+", np.float32, (total,))
    indices = mm(out / "indices.csc.index.npy", "w+", np.int32, (total,))
    filled = indptr[:-1].copy()
    pairs = np.memmap(out / "pairs.tmp", np.int32, "r").reshape(-1, 2)  # (term, tf) rows
    k1, b = BM25_PARAMS["k1"], BM25_PARAMS["b"]
    doc_start, pair_start = 0, 0
    while doc_start < n_docs:
        docs = np.arange(doc_start, min(doc_start + chunk_docs, n_docs))
        count = nnz_all[docs]
        chunk = np.asarray(pairs[pair_start : pair_start + count.sum()])
        term, tf = chunk[:, 0].astype(np.int64), chunk[:, 1].astype(np.float32)
        doc = np.repeat(docs, count)
        l_d = lens_all[doc].astype(np.float64)
        score = (idf[term] * (tf / (k1 * ((1 - b) + b * l_d / avg_len) + tf))).astype(np.float32)
        order = np.argsort(term, kind="stable")  # docs stay ascending within a term
        st = term[order]
        rank = np.arange(len(st)) - np.searchsorted(st, st, side="left")
        dest = filled[st] + rank
        data[dest], indices[dest] = score[order], doc[order]
        filled += np.bincount(term, minlength=len(filled))
        doc_start, pair_start = docs[-1] + 1, pair_start + int(count.sum())
    data.flush(), indices.flush()
    del data, indices, pairs
    (out / "pairs.tmp").unlink()
    np.save(out / "indptr.csc.index.npy", indptr.astype(np.int64))
    (out / "vocab.index.json").write_text(json.dumps(vocab, ensure_ascii=False))
    params = dict(**BM25_PARAMS, dtype="float32", int_dtype="int32", num_docs=n_docs)
    (out / "params.index.json").write_text(json.dumps({**params, "version": _bm25s().__version__}))
    return n_docs


class BM25Index:
    """A bm25s index over a jsonl corpus, built in a streaming pass and cached on disk by the
    corpus's hash; the score matrix is memory-mapped and passages are read from the corpus file
    by offset, so a 21M-passage corpus is never a Python list.

    Args:
      corpus_path: the jsonl corpus.
      cache_dir: where indexes are kept (default ~/.cache/jaxrl_tools/bm25).
    """

    def __init__(self, corpus_path: str | Path, cache_dir: str | Path | None = None):
        self.corpus_path = Path(corpus_path)
        cache_dir = Path(cache_dir or Path.home() / ".cache" / "jaxrl_tools" / "bm25")
        # "v2": the streaming layout (offsets.npy); an index of another layout is not reused.
        self.index_dir = cache_dir / f"bm25_v2_{corpus_hash(self.corpus_path)[:24]}"
        self.loaded_from_cache = (self.index_dir / "params.index.json").exists()
        if not self.loaded_from_cache:
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tmp_"))
            try:
                build_index(self.corpus_path, tmp)
                os.replace(tmp, self.index_dir)  # atomic: concurrent builders don't collide
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        self.model = _bm25s().BM25.load(str(self.index_dir), mmap=True, show_progress=False)
        self.passages = PassageStore(
            self.corpus_path, np.load(self.index_dir / "offsets.npy", mmap_mode="r")
        )
        self.vocab = self.model.vocab_dict

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """Top-k (passage index, score) for `query`, best first; [] if no query term is known."""
        toks = [t for t in _tokenize([query])[0] if t in self.vocab]
        if not toks:
            return []
        k = min(k, len(self.passages))
        ids, scores = self.model.retrieve([toks], k=k, show_progress=False)
        return [
            (int(i), float(s)) for i, s in zip(np.asarray(ids)[0], np.asarray(scores)[0]) if s > 0
        ]


def format_passages(docs: list[Passage] | list[tuple[str, str]]) -> str:
    """Search-R1's `_passages2string`: 'Doc 1(Title: t) text' per line."""
    pairs = [(d.title, d.text) if isinstance(d, Passage) else d for d in docs]
    return "".join(f"Doc {i}(Title: {t}) {x}\n" for i, (t, x) in enumerate(pairs, 1))


@register_tool("search")
class SearchTool(Tool):
    """Retrieves the top-k passages of a local corpus for a query (BM25, or dense).

    Args:
      corpus_path: jsonl corpus (see module docstring).
      top_k: passages per query (Search-R1: 3).
      cache_dir: index cache directory.
      retriever: "bm25" (bm25s) or "dense" (cosine over mean-pooled hidden states of
        `encoder_path`, a local Qwen2/Qwen3/Llama folder run with this project's JAX model code;
        tools/dense.py).
      encoder_path: the dense retriever's encoder folder.
      max_output_chars: observation cut to head + "..." + tail of this size.
      tool_schema: optional override of the declaration.
    """

    name = "search"
    description = "Search a knowledge base and return the top passages for a query."
    parameters = string_argument("query", "The search query.")

    def __init__(
        self,
        corpus_path: str,
        top_k: int = 3,
        cache_dir: str | None = None,
        max_output_chars: int = 3000,
        tool_schema: dict | None = None,
        retriever: str = "bm25",
        encoder_path: str | None = None,
    ):
        super().__init__(tool_schema=tool_schema)
        if retriever not in ("bm25", "dense"):
            raise ValueError(f"retriever must be 'bm25' or 'dense', got {retriever!r}")
        if retriever == "dense" and not encoder_path:
            raise ValueError("retriever 'dense' needs encoder_path (a local model folder)")
        self.corpus_path, self.cache_dir = corpus_path, cache_dir
        self.retriever, self.encoder_path = retriever, encoder_path
        self._index = None
        self.top_k = top_k
        self.max_output_chars = max_output_chars

    def start(self) -> None:
        self.index  # noqa: B018 - loads (or builds) the BM25 index now

    @property
    def index(self):
        """The corpus's BM25Index (or DenseIndex), loaded on first use (cached on disk)."""
        if self._index is None and self.retriever == "dense":
            from jaxrl_tools.tools.dense import DenseIndex  # noqa: PLC0415 - the model when used

            self._index = DenseIndex(self.corpus_path, self.encoder_path, self.cache_dir)
        elif self._index is None:
            self._index = BM25Index(self.corpus_path, self.cache_dir)
        return self._index

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        query = arguments.get("query", "")
        if not isinstance(query, str):
            return Observation.error("Error: 'query' must be a string")
        query = query.strip()
        if not query:
            return Observation.error("Error: empty search query")
        hits = self.index.search(query, self.top_k)
        if not hits:
            return Observation("No results found.", metrics={"n_hits": 0.0})
        text = format_passages([self.index.passages[i] for i, _ in hits])
        return Observation(
            truncate_middle(text, self.max_output_chars),
            metrics={"n_hits": float(len(hits)), "top_score": hits[0][1]},
        )
