"""Text-to-SQL data for DeepRetrieval's SQL recipe: small generated sqlite databases and
questions with gold queries, scored by execution accuracy (the `sql_exec` reward).

    paths = write_dataset("data/sql_qa")   # dbs/, train.jsonl, test.jsonl, coldstart.jsonl

Each database holds a `staff` table (id, name, dept, city, salary, hired) and a `depts` table
(name, floor, budget) with rows drawn from `seed`; each question is a template instantiated on
one database's values, with its gold SQL. A record:

    {"prompt": "<instruction>\\n\\nSchema:\\n...\\n\\nQuestion: How many staff work in sales?",
     "ground_truth": {"db": "data/sql_qa/dbs/shop_0.sqlite", "sql": "SELECT COUNT(*) ..."},
     "template": "count_dept"}

Training and test questions come from disjoint databases. The db path in a record is as given
to `write_dataset` (relative paths are relative to where training runs: the repository root).

Command: `python -m jaxrl_tools.datasets.sql_qa --out data/sql_qa`.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from jaxrl_tools.rewards.retrieval import run_readonly

SCHEMA = (
    "CREATE TABLE depts (name TEXT PRIMARY KEY, floor INTEGER, budget INTEGER);\n"
    "CREATE TABLE staff (id INTEGER PRIMARY KEY, name TEXT, dept TEXT REFERENCES depts(name), "
    "city TEXT, salary INTEGER, hired INTEGER);"
)
_DEPTS = ("sales", "research", "support", "legal", "design", "finance")
_CITIES = ("Lisbon", "Quito", "Tromso", "Perth", "Kyoto", "Accra")
_FIRST = ("Ada", "Bo", "Cy", "Di", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu", "Mo")
_LAST = ("Reyes", "Okafor", "Lindqvist", "Tanaka", "Moreau", "Silva", "Novak", "Haddad")
# DeepRetrieval's SQL prompt asks for its format (the `sql_exec` reward's `format_bonus`).
INSTRUCTION = (
    "Write one SQLite query that answers the question. Only read the database. Show your work "
    "in <think> </think> tags; your final response must be JSON within <answer> </answer>, e.g. "
    '<think>\n[thinking process]\n</think>\n<answer>\n{"sql": "SELECT ... (in one line)"}\n'
    "</answer>"
)

# (template id, question, gold SQL); {dept}, {city}, {year}, {salary} come from the database.
TEMPLATES = (
    ("count_dept", "How many staff work in {dept}?",
     "SELECT COUNT(*) FROM staff WHERE dept = '{dept}'"),
    ("names_city", "List the names of the staff based in {city}, highest salary first.",
     "SELECT name FROM staff WHERE city = '{city}' ORDER BY salary DESC, name"),
    ("avg_salary", "What is the average salary in {dept}?",
     "SELECT AVG(salary) FROM staff WHERE dept = '{dept}'"),
    ("top_dept", "Which department has the most staff?",
     "SELECT dept FROM staff GROUP BY dept ORDER BY COUNT(*) DESC, dept LIMIT 1"),
    ("floor_of", "On which floors do the staff hired after {year} work?",
     "SELECT DISTINCT d.floor FROM staff s JOIN depts d ON s.dept = d.name WHERE s.hired > {year}"),
    ("rich_count", "How many staff earn more than {salary}?",
     "SELECT COUNT(*) FROM staff WHERE salary > {salary}"),
    ("budget_city", "What is the total budget of the departments with staff in {city}?",
     "SELECT SUM(budget) FROM depts WHERE name IN (SELECT dept FROM staff WHERE city = '{city}')"),
)  # fmt: skip


def make_db(path: str | Path, seed: int, n_staff: int = 40) -> dict:
    """Writes one database; returns the values its questions draw from."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    depts = rng.sample(_DEPTS, 4)
    conn = sqlite3.connect(path)
    try:
        conn.executescript(SCHEMA)
        conn.executemany(
            "INSERT INTO depts VALUES (?, ?, ?)",
            [(d, rng.randint(1, 9), rng.randrange(100_000, 900_000, 1000)) for d in depts],
        )
        rows = [
            (i + 1, f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", rng.choice(depts),
             rng.choice(_CITIES), rng.randrange(30_000, 120_000, 500), rng.randint(2005, 2024))
            for i in range(n_staff)
        ]  # fmt: skip
        conn.executemany("INSERT INTO staff VALUES (?, ?, ?, ?, ?, ?)", rows)
        conn.commit()
    finally:
        conn.close()
    return {"dept": depts, "city": sorted({r[3] for r in rows}), "year": list(range(2010, 2021)),
            "salary": list(range(50_000, 100_001, 10_000))}  # fmt: skip


