"""An invented world whose facts only its tools know, for the recipes whose tool calls execute:
ARTIST's function calling (`artist_functions`) and a rollout that mixes search and Python
(`mixed_tools`). Nothing here is true of the real world, so a model cannot answer from memory.

- Functions (`get_weather`, `convert_currency`, `get_stock_price`): typed Python functions over
  fixed invented tables, declared and run as tools by import path (`tools: [{class: function,
  config: {function: "jaxrl_tools.datasets.tool_world:get_weather"}}]`). A question's answer is
  computed by calling them, so it is right only if the model made the calls and read them.
- A corpus of invented landmarks (the year each was built, its height) for the search tool, and
  questions that need two searches and a computation (years between two landmarks, their
  combined height in feet).

    paths = write_dataset("data/tool_world")  # corpus, functions_*, mixed_* (jsonl)

Command: `python -m jaxrl_tools.datasets.tool_world --out data/tool_world` (seed 0; the
shipped files are its output).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from jaxrl_tools.tools import FunctionTool

_TEMPERATURE_C = {"Velmora": 14, "Quillan": 21, "Dressik": 3, "Ormund": 27, "Tavira": 9}
_PER_USD = {"USD": 1.0, "EUR": 0.8, "GBP": 0.75, "NOK": 10.0}  # units of a currency per dollar
_PRICE_USD = {"KRNL": 40.0, "VOLT": 125.0, "BRYX": 8.0, "ZANE": 64.0}


def _known(value: str, table: dict, what: str) -> None:
    if value not in table:
        raise ValueError(f"unknown {what} {value!r}; known: {', '.join(sorted(table))}")


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> dict:
    """The current temperature in a city.

    Args:
      city: the city's name.
      unit: the temperature unit.
    """
    _known(city, _TEMPERATURE_C, "city")
    celsius = _TEMPERATURE_C[city]
    value = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32, 1)
    return {"city": city, "temperature": value, "unit": unit}


def convert_currency(amount: float, from_currency: str, to_currency: str) -> dict:
    """Converts an amount of money between currencies, at today's rate (to the cent).

    Args:
      amount: the amount to convert.
      from_currency: the ISO code of the currency the amount is in.
      to_currency: the ISO code of the currency to convert to.
    """
    _known(from_currency, _PER_USD, "currency")
    _known(to_currency, _PER_USD, "currency")
    value = round(amount / _PER_USD[from_currency] * _PER_USD[to_currency], 2)
    return {"amount": value, "currency": to_currency}


def get_stock_price(symbol: str) -> dict:
    """The last price of a share, in US dollars.

    Args:
      symbol: the stock's ticker symbol.
    """
    _known(symbol, _PRICE_USD, "symbol")
    return {"symbol": symbol, "price": _PRICE_USD[symbol], "currency": "USD"}


FUNCTIONS = (get_weather, convert_currency, get_stock_price)


def _number(x: float) -> str:
    return f"{x:g}" if abs(x - round(x)) > 1e-9 else str(int(round(x)))


def _function_question(rng: random.Random) -> tuple[str, str, list[str]]:
    """(question, answer, the functions it needs)."""
    kind = rng.randrange(4)
    cities, currencies = sorted(_TEMPERATURE_C), sorted(_PER_USD)
    if kind == 0:
        city = rng.choice(cities)
        t = get_weather(city, "fahrenheit")["temperature"]
        return f"What is the temperature in {city} in fahrenheit?", _number(t), ["get_weather"]
    if kind == 1:
        src, dst = rng.sample(currencies, 2)
        amount = rng.randrange(2, 60) * 10
        value = convert_currency(amount, src, dst)["amount"]
        question = f"How much is {amount} {src} in {dst}?"
        return question, _number(value), ["convert_currency"]
    if kind == 2:
        a, b = rng.sample(cities, 2)
        warmer = a if _TEMPERATURE_C[a] > _TEMPERATURE_C[b] else b
        return f"Which is warmer right now, {a} or {b}?", warmer, ["get_weather"]
    symbol, n = rng.choice(sorted(_PRICE_USD)), rng.randrange(2, 12)
    cur = rng.choice([c for c in currencies if c != "USD"])
    total = get_stock_price(symbol)["price"] * n
    value = convert_currency(total, "USD", cur)["amount"]
    question = f"How much do {n} shares of {symbol} cost in {cur}?"
    return question, _number(value), ["get_stock_price", "convert_currency"]


_SYLLABLES = ("ka", "ven", "dro", "mil", "sor", "tha", "qui", "ber", "lo", "zan", "ru", "pe")
_KINDS = ("Tower", "Bridge", "Lighthouse", "Observatory", "Gate", "Aqueduct")
FEET_PER_METRE = 3.28084


def _landmarks(rng: random.Random, n: int) -> list[dict]:
    names: set[str] = set()
    out = []
    while len(out) < n:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randrange(2, 4))).capitalize()
        name = f"the {word} {rng.choice(_KINDS)}"
        if name in names:
            continue
        names.add(name)
        city = rng.choice(sorted(_TEMPERATURE_C))
        out.append(
            {
                "id": f"landmark:{len(out)}",
                "name": name,
                "city": city,
                "year": rng.randrange(1650, 1990),
                "height": rng.randrange(12, 340),
            }
        )
    return out


def _passage(lm: dict) -> dict:
    title = lm["name"][4:].title()
    text = (
        f"{title} stands in {lm['city']}. It was built in {lm['year']} and is {lm['height']} "
        "metres tall."
    )
    return {"id": lm["id"], "title": title, "text": text}


def _mixed_question(rng: random.Random, a: dict, b: dict) -> tuple[str, str]:
    if rng.random() < 0.5:
        older, newer = sorted((a, b), key=lambda x: x["year"])
        question = f"How many years after {older['name']} was {newer['name']} built?"
        return question, str(newer["year"] - older["year"])
    feet = round((a["height"] + b["height"]) * FEET_PER_METRE, 1)
    question = (
        f"What is the combined height of {a['name']} and {b['name']} in feet (1 metre = "
        f"{FEET_PER_METRE} feet), to one decimal place?"
    )
    return question, _number(feet)


FUNCTIONS_INSTRUCTION = "Answer the question with the functions you are given."
MIXED_INSTRUCTION = (
    "Look the facts up with the search tool, compute with the Python tool, and put the final "
    "answer in \\boxed{}."
)


def write_dataset(
    out: str | Path, seed: int = 0, n_landmarks: int = 60, n_train: int = 400, n_test: int = 100
) -> dict[str, Path]:
    """Writes corpus.jsonl, functions_{train,test}.jsonl and mixed_{train,test}.jsonl into
    `out`; the test questions of the mixed set use landmarks no training question names."""
    rng = random.Random(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    landmarks = _landmarks(rng, n_landmarks)
    split = n_landmarks * 3 // 4  # landmarks [0, split) for training, the rest for testing
    files: dict[str, list[dict]] = {"corpus": [_passage(lm) for lm in landmarks]}
    for part, n, pool in (
        ("train", n_train, landmarks[:split]),
        ("test", n_test, landmarks[split:]),
    ):
        rows = []
        for i in range(n):
            question, answer, names = _function_question(rng)
            rows.append(
                {"id": f"functions-{part}-{i}", "prompt": question, "ground_truth": answer,
                 "functions": names}
            )  # fmt: skip
        files[f"functions_{part}"] = rows
        rows = []
        for i in range(n):
            a, b = rng.sample(pool, 2)
            question, answer = _mixed_question(rng, a, b)
            rows.append(
                {"id": f"mixed-{part}-{i}", "prompt": f"{question}\n\n{MIXED_INSTRUCTION}",
                 "ground_truth": answer, "landmarks": [a["id"], b["id"]]}
            )  # fmt: skip
        files[f"mixed_{part}"] = rows
    paths = {}
    for name, rows in files.items():
        paths[name] = out / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return paths


def function_signatures(functions: tuple[Callable, ...] = FUNCTIONS) -> str:
    """The functions as the ARTIST recipe's prompt lists them: one JSON declaration a line."""
    return "\n".join(json.dumps(FunctionTool(fn).schema()["function"]) for fn in functions)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="data/tool_world")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name, path in write_dataset(args.out, args.seed).items():
        print(f"{name}: {path} ({len(path.read_text().splitlines())} lines)")


if __name__ == "__main__":
    main()
