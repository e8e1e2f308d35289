"""DeepResearcher's tools (arXiv 2504.03160): `web_search` (ranked results: title, url, snippet)
and `browse` (a page's text), over a pluggable backend.

A backend is any object with these two methods (the documented interface, `WebBackend`):

    class MyAPI:
        def search(self, query: str, k: int) -> list[SearchHit]: ...   # best first
        def fetch(self, url: str) -> str | None: ...                   # None: no such page

For a real search API, write such a class (e.g. calling Serper or Bing in `search` and an
HTTP client plus an HTML-to-text step in `fetch`) and declare it by import path:

    tools:
      - {class: web_search, config: {backend: mypkg.web:MyAPI, backend_kwargs: {key: ...}}}
      - {class: browse, config: {backend: mypkg.web:MyAPI, backend_kwargs: {key: ...}}}

The offline backend, `LocalPages` (`backend: local`, the default), serves a jsonl file of pages
{"url", "title", "text"}: BM25 over title + text (bm25s, streamed and cached like the search
tool), snippets are each page's first sentence, `fetch` reads the page from disk by offset.
`python -m jaxrl_tools.datasets.search_qa` writes one (data/search_qa/pages.jsonl) whose
snippets alone do not answer the questions: the policy has to browse.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Protocol

from jaxrl_tools.tools.base import (
    Observation,
    Tool,
    register_tool,
    string_argument,
    truncate_middle,
)
from jaxrl_tools.tools.search import BM25Index


@dataclass(frozen=True)
class SearchHit:
    url: str
    title: str
    snippet: str


class WebBackend(Protocol):
    """What `web_search` and `browse` call; any object with these methods will do."""

    def search(self, query: str, k: int) -> list[SearchHit]: ...

    def fetch(self, url: str) -> str | None: ...


def _first_sentence(text: str, max_chars: int = 160) -> str:
    m = re.match(r".+?[.!?](?=\s|$)", text.strip(), re.DOTALL)
    return (m.group(0) if m else text.strip())[:max_chars]


class LocalPages:
    """An offline backend over a jsonl file of pages {"url", "title", "text"}.

    Args:
      pages_path: the pages file (the page's "url" is its id in the index).
      cache_dir: BM25 index cache (default ~/.cache/jaxrl_tools/bm25).
    """

    def __init__(self, pages_path: str, cache_dir: str | None = None):
        self.index = BM25Index(pages_path, cache_dir)
        # url -> passage position; one pass over the file (ids are read, texts are not kept).
        self._where = {self.index.passages[i].id: i for i in range(len(self.index))}

    def search(self, query: str, k: int) -> list[SearchHit]:
        hits = [self.index.passages[i] for i, _ in self.index.search(query, k)]
        return [SearchHit(p.id, p.title, _first_sentence(p.text)) for p in hits]

    def fetch(self, url: str) -> str | None:
        i = self._where.get(url.strip())
        if i is None:
            return None
        page = self.index.passages[i]
        return f"{page.title}\n\n{page.text}"


def make_backend(backend: str, pages_path: str | None, kwargs: dict | None) -> WebBackend:
    """`local` (LocalPages over `pages_path`) or "module:Class" built with `kwargs`."""
    if backend == "local":
        if not pages_path:
            raise ValueError("backend 'local' needs pages_path (a jsonl of url/title/text pages)")
        return LocalPages(pages_path, **(kwargs or {}))
    module, sep, name = backend.partition(":")
    if not sep:
        raise ValueError(f"backend must be 'local' or 'module:Class', got {backend!r}")
    obj = getattr(importlib.import_module(module), name)(**(kwargs or {}))
    missing = [m for m in ("search", "fetch") if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(f"backend {backend!r} lacks {missing} (see tools/browse.py: WebBackend)")
    return obj


class _WebTool(Tool):
    def __init__(
        self,
        backend: str = "local",
        pages_path: str | None = None,
        backend_kwargs: dict | None = None,
        max_output_chars: int = 3000,
        tool_schema: dict | None = None,
    ):
        super().__init__(tool_schema=tool_schema)
        self._spec = (backend, pages_path, backend_kwargs)
        self._backend: WebBackend | None = None
        self.max_output_chars = max_output_chars

    def start(self) -> None:
        self.backend  # noqa: B018 - builds the backend (and its index) now

    @property
    def backend(self) -> WebBackend:
        if self._backend is None:
            self._backend = make_backend(*self._spec)
        return self._backend

    def _arg(self, arguments: dict, key: str) -> str | Observation:
        value = arguments.get(key, "")
        if not isinstance(value, str) or not value.strip():
            return Observation.error(f"Error: '{key}' must be a non-empty string")
        return value.strip()


@register_tool("web_search")
class WebSearchTool(_WebTool):
    """Web search: the top-k results, each title, url and snippet (DeepResearcher's
    `web_search`). Config: backend, pages_path, backend_kwargs, top_k, max_output_chars."""

    name = "web_search"
    description = "Search the web; returns the top results with their title, url and snippet."
    parameters = string_argument("query", "The search query.")

    def __init__(
        self,
        backend: str = "local",
        pages_path: str | None = None,
        backend_kwargs: dict | None = None,
        top_k: int = 5,
        max_output_chars: int = 3000,
        tool_schema: dict | None = None,
    ):
        super().__init__(backend, pages_path, backend_kwargs, max_output_chars, tool_schema)
        self.top_k = top_k

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        query = self._arg(arguments, "query")
        if isinstance(query, Observation):
            return query
        hits = self.backend.search(query, self.top_k)
        if not hits:
            return Observation("No results found.", metrics={"n_hits": 0.0})
        text = "\n".join(f"{i}. {h.title} ({h.url})\n{h.snippet}" for i, h in enumerate(hits, 1))
        return Observation(
            truncate_middle(text, self.max_output_chars), metrics={"n_hits": float(len(hits))}
        )


@register_tool("browse")
class BrowseTool(_WebTool):
    """Reads a page by url and returns its text, cut to head + "..." + tail of
    `max_output_chars` (DeepResearcher's `browse_webpage`, without its reading agent)."""

    name = "browse"
    description = "Open a web page by its url and return its text."
    parameters = string_argument("url", "The page's url.")

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        url = self._arg(arguments, "url")
        if isinstance(url, Observation):
            return url
        text = self.backend.fetch(url)
        if text is None:
            return Observation.error(f"Error: no page at {url}")
        return Observation(truncate_middle(text, self.max_output_chars))
