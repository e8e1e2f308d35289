"""A scripted dry run: a recipe's protocol, stops, tools, budgets and reward acting on given
model text, with no model (`jaxrl-tools eval --scripted`).

The seam is the agent loop's text level: `stops.scan_chunk` cuts each scripted segment where
real decoding would stop (the text after a stop is dropped; a segment with no stop ends its
turn, an EOS appended), `resolver.Resolver` turns the ended segment into an observation, a
notice or a finish exactly as in training, and the recipe's reward scores the result. Only the
engine is left out: segment k is the model's k-th generation.

Tokens: the recipe's tokenizer when its folder is on disk, else `text_tokenizer()` (one token
per byte, Qwen2.5's special tokens and chat template), so that a recipe whose weights are not
here still runs; observation texts and the text trained on are the same either way.

Input lines: {"prompt": text or chat messages, "ground_truth": ..., "turns": [segment, ...]}.
Output lines: finish_reason, num_tool_calls (executed), invalid_actions (turns with neither a
call nor an answer), tool_calls ([{name, ok, error}]),
response_text (model text and observations, as trained on), model_text (what rewards read),
reward and its terms.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrl_tools import prompts
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.rollout.limits import RolloutLimits
from jaxrl_tools.rollout.resolver import Finish, Resolver, Sample
from jaxrl_tools.rollout.sampler import rollout_parser
from jaxrl_tools.rollout.stops import scan_chunk
from jaxrl_tools.tools import ToolExecutor
from jaxrl_tools.types import Trajectory

SCRIPT_END = "script_end"  # the script ran out while the loop waited for the model


def text_tokenizer():
    """A byte-level tokenizer with no merges (one token per byte) and Qwen2.5's added tokens
    and chat template: the dry run's tokens when the recipe's tokenizer is not on disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    from jaxrl_tools.tasks import tokenizer as demo  # noqa: PLC0415

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=demo.IM_END,
        pad_token=demo.ENDOFTEXT,
        chat_template=demo.CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.add_special_tokens({"additional_special_tokens": list(demo.SPECIAL_TOKENS)})
    fast.add_tokens(list(demo.TOOL_TOKENS))
    return fast


def recipe_tokenizer(cfg: RunConfig):
    """The recipe's tokenizer where its folder is here, else `text_tokenizer()`; with the
    recipe's prompt template either way."""
    path = Path(cfg.tokenizer_path)
    if (path / "tokenizer.json").is_file():
        tok = prompts.load_tokenizer(path)
    else:
        tok = text_tokenizer()
    return prompts.use_template(tok, cfg.rollout.template, cfg.rollout.plain_format)


