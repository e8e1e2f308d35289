"""DeepRetrieval's rewards: Recall/NDCG by hand, BM25 retrieval on a small corpus, and SQL
execution accuracy on a generated sqlite database (read-only, time-limited)."""

import json
import math
import sqlite3
import time

import pytest

from jaxrl_tools.rewards import get_reward, ndcg_at_k, recall_at_k


def test_recall_and_ndcg_by_hand():
    retrieved = ["a", "x", "b", "y"]
    assert recall_at_k(retrieved, {"a", "b", "c"}, 4) == pytest.approx(2 / 3)
    assert recall_at_k(retrieved, {"a", "b", "c"}, 1) == pytest.approx(1 / 3)
    assert recall_at_k(retrieved, set(), 4) == 0.0
    # DCG = 1/log2(2) + 1/log2(4); ideal (3 relevant) = 1 + 1/log2(3) + 1/log2(4)
    want = (1 + 0.5) / (1 + 1 / math.log2(3) + 0.5)
    assert ndcg_at_k(retrieved, {"a", "b", "c"}, 4) == pytest.approx(want)
    graded = {"a": 3.0, "b": 1.0, "c": 2.0}
    want = (1 + 3 / math.log2(3)) / (3 + 2 / math.log2(3))
    assert ndcg_at_k(["b", "a"], graded, 2) == pytest.approx(want)
    assert ndcg_at_k(["a", "c", "b"], graded, 3) == pytest.approx(1.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrieval")
    facts = {
        "p0": ("Aldermoor", "Aldermoor is a river town known for its glass bridges."),
        "p1": ("Brindle Vale", "Brindle Vale grows saffron on terraced hills."),
        "p2": ("Corvath", "Corvath mines cobalt and exports blue pigment."),
        "p3": ("Zorblax", "Zorblax is a comet observatory built in 1842."),
        "p4": ("Ebonreach", "Ebonreach hosts the winter lantern festival."),
    }
    path = tmp / "corpus.jsonl"
    path.write_text(
        "".join(json.dumps({"id": k, "title": t, "text": x}) + "\n" for k, (t, x) in facts.items())
    )
    return str(path), str(tmp / "cache")


def test_retrieval_reward_scores_what_the_query_retrieves(corpus):
    path, cache = corpus
    reward = get_reward("retrieval")
    kw = {"corpus": path, "cache_dir": cache, "k": 1}
    assert reward("<answer>comet observatory</answer>", ["p3"], **kw) == 1.0
    assert reward('<answer>{"query": "comet observatory 1842"}</answer>', ["p3"], **kw) == 1.0
    assert reward("<answer>saffron hills</answer>", ["p3"], **kw) == 0.0
    assert reward("no answer tag", ["p3"], **kw) == 0.0
    two = {"corpus": path, "cache_dir": cache, "k": 2}
    assert reward("<answer>cobalt pigment saffron</answer>", ["p1", "p2", "p4"], **two) == (
        pytest.approx(2 / 3)
    )
    ndcg = reward("<answer>saffron</answer>", {"p3": 1, "p1": 1}, metric="ndcg", **two)
    assert ndcg == pytest.approx(1 / (1 + 1 / math.log2(3)))


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("sql") / "company.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE employees (id INTEGER, name TEXT, dept TEXT, salary REAL)")
    conn.executemany(
        "INSERT INTO employees VALUES (?, ?, ?, ?)",
        [
            (1, "Ada", "eng", 72000.0),
            (2, "Bo", "eng", 48000.0),
            (3, "Cy", "ops", 51000.0),
            (4, "Di", "ops", 39000.0),
            (5, "Ed", "sales", 64000.0),
        ],
    )
    conn.commit()
    conn.close()
    return str(path)


def sql(query):
    return f"The query:\n```sql\n{query}\n```"


