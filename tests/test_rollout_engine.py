"""Decode engine: HF greedy parity (Qwen2, Qwen3, Llama), append == full forward, slots,
JetStream Engine API and its orchestrator."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from fakes import hf_greedy, tiny_hf_model

from jaxrl_tools import models
from jaxrl_tools.engine.sampling import GREEDY, SamplingParams
from jaxrl_tools.rollout import EngineCore
from jaxrl_tools.shapes import next_pow2

VOCAB = 96
_forward = jax.jit(models.forward, static_argnums=0)


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "llama"])
def model(request, tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("m"), request.param)


PROMPTS = [[5, 17, 33, 2, 9, 41, 12], [7, 3], [11, 64, 25, 18, 90, 4, 31, 56, 77, 20, 13]]


def test_greedy_matches_hf_generate(model):
    hf, config, params = model
    n = 12
    ref = hf_greedy(hf, PROMPTS, n)
    eng = EngineCore(config, params, slots=4, max_len=64, max_prefill_length=16, sampling=GREEDY)
    state = eng.init_decode_state()
    # slot 0 stays empty: inactive slots must not disturb the others
    for slot, p in zip([1, 2, 3], PROMPTS):
        prefix = eng.prefill(params=params, padded_tokens=np.array(p), true_length=len(p))
        state = eng.insert(prefix, state, slot)
    outs = []
    for _ in range(n // 4):
        state, out = eng.generate_steps(params, state, 4)
        outs.append(out)
    out1 = outs[0]
    toks = np.concatenate([np.asarray(o.tokens) for o in outs], axis=1)
    np.testing.assert_array_equal(toks[1:], ref)
    assert not np.asarray(out1.valid)[0].any() and np.asarray(out1.valid)[1:].all()
    lengths = np.asarray(state.lengths)
    assert lengths[0] == 0 and list(lengths[1:]) == [len(p) + n for p in PROMPTS]


def test_prefill_generate_append_generate_equals_full_forward(model):
    _, config, params = model
    eng = EngineCore(config, params, slots=4, max_len=64, max_prefill_length=16, sampling=GREEDY)
    state = eng.init_decode_state()
    prompt = [3, 14, 15, 92, 65, 35]
    state = eng.insert(
        eng.prefill(
            params=params, padded_tokens=np.array(prompt + [0, 0]), true_length=len(prompt)
        ),
        state,
        1,
    )
    state, out1 = eng.generate_steps(params, state, 4)
    gen1 = list(np.asarray(out1.tokens)[1])
    obs = [8, 9, 10, 11, 12]
    state = eng.append(params, state, 1, obs, start=len(prompt) + 4, sampled=4)
    state, out2 = eng.generate_steps(params, state, 4)
    gen2 = list(np.asarray(out2.tokens)[1])
    full = prompt + gen1 + obs + gen2
    logits = _forward(config, params, jnp.asarray([full]))[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    # pending logits after the whole sequence == full forward's last logits
    np.testing.assert_allclose(np.asarray(state.logits)[1], np.asarray(logits[-1]), atol=1e-4)
    # every sampled token's log-prob == the full forward's at the previous position
    pos1 = [len(prompt) - 1 + i for i in range(4)]
    pos2 = [len(prompt) + 4 + len(obs) - 1 + i for i in range(4)]
    ref = [float(logp[p, t]) for p, t in zip(pos1 + pos2, gen1 + gen2)]
    got = list(np.asarray(out1.logprobs)[1]) + list(np.asarray(out2.logprobs)[1])
    np.testing.assert_allclose(got, ref, atol=1e-4)
    # greedy: each token is the argmax of the full forward
    assert [int(jnp.argmax(logits[p])) for p in pos1 + pos2] == gen1 + gen2
    assert int(state.lengths[1]) == len(full)


def test_existing_prefix_and_write_slots_equal_plain_prefill(jet_model):
    _, config, params = jet_model
    eng = EngineCore(config, params, slots=4, max_len=64, max_prefill_length=16, sampling=GREEDY)
    a, b = [4, 8, 15, 16], [23, 42, 7, 1, 5, 6, 2]
    whole = eng.prefill(params=params, padded_tokens=np.array(a + b), true_length=len(a + b))
    first = eng.prefill(params=params, padded_tokens=np.array(a), true_length=len(a))
    chained = eng.prefill(
        params=params, existing_prefix=first, padded_tokens=np.array(b), true_length=len(b)
    )
    assert int(chained.length) == len(a + b)
    np.testing.assert_allclose(np.asarray(chained.logits), np.asarray(whole.logits), atol=1e-4)
    # the batched write path (prompt loading for the rollout loop) gives the same logits
    state = eng.init_decode_state()
    key = jax.random.PRNGKey(0)
    state = eng.write_slots(
        params, state, [2, 0], [a + b, a], starts=[0, 0], reset=[(key, GREEDY), (key, GREEDY)]
    )
    np.testing.assert_allclose(np.asarray(state.logits)[2], np.asarray(whole.logits), atol=1e-4)
    np.testing.assert_allclose(np.asarray(state.logits)[0], np.asarray(first.logits), atol=1e-4)
    assert list(np.asarray(state.active)) == [True, False, True, False]


def test_paused_slots_do_not_advance_and_sampling_is_per_slot(jet_model):
    _, config, params = jet_model
    eng = EngineCore(config, params, slots=4, max_len=64, max_prefill_length=16)
    state = eng.init_decode_state()
    sp = SamplingParams(temperature=1.0, top_k=5)
    key = jax.random.PRNGKey(3)
    # the same prompt and key in slots 0 and 3: identical samples whatever the other slots do
    state = eng.write_slots(
        params,
        state,
        [0, 1, 3],
        [[1, 2, 3]] * 3,
        starts=[0, 0, 0],
        reset=[(key, sp), (jax.random.PRNGKey(4), sp), (key, sp)],
    )
    state, o1 = eng.generate_steps(params, state, 4, active=np.array([1, 1, 0, 1], bool))
    snap = jax.tree.map(np.asarray, state)
    state, o2 = eng.generate_steps(params, state, 4, active=np.array([1, 0, 0, 1], bool))
    assert not np.asarray(o2.valid)[1].any()
    assert int(state.lengths[1]) == snap.lengths[1] == 7
    np.testing.assert_array_equal(np.asarray(state.keys)[1], snap.keys[1])
    np.testing.assert_array_equal(np.asarray(state.cache.k)[:, 1], snap.cache.k[:, 1])
    np.testing.assert_array_equal(np.asarray(o1.tokens)[0], np.asarray(o1.tokens)[3])
    np.testing.assert_array_equal(np.asarray(o2.tokens)[0], np.asarray(o2.tokens)[3])


def test_decode_state_sharded_on_mesh(jet_model):
    from jaxrl_tools.sharding import make_mesh

    _, config, params = jet_model
    mesh = make_mesh((1, 1, 1))
    eng = EngineCore(
        config, params, slots=4, max_len=64, max_prefill_length=16, mesh=mesh, sampling=GREEDY
    )
    state = eng.init_decode_state()
    assert state.cache.k.sharding.mesh.shape == mesh.shape
    state = eng.insert(
        eng.prefill(params=params, padded_tokens=np.array([1, 2, 3]), true_length=3), state, 0
    )
    state, out = eng.generate_steps(params, state, 4)
    plain = EngineCore(config, params, slots=4, max_len=64, max_prefill_length=16, sampling=GREEDY)
    st2 = plain.insert(
        plain.prefill(params=params, padded_tokens=np.array([1, 2, 3]), true_length=3),
        plain.init_decode_state(),
        0,
    )
    _, out2 = plain.generate_steps(params, st2, 4)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(out2.tokens))


def test_write_slots_errors_name_the_slot(jet_model):
    _, config, params = jet_model
    eng = EngineCore(config, params, slots=4, max_len=64, max_prefill_length=16)
    state = eng.init_decode_state()
    with pytest.raises(ValueError, match="slot 1"):
        eng.write_slots(params, state, [1], [[1] * 10], starts=[60])
    with pytest.raises(ValueError, match="max_prefill_length"):
        EngineCore(config, params, max_prefill_length=24)
    assert next_pow2(17, 16) == 32 and next_pow2(3, 16) == 16


def test_live_length_decode_equals_whole_row_decode_token_for_token(jet_model):
    # The same rollout on an engine whose steps read whole max_len rows (the engine before
    # live-length attention) and on the default one, which reads a power-of-two bucket above the
    # longest live row: sampled tokens identical, log-probs and pending logits equal to 1e-5,
    # across bucket boundaries (16 -> 32 -> 64), an appended observation and a paused slot.
    _, config, params = jet_model
    sp = SamplingParams(temperature=1.0)
    runs = []
    for live in (True, False):
        eng = EngineCore(
            config, params, slots=4, max_len=128, max_prefill_length=16, live_attention=live
        )
        state = eng.init_decode_state()
        state = eng.write_slots(
            params,
            state,
            [0, 2, 3],
            PROMPTS,
            starts=[0, 0, 0],
            reset=[(jax.random.PRNGKey(i), sp) for i in range(3)],
        )
        outs = []
        for k in range(5):
            active = np.array([1, 0, 1, k != 1], bool)  # slot 3 paused once
            state, out = eng.generate_steps(params, state, 8, active=active)
            outs.append(out)
            if k == 2:
                n = int(state.lengths[2])
                state = eng.append(params, state, 2, [8, 9, 10, 11, 12], start=n, sampled=n)
        tokens = np.concatenate([np.asarray(o.tokens) for o in outs], axis=1)
        logps = np.concatenate([np.asarray(o.logprobs) for o in outs], axis=1)
        runs.append((tokens, logps, np.asarray(state.logits), np.asarray(state.lengths)))
    (tok_live, lp_live, logits_live, len_live), (tok_full, lp_full, logits_full, len_full) = runs
    assert int(len_live.max()) > 32  # the last steps read the 64 bucket, the first ones 16
    np.testing.assert_array_equal(tok_live, tok_full)
    np.testing.assert_array_equal(len_live, len_full)
    np.testing.assert_allclose(lp_live, lp_full, atol=1e-5)
    np.testing.assert_allclose(logits_live, logits_full, atol=1e-5)


def test_parked_row_decodes_on_in_another_slot_as_if_it_had_stayed(jet_model):
    # The rollout loop parks a trajectory waiting on a tool and brings it back in whichever slot
    # frees first: its sampled tokens, log-probs and counters must not notice.
    _, config, params = jet_model
    sp = SamplingParams(temperature=1.0)
    obs = [8, 9, 10, 11, 12]

    def start():
        eng = EngineCore(config, params, slots=4, max_len=128, max_prefill_length=16)
        state = eng.write_slots(
            params,
            eng.init_decode_state(),
            [0, 1],
            [PROMPTS[2], PROMPTS[1]],
            starts=[0, 0],
            reset=[(jax.random.PRNGKey(7), sp), (jax.random.PRNGKey(8), sp)],
            seq_ids=[40, 41],
        )
        state, _ = eng.generate_steps(params, state, 8, active=np.array([1, 1, 0, 0], bool))
        return eng, state

    eng, state = start()  # uninterrupted: slot 0 gets an observation and decodes on
    state = eng.append(params, state, 0, obs, start=19, sampled=8)
    state, ref = eng.generate_steps(params, state, 16, active=np.array([1, 1, 0, 0], bool))

    eng, state = start()
    parked = eng.park(state, 0, 19)  # 19 positions: a 32-position row leaves the engine
    state = eng.write_slots(  # another sample decodes in slot 0 meanwhile
        params, state, [0], [PROMPTS[0]], starts=[0], reset=[(jax.random.PRNGKey(9), sp)]
    )
    state, _ = eng.generate_steps(params, state, 8, active=np.array([1, 1, 0, 0], bool))
    state = eng.unpark(state, 3, parked)
    assert int(state.seq[3]) == 40 and int(state.sampled[3]) == 8 and int(state.seq[0]) == 0
    state = eng.append(params, state, 3, obs, start=19, sampled=8)
    state, out = eng.generate_steps(params, state, 16, active=np.array([1, 1, 0, 1], bool))
    np.testing.assert_array_equal(np.asarray(out.tokens)[3], np.asarray(ref.tokens)[0])
    np.testing.assert_allclose(np.asarray(out.logprobs)[3], np.asarray(ref.logprobs)[0], atol=1e-5)


@pytest.fixture(scope="module")
def jet_model(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("jet"), "qwen2", seed=1)


def test_jetstream_engine_api(jet_model):
    from jetstream.engine import engine_api

    from jaxrl_tools.engine.jetstream import DecodeEngine, HFTokenizer

    _, config, params = jet_model
    eng = DecodeEngine(
        config,
        params,
        slots=4,
        max_len=64,
        max_prefill_length=16,
        sampling=GREEDY,
        steps_per_generate=4,
    )
    assert isinstance(eng, engine_api.Engine)
    assert eng.max_concurrent_decodes == 4 and eng.samples_per_slot == 1
    assert eng.max_prefill_length == 16 and eng.load_params() is params
    state = eng.init_decode_state()
    prefix = eng.prefill(params=params, padded_tokens=jnp.array([5, 6, 7, 0]), true_length=3)
    state = eng.insert(prefix, state, 1)
    state, res = eng.generate(params, state)
    res = res.convert_to_numpy()
    slot = res.get_result_at_slot(1)
    assert slot.tokens.shape == (1, 4) and slot.valid.all() and slot.lengths[0] == 4
    assert not res.get_result_at_slot(0).valid.any()
    assert HFTokenizer.__mro__[1].__name__ == "Tokenizer"


def test_jetstream_orchestrator_serves_the_engine(jet_model, tmp_path):
    from jaxrl_tools.engine.jetstream import DecodeEngine, import_orchestrator

    orchestrator = import_orchestrator()
    from jetstream.core.utils import async_multifuture

    _, config, params = jet_model
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_byte_tokenizer(), eos_token="<eos>", pad_token="<pad>"
    )
    # Stop ids: none the random model emits. 2 tokens per generate call (N-token steps).
    eng = DecodeEngine(
        config,
        params,
        slots=4,
        max_len=64,
        max_prefill_length=16,
        sampling=GREEDY,
        tokenizer=tok,
        eos_token_ids=[VOCAB + 5],
        steps_per_generate=2,
    )
    prompt = [5, 17, 33, 2, 9]
    n_check = 8
    # direct engine call
    state = eng.init_decode_state()
    state = eng.insert(
        eng.prefill(params=params, padded_tokens=np.array(prompt), true_length=len(prompt)),
        state,
        0,
    )
    direct = []
    for _ in range(n_check // 4):
        state, out = eng.generate_steps(params, state, 4)
        direct += np.asarray(out.tokens)[0].tolist()

    driver = orchestrator.Driver(
        prefill_engines=[eng],
        generate_engines=[eng],
        prefill_params=[params],
        generate_params=[params],
    )

    async def serve():
        channel = async_multifuture.AsyncMultifuture()  # needs the running loop
        # history_path set: no BOS (Qwen has none); ids as an array (pad_tokens needs .shape).
        request = orchestrator.ActiveRequest(
            max_tokens=1000,
            return_channel=channel,
            prefill_content=np.array(prompt),
            history_path="none",
            is_client_side_tokenization=True,
        )
        driver.place_request_on_prefill_queue(request)
        toks = []
        async for samples in channel:
            toks.extend(samples[0].token_ids)
            if len(toks) >= n_check:
                break
        # Stop while the request is live and the loop still runs: JetStream 0.2.2's generate
        # thread asserts if every slot is free at the wrong moment, and its detokenize thread
        # posts results to this loop (a closed loop would kill the process).
        driver.stop()
        return toks

    served = asyncio.run(asyncio.wait_for(serve(), timeout=60))
    assert served[:n_check] == direct


def _byte_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers import models as tmodels

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"<eos>": VOCAB + 5, "<pad>": VOCAB + 6})
    return Tokenizer(tmodels.WordLevel(vocab, unk_token="t0"))
