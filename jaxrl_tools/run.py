"""The composition root: builds a run's parts from a RunConfig and drives them.

The CLI's subcommands call `train`, `sft_only`, `evaluate_policy` and `export` (and `demo`, in
`demo.runner`, calls `train`); each wires library pieces together, handing every piece only its
own section of the config. The parts are built in `setup`, the prompt records and SFT traces come
from `records`, and `check.preflight` validates a run before `train` builds anything.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_tools import check, models, plan, records, sharding
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.eval import evaluate
from jaxrl_tools.models import gguf_io
from jaxrl_tools.rollout import Sampler, make_engine
from jaxrl_tools.setup import (
    close_episodes,
    close_tools,
    import_adapters,
    make_mesh,
    make_reward,
    make_rollout_mesh,
    run_checkpoints,
    saved_checkpoints,
    setup_episodes,
    setup_model,
    setup_tokenizer,
    setup_tools,
)
from jaxrl_tools.step_config import step_settings
from jaxrl_tools.tools import ToolExecutor
from jaxrl_tools.train import rl_loop, sft, trackers
from jaxrl_tools.train.metrics import MetricsLogger, public, step_split, write_json
from jaxrl_tools.train.rl import RLTrainer

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- pieces


def policy_engine(cfg: RunConfig, model_cfg, params, tokenizer, mesh=None, **options):
    """The run's decode engine (`make_engine`: `rollout.engine` unless `options` name another;
    the rest of `options` go to its class) on the rollout mesh, in the run's dtypes and seed:
    the sampler's, and both servers'."""
    return make_engine(
        model_cfg,
        params,
        tokenizer,
        cfg.rollout,
        mesh=make_rollout_mesh(cfg, mesh),
        seed=cfg.trainer.seed,
        dtypes=cfg.model.dtypes,
        **options,
    )


def make_sampler(
    cfg: RunConfig, model_cfg, params, tokenizer, tools: list, mesh=None, episodes=None
) -> Sampler:
    r = cfg.rollout
    executor = (
        ToolExecutor(tools, max_concurrency=r.tool_concurrency, timeout_s=r.tool_timeout_s)
        if tools
        else None
    )
    return Sampler(
        policy_engine(cfg, model_cfg, params, tokenizer, mesh),
        tokenizer,
        executor,
        r,
        system_prompt=cfg.data.system_prompt,
        seed=cfg.trainer.seed,
        episodes=episodes,
    )


def make_trainer(cfg: RunConfig, model_cfg, params, mesh=None) -> RLTrainer:
    return RLTrainer(
        step_settings(cfg, model_cfg),  # one mapping, so that `plan` lowers the step trained here
        params,
        rows=cfg.update_rows,
        seed=cfg.trainer.seed,
        lora_decode=cfg.model.lora.decode,
        # After SFT the base is not model.path's weights: a resumed run needs it back.
        checkpoint_base=cfg.sft.enabled,
        mesh=mesh,
        adapters=import_adapters(cfg, model_cfg),
    )


def run_eval(cfg: RunConfig, sampler: Sampler, params, evals, reward, step: int = 0) -> dict:
    r = cfg.rollout
    return evaluate(
        sampler,
        params,
        evals,
        reward,
        group_size=r.eval_group_size,
        temperature=r.eval_temperature,
        batch_size=cfg.data.eval_batch_size,
        seed=cfg.trainer.seed,
        step=step,
    )


def run_sft(cfg: RunConfig, model_cfg, params, tokenizer, mesh=None):
    traces = records.sft_traces(cfg, tokenizer)
    log.info("SFT on %d traces for %d epochs", len(traces), cfg.sft.epochs)

    def on_step(step, metrics):
        if step % 20 == 0:
            log.info("SFT step %d: loss %.4f", step, float(metrics["sft/loss"]))

    s = cfg.sft
    return sft.train_sft(
        model_cfg,
        params,
        tokenizer,
        traces,
        epochs=s.epochs,
        lr=s.lr,
        batch_size=s.batch_size,
        max_len=s.max_len,
        warmup_steps=s.warmup_steps,
        micro_batch_size=cfg.optim.micro_batch_size,
        seed=cfg.trainer.seed,
        on_step=on_step,
        mesh=mesh,
        dtypes=cfg.model.dtypes,
        attention=cfg.model.attention,
        pack=s.pack,
    )


# ---------------------------------------------------------------------------------- stages


def train(
    cfg: RunConfig,
    *,
    evaluate_before: bool = False,
    evaluate_after: bool = False,
    init_params: Any = None,
    keep_init_params: bool = False,
) -> dict:
    """SFT (when enabled) then RL for `trainer.steps` steps, with checkpoints and metrics.

    Resumes from the newest checkpoint in `trainer.checkpoint_dir` when `trainer.resume` is set
    (the SFT stage is then skipped: the checkpoint holds the policy after it).

    Args:
      cfg: the run config.
      evaluate_before, evaluate_after: evaluate on the held-out records before / after RL.
      init_params: start RL from these params (e.g. another run's SFT policy): no SFT stage.
      keep_init_params: keep a copy of the policy RL starts from in `summary["init_params"]`
        (not when resuming: that policy is gone).

    Returns:
      A summary: final metrics, and the held-out evaluations asked for ("before", "after").
    """
    check.preflight(cfg, needs_eval=evaluate_before or evaluate_after)
    sharding.initialize_distributed()
    t = cfg.trainer
    run_dir = Path(t.log_dir)
    mesh = make_mesh(cfg)
    plan.check_fits(cfg, mesh)  # on an accelerator: refuse a run that cannot fit, first
    ckpt, resuming = run_checkpoints(t)  # locked now: a second run on the folder is refused
    summary: dict[str, Any] = {"run_name": t.run_name}
    tools, episodes, logger, opened, done = [], None, None, [], False
    try:
        # Before the model: a tracker that cannot start (wandb not logged in) fails at once.
        opened = trackers.open_trackers(cfg, resume=resuming)
        tokenizer = setup_tokenizer(cfg)
        model_cfg, params = setup_model(cfg, tokenizer, mesh)
        reward = make_reward(cfg)
        tools = setup_tools(cfg)
        episodes = setup_episodes(cfg)
        sampler = make_sampler(cfg, model_cfg, params, tokenizer, tools, mesh, episodes)
        if init_params is not None:
            params = init_params
        elif cfg.sft.enabled and not resuming:
            t0 = time.perf_counter()
            params = run_sft(cfg, model_cfg, params, tokenizer, mesh=mesh)
            summary["sft_time_s"] = time.perf_counter() - t0
        schema = sampler.tools_schema  # the prompts are fitted as the sampler renders them
        evaluates = evaluate_before or evaluate_after or t.eval_every
        evals = records.eval_records(cfg, tokenizer, schema) if evaluates else []
        before_path = run_dir / "eval_before_rl.json"
        if evaluate_before:
            if resuming and before_path.exists():
                summary["before"] = json.loads(before_path.read_text())
            else:
                t0 = time.perf_counter()
                summary["before"] = run_eval(cfg, sampler, params, evals, reward)
                summary["eval_time_s"] = time.perf_counter() - t0
                write_json(before_path, summary["before"])
        if keep_init_params and not resuming:  # the update donates the state's buffers
            summary["init_params"] = jax.tree.map(jnp.copy, params)
        trainer = make_trainer(cfg, model_cfg, params, mesh)
        loader = records.train_loader(cfg, tokenizer, schema)
        start = 0
        if resuming:
            start, state, extras = ckpt.restore(trainer.checkpoint_state())
            trainer.load_checkpoint_state(state)
            loader.set_state(extras["data"])
            sampler.set_state(extras["sampler"])
            log.info("resumed from step %d of %s", start, ckpt.directory)
        # After the restore: it may fall back to an older step (the log is cut there).
        logger = MetricsLogger(
            run_dir,
            total_steps=t.steps,
            desc=t.run_name,
            start_step=start,
            tensorboard="tensorboard" in t.loggers,
            trackers=opened,
        )
        # With rollouts ahead, an evaluation runs while a rollout is mid-way: its own engine view.
        evaluator = sampler.view() if t.max_staleness else sampler
        metrics = rl_loop.run_steps(
            cfg,
            trainer=trainer,
            sampler=sampler,
            loader=loader,
            reward=reward,
            ckpt=ckpt,
            logger=logger,
            start=start,
            pad_id=tokenizer.pad_token_id or 0,
            evaluate=lambda params, step: run_eval(cfg, evaluator, params, evals, reward, step),
        )
        ckpt.wait()
        summary["final_metrics"] = public(metrics)
        summary["step_time_s"] = step_split(logger.history)
        if evaluate_after:
            summary["after"] = run_eval(cfg, sampler, trainer.params, evals, reward, t.steps)
        summary["plot"] = str(logger.plot() or "")
        summary.update(params=trainer.params, model_config=model_cfg, tokenizer=tokenizer)
        done = True
        return summary
    finally:
        if logger is not None:
            logger.close(failed=not done)  # ends the trackers' runs too
        else:
            trackers.close_trackers(opened, failed=True)
        ckpt.close()
        close_tools(tools)
        close_episodes(episodes)


def restore_policy(cfg: RunConfig, step: int | None = None):
    """(model_cfg, params, tokenizer, step) of a run's checkpoint (with LoRA, the policy's
    weights as the engine takes them: `RLTrainer.params`). Errors: see `restore_trainer`."""
    trainer, tokenizer, step = restore_trainer(cfg, step)
    return trainer.model_cfg, trainer.params, tokenizer, step


def restore_trainer(cfg: RunConfig, step: int | None = None):
    """(trainer, tokenizer, step): a trainer holding a run's checkpoint.

    Raises:
      ConfigError: no checkpoint folder or no checkpoint in it, no checkpoint of `step` (the
        message lists the steps there), or a checkpoint of another model or algorithm; checked
        before the model is built, and nothing is written.
    """
    ckpt = saved_checkpoints(cfg.trainer, step)
    try:
        mesh = make_mesh(cfg)
        tokenizer = setup_tokenizer(cfg)
        model_cfg, params = setup_model(cfg, tokenizer, mesh)
        trainer = make_trainer(cfg, model_cfg, params, mesh)
        # A checkpoint of another model or algorithm, or none readable: a CheckpointError.
        step, state, _ = ckpt.restore(trainer.checkpoint_state(), step)
    finally:
        ckpt.close()
    trainer.load_checkpoint_state(state)
    return trainer, tokenizer, step


def export(cfg: RunConfig, out: str, step: int | None = None, fmt: str = "hf") -> Path:
    """Writes a checkpoint's policy as a Hugging Face folder (weights, config, tokenizer), or with
    `fmt` "gguf-<dtype>" (f32, f16, bf16, q8_0) as one GGUF file (weights, tokenizer, chat
    template) for llama.cpp-based tools.

    `out` must be new (a folder may be empty): nothing is overwritten. A LoRA run writes the
    merged weights there; as a folder, its adapters also in PEFT's format in `out/adapter` (after
    an SFT stage, their base, the SFT policy, in `out/adapter_base`).
    """
    gguf_dtype = _gguf_dtype(fmt, out)
    if gguf_dtype is None:
        check.check_new_output(out)
    trainer, tokenizer, step = restore_trainer(cfg, step)
    model_cfg, params = trainer.model_cfg, trainer.params
    if trainer.lora is not None:
        params = models.merge(trainer.base, trainer.state.params, trainer.lora)
    if gguf_dtype is not None:
        try:
            gguf_io.save_gguf(
                model_cfg, params, tokenizer, out, gguf_dtype, name=cfg.trainer.run_name
            )
        except (ImportError, ValueError) as e:
            raise ConfigError(f"export --format {fmt}: {e}") from None
        log.info("exported step %d to %s", step, out)
        return Path(out)
    if trainer.lora is not None:  # the adapters in PEFT's format
        base_name = cfg.model.path
        if cfg.sft.enabled:  # the adapters' base is the SFT policy, not model.path
            base_name = str(Path(out) / "adapter_base")
            models.save_pretrained(model_cfg, trainer.base, base_name)
        models.peft_io.save_peft(
            model_cfg,
            trainer.lora,
            trainer.state.params,
            Path(out) / "adapter",
            base_model_name_or_path=base_name,
        )
    models.save_pretrained(model_cfg, params, out)
    tokenizer.save_pretrained(out)
    log.info("exported step %d to %s", step, out)
    return Path(out)


EXPORT_FORMATS = ("hf", *(f"gguf-{d}" for d in gguf_io.GGUF_DTYPES))


def _gguf_dtype(fmt: str, out: str) -> str | None:
    """The GGUF dtype of an export format ("hf": None); checks `out` is a new .gguf file."""
    if fmt not in EXPORT_FORMATS:
        raise ConfigError(f"export --format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    if fmt == "hf":
        return None
    if not out.endswith(".gguf") or Path(out).exists():
        raise ConfigError(f"export --format {fmt}: --out {out} must be a new file named *.gguf")
    try:
        gguf_io.require_gguf()  # a missing extra: before the checkpoint is restored
    except ImportError as e:
        raise ConfigError(f"export --format {fmt}: {e}") from None
    return fmt.removeprefix("gguf-")


class Policy(NamedTuple):
    """A policy to decode with, and what it is (for logs)."""

    model_cfg: models.ModelConfig
    params: Any
    tokenizer: Any
    source: str


def load_policy(
    cfg: RunConfig, *, from_checkpoint: bool, step: int | None = None, mesh=None
) -> Policy:
    """The policy of a run's checkpoint, or of `model.path` (a random tiny model without one),
    for eval, pass-rate and both servers."""
    if from_checkpoint:
        model_cfg, params, tokenizer, step = restore_policy(cfg, step)
        return Policy(model_cfg, params, tokenizer, f"{cfg.trainer.checkpoint_dir} step {step}")
    tokenizer = setup_tokenizer(cfg)
    model_cfg, params = setup_model(cfg, tokenizer, make_mesh(cfg) if mesh is None else mesh)
    return Policy(model_cfg, params, tokenizer, cfg.model.path or "a random tiny model")


def evaluate_policy(cfg: RunConfig, *, from_checkpoint: bool, step: int | None = None) -> dict:
    """Held-out evaluation of `model.path` or of a run's checkpoint."""
    model_cfg, params, tokenizer, _ = load_policy(cfg, from_checkpoint=from_checkpoint, step=step)
    tools = setup_tools(cfg)
    episodes = setup_episodes(cfg)
    try:
        sampler = make_sampler(cfg, model_cfg, params, tokenizer, tools, episodes=episodes)
        evals = records.eval_records(cfg, tokenizer, sampler.tools_schema)
        return run_eval(cfg, sampler, params, evals, make_reward(cfg))
    finally:
        close_tools(tools)
        close_episodes(episodes)


def sft_only(cfg: RunConfig, out: str) -> Path:
    """The SFT stage alone; writes the result as a Hugging Face folder (`model.path` for RL)."""
    tokenizer = setup_tokenizer(cfg)
    model_cfg, params = setup_model(cfg, tokenizer)
    params = run_sft(cfg, model_cfg, params, tokenizer)
    models.save_pretrained(model_cfg, params, out)
    tokenizer.save_pretrained(out)
    return Path(out)
