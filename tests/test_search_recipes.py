"""Search and retrieval recipes' parts: the shipped synthetic data (up to date, answerable only
through the corpus), the streaming BM25 index against bm25s's in-memory one, DeepResearcher's
web_search / browse tools and contamination filter, and the generated text-to-SQL data."""

import asyncio
import json
import shutil
import sqlite3
from pathlib import Path

import bm25s
import numpy as np
import pytest

from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.contamination import filter_contaminated
from jaxrl_tools.datasets import search_qa, sql_qa
from jaxrl_tools.records import tokenizer_texts
from jaxrl_tools.rewards import get_reward, qa_correct
from jaxrl_tools.setup import setup_tokenizer
from jaxrl_tools.tasks.tokenizer import build_tokenizer
from jaxrl_tools.tools import create_tool, get_parser
from jaxrl_tools.tools.dense import DenseIndex
from jaxrl_tools.tools.search import BM25Index, PassageStore, build_index, iter_passages

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "data" / "search_qa"


def arun(coro):
    return asyncio.run(coro)


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def world():
    return search_qa.make_world(seed=0)


@pytest.fixture(scope="module")
def shipped_index(tmp_path_factory):
    return BM25Index(SHIPPED / "corpus.jsonl", tmp_path_factory.mktemp("bm25"))


# ------------------------------------------------------------------------- the shipped data
def test_shipped_search_data_is_the_generators(world):
    """data/search_qa is what `python -m jaxrl_tools.datasets.search_qa` writes (seed 0)."""
    assert read_jsonl(SHIPPED / "corpus.jsonl") == search_qa.corpus_rows(world)
    assert read_jsonl(SHIPPED / "pages.jsonl") == search_qa.page_rows(world)
    for split in ("train", "test"):
        records = search_qa.questions(world, split, seed=0)
        assert read_jsonl(SHIPPED / f"{split}.jsonl") == records
        want = search_qa.retrieval_records(records)
        assert read_jsonl(SHIPPED / f"retrieval_{split}.jsonl") == want
    again = search_qa.make_world(seed=0)
    assert again == world and search_qa.make_world(seed=1) != world


def test_questions_need_the_corpus(world, shipped_index):
    """Held-out, RL and SFT questions are about disjoint entities; each answer is in its
    supporting passages and not in the question; each query's top BM25 hit is the passage the
    searcher needs (what the SFT traces and the demo rely on)."""
    rows = {r["id"]: r for r in read_jsonl(SHIPPED / "corpus.jsonl")}
    splits = {s: search_qa.questions(world, s) for s in search_qa.SPLITS}
    subjects = {s: {r["id"].split(":", 1)[1] for r in recs} for s, recs in splits.items()}
    assert not subjects["test"] & (subjects["train"] | subjects["sft"])
    assert not subjects["train"] & subjects["sft"]
    assert {r["hops"] for r in splits["test"]} == {1, 2}
    for r in splits["test"][:40] + splits["train"][:40]:
        answer = r["golden_answers"][0]
        assert answer.lower() not in r["question"].lower()
        assert answer in rows[r["support"][-1]]["text"]
        for query, support in zip(r["queries"], r["support"]):
            top = shipped_index.search(query, 1)
            assert shipped_index.passages[top[0][0]].id == support, (r, query)


def test_shipped_sft_traces_show_what_the_tool_returns(shipped_index):
    """Each trace's observations are the search tool's output (top 1) through the Search-R1
    parser, and only the policy's own text is trainable."""
    traces = read_jsonl(SHIPPED / "sft_traces.jsonl")
    share = sum(t["uses_search"] for t in traces) / len(traces)
    assert 0.3 < share < 0.5  # search_mix 0.4: imperfect on purpose
    tool = create_tool("search", {"corpus_path": str(SHIPPED / "corpus.jsonl"), "top_k": 1})
    tool._index = shipped_index
    parser = get_parser("search_r1")
    for t in [t for t in traces if t["uses_search"]][:40]:
        segs = t["segments"]
        assert segs[0][1] is False and segs[0][0].endswith("<|im_start|>assistant\n")
        for (call, trained), (obs, obs_trained) in zip(segs[1:-1:2], segs[2:-1:2]):
            query = call.removeprefix("<search> ").removesuffix(" </search>")
            assert trained and not obs_trained
            want = arun(tool.call({"query": query})).text
            assert obs == parser.format_observation([want])
        assert segs[-1][1] and segs[-1][0].startswith("<answer> ")


