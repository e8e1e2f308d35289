"""The function-calling generator: a catalog of tools with JSON-schema parameters and request
templates, and `generate`, which draws records from it (see `datasets.function_calling`)."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence


def declaration(name: str, description: str, properties: dict, required: Sequence[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(required)},
        },
    }


def _p(kind: str, description: str, **extra) -> dict:
    return {"type": kind, "description": description, **extra}


# ------------------------------------------------------------------------------- the generator
# (tool declaration, request templates, argument samplers). A template's {fields} are the
# call's arguments, drawn per example.
_CITIES = ["Paris", "Lima", "Osaka", "Nairobi", "Oslo", "Denver", "Hanoi", "Porto"]
_CURRENCIES = ["USD", "EUR", "JPY", "GBP", "KES", "NOK"]
_LANGS = ["French", "Spanish", "German", "Japanese", "Swahili"]
_WORDS = ["serendipity", "ephemeral", "lucid", "gregarious", "taciturn"]
_PHRASES = ["good morning", "where is the station", "thank you very much", "see you soon"]
_SYMBOLS = ["AAPL", "MSFT", "NVDA", "TSLA", "AMZN"]
_CATALOG = [
    (
        declaration(
            "get_weather",
            "Current weather in a city.",
            {
                "city": _p("string", "City name"),
                "unit": _p("string", "Temperature unit", enum=["celsius", "fahrenheit"]),
            },
            ["city"],
        ),
        ["What's the weather in {city}?", "Is it cold in {city} right now?"],
        ["What's the weather in {city} in {unit}?"],
        lambda r: {"city": r.choice(_CITIES), "unit": r.choice(["celsius", "fahrenheit"])},
    ),
    (
        declaration(
            "convert_currency",
            "Convert an amount of money between currencies.",
            {
                "amount": _p("number", "Amount to convert"),
                "from_currency": _p("string", "ISO code of the source currency"),
                "to_currency": _p("string", "ISO code of the target currency"),
            },
            ["amount", "from_currency", "to_currency"],
        ),
        ["How much is {amount} {from_currency} in {to_currency}?"],
        [],
        lambda r: dict(
            zip(
                ("amount", "from_currency", "to_currency"),
                (r.choice([5, 20, 75, 120, 999]), *r.sample(_CURRENCIES, 2)),
            )
        ),
    ),
    (
        declaration(
            "set_timer",
            "Start a countdown timer.",
            {"minutes": _p("integer", "Length of the timer in minutes", minimum=1)},
            ["minutes"],
        ),
        ["Set a timer for {minutes} minutes.", "Remind me in {minutes} minutes."],
        [],
        lambda r: {"minutes": r.choice([3, 5, 10, 25, 45])},
    ),
    (
        declaration(
            "translate",
            "Translate text into another language.",
            {
                "text": _p("string", "The text to translate"),
                "target_language": _p("string", "Language to translate into"),
            },
            ["text", "target_language"],
        ),
        ['How do you say "{text}" in {target_language}?'],
        [],
        lambda r: {"text": r.choice(_PHRASES), "target_language": r.choice(_LANGS)},
    ),
    (
        declaration(
            "get_stock_price",
            "Latest price of a stock.",
            {"symbol": _p("string", "Ticker symbol")},
            ["symbol"],
        ),
        ["What is {symbol} trading at?", "Give me the current price of {symbol}."],
        [],
        lambda r: {"symbol": r.choice(_SYMBOLS)},
    ),
    (
        declaration(
            "define_word",
            "Dictionary definition of an English word.",
            {"word": _p("string", "The word")},
            ["word"],
        ),
        ["What does '{word}' mean?", "Define {word}."],
        [],
        lambda r: {"word": r.choice(_WORDS)},
    ),
    (
        declaration(
            "calculate_tip",
            "Tip for a restaurant bill.",
            {
                "bill": _p("number", "Bill amount"),
                "percent": _p("number", "Tip percentage", minimum=0, maximum=100),
            },
            ["bill", "percent"],
        ),
        ["What is a {percent}% tip on a {bill} bill?"],
        [],
        lambda r: {"bill": r.choice([18.5, 42, 64.2, 120]), "percent": r.choice([10, 15, 18, 20])},
    ),
]
_NO_CALL = [
    "Hi! How are you today?",
    "Tell me a fun fact about octopuses.",
    "Thanks, that's all I needed.",
    "What's your favourite colour?",
]
SYSTEM = "You are a helpful assistant. Call the functions you are given when they help."


def generate(
    n: int,
    seed: int = 0,
    no_call_frac: float = 0.15,
    multi_frac: float = 0.3,
    *,
    num_tools: tuple[int, int] = (3, 5),
    system: str = SYSTEM,
    param_descriptions: bool = True,
):
    """`n` generated records, each showing `num_tools` (lo, hi) tools: the needed ones and at
    least one distractor. `param_descriptions=False` drops the parameters' descriptions (shorter
    prompts, for small models)."""
    lo, hi = num_tools
    if not 2 <= lo <= hi <= len(_CATALOG):
        raise ValueError(
            f"num_tools must satisfy 2 <= lo <= hi <= {len(_CATALOG)}, got {num_tools}"
        )
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = 0 if rng.random() < no_call_frac else (2 if rng.random() < multi_frac else 1)
        picks = rng.sample(range(len(_CATALOG)), max(k, 1))[:k]
        calls, requests = [], []
        for i in picks:
            decl, simple, full, draw = _CATALOG[i]
            args = draw(rng)
            template = rng.choice(simple + full)
            used = set(re.findall(r"{(\w+)}", template))
            # In the declaration's order: a set's order changes with PYTHONHASHSEED.
            order = decl["function"]["parameters"]["properties"]
            calls.append(
                {
                    "name": decl["function"]["name"],
                    "arguments": {a: args[a] for a in order if a in used},
                }
            )
            requests.append(template.format(**args))
        others = [i for i in range(len(_CATALOG)) if i not in picks]
        shown = picks + rng.sample(others, max(rng.randint(lo, hi), k + 1) - len(picks))
        rng.shuffle(shown)
        text = " Also, ".join(requests) if requests else rng.choice(_NO_CALL)
        tools = [_CATALOG[i][0] for i in shown]
        out.append(
            {
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": text},
                ],
                "tools": tools
                if param_descriptions
                else [_without_param_descriptions(t) for t in tools],
                "ground_truth": calls,
            }
        )
    return out


def _without_param_descriptions(tool: dict) -> dict:
    fn = tool["function"]
    props = {
        k: {kk: vv for kk, vv in v.items() if kk != "description"}
        for k, v in fn["parameters"]["properties"].items()
    }
    return declaration(fn["name"], fn["description"], props, fn["parameters"]["required"])
