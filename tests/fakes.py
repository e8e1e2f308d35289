"""Shared test fixtures that are plain functions: a tiny model and fixed trajectories.

Importable both by pytest (tests/ is on sys.path) and by test files run as scripts in a
subprocess (for 8 simulated devices).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxrl_tools.types import Span, Trajectory

VOCAB = 64

# The built-in advantage estimators, sorted: the registry's tests check it against this list, so
# a new estimator is added here too.
ESTIMATORS = [
    "drgrpo",
    "gae",
    "gigpo",
    "grpo",
    "kevin",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "turn_rloo",
    "vapo",
]

# The `model.tiny` section of the CLI and resume tests' run configs (hidden 32, 2 layers).
TINY_RUN_MODEL = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
}


def tiny_run_config(tmp: Path, name: str, reward: str | dict, **sections) -> dict:
    """The tiny RL run of the resume, multi-host and asynchronous-rollout tests, as a config
    dict: 2 tool_arithmetic prompts x 4 samples of the tiny Qwen2, GRPO without KL, the reward
    `reward` (a name, a "module:function" name or a whole `reward[]` entry), checkpoints and
    logs under tmp/name. `sections` update a section's keys (e.g. rollout={"protocol":
    "retool"}) or add a section (tools=[...])."""
    cfg = {
        "model": {"tiny": TINY_RUN_MODEL},
        "tokenizer": {"path": str(tmp / "tokenizer"), "vocab_size": 300},
        "data": {
            "task": "tool_arithmetic",
            "task_train_size": 64,
            "task_eval_size": 4,
            "task_difficulty": 1,
            "batch_size": 2,
            "shuffle_seed": 3,
        },
        "rollout": {
            "group_size": 4,
            "max_prompt_len": 96,  # prompts of this tokenizer are ~60-80 tokens
            "chunk_size": 8,
            "slots": 8,
        },
        "algorithm": {"adv_estimator": "grpo", "kl_coef": 0.0},
        "reward": [reward if isinstance(reward, dict) else {"name": reward}],
        "optim": {"lr": 1e-3, "micro_batch_size": 4, "weight_decay": 0.0},
        "trainer": {
            "seed": 5,
            "checkpoint_dir": str(tmp / name / "ckpt"),
            "keep_checkpoints": 3,
            "resume": True,
            "log_dir": str(tmp / name / "logs"),
            "run_name": name,
        },
    }
    for section, value in sections.items():
        cfg[section] = {**cfg.get(section, {}), **value} if isinstance(value, dict) else value
    return cfg


# LLVM -O0: the tiny programs of a subprocess run compile in about 2/3 of the time. Only for
# runs whose every parity is against a run compiled alike (-O0 drops fused multiply-adds).
FAST_COMPILE = "--xla_backend_optimization_level=0"


def run_on_8_devices(script: str, out_dir: Path, timeout: int, xla_flags: str = "") -> dict:
    """Runs `python script out_dir` on 8 simulated CPU devices (with `xla_flags` added); returns
    its out_dir/report.json."""
    env = dict(os.environ)
    flags = f"{env.get('XLA_FLAGS', '')} {xla_flags} --xla_force_host_platform_device_count=8"
    env["XLA_FLAGS"] = flags.strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, script, str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out_dir / "report.json").read_text())


def tiny_model_config(
    intermediate_size: int = 64, *, vocab_size: int = VOCAB, attention_bias: bool = True, **kw
):
    """Qwen2, 2 layers, hidden 32, 4 heads / 2 kv heads, tied: divides the 2x2x2 and 1x4x2
    meshes under DEFAULT_RULES. `kw`: other ModelConfig fields (a tokenizer's eos and pad)."""
    from jaxrl_tools import models

    return models.ModelConfig(
        model_type="qwen2",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        attention_bias=attention_bias,
        **kw,
    )


def tiny_hf_model(folder: Path, kind: str, *, seed: int = 0, vocab_size: int = 96):
    """A random transformers model of `kind` ("qwen2" with tied embeddings, "qwen3", "llama"):
    2 layers, hidden 32, no eos, with weights bigger than the default 0.02 init (fewer tied
    argmaxes), saved to folder/kind; (torch model, our config, our params) read back from it."""
    import torch
    import transformers

    from jaxrl_tools import models

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    config = {
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16),
        "llama": lambda: transformers.LlamaConfig(**common),
    }[kind]()
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    hf.eval()
    hf.save_pretrained(folder / kind)
    return (hf, *models.from_pretrained(folder / kind))