def test_demo_tokenizer_reads_the_corpus_names_whole(tmp_path, monkeypatch):
    """The search demo's tokenizer is trained on the corpus passages too: an invented name is
    at most two tokens, the same ones in the question, the query and the passage (what a tiny
    policy copies)."""
    monkeypatch.chdir(ROOT)  # the recipe's data paths are relative to the repository
    cfg = load_config("configs/search_demo.yaml", [f"tokenizer.path={tmp_path / 'tok'}"])
    texts = tokenizer_texts(cfg)
    assert len(texts) == len(read_jsonl(SHIPPED / "corpus.jsonl"))
    tok = setup_tokenizer(cfg)
    trace = read_jsonl(SHIPPED / "sft_traces.jsonl")
    searched = next(t for t in trace if t["uses_search"] and t["id"].startswith("birthplace"))
    name = searched["id"].split(":")[1]
    ids = tok.encode(" " + name)
    assert len(ids) <= 4  # two words, each at most two tokens
    for text, _ in searched["segments"][:3]:  # the question, the query, the passage
        assert " ".join(map(str, ids)) in " ".join(map(str, tok.encode(text))), text
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"id": "a", "text": "A passage."}\n{"id": "b"}\n')
    tools = f"tools=[{{class: search, config: {{corpus_path: {bad}, top_k: 1}}}}]"
    with pytest.raises(ConfigError, match=r"tools\[0\].config.corpus_path: .*corpus.jsonl:2: "):
        tokenizer_texts(load_config("configs/search_demo.yaml", [tools]))


# ------------------------------------------------------------------ streaming BM25 index
CORPUS = [
    {"id": "a", "title": "Eiffel Tower", "text": "A wrought-iron lattice tower in Paris, France."},
    {"id": "b", "contents": '"Mount Everest"\nEarth\'s highest mountain above sea level.'},
    {"id": "c", "title": "Python", "text": "Python is a language; python python snakes."},
    {"title": "The", "text": "the of and"},  # only stop words: an empty passage for BM25
    {"id": "e", "title": "Amazon", "text": "The Amazon is the largest river in Brazil and Peru."},
    {"id": "f", "title": "Paris", "text": "Paris is the capital of France, on the Seine river."},
    {"id": "g", "title": "Seine", "text": "The Seine flows through Paris to the English Channel."},
]


def test_streaming_index_equals_bm25s_in_memory(tmp_path):
    """Built in chunks of 2 passages (so vocabularies grow across chunks), the index bm25s loads
    memory-mapped ranks and scores every query exactly as bm25s's own in-memory index."""
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps(r) for r in CORPUS]
    path.write_text("\n".join(lines[:3] + ["", *lines[3:]]) + "\n")  # a blank line is skipped
    passages = [p for _, p in iter_passages(path)]
    assert [p.id for p in passages] == ["a", "b", "c", "3", "e", "f", "g"]
    assert passages[1].title == "Mount Everest"
    ref = bm25s.BM25()
    texts = [f"{p.title} {p.text}" for p in passages]
    ref.index(bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False))
    assert build_index(path, tmp_path / "idx", chunk_docs=2) == len(CORPUS)
    ours = bm25s.BM25.load(str(tmp_path / "idx"), mmap=True, show_progress=False)
    assert isinstance(ours.scores["data"], np.memmap)
    for query in ["paris river", "python snakes language", "highest mountain", "france seine"]:
        toks = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        want_ids, want = ref.retrieve(toks, k=len(CORPUS), show_progress=False)
        got_ids, got = ours.retrieve(toks, k=len(CORPUS), show_progress=False)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_ids[want > 0], want_ids[want > 0])
    store = PassageStore(path, np.load(tmp_path / "idx" / "offsets.npy", mmap_mode="r"))
    assert [store[i] for i in (6, 0, 3)] == [passages[6], passages[0], passages[3]]


