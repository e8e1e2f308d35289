"""GGUF in and out on tiny random Llama / Qwen2 / Qwen3 models (no download).

In: a GGUF written by an independent writer here (gguf's own tensor-name table, llama.cpp's q/k
permutation, a dozen tensor types including K-quants) -> `prepare gguf` -> an HF folder whose
weights are exactly transformers' dequantisation of the same file, whose tokenizer and chat
template are transformers', and whose logits are transformers'. Out: `save_gguf` in F16, BF16 and
Q8_0 -> transformers' GGUF loader reads back exactly the rounded weights, the same tokenizer, the
same logits; `export --format gguf-*` of a trained checkpoint too. Bad files: one line each,
nothing written.
"""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml
from fakes import tiny_run_config

from jaxrl_tools import models, run
from jaxrl_tools.cli import main
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.models import gguf_io, gguf_vocab
from jaxrl_tools.tasks.tokenizer import build_tokenizer

Q = gguf.GGMLQuantizationType
# Every 2-D tensor of the file gets the next of these (K-quants: random valid blocks).
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16, Q.F32]
TYPES += [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of the float16 scales in one K-quant block (the rest may be any bytes).
_K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}
VOCAB = 336  # the tokenizer has 320: the rest are unused padding ids, as in Qwen's checkpoints
_forward = jax.jit(models.forward, static_argnums=0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "t", vocab_size=320)


