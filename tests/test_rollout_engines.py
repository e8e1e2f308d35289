"""The RL loop on either engine (`rollout.engine`): `EngineCore`, or `engine.jetstream.
DecodeEngine`, the same engine as a JetStream `Engine` (the [serve] extra). The driver makes
only Engine-API calls (prefill, insert) and the named extensions the API lacks (N-step
generate with a pause mask and log-probs, the cache append of observations, park / unpark);
a scripted tool-calling run through the RL sampler gives the same trajectories, token for
token, on both engines."""

import asyncio

import pytest
from fakes import forced_engine
from jetstream.engine import engine_api

from jaxrl_tools.config import ConfigError, RolloutSection
from jaxrl_tools.config.rollout import ENGINES
from jaxrl_tools.engine.jetstream import DecodeEngine
from jaxrl_tools.rollout import EngineCore, RolloutLimits, Sampler, make_engine, run_rollouts
from jaxrl_tools.rollout.sampler import ENGINE_CLASSES
from jaxrl_tools.tools import ToolExecutor, function_tool

SCRIPT_LEN = 96


def _scripted_engine(name, tok_model, tok):
    """An engine of kind `name` whose samples think freely, call `slow`, think, and answer."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    call = enc('<tool_call>\n{"name": "slow", "arguments": {"x": 1}}\n</tool_call>')
    script = [-1] * 10 + call + [-1] * 8 + enc("Done.<|im_end|>")
    script += [script[-1]] * (SCRIPT_LEN - len(script))
    return forced_engine(tok_model, tok, script, engine_class=ENGINE_CLASSES[name]())


@function_tool
async def slow(x: int) -> str:
    """Takes its time (long enough that waiting samples are parked)."""
    await asyncio.sleep(0.2)
    return "ok"


SETTINGS = RolloutSection(
    protocol="qwen", max_prompt_len=512, max_response_len=200, max_tool_calls=1, chunk_size=8,
    slots=2, temperature=1.0, top_p=0.95,
)  # fmt: skip


def test_rollout_engine_setting_builds_that_engine(tok_model, tok):
    config, params = tok_model
    jet = make_engine(config, params, tok, RolloutSection(engine="jetstream", slots=2))
    assert isinstance(jet, DecodeEngine) and isinstance(jet, engine_api.Engine)
    core = make_engine(config, params, tok, RolloutSection(slots=2))
    assert type(core) is EngineCore and not isinstance(core, engine_api.Engine)
    with pytest.raises(
        ConfigError, match=r"rollout.engine='vllm' is not one of \['core', 'jetstream'\]"
    ):
        RolloutSection(engine="vllm")
    assert tuple(ENGINE_CLASSES) == ENGINES  # the config's names are the sampler's classes


def test_both_engines_give_the_same_trajectories_token_for_token(tok_model, tok):
    """6 samples on 2 slots through the RL sampler, sampled at temperature 1 between the forced
    tool call and answer, parked while the tool sleeps: the same tokens, log-probs, spans,
    tool records and scheduling on EngineCore and on the JetStream Engine."""
    _, params = tok_model
    runs = {}
    for name in ("core", "jetstream"):
        sampler = Sampler(
            _scripted_engine(name, tok_model, tok), tok, ToolExecutor([slow]), SETTINGS
        )
        records = [{"prompt": "Go."}, {"prompt": "Again."}]
        runs[name] = (sampler(records, 3, params, seed=5), sampler.take_metrics())
    (core, core_m), (jet, jet_m) = runs["core"], runs["jetstream"]
    assert core_m == jet_m and core_m["schedule/parks"] >= 2, core_m
    assert len({tuple(t.response_ids) for t in core}) == 6  # the free stretches differ
    for a, b in zip(core, jet, strict=True):
        assert a.finish_reason == b.finish_reason == "eos" and a.num_tool_calls == 1
        assert a.response_ids == b.response_ids and a.prompt_ids == b.prompt_ids
        assert a.loss_mask == b.loss_mask and a.spans == b.spans
        assert a.logprobs == b.logprobs  # the same kernels: bit for bit
        assert a.tool_calls[0].observation == b.tool_calls[0].observation == "ok"
        assert a.model_text == b.model_text


class _Recorder:
    """An engine that records which of its methods are called."""

    def __init__(self, engine):
        self._engine, self.calls = engine, set()

    def __getattr__(self, name):
        value = getattr(self._engine, name)
        if callable(value):
            self.calls.add(name)
        return value


def test_the_driver_makes_engine_api_calls_and_the_named_extensions(tok_model, tok):
    _, params = tok_model
    eng = _Recorder(_scripted_engine("jetstream", tok_model, tok))
    trajs = run_rollouts(
        eng,
        params,
        [[{"role": "user", "content": "Go."}]],
        tokenizer=tok,
        num_samples=4,
        protocol="qwen",
        executor=ToolExecutor([slow]),
        rng=1,
        limits=RolloutLimits(max_tool_calls=1, chunk_size=8, max_response_tokens=200),
    )
    assert all(t.finish_reason == "eos" for t in trajs)
    engine_api_calls = {"init_decode_state", "prefill", "insert"}
    extensions = {"generate_steps", "write_slots", "park", "unpark"}
    assert eng.calls == engine_api_calls | extensions, eng.calls