# --------------------------------------------------------------- DeepResearcher's tools
class EchoBackend:
    """A custom backend, declared by import path."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def search(self, query, k):
        from jaxrl_tools.tools import SearchHit

        return [SearchHit(f"{self.prefix}/{query}", query.title(), "snippet")][:k]

    def fetch(self, url):
        return f"page {url}" if url.startswith(self.prefix) else None


def test_web_search_and_browse_over_local_pages(tmp_path, world):
    cfg = {
        "pages_path": str(SHIPPED / "pages.jsonl"),
        "backend_kwargs": {"cache_dir": str(tmp_path)},
    }
    search = create_tool("web_search", {**cfg, "top_k": 2})
    browse = create_tool("browse", cfg)
    person = next(p for p in world.people if p.split == "test")
    obs = arun(search.call({"query": person.name}))
    url = f"https://wiki.local/{person.name.replace(' ', '_')}"
    assert obs.ok and obs.text.startswith(f"1. {person.name} ({url})\n")
    assert person.city not in obs.text  # the snippet does not answer: browse the page
    page = arun(browse.call({"url": url}))
    assert page.ok and f"born in {person.city}, a city in {world.cities[person.city]}" in page.text
    assert not arun(browse.call({"url": "https://wiki.local/Nobody"})).ok
    assert not arun(search.call({"query": ""})).ok
    custom = {"backend": "test_search_recipes:EchoBackend", "backend_kwargs": {"prefix": "x:"}}
    assert arun(create_tool("web_search", custom).call({"query": "a b"})).text == (
        "1. A B (x:/a b)\nsnippet"
    )
    assert arun(create_tool("browse", custom).call({"url": "x:/p"})).text == "page x:/p"
    with pytest.raises(ValueError, match="'local' or 'module:Class'"):
        create_tool("browse", {"backend": "nope"}).start()


def test_contamination_filter_drops_what_the_policy_knows_without_tools():
    records = [{"prompt": f"q{i}", "ground_truth": [f"a{i}"]} for i in range(4)]

    def sample(recs, k):  # knows q1 at its 3rd sample, q3 at every sample
        said = {1: lambda j: "a1" if j == 2 else "x", 3: lambda j: "a3"}
        return [
            [
                f"<answer>{said.get(int(r['prompt'][1:]), lambda j: 'x')(j)}</answer>"
                for j in range(k)
            ]
            for r in recs
        ]

    kept, dropped = filter_contaminated(records, sample, k=2, correct=qa_correct)
    assert [r["prompt"] for r in kept] == ["q0", "q1", "q2"] and dropped == [records[3]]
    kept, dropped = filter_contaminated(records, sample, k=3, correct=qa_correct)
    assert [r["prompt"] for r in kept] == ["q0", "q2"]
    with pytest.raises(ValueError, match="must return 2 responses"):
        filter_contaminated(records, lambda r, k: [["x"]] * len(r), k=2, correct=qa_correct)


# -------------------------------------------------------------------------- text-to-SQL
def test_generated_sql_data_is_shipped_and_scored_by_execution(tmp_path):
    paths = sql_qa.write_dataset(tmp_path / "sql")
    for split in ("train", "test"):
        ours = read_jsonl(paths[split])
        shipped = read_jsonl(ROOT / "data" / "sql_qa" / f"{split}.jsonl")
        for a, b in zip(ours, shipped, strict=True):
            assert (
                a["prompt"] == b["prompt"] and a["ground_truth"]["sql"] == b["ground_truth"]["sql"]
            )
            assert Path(a["ground_truth"]["db"]).name == Path(b["ground_truth"]["db"]).name
    train_dbs = {Path(r["ground_truth"]["db"]).name for r in read_jsonl(paths["train"])}
    test_dbs = {Path(r["ground_truth"]["db"]).name for r in read_jsonl(paths["test"])}
    assert not train_dbs & test_dbs
    for name in sorted(train_dbs | test_dbs):
        db_ours = sqlite3.connect(tmp_path / "sql" / "dbs" / name)
        db_shipped = sqlite3.connect(ROOT / "data" / "sql_qa" / "dbs" / name)
        q = "SELECT * FROM staff ORDER BY id"
        assert db_ours.execute(q).fetchall() == db_shipped.execute(q).fetchall()
    # the cold start: one in-format, correct answer per training question (the recipe's reward)
    coldstart = read_jsonl(paths["coldstart"])
    assert coldstart == read_jsonl(ROOT / "data" / "sql_qa" / "coldstart.jsonl")
    train = read_jsonl(paths["train"])
    assert [c["prompt"] for c in coldstart] == [r["prompt"] for r in train]
    (spec,) = load_config(ROOT / "configs" / "deepretrieval_sql.yaml").reward
    scores = {get_reward("sql_exec")(c["response"], r["ground_truth"], **spec.kwargs)
              for c, r in zip(coldstart, train, strict=True)}  # fmt: skip
    assert scores == {1.1}
    reward = get_reward("sql_exec")
    rec = next(r for r in read_jsonl(paths["train"]) if r["template"] == "count_dept")
    gt = rec["ground_truth"]
    dept = gt["sql"].split("'")[1]
    equivalent = f"```sql\nSELECT COUNT(id) FROM staff AS s WHERE s.dept IN ('{dept}')\n```"
    assert reward(equivalent, gt) == 1.0
    assert reward("```sql\nSELECT COUNT(*) FROM staff\n```", gt) == 0.0
    assert reward(f"```sql\nDELETE FROM staff WHERE dept = '{dept}'\n```", gt) == 0.0


# ------------------------------------------------------------------------ dense retriever
def test_dense_retriever_ranks_by_cosine_of_its_embeddings(tmp_path, tiny_hf):
    """A tiny random Qwen2 folder as the encoder: the tool's ranking is NumPy's cosine ranking
    of the same embeddings, which are cached on disk and reused."""
    folder = tmp_path / "encoder"
    shutil.copytree(tiny_hf("qwen2", vocab_size=300, num_key_value_heads=2)[1], folder)
    build_tokenizer(tmp_path / "tok", vocab_size=300).save_pretrained(folder)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    tool = create_tool(
        "search",
        {"corpus_path": str(path), "top_k": 3, "cache_dir": str(tmp_path / "cache"),
         "retriever": "dense", "encoder_path": str(folder)},
    )  # fmt: skip
    index = tool.index
    assert isinstance(index, DenseIndex) and not index.loaded_from_cache
    passages = [p for _, p in iter_passages(path)]
    emb = index.embed([f"{p.title} {p.text}" for p in passages])
    np.testing.assert_allclose(np.asarray(index.embeddings), emb, atol=1e-6)
    for query in ["paris river", "highest mountain", "python"]:
        q = index.embed([query])[0]
        cos = (emb / np.linalg.norm(emb, axis=1, keepdims=True)) @ (q / np.linalg.norm(q))
        want = list(np.argsort(-cos, kind="stable")[:3])
        assert [i for i, _ in index.search(query, 3)] == want
        text = arun(tool.call({"query": query})).text
        assert text.splitlines()[0].startswith(f"Doc 1(Title: {passages[want[0]].title})")
    assert (index.index_dir / "embeddings.npy").is_file()  # reused by the next index
    with pytest.raises(ValueError, match="needs encoder_path"):
        create_tool("search", {"corpus_path": str(path), "retriever": "dense"})
