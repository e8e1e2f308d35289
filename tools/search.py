"""BM25 search over a local jsonl corpus (bm25s), formatted as Search-R1 formats passages.

Corpus lines: {"id", "title", "text"} or Search-R1's wiki format {"id", "contents"} where
`contents` is '"Title"\\ntext'. The index is built once and cached on disk under
`cache_dir/bm25_<sha256 of the corpus file>`; a changed corpus gets a new index.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import bm25s
import numpy as np

from jaxrl_tools.tools.base import Observation, Tool, register_tool, truncate_middle


def corpus_hash(path: str | Path) -> str:
    """sha256 of the corpus file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_corpus(path: str | Path) -> list[tuple[str, str]]:
    """(title, text) per passage of a jsonl corpus; errors name the file and line."""
    docs = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            if "contents" in d:
                title, _, text = str(d["contents"]).partition("\n")
                docs.append((title.strip().strip('"'), text.strip()))
            elif "text" in d:
                docs.append((str(d.get("title", "")), str(d["text"])))
            else:
                raise ValueError(f"{path}:{n}: passage needs 'contents' or 'text' (+ 'title')")
    if not docs:
        raise ValueError(f"{path}: empty corpus")
    return docs


def corpus_ids(path: str | Path) -> list[str]:
    """Each passage's "id" field (as a string), else its 0-based position in the corpus."""
    ids = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                ids.append(str(json.loads(line).get("id", len(ids))))
    return ids


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class BM25Index:
    """A bm25s index over a jsonl corpus, cached on disk by corpus hash.

    Args:
      corpus_path: the jsonl corpus.
      cache_dir: where indexes are kept (default ~/.cache/jaxrl_tools/bm25).
    """

    def __init__(self, corpus_path: str | Path, cache_dir: str | Path | None = None):
        self.corpus_path = Path(corpus_path)
        self.docs = load_corpus(self.corpus_path)
        self.ids = corpus_ids(self.corpus_path)
        cache_dir = Path(cache_dir or Path.home() / ".cache" / "jaxrl_tools" / "bm25")
        self.index_dir = cache_dir / f"bm25_{corpus_hash(self.corpus_path)[:24]}"
        self.loaded_from_cache = (self.index_dir / "params.index.json").exists()
        if self.loaded_from_cache:
            self.model = bm25s.BM25.load(str(self.index_dir), show_progress=False)
        else:
            self.model = bm25s.BM25()
            self.model.index(_tokenize([f"{t} {x}" for t, x in self.docs]), show_progress=False)
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".tmp_"))
            self.model.save(str(tmp), show_progress=False)
            try:
                os.replace(tmp, self.index_dir)  # atomic: concurrent builders don't collide
            except OSError:
                pass  # another process won the race; its index is identical
        self.vocab = self.model.vocab_dict

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """Top-k (doc index, score) for `query`, best first; [] if no query term is known."""
        toks = [t for t in _tokenize([query])[0] if t in self.vocab]
        if not toks:
            return []
        k = min(k, len(self.docs))
        ids, scores = self.model.retrieve([toks], k=k, show_progress=False)
        return [
            (int(i), float(s)) for i, s in zip(np.asarray(ids)[0], np.asarray(scores)[0]) if s > 0
        ]


def format_passages(docs: list[tuple[str, str]]) -> str:
    """Search-R1's `_passages2string`: 'Doc 1(Title: t) text' per line."""
    return "".join(f"Doc {i}(Title: {t}) {x}\n" for i, (t, x) in enumerate(docs, 1))


@register_tool("search")
class SearchTool(Tool):
    """Retrieves the top-k passages of a local corpus for a query (BM25).

    Args:
      corpus_path: jsonl corpus (see module docstring).
      top_k: passages per query (Search-R1: 3).
      cache_dir: index cache directory.
      max_output_chars: observation cut to head + "..." + tail of this size.
      tool_schema: optional override of the declaration.
    """

    name = "search"
    description = "Search a knowledge base and return the top passages for a query."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "The search query."}},
        "required": ["query"],
    }

    def __init__(
        self,
        corpus_path: str,
        top_k: int = 3,
        cache_dir: str | None = None,
        max_output_chars: int = 3000,
        tool_schema: dict | None = None,
    ):
        super().__init__(tool_schema=tool_schema)
        self.corpus_path, self.cache_dir = corpus_path, cache_dir
        self._index: BM25Index | None = None
        self.top_k = top_k
        self.max_output_chars = max_output_chars

    def start(self) -> None:
        self.index  # noqa: B018 - loads (or builds) the BM25 index now

    @property
    def index(self) -> BM25Index:
        """The BM25 index of the corpus, loaded on first use (cached on disk)."""
        if self._index is None:
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
        text = format_passages([self.index.docs[i] for i, _ in hits])
        return Observation(
            truncate_middle(text, self.max_output_chars),
            metrics={"n_hits": float(len(hits)), "top_score": hits[0][1]},
        )
