"""DeepResearcher's contamination filter (arXiv 2504.03160) as a data step: drop the questions
the base policy already answers right without tools in any of k samples (pass@k), so that RL
trains on questions that need the tools, not on what the model memorised.

    kept, dropped = filter_contaminated(records, sample, k=10, correct=qa_correct)

or, with a run config's policy (`model.path`, its tokenizer and chat template, the recipe's
system prompt and sampling temperature, no tools) and its reward's answer checker:

    python -m jaxrl_tools.contamination --config search_r1 --k 10 \\
        --input data/nq_hotpotqa_train.jsonl --output data/nq_hotpotqa_train.clean.jsonl

The output keeps the input's lines as they were (jsonl), minus the dropped ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrl_tools import configs, data, run
from jaxrl_tools.config import RunConfig
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.rewards import is_correct

log = logging.getLogger(__name__)

# records, k -> k responses per record, in order
Sample = Callable[[Sequence[dict], int], Sequence[Sequence[str]]]


def filter_contaminated(
    records: Sequence[dict], sample: Sample, *, k: int, correct: Callable[[str, Any], bool]
) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): a record is dropped when any of its k tool-free samples is correct.

    Args:
      records: prompt records with "ground_truth".
      sample: the base policy, without tools: (records, k) -> k responses per record.
      k: samples per question (pass@k).
      correct: (response, ground_truth) -> bool, the recipe's answer checker.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    responses = sample(records, k)
    if len(responses) != len(records) or any(len(r) != k for r in responses):
        raise ValueError(f"sample must return {k} responses for each of the {len(records)} records")
    kept, dropped = [], []
    for rec, outs in zip(records, responses):
        hit = any(correct(o, rec["ground_truth"]) for o in outs)
        (dropped if hit else kept).append(rec)
    return kept, dropped


def policy_sampler(cfg: RunConfig, batch_size: int = 64) -> Sample:
    """The run's policy as a `Sample`, with its tools taken away (protocol none, no calls)."""
    bare = dataclasses.replace(
        cfg,
        tools=(),
        rollout=dataclasses.replace(cfg.rollout, protocol="none", max_tool_calls=0),
    )
    tokenizer = run.setup_tokenizer(bare)
    model_cfg, params = run.setup_model(bare, tokenizer, run.make_mesh(bare))
    sampler = run.make_sampler(bare, model_cfg, params, tokenizer, [], run.make_mesh(bare))

    def sample(records: Sequence[dict], k: int) -> list[list[str]]:
        out: list[list[str]] = []
        for i in range(0, len(records), batch_size):
            chunk = list(records[i : i + batch_size])
            trajs = sampler(chunk, k, params, temperature=cfg.rollout.temperature, seed=i)
            out += [[t.model_text for t in trajs[j * k : (j + 1) * k]] for j in range(len(chunk))]
        return out

    return sample


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a recipe (file or shipped name)")
    p.add_argument("--input", required=True, help="prompt records (jsonl)")
    p.add_argument("--output", required=True, help="where the kept records go (jsonl)")
    p.add_argument("--k", type=int, default=10, help="samples per question (pass@k)")
    args, overrides = p.parse_known_args(argv)
    path = Path(args.config)
    cfg = load_config(path if path.is_file() else configs.path(args.config), overrides)
    d = cfg.data
    source = data.RecordSource([args.input], prompt_key=d.prompt_key, answer_key=d.answer_key)
    kind = run.make_reward(cfg).correctness
    kept, dropped = filter_contaminated(
        list(source), policy_sampler(cfg), k=args.k, correct=lambda r, gt: is_correct(r, gt, kind)
    )
    lines = Path(args.input).read_text(encoding="utf-8").splitlines(keepends=True)
    keep = {int(r["source"].rsplit(":", 1)[1]) for r in kept}
    Path(args.output).write_text("".join(line for n, line in enumerate(lines, 1) if n in keep))
    print(
        f"kept {len(kept)} of {len(source)} questions ({len(dropped)} answered without tools "
        f"at pass@{args.k}) -> {args.output}"
    )


if __name__ == "__main__":
    main()
