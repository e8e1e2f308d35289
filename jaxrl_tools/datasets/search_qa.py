"""A synthetic search-QA world: invented people, cities, countries and organisations, a passage
corpus about them, and single- and multi-hop questions that only the corpus can answer.

Every name is made of invented syllables, so no model knows the facts: a policy answers right
only by searching. The generator is deterministic (same seed and sizes, same files).

    world = make_world(seed=0)
    corpus = corpus_rows(world)          # [{"id", "title", "text"}]: the search tool's jsonl
    train = questions(world, "train")    # [{"question", "golden_answers", "hops", "support", ...}]
    write_dataset("data/search_qa")      # corpus, train, test, SFT traces, retrieval sets

Question kinds (`support`: the ids of the passages that answer it, for retrieval rewards):

| kind | hops | example | searches |
| --- | --- | --- | --- |
| birthplace | 1 | Where was Davor Kelm born? | the person |
| occupation | 1 | What is the occupation of Davor Kelm? | the person |
| country | 2 | In which country was Davor Kelm born? | the person, then the city |
| founder_birthplace | 2 | Where was the founder of Qorvex Guild born? | the org, its founder |

People and organisations are split three ways: "sft" entities (the SFT traces), "train" ones (the
RL prompts) and "test" ones (held out): no entity of a question is in another split, so an answer
"from memory" of the SFT traces is a guess on RL and held-out questions alike.

Command: `python -m jaxrl_tools.datasets.search_qa --out data/search_qa` writes the shipped files.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxrl_tools.tools.parsers import get_parser
from jaxrl_tools.tools.search import SearchTool

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CODAS = ["", "", "n", "r", "l", "s", "m", "k", "th", "x"]
OCCUPATIONS = (
    "painter", "sailor", "farmer", "doctor", "baker", "poet", "miner", "judge", "weaver", "pilot"
)  # fmt: skip
_ORG_KINDS = ("Guild", "Works", "Company", "Society", "Press")
KINDS = ("birthplace", "occupation", "country", "founder_birthplace")
HOPS = {"birthplace": 1, "occupation": 1, "country": 2, "founder_birthplace": 2}
SPLITS = ("sft", "train", "test")
SPLIT_FRACTIONS = (0.375, 0.375, 0.25)


@dataclass(frozen=True)
class Person:
    name: str
    occupation: str
    city: str
    split: str  # "sft", "train" or "test"


@dataclass(frozen=True)
class Org:
    name: str
    founder: str  # a Person's name, of the same split
    split: str


@dataclass(frozen=True)
class World:
    countries: tuple[str, ...]
    cities: dict  # city -> country
    people: tuple[Person, ...]
    orgs: tuple[Org, ...]


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables))
    return (w + rng.choice(_CODAS)).capitalize()


def _unique(rng: random.Random, n: int, make, taken: set) -> list[str]:
    out = []
    while len(out) < n:
        w = make()
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def _split(i: int, n: int) -> str:
    """The split of entity i of n: the first 25% test, then sft, then train."""
    test, sft = round(n * SPLIT_FRACTIONS[2]), round(n * SPLIT_FRACTIONS[0])
    return "test" if i < test else "sft" if i < test + sft else "train"


def make_world(
    seed: int = 0,
    n_people: int = 1200,
    n_cities: int = 40,
    n_countries: int = 8,
    n_orgs: int = 240,
) -> World:
    """Invented entities and their facts, deterministically from `seed`."""
    rng = random.Random(seed)
    taken: set[str] = set()
    countries = _unique(rng, n_countries, lambda: _word(rng, 3), taken)
    cities = _unique(rng, n_cities, lambda: _word(rng, 2), taken)
    city_country = {c: countries[i % n_countries] for i, c in enumerate(cities)}
    firsts = _unique(rng, max(8, n_people // 20), lambda: _word(rng, 2), taken)
    lasts = _unique(rng, max(8, n_people // 16), lambda: _word(rng, 2), taken)
    names = _unique(rng, n_people, lambda: f"{rng.choice(firsts)} {rng.choice(lasts)}", set())
    people = tuple(
        Person(n, rng.choice(OCCUPATIONS), rng.choice(cities), _split(i, n_people))
        for i, n in enumerate(names)
    )
    stems = _unique(rng, n_orgs, lambda: _word(rng, 2), taken)
    orgs = []
    for i, stem in enumerate(stems):
        split = _split(i, n_orgs)
        founder = rng.choice([p for p in people if p.split == split])
        orgs.append(Org(f"{stem} {rng.choice(_ORG_KINDS)}", founder.name, split))
    return World(tuple(countries), city_country, people, tuple(orgs))


def _id(kind: str, name: str) -> str:
    return f"{kind}:{name.lower().replace(' ', '_')}"


def corpus_rows(world: World) -> list[dict]:
    """One passage per entity: {"id", "title", "text"} (the search tool's corpus format)."""
    rows = [
        {"id": _id("city", c), "title": c, "text": f"{c} is a city in {k}."}
        for c, k in world.cities.items()
    ]
    rows += [
        {"id": _id("person", p.name), "title": p.name,
         "text": f"{p.name} is a {p.occupation} born in {p.city}."}
        for p in world.people
    ]  # fmt: skip
    rows += [
        {"id": _id("org", o.name), "title": o.name, "text": f"{o.name} was founded by {o.founder}."}
        for o in world.orgs
    ]
    return rows


PAGE_URL = "https://wiki.local/{}"


def page_rows(world: World) -> list[dict]:
    """One web page per person and organisation, {"url", "title", "text"}, for the offline
    `web_search` / `browse` backend (tools/browse.py: LocalPages). A page's first sentence (the
    search snippet) names the entity only; the facts are further down, so that answering takes a
    `browse` of the page, as in DeepResearcher."""
    founded = {}
    for o in world.orgs:
        founded.setdefault(o.founder, []).append(o.name)
    url = lambda name: PAGE_URL.format(name.replace(" ", "_"))
    rows = []
    for p in world.people:
        orgs = "".join(f" {p.name} founded {o}." for o in founded.get(p.name, []))
        text = (
            f"{p.name} is a person in the registry. {p.name} works as a {p.occupation}. "
            f"{p.name} was born in {p.city}, a city in {world.cities[p.city]}.{orgs}"
        )
        rows.append({"id": url(p.name), "title": p.name, "text": text})
    for o in world.orgs:
        text = f"{o.name} is an organisation. It was founded by {o.founder}."
        rows.append({"id": url(o.name), "title": o.name, "text": text})
    return rows


def _question(kind: str, subject, world: World) -> dict:
    """(question, answer, the queries a searcher makes, the supporting passage ids)."""
    people = {p.name: p for p in world.people}
    if kind == "founder_birthplace":
        founder = people[subject.founder]
        q = f"Where was the founder of {subject.name} born?"
        return dict(question=q, answer=founder.city, queries=[subject.name, founder.name],
                    support=[_id("org", subject.name), _id("person", founder.name)])  # fmt: skip
    p = subject
    if kind == "birthplace":
        q, a, queries = f"Where was {p.name} born?", p.city, [p.name]
    elif kind == "occupation":
        q, a, queries = f"What is the occupation of {p.name}?", p.occupation, [p.name]
    else:
        q, a, queries = (
            f"In which country was {p.name} born?",
            world.cities[p.city],
            [p.name, p.city],
        )
    support = [_id("person", p.name)] + ([_id("city", p.city)] if kind == "country" else [])
    return dict(question=q, answer=a, queries=queries, support=support)


def questions(world: World, split: str, kinds: Sequence[str] = KINDS, seed: int = 0) -> list[dict]:
    """Every question of `kinds` about the `split` entities, shuffled by `seed`.

    Each record: question, golden_answers (Search-R1's field names), hops, kind, queries (what a
    searcher looks up, in order), support (ids of the passages that answer it).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown question kind(s) {bad}; kinds: {list(KINDS)}")
    out = []
    for kind in kinds:
        subjects = world.orgs if kind == "founder_birthplace" else world.people
        for s in subjects:
            if s.split == split:
                q = _question(kind, s, world)
                out.append(
                    {"id": f"{kind}:{s.name}", "question": q["question"],
                     "golden_answers": [q["answer"]], "hops": HOPS[kind], "kind": kind,
                     "queries": q["queries"], "support": q["support"]}
                )  # fmt: skip
    random.Random(seed).shuffle(out)
    return out


RETRIEVAL_INSTRUCTION = (
    "Write a search query that retrieves the passages needed to answer the question. Think in "
    '<think></think>, then give the query as <answer>{"query": "..."}</answer>.'
)


def retrieval_records(records: Sequence[dict]) -> list[dict]:
    """DeepRetrieval's query-rewriting records: the policy writes one query for the question,
    rewarded by the Recall@K / NDCG@K of its BM25 results against the supporting passages."""
    return [
        {"id": r["id"], "prompt": f"{RETRIEVAL_INSTRUCTION}\n\nQuestion: {r['question']}",
         "ground_truth": r["support"], "hops": r["hops"], "kind": r["kind"]}
        for r in records
    ]  # fmt: skip


# ------------------------------------------------------------------------------- SFT traces
def trace_messages(record: dict, search, protocol: str = "search_r1", use_search: bool = True):
    """The assistant turn of a trace: [(text, trainable)] pieces after the prompt.

    With `use_search`, one `<search>` per query of the record, each followed by the observation
    the rollout inserts (`search(query)` through the protocol's parser), then the answer;
    without, the answer alone ("from memory": right on training entities, and a guess on
    held-out ones, which the policy cannot know).
    """
    parser = get_parser(protocol)
    pieces: list[tuple[str, bool]] = []
    # Spaces inside the tags, as Search-R1's prompt writes them: a name is then the same
    # tokens in the question, the passage and the call (" Moran", not "Moran").
    if use_search:
        for q in record["queries"]:
            pieces.append((f"<search> {q} </search>", True))
            pieces.append((parser.format_observation([search(q)]), False))
    pieces.append((f"<answer> {record['golden_answers'][0]} </answer>", True))
    return pieces


def sft_traces(
    records: Sequence[dict],
    tokenizer,
    search,
    *,
    search_mix: float = 0.4,
    seed: int = 0,
    system_prompt: str | None = None,
) -> list[dict]:
    """Imperfect SFT traces: a record is solved by searching with probability `search_mix`,
    else answered directly. Each trace: {"id", "uses_search", "segments": [[text, trainable]]}
    (the `sft.train_files` format), rendered with the tokenizer's chat template."""
    if not 0.0 <= search_mix <= 1.0:
        raise ValueError(f"search_mix must be in [0, 1], got {search_mix}")
    rng = random.Random(seed)
    out = []
    for r in records:
        use = rng.random() < search_mix
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": r["question"]}
        ]
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        pieces = trace_messages(r, search, use_search=use)
        body = "".join(t for t, _ in pieces)
        full = tokenizer.apply_chat_template(
            [*msgs, {"role": "assistant", "content": body}], tokenize=False
        )
        if not full.startswith(prompt + body):
            raise ValueError("the chat template does not render the assistant turn verbatim")
        end = full[len(prompt) + len(body) :]  # <|im_end|>\n: trained, as the policy must stop
        segments = [[prompt, False], *[[t, m] for t, m in pieces]]
        segments[-1][0] += end
        out.append({"id": r["id"], "uses_search": use, "segments": segments})
    return out


def search_fn(corpus_path: str | Path, top_k: int, cache_dir: str | None = None):
    """query -> the search tool's observation text (what rollouts insert)."""
    tool = SearchTool(str(corpus_path), top_k=top_k, cache_dir=cache_dir)
    return lambda q: asyncio.run(tool.call({"query": q})).text


def write_jsonl(rows, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def write_dataset(
    out: str | Path,
    *,
    seed: int = 0,
    top_k: int = 1,
    search_mix: float = 0.4,
    tokenizer=None,
    cache_dir: str | None = None,
) -> dict[str, Path]:
    """Writes corpus.jsonl, pages.jsonl (web pages for the offline browse backend), train.jsonl
    (and its one- and two-hop questions apart: train_one_hop.jsonl, train_two_hop.jsonl),
    test.jsonl, sft_traces.jsonl and the query-rewriting sets retrieval_train.jsonl,
    retrieval_test.jsonl under `out`.

    The traces are rendered with `tokenizer`'s chat template (default: the demo tokenizer's,
    Qwen2.5's format) and show `top_k` passages per search, as the search_demo recipe's tool.
    """
    from jaxrl_tools.tasks.tokenizer import build_tokenizer  # noqa: PLC0415 - trains a BPE

    out = Path(out)
    world = make_world(seed)
    paths = {"corpus": write_jsonl(corpus_rows(world), out / "corpus.jsonl")}
    paths["pages"] = write_jsonl(page_rows(world), out / "pages.jsonl")
    for split in ("train", "test"):
        records = questions(world, split, seed=seed)
        paths[split] = write_jsonl(records, out / f"{split}.jsonl")
        paths[f"retrieval_{split}"] = write_jsonl(
            retrieval_records(records), out / f"retrieval_{split}.jsonl"
        )
    for hops, name in ((1, "one_hop"), (2, "two_hop")):  # for mixing by weight (deepresearcher)
        rows = [r for r in questions(world, "train", seed=seed) if r["hops"] == hops]
        paths[f"train_{name}"] = write_jsonl(rows, out / f"train_{name}.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        tok = tokenizer or build_tokenizer(Path(tmp) / "tok", vocab_size=300)
        search = search_fn(paths["corpus"], top_k, cache_dir or str(Path(tmp) / "bm25"))
        sft = questions(world, "sft", seed=seed)
        traces = sft_traces(sft, tok, search, search_mix=search_mix, seed=seed)
    paths["sft"] = write_jsonl(traces, out / "sft_traces.jsonl")
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="data/search_qa")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, path in write_dataset(args.out, seed=args.seed).items():
        print(f"{name}: {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