def test_sql_execution_accuracy_accepts_equivalent_queries(db):
    reward = get_reward("sql_exec")
    gt = {"db": db, "sql": "SELECT name FROM employees WHERE salary > 50000"}
    assert reward(sql("SELECT name FROM employees WHERE salary > 50000"), gt) == 1.0
    assert reward(sql("SELECT e.name FROM employees e WHERE NOT e.salary <= 50000"), gt) == 1.0
    assert reward("<answer>SELECT name FROM employees WHERE salary >= 51000</answer>", gt) == 1.0
    assert reward(sql("SELECT name FROM employees WHERE salary > 60000"), gt) == 0.0
    assert reward(sql("SELECT nme FROM employees"), gt) == 0.0  # an error
    assert reward("no query", gt) == 0.0
    ordered = {"db": db, "sql": "SELECT name FROM employees ORDER BY salary DESC"}
    assert reward(sql("SELECT name FROM employees ORDER BY salary"), ordered) == 0.0
    assert reward(sql("SELECT name FROM employees ORDER BY -salary"), ordered) == 1.0


def test_sql_reward_refuses_writes_and_stops_runaway_queries(db):
    reward = get_reward("sql_exec")
    gt = {"db": db, "sql": "SELECT count(*) FROM employees"}
    for attack in (
        "DELETE FROM employees",
        "UPDATE employees SET salary = 0",
        "DROP TABLE employees",
        "CREATE TABLE x (a)",
        f"ATTACH DATABASE '{db}.copy' AS other",
        "PRAGMA writable_schema = ON",
    ):
        assert reward(sql(attack), gt) == 0.0, attack
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*), sum(salary) FROM employees").fetchone() == (5, 274000.0)
    conn.close()
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c"
    t0 = time.monotonic()
    assert reward(sql(forever), gt, timeout_s=0.5) == 0.0
    assert time.monotonic() - t0 < 3.0


def formatted(answer: str, think: str = "<think>look it up</think>") -> str:
    return f"{think}\n<answer>{answer}</answer>"


def test_deepretrieval_format_reward_gates_both_rewards(corpus, db):
    # The paper's scripts: out of format -2; in format 0.1 + the score when it is above 0, else 0.
    path, cache = corpus
    retrieval = get_reward("retrieval")
    kw = {"corpus": path, "cache_dir": cache, "k": 1, "format_bonus": 0.1}
    assert retrieval(formatted('{"query": "comet observatory"}'), ["p3"], **kw) == 1.1
    assert retrieval(formatted('{"query": "saffron hills"}'), ["p3"], **kw) == 0.0
    out_of_format = [
        formatted("comet observatory"),  # not JSON
        formatted('{"q": "comet observatory"}'),  # no "query"
        formatted('{"query": 3}'),
        formatted('{"query": "comet"}', think=""),  # no <think>
        formatted('{"query": "comet"}', think="<think>a</think><think>b</think>"),
        '<answer>{"query": "comet"}</answer><think>late</think>',  # out of order
    ]
    for response in out_of_format:
        assert retrieval(response, ["p3"], **kw) == -2.0, response
    assert retrieval(out_of_format[0], ["p3"], **kw, format_penalty=-4.0) == -4.0
    # Without format_bonus the same responses are read as before.
    assert retrieval(out_of_format[0], ["p3"], corpus=path, cache_dir=cache, k=1) == 1.0
    sql_exec = get_reward("sql_exec")
    gt = {"db": db, "sql": "SELECT name FROM employees WHERE salary > 50000"}
    right = json.dumps({"sql": "SELECT name FROM employees WHERE salary > 50000"})
    wrong = json.dumps({"sql": "SELECT name FROM employees"})
    assert sql_exec(formatted(right), gt, format_bonus=0.1) == 1.1
    assert sql_exec(formatted(wrong), gt, format_bonus=0.1) == 0.0
    assert sql_exec(sql(gt["sql"]), gt, format_bonus=0.1) == -2.0  # a ```sql block is not it
