"""The composition root: builds a run's parts from a RunConfig and drives them.

The CLI's subcommands call `train`, `sft_only`, `evaluate_policy`, `export` and `demo`; each
wires library pieces together, handing every piece only its own section of the config.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools import algorithms, check, data, envs, models, plan, sharding
from jaxrl_tools.config import ConfigError, RewardSpec, RunConfig
from jaxrl_tools.demo import grid_games, report, task
from jaxrl_tools.eval import evaluate
from jaxrl_tools.rewards import CompositeReward
from jaxrl_tools.rollout import AsyncRollouts, Sampler, make_engine
from jaxrl_tools.tools import SandboxPool, ToolExecutor, create_tool
from jaxrl_tools.train import sft
from jaxrl_tools.train.batch import collect_batch
from jaxrl_tools.train.checkpoint import Checkpointer
from jaxrl_tools.train.metrics import MetricsLogger
from jaxrl_tools.train.rl import NonFiniteUpdate, RLSetup, RLTrainer
from jaxrl_tools.train.signals import RunInterrupted, StopOnSignal

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------- pieces


def use_compile_cache(cfg: RunConfig) -> str | None:
    """Points jax's persistent compilation cache at `trainer.compile_cache_dir` (unless the
    JAX_COMPILATION_CACHE_DIR environment variable names one, or the field is null), before
    anything compiles; returns the folder in use."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    folder = cfg.trainer.compile_cache_dir
    if folder is not None:
        jax.config.update("jax_compilation_cache_dir", folder)
    return folder


def make_mesh(cfg: RunConfig):
    """The run's mesh, or None for the trivial 1x1x1 shape (one device, the default one)."""
    shape = cfg.trainer.mesh_shape
    if shape is None:
        return sharding.make_mesh((1, -1, 1))
    if shape == (1, 1, 1):
        return None
    return sharding.make_mesh(shape)


def make_rollout_mesh(cfg: RunConfig, mesh):
    """The engine's mesh: `rollout.mesh` over the trainer mesh's devices, or `mesh` itself."""
    shape = cfg.rollout.mesh_shape
    if shape is None:
        return mesh
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    return None if len(devices) == 1 else sharding.make_mesh(shape, devices)


def setup_tokenizer(cfg: RunConfig):
    """The tokenizer folder's tokenizer; for a tiny model (`model.path: null`) with
    `tokenizer.build`, built there first if missing. Never built into a model's folder, and a
    folder built with another vocab_size or seed is an error (`check.check_tokenizer`)."""
    return check.open_tokenizer(cfg)