class ScriptedRun:
    """The recipe's rollout, one scripted response at a time.

    Args:
      cfg: the recipe (its rollout section, tools and reward).
      tools: started tools (None: the recipe's own, started here; `close` stops them).
      tokenizer: None: `recipe_tokenizer(cfg)`.
    """

    def __init__(self, cfg: RunConfig, *, tools: list | None = None, tokenizer=None):
        from jaxrl_tools import setup  # noqa: PLC0415 -- the run's pieces

        if cfg.env.name is not None or cfg.rollout.agent is not None:
            raise ConfigError(
                "eval --scripted plays tool recipes; this one has an environment or an agent"
            )
        self.cfg, r = cfg, cfg.rollout
        self.own_tools = tools is None
        self.tools = setup.setup_tools(cfg) if tools is None else tools
        self.tokenizer = tokenizer if tokenizer is not None else recipe_tokenizer(cfg)
        self.reward = setup.make_reward(cfg)
        self.parser = rollout_parser(r, tuple(t.name for t in self.tools)) if self.tools else None
        self.executor = None
        if self.parser is not None:
            self.executor = ToolExecutor(
                self.tools, max_concurrency=r.tool_concurrency, timeout_s=r.tool_timeout_s
            )
        self.schema = self.executor.schemas() if self.executor and self.parser.chat_role else []
        tok = self.tokenizer
        self.eos_ids = {tok.eos_token_id} | {
            i for i in tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) if i is not None
        }
        self.eos_ids.discard(tok.unk_token_id)
        end = "<|endoftext|>" if r.template == "plain" else "<|im_end|>"
        self.turn_end = tok.convert_tokens_to_ids(end)
        if self.turn_end not in self.eos_ids:
            self.turn_end = tok.eos_token_id
        self.ctx_limit = r.context_len
        self.tool_stops = tuple(self.parser.stop_strings) if self.parser else ()
        self.final_stops = tuple(getattr(self.parser, "turn_stops", ()))

    def _resolver(self) -> Resolver:
        return RolloutLimits.from_section(self.cfg.rollout).resolver(
            tokenizer=self.tokenizer,
            parser=self.parser,
            executor=self.executor,
            env_format=None,
            ctx_limit=self.ctx_limit,
        )

    async def play(self, line: dict, index: int = 0) -> Trajectory:
        """The trajectory of one input line (the Driver's scan and resolve, no engine)."""
        r, tok = self.cfg.rollout, self.tokenizer
        record = {"prompt": line["prompt"]}
        ids = prompts.encode_prompt(tok, record, self.schema or None, self.cfg.data.system_prompt)
        s = Sample(Trajectory(index, 0, list(ids)), None, index)
        resolver = self._resolver()
        turns = list(line.get("turns", []))
        reason = SCRIPT_END
        for text in turns:
            toks = list(tok.encode(text, add_special_tokens=False)) + [self.turn_end]
            room = r.max_response_len - len(s.traj.response_ids)
            turn_room = room if r.max_turn_tokens is None else r.max_turn_tokens - len(s.seg_tokens)
            keep, cut, stop_end = scan_chunk(
                toks,
                segment=s.seg_tokens,
                decode=resolver.decode,
                eos_ids=self.eos_ids,
                tool_stops=self.tool_stops,
                final_stops=self.final_stops,
                room=min(room, turn_room),
                context=self.ctx_limit - s.length,
            )
            if cut == "length" and turn_room < room:
                cut = "turn_length"
            s.add_model(toks[:keep], [0.0] * keep)
            out = resolver.end_segment(s, cut, stop_end)
            if not isinstance(out, Finish):
                out = resolver.bounded(s, await out)
            if isinstance(out, Finish):
                reason = out.reason
                break
            s.add_observation(out)
        await resolver.finish(s, reason)
        return s.traj

    async def run(self, lines: Sequence[dict]) -> list[dict]:
        """Each line's output row (see the module docstring)."""
        from jaxrl_tools.train.scoring import score_trajectories  # noqa: PLC0415

        trajs = [await self.play(line, i) for i, line in enumerate(lines)]
        records = [{"ground_truth": line.get("ground_truth")} for line in lines]
        scores, parts = score_trajectories(self.reward, records, trajs, 1)
        return [
            {
                "finish_reason": t.finish_reason,
                "num_tool_calls": t.num_tool_calls,
                "invalid_actions": t.invalid_actions,
                "tool_calls": [
                    {"name": c.name, "ok": c.ok, "error": c.error} for c in t.tool_calls
                ],
                "response_text": t.response_text,
                "model_text": t.model_text,
                "reward": float(scores[i]),
                "reward_terms": {k: float(v[i]) for k, v in parts.items()},
            }
            for i, t in enumerate(trajs)
        ]

    def close(self) -> None:
        if self.executor is not None:
            asyncio.run(self.executor.close())
        if self.own_tools:
            from jaxrl_tools import setup  # noqa: PLC0415

            setup.close_tools(self.tools)


def scripted_eval(cfg: RunConfig, script: str | Path, output: str | Path) -> list[dict]:
    """`jaxrl-tools eval --scripted FILE --output OUT`: plays each line of `script` and writes
    its row to `output` (JSON lines); returns the rows."""
    lines = []
    for n, text in enumerate(Path(script).read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--scripted {script}, line {n}: not JSON ({e.msg})") from None
        if not isinstance(line, dict) or "prompt" not in line:
            raise ConfigError(f"--scripted {script}, line {n}: needs a 'prompt' (and 'turns')")
        if not isinstance(line.get("turns", []), list):
            raise ConfigError(f"--scripted {script}, line {n}: 'turns' must be a list of texts")
        lines.append(line)
    run = ScriptedRun(cfg)
    try:
        rows = asyncio.run(run.run(lines))
    finally:
        run.close()
    with open(output, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return rows


def scripted_rows(cfg: RunConfig, lines: Sequence[dict], **kwargs: Any) -> list[dict]:
    """The output rows of `lines` (tests: `tools` and `tokenizer` as `ScriptedRun` takes)."""
    run = ScriptedRun(cfg, **kwargs)
    try:
        return asyncio.run(run.run(lines))
    finally:
        run.close()