def _hf_model(kind: str, seed: int = 0):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=256,  # a whole K-quant block per row
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(
            **common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
        )
    elif kind == "qwen3":  # transformers' GGUF loader takes Qwen3's head_dim as 128
        cfg = transformers.Qwen3Config(
            **common, num_attention_heads=2, num_key_value_heads=1, head_dim=128
        )
    else:
        cfg = transformers.LlamaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0
        )
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # larger than the default init: quantisation error shows
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return hf


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute, as written there."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _encode(w: np.ndarray, qtype, rng) -> np.ndarray:
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype not in _K_SCALES and qtype != Q.Q8_K:
        return gguf.quantize(w.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
    for at in _K_SCALES.get(qtype, ()):
        scale = rng.uniform(0.001, 0.01, raw.shape[:2]).astype(np.float16)
        raw[:, :, at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(w.shape[0], -1)


def write_llama_cpp_style(hf, kind: str, tokenizer, path, types=TYPES, arch=None) -> None:
    """A GGUF as llama.cpp's converter lays it out, with gguf's own writer and name table."""
    c = hf.config
    n_layers = c.num_hidden_layers
    names = gguf.get_tensor_name_map(_ARCH[kind], n_layers)
    w = gguf.GGUFWriter(str(path), arch or kind)
    w.add_block_count(n_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    if kind == "llama":
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    if kind == "qwen3":
        w.add_key_length(c.head_dim)
    gguf_vocab.add_tokenizer(w, tokenizer, VOCAB)
    rng = np.random.default_rng(0)
    k = 0
    for hf_name, p in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base) + "." + suffix
        data = p.numpy()
        if kind == "llama" and ".q_proj." in hf_name:
            data = _llama_cpp_permute(data, c.num_attention_heads)
        if kind == "llama" and ".k_proj." in hf_name:
            data = _llama_cpp_permute(data, c.num_key_value_heads)
        if data.ndim == 1:
            w.add_tensor(name, data.astype(np.float32))
            continue
        qtype = types[k % len(types)]
        k += 1
        encoded = _encode(data, qtype, rng)
        w.add_tensor(name, encoded, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_from_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


IDS = [5, 17, 33, 2, 9, 41, 12, 250, 319, 100, 7, 64]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_prepare_gguf_equals_transformers_dequantisation(kind, tokenizer, tmp_path, capsys):
    hf = _hf_model(kind)
    src = tmp_path / f"{kind}.gguf"
    write_llama_cpp_style(hf, kind, tokenizer, src)
    out = tmp_path / "hf"
    assert main(["prepare", "gguf", "--input", str(src), "--output", str(out)]) == 0
    assert f"wrote {kind} (2 layers, vocab {VOCAB})" in capsys.readouterr().out

    ref = _hf_from_gguf(src)
    mine = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want, got = ref.state_dict(), mine.state_dict()
    assert set(want) == set(got)
    for name in want:  # bit for bit: the same dequantisation and the same un-permutation
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    # ... which differ from the torch model's weights (quantised), but not past quantisation
    assert max(float((want[n] - p).abs().max()) for n, p in hf.state_dict().items()) > 1e-3

    config, params = models.from_pretrained(out)
    assert config.model_type == kind and config.vocab_size == VOCAB
    np.testing.assert_allclose(
        np.asarray(_forward(config, params, jnp.asarray([IDS]))[0]), _logits(ref, IDS), atol=1e-4
    )

    # the tokenizer and chat template are transformers' reading of the file
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=src.name)
    ours = transformers.AutoTokenizer.from_pretrained(str(out))
    chat = [
        {"role": "user", "content": "What is 12*7? Use <tool_call> if you must."},
        {"role": "assistant", "content": "<tool_call>\nprint(12*7)\n</tool_call>"},
        {"role": "tool", "content": "84"},
    ]
    for kwargs in ({}, {"add_generation_prompt": True}):
        text = ours.apply_chat_template(chat, tokenize=False, **kwargs)
        assert text == theirs.apply_chat_template(chat, tokenize=False, **kwargs)
        assert ours.encode(text) == theirs.encode(text) == tokenizer.encode(text)
    assert ours.chat_template == tokenizer.chat_template
    assert (ours.eos_token, ours.pad_token) == (tokenizer.eos_token, tokenizer.pad_token)
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == tokenizer.chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def _rounded(hf, dtype: str) -> dict[str, torch.Tensor]:
    """The weights a GGUF of `dtype` holds: matrices rounded (Q8_0: quantised and back), vectors
    in float32, as `save_gguf` writes them."""
    out = {}
    for name, p in hf.state_dict().items():
        w = p.numpy().astype(np.float32)
        if w.ndim == 2 and dtype == "f16":
            w = w.astype(np.float16).astype(np.float32)
        elif w.ndim == 2:
            qtype = {"bf16": Q.BF16, "q8_0": Q.Q8_0}[dtype]
            w = gguf.dequantize(gguf.quantize(w, qtype), qtype)
        out[name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_save_gguf_reads_back_in_transformers(kind, dtype, tokenizer, tmp_path):
    hf = _hf_model(kind, seed=1)
    hf.save_pretrained(tmp_path / "src")
    config, params = models.from_pretrained(tmp_path / "src")
    path = tmp_path / f"out-{dtype}.gguf"
    gguf_io.save_gguf(config, params, tokenizer, path, dtype)

    back = _hf_from_gguf(path)
    want, got = _rounded(hf, dtype), back.state_dict()
    for name in want:  # exactly the rounded weights (Llama's q/k permuted there and back)
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert back.config.eos_token_id == 2 and back.config.vocab_size == VOCAB

    # the same logits as our model on the rounded weights, and near the unrounded model's
    hf.load_state_dict(want)
    ref = _logits(back, IDS)
    np.testing.assert_allclose(_logits(hf, IDS), ref, atol=1e-5)
    full = np.asarray(_forward(config, params, jnp.asarray([IDS]))[0])
    err = float(np.abs(full - ref).max() / np.abs(ref).max())  # relative to the largest logit
    print(f"{kind} {dtype}: max |logit error| / max |logit| = {err:.2e}")
    assert err < {"f16": 5e-3, "bf16": 5e-2, "q8_0": 5e-2}[dtype], err

    # our reader gives the same weights and config back
    gguf_io.gguf_to_hf(path, tmp_path / "again")
    assert models.load_config(tmp_path / "again") == config
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").state_dict()
    for name in want:
        torch.testing.assert_close(again[name], want[name], rtol=0, atol=0, msg=name)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    chat = [{"role": "user", "content": "Compute 3+4 with the tool."}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == text
    assert theirs.encode(text) == tokenizer.encode(text)


def _prepare(src, out, capsys) -> str:
    assert main(["prepare", "gguf", "--input", str(src), "--output", str(out)]) == 2
    # (other lines: logging of earlier tests' writers into streams pytest has closed)
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("jaxrl-tools:")]
    assert len(errors) == 1, errors
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    return errors[0]


def test_bad_gguf_files_are_one_line_errors_and_write_nothing(tokenizer, tmp_path, capsys):
    hf = _hf_model("llama")
    good = tmp_path / "good.gguf"
    write_llama_cpp_style(hf, "llama", tokenizer, good, types=[Q.Q8_0])
    out = tmp_path / "out"

    (tmp_path / "model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b'{"a": 1}')
    assert "not a GGUF file" in _prepare(tmp_path / "model.safetensors", out, capsys)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "cut.gguf: truncated" in _prepare(cut, out, capsys)
    cut.write_bytes(good.read_bytes()[:1000])  # inside the metadata
    assert "cut.gguf: truncated or corrupt" in _prepare(cut, out, capsys)

    other = tmp_path / "gpt2.gguf"
    write_llama_cpp_style(hf, "llama", tokenizer, other, types=[Q.F16], arch="gpt2")
    assert "architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3" in _prepare(
        other, out, capsys
    )

    q8k = tmp_path / "q8k.gguf"  # a type gguf cannot dequantise (llama.cpp's internal Q8_K)
    write_llama_cpp_style(hf, "llama", tokenizer, q8k, types=[Q.F16, Q.Q8_K])
    err = _prepare(q8k, out, capsys)
    assert "has type Q8_K, which the gguf library cannot dequantise" in err and "blk.0" in err
    assert "missing" in _prepare_missing(tmp_path, hf, tokenizer, out, capsys)


def _prepare_missing(tmp_path, hf, tokenizer, out, capsys):
    """A file without one of the layer's tensors."""
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]

    class Partial:
        config = hf.config

        def state_dict(self):
            return sd

    path = tmp_path / "partial.gguf"
    write_llama_cpp_style(Partial(), "llama", tokenizer, path, types=[Q.F16])
    return _prepare(path, out, capsys)


def test_without_the_gguf_package_the_error_says_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + b"\0" * 64)
    err = _prepare(tmp_path / "m.gguf", tmp_path / "out", capsys)
    assert "pip install 'jaxrl-tools[gguf]'" in err


def test_prepare_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert main(["prepare", "gguf", "--input", "x.gguf", "--output", str(tmp_path / "out")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step tiny RL run (the tiny Qwen2, no tools): its config file."""
    d = tmp_path_factory.mktemp("run")
    cfg = tiny_run_config(
        d,
        "gguf",
        "math",
        trainer={"steps": 1, "resume": False},
        rollout={"max_response_len": 16, "protocol": "none"},
    )
    path = d / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(path)]) == 0
    return path


@pytest.mark.parametrize("fmt", ["gguf-f16", "gguf-q8_0"])
def test_export_gguf_reads_back_in_transformers(trained, fmt, capsys):
    """`export --format gguf-*`: one file that transformers' GGUF loader reads to the checkpoint's
    logits (the tiny model's 32-wide rows are not whole Q8_0 blocks: F16, as llama.cpp does)."""
    out = trained.parent / f"policy-{fmt}.gguf"
    assert main(["export", "--config", str(trained), "--out", str(out), "--format", fmt]) == 0
    back = _hf_from_gguf(out)
    model_cfg, params, tokenizer, _ = run.restore_policy(load_config(trained))
    ids = tokenizer.encode("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    ours = np.asarray(_forward(model_cfg, params, jnp.asarray([ids]))[0])
    np.testing.assert_allclose(_logits(back, ids), ours, atol=1e-2 * np.abs(ours).max())
    theirs = transformers.AutoTokenizer.from_pretrained(str(out.parent), gguf_file=out.name)
    assert theirs.encode("What is 2+3?") == tokenizer.encode("What is 2+3?")
    assert theirs.chat_template == tokenizer.chat_template
    # an existing file or another suffix: one line, nothing written
    for bad in (out, trained.parent / "policy.bin"):
        assert main(["export", "--config", str(trained), "--out", str(bad), "--format", fmt]) == 2
        assert "must be a new file named *.gguf" in capsys.readouterr().err
    assert not (trained.parent / "policy.bin").exists()


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {  # Llama 3.x's: llama.cpp keeps only a rope_freqs tensor of the divisors
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_scaling_round_trips(scaling, tokenizer, tmp_path):
    hf = _hf_model("llama")
    hf.config.rope_parameters = {"rope_theta": 500000.0, **scaling}
    hf.save_pretrained(tmp_path / "src")
    config, params = models.from_pretrained(tmp_path / "src")
    assert config.rope_type == scaling["rope_type"]
    gguf_io.save_gguf(config, params, tokenizer, tmp_path / "m.gguf", "f32")
    gguf_io.gguf_to_hf(tmp_path / "m.gguf", tmp_path / "back", with_tokenizer=False)
    back, params2 = models.from_pretrained(tmp_path / "back")
    assert back == config
    np.testing.assert_array_equal(
        np.asarray(_forward(back, params2, jnp.asarray([IDS]))[0]),
        np.asarray(_forward(config, params, jnp.asarray([IDS]))[0]),
    )