def setup_model(cfg: RunConfig, tokenizer, mesh=None) -> tuple[models.ModelConfig, Any]:
    """The policy: loaded from `model.path`, or a random-init tiny model, in the dtype of the
    master weights (`model.param_dtype`; the compute dtype is applied per pass)."""
    dtype = models.PARAM_DTYPES[cfg.model.param_dtype]
    if cfg.model.path is not None:
        return models.from_pretrained(cfg.model.path, dtype=dtype, mesh=mesh)
    tiny = dataclasses.asdict(cfg.model.tiny)
    seed = tiny.pop("seed")
    model_cfg = models.ModelConfig(
        **tiny,
        vocab_size=len(tokenizer),
        attention_bias=tiny["model_type"] == "qwen2",
        qk_norm=tiny["model_type"] == "qwen3",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model_cfg, models.init_params(model_cfg, jax.random.key(seed), dtype=dtype, mesh=mesh)


def setup_tools(cfg: RunConfig) -> list:
    """The tools the config declares, started (the Python tool's worker pool starts here)."""
    tools = []
    for spec in cfg.tools:
        tool = create_tool(spec.cls, dict(spec.config))
        tool.name = spec.name or tool.name
        tools.append(tool)
    for tool in tools:
        tool.start()
    return tools


def close_tools(tools: list) -> None:
    for tool in tools:
        try:
            asyncio.run(tool.close())
        except Exception as e:  # noqa: BLE001 - closing must not hide the run's own error
            log.warning("closing tool %s: %s", tool.name, e)


def setup_episodes(cfg: RunConfig) -> envs.Episodes | None:
    """The `env` section's episodes (None without one); environments that run code get a
    sandbox pool of `env.sandbox_workers` workers (closed by `close_episodes`)."""
    if cfg.env.name is None:
        return None
    pool = SandboxPool(cfg.env.sandbox_workers) if envs.needs_sandbox(cfg.env.name) else None
    return envs.Episodes.from_section(cfg.env, pool)


def close_episodes(episodes: envs.Episodes | None) -> None:
    if episodes is not None and episodes.pool is not None:
        episodes.pool.close()


def make_sampler(
    cfg: RunConfig, model_cfg, params, tokenizer, tools: list, mesh=None, episodes=None
) -> Sampler:
    r = cfg.rollout
    executor = (
        ToolExecutor(tools, max_concurrency=r.tool_concurrency, timeout_s=r.tool_timeout_s)
        if tools
        else None
    )
    engine = make_engine(
        model_cfg,
        params,
        tokenizer,
        r,
        mesh=make_rollout_mesh(cfg, mesh),
        seed=cfg.trainer.seed,
        dtypes=cfg.model.dtypes,
    )
    return Sampler(
        engine,
        tokenizer,
        executor,
        r,
        system_prompt=cfg.data.system_prompt,
        seed=cfg.trainer.seed,
        episodes=episodes,
    )


def make_reward(cfg: RunConfig) -> CompositeReward:
    return CompositeReward([(r.name, r.weight, r.kwargs) for r in cfg.reward])


def make_trainer(cfg: RunConfig, model_cfg, params, mesh=None) -> RLTrainer:
    setup = RLSetup(
        rows=cfg.update_rows,
        group_size=cfg.rollout.group_size,
        temperature=cfg.rollout.temperature,
        max_response_len=cfg.rollout.max_response_len,
        total_steps=cfg.trainer.steps,
        seed=cfg.trainer.seed,
        remat=cfg.model.remat_policy if cfg.model.remat else False,
        dtypes=cfg.model.dtypes,
        attention=cfg.model.attention,
        pack=cfg.optim.pack,
        lora=cfg.model.lora.config,
        lora_decode=cfg.model.lora.decode,
        # After SFT the base is not model.path's weights: a resumed run needs it back.
        checkpoint_base=cfg.sft.enabled,
        on_nonfinite=cfg.trainer.on_nonfinite,
    )
    return RLTrainer(
        model_cfg,
        params,
        algorithm=cfg.algorithm,
        optim=cfg.optim,
        critic=cfg.critic,
        setup=setup,
        mesh=mesh,
        adapters=import_adapters(cfg, model_cfg),
    )


def import_adapters(cfg: RunConfig, model_cfg) -> Any:
    """The PEFT adapter of `model.lora.init_from` (None: not set); its rank, alpha and targets
    must be the section's."""
    lora = cfg.model.lora
    if not lora.enabled or lora.init_from is None:
        return None
    dtype = models.PARAM_DTYPES[cfg.model.param_dtype]
    try:
        found, adapters = models.peft_io.load_peft(model_cfg, lora.init_from, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.lora.init_from: {e}") from None
    for name in ("rank", "alpha", "targets"):
        want, got = getattr(lora.config, name), getattr(found, name)
        if (sorted(want) != sorted(got)) if name == "targets" else want != got:
            raise ConfigError(
                f"model.lora.{name}={want!r} but the adapter in model.lora.init_from="
                f"{lora.init_from} has {got!r}"
            )
    return adapters


def train_loader(cfg: RunConfig) -> data.PromptLoader:
    """The prompts of the RL steps (without those over `rollout.max_prompt_len` tokens, with
    `data.drop_long_prompts`)."""
    if cfg.env.name is not None:
        records = check.env_records(cfg, "train")
    elif cfg.data.task is not None:
        records = task.task_records(cfg.data, cfg.rollout.protocol, "train")
    else:
        records = data.record_source(cfg.data, "train")
    # Each process of a multi-process job reads its slice of every batch; all see the batch.
    shard = dict(shard=(jax.process_index(), jax.process_count()), gather=sharding.agree)
    return data.loader_from_config(
        cfg.data,
        "train",
        source=check.fit_prompts(cfg, records, "train"),
        **(shard if jax.process_count() > 1 else {}),
    )


def eval_records(cfg: RunConfig) -> list[dict]:
    """The held-out prompts (the first `data.max_eval_records`; long ones dropped as in
    `train_loader`)."""
    if cfg.env.name is not None:
        records = check.env_records(cfg, "eval")
    elif cfg.data.task is not None:
        records = task.task_records(cfg.data, cfg.rollout.protocol, "eval")
    else:
        records = list(data.record_source(cfg.data, "eval"))
    records = records[: cfg.data.max_eval_records]
    return list(check.fit_prompts(cfg, records, "eval"))


def run_eval(cfg: RunConfig, sampler: Sampler, params, records, reward) -> dict:
    r = cfg.rollout
    return evaluate(
        sampler,
        params,
        records,
        reward,
        group_size=r.eval_group_size,
        temperature=r.eval_temperature,
        batch_size=cfg.data.eval_batch_size,
        seed=cfg.trainer.seed,
    )


def run_sft(cfg: RunConfig, model_cfg, params, tokenizer, mesh=None):
    if cfg.sft.train_files:
        traces = data.load_sft_traces(cfg.sft.train_files)[: cfg.sft.max_traces]
    elif cfg.env.name is not None:
        traces = grid_games.sft_traces(cfg, tokenizer)
    else:
        traces = task.task_sft_traces(cfg.data, cfg.sft, cfg.rollout.protocol, tokenizer)
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


def write_json(path: Path, obj: Any) -> None:
    """Writes `obj` as JSON (process 0 only: in a multi-process job every process has it)."""
    if not sharding.is_main_process():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    default = lambda x: x.tolist() if isinstance(x, np.generic | np.ndarray) else str(x)
    path.write_text(json.dumps(obj, indent=2, default=default))


def public(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------- stages


def _open_checkpoints(t) -> Checkpointer:
    """The run's checkpoint folder, locked for the run's life before anything loads (a second
    run on it is refused); one holding checkpoints is refused unless `trainer.resume` is set."""
    ckpt = Checkpointer(
        t.checkpoint_dir,
        every=t.checkpoint_every or t.steps or 1,
        keep=t.keep_checkpoints,
        lock=True,
    )
    latest = ckpt.latest_step()
    if latest is not None and not t.resume:
        ckpt.close()
        raise ConfigError(
            f"trainer.checkpoint_dir {ckpt.directory} already holds checkpoints of a run (latest "
            f"step {latest}): continue it with --resume (trainer.resume=true), or give "
            "trainer.checkpoint_dir a new folder"
        )
    return ckpt


def _resume(ckpt: Checkpointer, trainer: RLTrainer, loader, sampler) -> int:
    """Restores the newest readable checkpoint into the trainer, data loader and sampler;
    returns its step."""
    start, state, extras = ckpt.restore(trainer.checkpoint_state())
    trainer.load_checkpoint_state(state)
    loader.set_state(extras["data"])
    sampler.calls = extras["rollout_calls"]
    log.info("resumed from step %d of %s", start, ckpt.directory)
    return start


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
    ckpt = _open_checkpoints(t)
    resuming = ckpt.latest_step() is not None
    summary: dict[str, Any] = {"run_name": t.run_name}
    tools, episodes, logger, ahead = [], None, None, None
    try:
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
        evals = eval_records(cfg) if (evaluate_before or evaluate_after or t.eval_every) else []
        before_path = run_dir / "eval_before_rl.json"
        if evaluate_before:
            if resuming and before_path.exists():
                summary["before"] = json.loads(before_path.read_text())
            else:
                summary["before"] = run_eval(cfg, sampler, params, evals, reward)
                write_json(before_path, summary["before"])
        if keep_init_params and not resuming:  # the update donates the state's buffers
            summary["init_params"] = jax.tree.map(jnp.copy, params)
        trainer = make_trainer(cfg, model_cfg, params, mesh)
        loader = train_loader(cfg)
        start = _resume(ckpt, trainer, loader, sampler) if resuming else 0
        # After the restore: it may fall back to an older step (the log is cut there).
        logger = MetricsLogger(run_dir, total_steps=t.steps, desc=t.run_name, start_step=start)
        metrics: dict = {}
        group_size, pad_id = cfg.rollout.group_size, tokenizer.pad_token_id or 0
        # ReMax's baseline: a greedy rollout per prompt, when the estimator reads one.
        greedy = "baseline_B" in algorithms.estimator_inputs(cfg.algorithm.adv_estimator)

        def rollout(step: int, params) -> tuple[Any, float]:
            """Step `step`'s batch, sampled with `params`, and the time it took."""
            reward.step = step  # for rewards scheduled over training (ToolRL's scale)
            t0 = time.perf_counter()
            sampler.take_metrics()  # (drops an evaluation's)
            # DAPO dynamic sampling draws more prompts (rounds) until the batch is full.
            batch = collect_batch(
                lambda: next(loader),
                lambda recs, g, **kw: sampler(recs, g, params, **kw),
                reward, cfg.algorithm.filters,
                group_size=group_size, rows=cfg.data.batch_size * group_size, pad_id=pad_id,
                greedy_baseline=greedy, turn_rows=trainer.rows,
            )  # fmt: skip
            batch.metrics.update(sampler.take_metrics())
            return batch, time.perf_counter() - t0

        ahead = AsyncRollouts(rollout) if t.async_rollouts else None
        with StopOnSignal() as stop:
            for step in range(start + 1, t.steps + 1):
                t0 = time.perf_counter()
                if ahead is not None and ahead.pending:
                    (batch, rollout_s), staleness = ahead.result(), 1
                else:
                    (batch, rollout_s), staleness = rollout(step, trainer.params), 0
                wait_s = time.perf_counter() - t0
                streams = None  # with a batch sampled ahead: the data and sampler streams before it
                if ahead is not None and step < t.steps and stop.signum is None:
                    streams = {"data": loader.get_state(), "rollout_calls": sampler.calls}
                    # The next batch, sampled with the weights before this update.
                    ahead.start(step + 1, sampler.engine.serving_copy(trainer.params))
                metrics = trainer.step(batch)
                if diverged := trainer.diverged(metrics):  # nothing of this step is saved
                    logger.log(step, metrics)
                    ckpt.wait()
                    raise NonFiniteUpdate(step, diverged, ckpt.latest_step(), str(ckpt.directory))
                metrics["time/rollout_s"] = rollout_s
                n_tokens = batch.metrics["rollout/tokens"]
                metrics["throughput/rollout_tokens_per_s"] = n_tokens / max(rollout_s, 1e-9)
                if ahead is not None:
                    metrics["async/staleness"] = float(staleness)
                    metrics["async/rollout_wait_s"] = wait_s
                metrics["time/step_s"] = time.perf_counter() - t0
                if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                    if ahead is not None:
                        ahead.wait()  # one engine: the batch sampled ahead finishes first
                    ev = run_eval(cfg, sampler, trainer.params, evals, reward)
                    metrics.update({f"eval/{k}": v for k, v in public(ev).items()})
                if step % t.log_every == 0 or step == t.steps:
                    logger.log(step, metrics)
                # What a resumed run continues from (a batch sampled ahead is sampled again).
                extras = streams or {"data": loader.get_state(), "rollout_calls": sampler.calls}
                extras["metrics"] = public(metrics)
                last = step == t.steps or stop.signum is not None
                if ckpt.save(step, trainer.checkpoint_state(), extras, force=last):
                    logger.flush()  # what the checkpoint covers is on disk too
                if stop.signum is not None and step != t.steps:
                    ckpt.wait()
                    raise RunInterrupted(step, stop.signum, str(ckpt.directory))
        ckpt.wait()
        summary["final_metrics"] = public(metrics)
        if evaluate_after:
            summary["after"] = run_eval(cfg, sampler, trainer.params, evals, reward)
        summary["plot"] = str(logger.plot() or "")
        summary.update(params=trainer.params, model_config=model_cfg, tokenizer=tokenizer)
        return summary
    finally:
        if ahead is not None:
            ahead.close()
        if logger is not None:
            logger.close()
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
    directory = cfg.trainer.checkpoint_dir
    if not Path(directory).is_dir():
        raise ConfigError(
            f"trainer.checkpoint_dir={directory} does not exist: train first, or set "
            "trainer.checkpoint_dir to the run's checkpoint folder"
        )
    ckpt = Checkpointer(directory)
    try:
        steps = sorted(ckpt.all_steps())
        if not steps:
            raise ConfigError(
                f"no checkpoints in trainer.checkpoint_dir={directory}: train first, or set "
                "trainer.checkpoint_dir to the run's checkpoint folder"
            )
        if step is not None and step not in steps:
            raise ConfigError(
                f"--step {step}: there is no checkpoint of step {step} in {directory}; steps "
                f"there: {', '.join(map(str, steps))}"
            )
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


def export(cfg: RunConfig, out: str, step: int | None = None) -> Path:
    """Writes a checkpoint's policy as a Hugging Face folder (weights, config, tokenizer).

    `out` must be new or an empty folder: nothing is overwritten. A LoRA run writes the merged
    weights there, and its adapters in PEFT's format in `out/adapter` (after an SFT stage, their
    base, the SFT policy, in `out/adapter_base`).
    """
    check.check_new_output(out)
    trainer, tokenizer, step = restore_trainer(cfg, step)
    model_cfg, params = trainer.model_cfg, trainer.params
    if trainer.lora is not None:  # merged full weights, and the adapters in PEFT's format
        params = models.merge(trainer.base, trainer.state.params, trainer.lora)
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


def evaluate_policy(cfg: RunConfig, *, from_checkpoint: bool, step: int | None = None) -> dict:
    """Held-out evaluation of `model.path` or of a run's checkpoint."""
    if from_checkpoint:
        model_cfg, params, tokenizer, _ = restore_policy(cfg, step)
    else:
        tokenizer = setup_tokenizer(cfg)
        model_cfg, params = setup_model(cfg, tokenizer, make_mesh(cfg))
    tools = setup_tools(cfg)
    episodes = setup_episodes(cfg)
    try:
        sampler = make_sampler(cfg, model_cfg, params, tokenizer, tools, episodes=episodes)
        return run_eval(cfg, sampler, params, eval_records(cfg), make_reward(cfg))
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


def demo(
    cfg: RunConfig, *, baseline_reward: str | None = None, baseline_estimator: str | None = None
) -> dict:
    """SFT cold start, held-out eval, GRPO with the sandbox in the loop, held-out eval, report.

    With `baseline_reward` (e.g. "math") or `baseline_estimator` (e.g. "grpo"), a second RL run
    starts from the same SFT policy with only that reward or with that advantage estimator, for
    the same steps on the same data, and the report compares the two (OTC vs plain GRPO, GiGPO
    vs GRPO).
    """
    t0 = time.perf_counter()
    out = Path(cfg.trainer.log_dir)
    base_cfg = None
    if baseline_reward is not None or baseline_estimator is not None:
        t = cfg.trainer
        change: dict[str, Any] = {}
        if baseline_reward is not None:
            change["reward"] = (RewardSpec(baseline_reward, 1.0, {}),)
        if baseline_estimator is not None:
            change["algorithm"] = dataclasses.replace(
                cfg.algorithm, adv_estimator=baseline_estimator
            )
        # Built (and so validated) before anything runs.
        base_cfg = dataclasses.replace(
            cfg,
            **change,
            trainer=dataclasses.replace(
                t,
                log_dir=str(out / "baseline"),
                run_name=f"{t.run_name}_baseline",
                checkpoint_dir=str(Path(t.checkpoint_dir) / "baseline"),
            ),
        )
    summary = train(
        cfg, evaluate_before=True, evaluate_after=True, keep_init_params=base_cfg is not None
    )
    summary["reward_name"] = "+".join(r.name for r in cfg.reward)
    summary["estimator"] = cfg.algorithm.adv_estimator
    summary["tools_desc"] = ", ".join(t.cls for t in cfg.tools) or "no tools"
    r = cfg.rollout
    summary["eval_desc"] = (
        "greedy decoding"
        if r.eval_temperature == 0
        else f"sampling at temperature {r.eval_temperature:g}, {r.eval_group_size} per problem"
    )
    baseline = None
    if base_cfg is not None:
        # A resumed run has no copy of its SFT policy; SFT is deterministic, so the baseline
        # then redoes it (or resumes its own checkpoint).
        baseline = train(
            base_cfg, evaluate_after=True, init_params=summary.pop("init_params", None)
        )
        baseline["reward_name"] = "+".join(r.name for r in base_cfg.reward)
        baseline["estimator"] = base_cfg.algorithm.adv_estimator
    summary["wall_time_s"] = time.perf_counter() - t0
    text = report.demo_report(summary, baseline)
    if sharding.is_main_process():
        (out / "report.md").write_text(text)
    keep = lambda d: {k: v for k, v in d.items() if k not in _NOT_JSON}
    write_json(
        out / "report.json", {**keep(summary), "baseline": keep(baseline) if baseline else None}
    )
    print(text)
    print(f"(wall time {summary['wall_time_s']:.0f} s; report in {out / 'report.md'})")
    return summary


_NOT_JSON = ("params", "model_config", "tokenizer", "init_params")
