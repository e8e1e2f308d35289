"""`--smoke`: a recipe shrunk to run on a laptop CPU in about a minute, to find its mistakes.

    cfg = smoke_config(load_config("configs/retool.yaml"))

The same data, tools, rewards, protocol and algorithm; a tiny random model of the recipe's
family (`model_type` from `model.path`'s config.json when there is one); the model's own
tokenizer when its folder is there, else a small one built in the run folder; 2 RL steps of 2
prompts, a short SFT stage and short evaluations; one device; every output under
`runs/smoke/<run_name>`, never in the recipe's own folders. The command line's overrides win
over these (`smoke_config(cfg, overrides)`): a multi-process smoke run sets `trainer.mesh`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from jaxrl_tools import models, records, sharding
from jaxrl_tools.config import ConfigError, RunConfig, TinyModelConfig
from jaxrl_tools.config_loader import apply_overrides
from jaxrl_tools.tasks.tokenizer import build_mismatch

log = logging.getLogger(__name__)

SMOKE_ROOT = Path("runs/smoke")
STEPS = 2
PROMPTS = 2  # per RL step
EVAL_RECORDS = 4
SFT_TRACES = 16
MAX_RESPONSE_LEN = 64
TOKENIZER_VOCAB = 512


def smoke_dir(cfg: RunConfig) -> Path:
    """Where a smoke run of `cfg` (the recipe, before `smoke_config`) writes."""
    return SMOKE_ROOT / cfg.trainer.run_name


def _family(cfg: RunConfig) -> tuple[str, dict]:
    """(model_type, what of the real model's config.json the tiny one keeps)."""
    if cfg.model.path is None:
        return cfg.model.tiny.model_type, {}
    config_json = Path(cfg.model.path) / "config.json"
    if config_json.is_file():
        try:
            hf = json.loads(config_json.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{config_json}: not valid JSON ({e})") from None
        model_type = hf.get("model_type")
        if model_type not in models.SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{config_json}: model_type {model_type!r} is not supported; supported: "
                f"{', '.join(models.SUPPORTED_MODEL_TYPES)}"
            )
        keep = {k: hf[k] for k in ("tie_word_embeddings", "rope_theta") if hf.get(k) is not None}
        return model_type, keep
    # No folder yet (a recipe for a model not downloaded): the family from its name.
    name = Path(cfg.model.path).name.lower()
    llama = "llama" in name or "smollm" in name
    return ("qwen3" if "qwen3" in name else "llama" if llama else "qwen2"), {}


def smoke_config(cfg: RunConfig, overrides: Sequence[str] = ()) -> RunConfig:
    """The smoke-test version of a run config (pure: reads `model.path`'s config.json and
    tokenizer folder if they exist, writes nothing).

    Args:
      cfg: the recipe, with the command line's overrides.
      overrides: those overrides, set again on the smoke config: a value given on the command
        line wins over the smoke's own (`trainer.mesh`: a multi-process run needs a mesh over
        every process's devices, `trainer.checkpoint_dir`, `trainer.steps`, `--resume`, ...),
        except those of `model.*` and `tokenizer.*`, which choose the tiny model's family and
        its tokenizer.

    Returns:
      A RunConfig with a tiny model, 2 RL steps of 2 prompts (x 2 samples, or 1 for a recipe
      sampling one per prompt), mini- and micro-batches that divide them, a 1x1x1 mesh, at most
      8 slots and 64 response tokens, SFT of 16 traces for 1 epoch, 4 evaluation prompts, and
      its folders under `runs/smoke/<run_name>`.
    """
    root = smoke_dir(cfg)
    r, d, o, s, t = cfg.rollout, cfg.data, cfg.optim, cfg.sft, cfg.trainer
    model_type, keep = _family(cfg)
    max_response_len = min(r.max_response_len, MAX_RESPONSE_LEN)
    positions = r.prefill_len + max_response_len
    if cfg.model.path is None:
        tiny = cfg.model.tiny
        tiny = dataclasses.replace(
            tiny, max_position_embeddings=max(tiny.max_position_embeddings, positions)
        )
    else:
        tiny = TinyModelConfig(
            model_type=model_type,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=positions,
            **keep,
        )
    own = Path(cfg.tokenizer_path) if cfg.model.path is not None else None
    if own is not None and (own / "tokenizer.json").is_file():
        tokenizer = dataclasses.replace(cfg.tokenizer, path=str(own), build=False)
    else:  # a tiny recipe's own settings (its prompt lengths depend on them), else small
        vocab = cfg.tokenizer.vocab_size if cfg.model.path is None else TOKENIZER_VOCAB
        tokenizer = dataclasses.replace(
            cfg.tokenizer, path=str(root / "tokenizer"), build=True, vocab_size=vocab
        )

    group_size = 1 if r.group_size == 1 else 2
    rows = PROMPTS * group_size
    mini = 2 if o.num_mini_batches > 1 and rows % 2 == 0 else 1
    micro = rows // mini
    sft_batch = micro * (2 if s.batch_size >= 2 * micro else 1)
    # float32 throughout (a CPU run; bfloat16 master weights would not pass with a float32
    # compute): said when the recipe asked for another dtype, so a bfloat16 bug is not hidden.
    m = cfg.model
    changed = [
        f"model.{k}={getattr(m, k)}"
        for k in ("dtype", "param_dtype", "kv_cache_dtype")
        if getattr(m, k) not in (None, "float32")
    ]
    if changed:
        log.warning("--smoke runs in float32: %s replaced by float32", ", ".join(changed))
    smoke = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            m, path=None, tiny=tiny, dtype="float32", param_dtype="float32", kv_cache_dtype=None
        ),
        tokenizer=tokenizer,
        data=dataclasses.replace(
            d,
            batch_size=PROMPTS,
            eval_batch_size=min(d.eval_batch_size, EVAL_RECORDS),
            max_eval_records=EVAL_RECORDS,
            task_train_size=min(d.task_train_size, 64),
            task_eval_size=min(d.task_eval_size, EVAL_RECORDS),
        ),
        rollout=dataclasses.replace(
            r,
            group_size=group_size,
            max_response_len=max_response_len,
            max_turn_tokens=None if r.max_turn_tokens is None else min(r.max_turn_tokens, 32),
            chunk_size=min(r.chunk_size, 16),
            slots=min(r.slots, 8),
            tool_concurrency=min(r.tool_concurrency, 4),
            eval_group_size=min(r.eval_group_size, 2),
        ),
        optim=dataclasses.replace(
            o, micro_batch_size=micro, num_mini_batches=mini, ppo_epochs=min(o.ppo_epochs, 2)
        ),
        critic=dataclasses.replace(cfg.critic, pretrain_steps=min(cfg.critic.pretrain_steps, 1)),
        env=dataclasses.replace(
            cfg.env,
            train_episodes=min(cfg.env.train_episodes, 64),
            eval_episodes=min(cfg.env.eval_episodes, EVAL_RECORDS),
            sandbox_workers=min(cfg.env.sandbox_workers, 2),
        ),
        sft=dataclasses.replace(
            s,
            epochs=min(s.epochs, 1),
            num_traces=SFT_TRACES,
            max_traces=SFT_TRACES,
            batch_size=sft_batch,
        ),
        trainer=dataclasses.replace(
            t,
            steps=STEPS,
            mesh="1x1x1",
            checkpoint_dir=str(root / "checkpoints"),
            checkpoint_every=STEPS,
            keep_checkpoints=1,
            resume=False,
            log_dir=str(root / "logs"),
            log_every=1,
            eval_every=1 if t.eval_every else 0,
        ),
    )
    if not overrides:
        return smoke
    return apply_overrides(smoke, overrides, except_sections=("model", "tokenizer"))


def clear_outputs(cfg: RunConfig) -> None:
    """Removes an earlier smoke run's checkpoints and logs, so that this one starts fresh, and
    its tokenizer when it was built with other settings. Only folders under `runs/smoke` are
    touched; a resumed run (`--resume`) keeps its checkpoints and logs. In a multi-process run
    process 0 removes them and the others wait for it (a collective: every process calls it).

    Args:
      cfg: a config from `smoke_config`.
    """
    if sharding.is_main_process():
        _clear_outputs(cfg)
    sharding.agree(None)  # none of them starts the run while process 0 still removes folders


def _clear_outputs(cfg: RunConfig) -> None:
    root = SMOKE_ROOT.resolve()
    folders = [] if cfg.trainer.resume else [cfg.trainer.checkpoint_dir, cfg.trainer.log_dir]
    t = cfg.tokenizer
    extra = len(records.tokenizer_texts(cfg))
    if t.build and build_mismatch(
        cfg.tokenizer_path, vocab_size=t.vocab_size, seed=t.seed, n_extra_texts=extra
    ):
        folders.append(cfg.tokenizer_path)
    for folder in folders:
        path = Path(folder).resolve()
        if path.is_relative_to(root) and path.is_dir():
            shutil.rmtree(path)