def hf_greedy(hf, prompts: list[list[int]], n: int, eos: int | None = None) -> list[list[int]]:
    """transformers' greedy continuations of `prompts` (left-padded into one batch): n tokens
    each, or fewer up to and including `eos`."""
    import torch

    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p)
        mask[i, T - len(p) :] = 1
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=eos,
        )
    rows = out[:, T:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def fixed_trajectories(seed: int = 0) -> list[Trajectory]:
    """Two groups of four; in each, responses 0 and 1 are 'correct' (text with the answer 7)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(2):
        prompt = list(rng.integers(3, VOCAB, size=5 + g))
        for j in range(4):
            n = 6 + j
            resp = list(rng.integers(3, VOCAB, size=n))
            mask = [1] * n
            mask[2] = mask[3] = 0  # an observation inside the response
            text = "\\boxed{7}" if j < 2 else "\\boxed{8}"
            spans = [Span("model", 0, 2), Span("observation", 2, 4), Span("model", 4, n)]
            out.append(
                Trajectory(
                    g, j, prompt, resp, mask, [0.0] * n, spans, response_text=text, model_text=text
                )
            )
    return out


# The records of `fixed_trajectories`' two groups: the answer is 7.
FIXED_RECORDS = [{"prompt": "q", "ground_truth": "7"}] * 2


def fixed_batch(cfg, rows: int, trajectories=None, *, group_size: int = 4):
    """The `Batch` a run makes of `trajectories` (default `fixed_trajectories()`) sampled for
    FIXED_RECORDS: scored by cfg's reward, kept by its filters, padded into `rows` rows."""
    from jaxrl_tools import run
    from jaxrl_tools.train.batch import make_batch

    return make_batch(
        FIXED_RECORDS,
        fixed_trajectories() if trajectories is None else trajectories,
        run.make_reward(cfg),
        cfg.algorithm.filters,
        group_size=group_size,
        rows=rows,
        pad_id=0,
    )


def wait_until(pred, timeout=3.0) -> bool:
    """Polls `pred` every 50 ms until it holds or `timeout` seconds pass; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def free_or_forced_hook(logits_BV, sampled_B, seq_B, data):
    """logits_hook: forces `script_K` where it is >= 0 (indexed by tokens sampled so far);
    elsewhere the model samples freely, without the added tokens `added_V` (no stray end or
    tool tags). One function for every test file: they share its compile."""
    script_K, added_V = data
    want_B = script_K[jnp.minimum(sampled_B, script_K.shape[0] - 1)]
    forced_BV = jnp.where(jnp.arange(logits_BV.shape[-1])[None] == want_B[:, None], 0.0, -1e9)
    free_BV = jnp.where(added_V[None], -1e9, logits_BV)
    return jnp.where((want_B >= 0)[:, None], forced_BV, free_BV)


def added_tokens(tok, vocab_size: int) -> np.ndarray:
    """[vocab_size] bool: True at the tokenizer's added (special) tokens."""
    added = np.zeros((vocab_size,), bool)
    added[list(tok.get_added_vocab().values())] = True
    return added


def forced_engine(tok_model, tok, script, *, slots: int = 2, engine_class=None):
    """An engine (`EngineCore` unless `engine_class`) on the tiny model `tok_model` = (config,
    params) with `free_or_forced_hook`: `script`'s tokens forced where they are >= 0, the model's
    own tokens elsewhere; 768 tokens of context, prompts of up to 512."""
    from jaxrl_tools.engine.core import EngineCore

    config, params = tok_model
    added = added_tokens(tok, config.vocab_size)
    return (engine_class or EngineCore)(
        config,
        params,
        slots=slots,
        max_len=768,
        max_prefill_length=512,
        tokenizer=tok,
        logits_hook=free_or_forced_hook,
        hook_data=(jnp.asarray(script, jnp.int32), jnp.asarray(added)),
    )
