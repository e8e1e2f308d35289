"""DeepRetrieval's rewards (2503.00223): the policy writes a search query or an SQL query, and is
rewarded by what the query retrieves, not by matching a reference text.

- `retrieval`: the query in the last `<answer>` (plain text, or DeepRetrieval's
  `{"query": "..."}`) is run on a BM25 index of a jsonl corpus; the reward is Recall@K or NDCG@K
  of the retrieved passages against the record's relevant ids.
- `sql_exec`: the SQL in the last ```sql block (or `<answer>`) is run on the record's sqlite
  database, opened read-only with an authorizer that allows reading only and a time limit; the
  reward is 1 when its rows equal the gold query's (as a multiset, or in order when the gold
  query has ORDER BY), so an equivalent but different query scores 1.

Both take DeepRetrieval's format reward (`format_bonus`, as its scripts do: 0.1, penalty -2):
the response must hold `<think>`, `</think>`, `<answer>`, `</answer>` once each, in that order,
with a JSON object in the answer ({"query": ...} or {"sql": ...}); a response out of format
scores `format_penalty`, one in format scores `format_bonus` + its score when that is above 0,
and 0 otherwise.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import re
import sqlite3
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from jaxrl_tools.rewards.answers import last_answer_tag
from jaxrl_tools.rewards.registry import register_reward


# ----------------------------------------------------------------------------- ranking metrics
def recall_at_k(retrieved: Sequence, relevant: Collection, k: int) -> float:
    """|top-k ∩ relevant| / |relevant| (0 when nothing is relevant)."""
    relevant = set(relevant)
    if not relevant:
        return 0.0
    return len(set(list(retrieved)[:k]) & relevant) / len(relevant)


def ndcg_at_k(retrieved: Sequence, relevance: Mapping[Any, float] | Collection, k: int) -> float:
    """NDCG@k with linear gains (trec_eval's): DCG = Σ_{rank i=1..k} gain_i / log2(i + 1),
    divided by the DCG of the ideal ranking. `relevance`: id -> gain, or a set (gain 1)."""
    gains = dict(relevance) if isinstance(relevance, Mapping) else dict.fromkeys(relevance, 1.0)
    dcg = sum(gains.get(d, 0.0) / math.log2(i + 2) for i, d in enumerate(list(retrieved)[:k]))
    ideal = sorted((g for g in gains.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


_FORMAT_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def formatted_answer(response: str, key: str) -> str | None:
    """The string `key` of the answer's JSON object when the response is in DeepRetrieval's
    format (each tag of `_FORMAT_TAGS` once, in that order), else None."""
    if any(response.count(tag) != 1 for tag in _FORMAT_TAGS):
        return None
    where = [response.find(tag) for tag in _FORMAT_TAGS]
    if where != sorted(where):
        return None
    try:
        obj = json.loads(response[where[2] + len("<answer>") : where[3]])
    except ValueError:
        return None
    value = obj.get(key) if isinstance(obj, dict) else None
    return (value.strip() or None) if isinstance(value, str) else None


def _format_gated(score: float, bonus: float) -> float:
    """DeepRetrieval's total for a response in format: the bonus only with a positive score."""
    return bonus + score if score > 0 else 0.0


def extract_query(response: str) -> str | None:
    """The query of the last `<answer>`: its "query" field when it is a JSON object."""
    answer = last_answer_tag(response)
    if answer is None or not answer.strip():
        return None
    try:
        obj = json.loads(answer)
    except ValueError:
        return answer.strip()
    if isinstance(obj, dict) and isinstance(obj.get("query"), str):
        return obj["query"].strip() or None
    return answer.strip()


@functools.lru_cache(maxsize=8)
def _index(corpus: str, cache_dir: str | None):
    from jaxrl_tools.tools.search import BM25Index  # noqa: PLC0415 - bm25s only when used

    return BM25Index(corpus, cache_dir)


def _ids_truth(ground_truth: Any, kwargs) -> str | None:
    gt = ground_truth
    if isinstance(gt, Mapping) and all(isinstance(g, int | float) for g in gt.values()):
        return None
    if isinstance(gt, list | tuple) and all(isinstance(d, str | int) for d in gt):
        return None
    return "expects the relevant passage ids: a list, or {id: gain}"


@register_reward("retrieval", slow=True, truth=_ids_truth)
def retrieval_reward(
    response: str,
    ground_truth: Any,
    info=None,
    *,
    corpus: str,
    k: int = 10,
    metric: str = "recall",
    cache_dir: str | None = None,
    format_bonus: float | None = None,
    format_penalty: float = -2.0,
) -> float:
    """Recall@k or NDCG@k of the BM25 results of the response's query.

    ground_truth: the relevant passage ids (a list, or {id: gain} for graded NDCG); a passage's
    id is its "id" field in the corpus, else its 0-based position. format_bonus: DeepRetrieval's
    format reward (module docstring); None checks no format.
    """
    if metric not in ("recall", "ndcg"):
        raise ValueError(f"retrieval reward: metric must be 'recall' or 'ndcg', got {metric!r}")
    if format_bonus is None:
        query = extract_query(response)
        if query is None:
            return 0.0
        return _query_score(query, ground_truth, corpus, k, metric, cache_dir)
    query = formatted_answer(response, "query")
    if query is None:
        return float(format_penalty)
    score = _query_score(query, ground_truth, corpus, k, metric, cache_dir)
    return _format_gated(score, float(format_bonus))


def _query_score(query: str, ground_truth: Any, corpus, k: int, metric: str, cache_dir) -> float:
    index = _index(str(corpus), cache_dir)
    retrieved = [index.passages[i].id for i, _ in index.search(query, k)]
    relevant = ground_truth if isinstance(ground_truth, Mapping) else list(ground_truth or [])
    relevant = (
        {str(d): float(g) for d, g in relevant.items()}
        if isinstance(relevant, Mapping)
        else [str(d) for d in relevant]
    )
    if metric == "recall":
        return recall_at_k(retrieved, relevant, k)
    return ndcg_at_k(retrieved, relevant, k)


# ----------------------------------------------------------------------------- text-to-SQL
_SQL_BLOCK = re.compile(r"```sql\s*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# What a query may do: read tables and call functions (WITH RECURSIVE included). Everything else
# (writes, ATTACH, PRAGMA, schema changes) is refused by the authorizer.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
_ALLOWED.add(getattr(sqlite3, "SQLITE_RECURSIVE", 33))


class SQLRefused(Exception):
    """The query failed, wrote, ran past its time or row limit."""


def extract_sql(response: str) -> str | None:
    blocks = _SQL_BLOCK.findall(response)
    if blocks:
        return blocks[-1].strip() or None
    answer = last_answer_tag(response)
    return answer.strip() if answer and answer.strip() else None


def run_readonly(db: str, sql: str, timeout_s: float = 5.0, max_rows: int = 10_000) -> list:
    """Rows of `sql` on the sqlite file `db`, opened read-only; raises SQLRefused."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, check_same_thread=False)
    try:
        conn.set_authorizer(lambda action, *_: 0 if action in _ALLOWED else 1)  # 1: DENY
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
        try:
            rows = conn.execute(sql).fetchmany(max_rows + 1)
        except (sqlite3.Error, ValueError) as e:
            raise SQLRefused(str(e)) from None
        if len(rows) > max_rows:
            raise SQLRefused(f"more than {max_rows} rows")
        return rows
    finally:
        conn.close()


def _normalise(row) -> tuple:
    return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


@functools.lru_cache(maxsize=4096)
def _gold_rows(db: str, sql: str, timeout_s: float, max_rows: int) -> list:
    return [_normalise(r) for r in run_readonly(db, sql, timeout_s, max_rows)]


def _sql_truth(ground_truth: Any, kwargs) -> str | None:
    gt = ground_truth
    if isinstance(gt, Mapping) and all(isinstance(gt.get(k), str) for k in ("db", "sql")):
        return None
    return 'expects {"db": a sqlite file, "sql": the gold query}'


@register_reward("sql_exec", slow=True, truth=_sql_truth)
def sql_exec_reward(
    response: str,
    ground_truth: Any,
    info=None,
    *,
    timeout_s: float = 5.0,
    max_rows: int = 10_000,
    format_bonus: float | None = None,
    format_penalty: float = -2.0,
) -> float:
    """Execution accuracy. ground_truth: {"db": sqlite path, "sql": the gold query}.
    format_bonus: DeepRetrieval's format reward, the query then read from `{"sql": ...}` in the
    answer (module docstring); None checks no format."""
    if format_bonus is None:
        sql = extract_sql(response)
        return 0.0 if sql is None else _sql_score(sql, ground_truth, timeout_s, max_rows)
    sql = formatted_answer(response, "sql")
    if sql is None:
        return float(format_penalty)
    return _format_gated(_sql_score(sql, ground_truth, timeout_s, max_rows), float(format_bonus))


def _sql_score(sql: str, ground_truth: Any, timeout_s: float, max_rows: int) -> float:
    db, gold = str(ground_truth["db"]), str(ground_truth["sql"])
    want = _gold_rows(db, gold, timeout_s, max_rows)
    try:
        got = [_normalise(r) for r in run_readonly(db, sql, timeout_s, max_rows)]
    except SQLRefused:
        return 0.0
    if re.search(r"\border\s+by\b", gold, re.IGNORECASE):
        return float(got == want)
    return float(collections.Counter(got) == collections.Counter(want))