# Cold-start reasoning per template, standing in for DeepRetrieval's teacher-written traces.
REASONS = {
    "count_dept": "Each staff row has a dept; count the rows whose dept is '{dept}'.",
    "names_city": "Take the staff rows with city '{city}', sort by salary descending (then "
    "name), and return the names.",
    "avg_salary": "Average the salary column over the staff rows with dept '{dept}'.",
    "top_dept": "Group staff by dept, order the groups by their size descending (ties by "
    "name), and keep the first.",
    "floor_of": "Floors live in depts; join staff to depts on the department name, keep staff "
    "hired after {year}, and return the distinct floors.",
    "rich_count": "Count the staff rows with salary above {salary}.",
    "budget_city": "Find the departments that have staff in {city}, then sum their budgets "
    "from depts.",
}


def prompt(question: str) -> str:
    return f"{INSTRUCTION}\n\nSchema:\n{SCHEMA}\n\nQuestion: {question}"


def coldstart_response(template: str, fill: dict, sql: str) -> str:
    """A cold-start answer in DeepRetrieval's format: the reasoning, then the gold query."""
    reason = REASONS[template].format(**fill)
    answer = json.dumps({"sql": sql})
    return f"<think>\n{reason}\n</think>\n<answer>\n{answer}\n</answer>"


def questions_for(db: str, values: dict, rng: random.Random, per_template: int = 4) -> list[dict]:
    out = []
    for tid, question, sql in TEMPLATES:
        seen = set()
        for _ in range(per_template):
            fill = {k: rng.choice(v) for k, v in values.items()}
            q, gold = question.format(**fill), sql.format(**fill)
            rows = run_readonly(db, gold)
            if q in seen or not rows or rows == [(None,)]:  # an empty answer rewards anything empty
                continue
            seen.add(q)
            out.append({"prompt": prompt(q), "ground_truth": {"db": db, "sql": gold},
                        "template": tid,
                        "response": coldstart_response(tid, fill, gold)})  # fmt: skip
    return out


def write_dataset(
    out: str | Path, *, seed: int = 0, n_train_dbs: int = 10, n_test_dbs: int = 3
) -> dict[str, Path]:
    """Writes dbs/shop_<i>.sqlite, train.jsonl (questions on the first `n_train_dbs`
    databases), test.jsonl (on the others) and coldstart.jsonl (the training questions with
    a reasoned gold answer: {"prompt", "response"}, the SFT cold start) under `out`."""
    out = Path(out)
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for i in range(n_train_dbs + n_test_dbs):
        db = out / "dbs" / f"shop_{i}.sqlite"
        values = make_db(db, seed * 1000 + i)
        split = "train" if i < n_train_dbs else "test"
        splits[split] += questions_for(str(db), values, rng)
    paths = {}
    for split, rows in splits.items():
        rng.shuffle(rows)
        answers = [{"prompt": r["prompt"], "response": r.pop("response")} for r in rows]
        if split == "train":
            paths["coldstart"] = out / "coldstart.jsonl"
            paths["coldstart"].write_text("".join(json.dumps(a) + "\n" for a in answers))
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/sql_qa")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, path in write_dataset(args.out, seed=args.seed).items():
        print(f"{name}: {path} ({sum(1 for _ in open(path))} questions)")


if __name__ == "__main__":
    main()
