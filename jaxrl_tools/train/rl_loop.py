"""The RL loop: steps `start + 1 .. trainer.steps`, each a sampled batch and one update.

`run_steps` samples each step's batch (`collect_batch`, DAPO's rounds included), runs the
trainer's step, logs, evaluates every `trainer.eval_every` steps and checkpoints what a resumed
run continues from (the policy, the data and sampler streams). With `trainer.async_rollouts` the
next batch is sampled with the weights before this update while it runs (staleness 1).
`run.train` builds the parts and calls it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jaxrl_tools import algorithms
from jaxrl_tools.config import RunConfig
from jaxrl_tools.rollout import AsyncRollouts, Sampler
from jaxrl_tools.train.batch import collect_batch
from jaxrl_tools.train.checkpoint import Checkpointer
from jaxrl_tools.train.metrics import MetricsLogger, public
from jaxrl_tools.train.rl import NonFiniteUpdate, RLTrainer
from jaxrl_tools.train.signals import RunInterrupted, StopOnSignal


def run_steps(
    cfg: RunConfig,
    *,
    trainer: RLTrainer,
    sampler: Sampler,
    loader,
    reward,
    ckpt: Checkpointer,
    logger: MetricsLogger,
    start: int,
    pad_id: int,
    evaluate: Callable[[Any, int], dict],
) -> dict:
    """Runs RL steps `start + 1 .. cfg.trainer.steps` and returns the last step's metrics.

    Args:
      loader: the prompt records' iterator (`records.train_loader`; checkpointed state).
      reward: the run's CompositeReward.
      evaluate: (params, step) -> the held-out evaluation's metrics.

    Raises:
      NonFiniteUpdate: an update gave a non-finite loss or gradient (nothing of it is saved).
      RunInterrupted: SIGINT / SIGTERM; the step that was running is saved first.
    """
    t = cfg.trainer
    metrics: dict = {}
    group_size = cfg.rollout.group_size
    # ReMax's baseline: a greedy rollout per prompt, when the estimator reads one.
    greedy = "baseline_B" in algorithms.estimator_inputs(cfg.algorithm.adv_estimator)
    every = t.log_samples_every

    def rollout(step: int, params) -> tuple[Any, float]:
        """Step `step`'s batch, sampled with `params`, and the time it took."""
        t0 = time.perf_counter()
        sampler.take_metrics()  # (drops an evaluation's)
        # DAPO dynamic sampling draws more prompts (rounds) until the batch is full.
        batch = collect_batch(
            lambda: next(loader),
            lambda recs, g, **kw: sampler(recs, g, params, **kw),
            reward, cfg.algorithm.filters,
            group_size=group_size, rows=cfg.data.batch_size * group_size, pad_id=pad_id,
            greedy_baseline=greedy, turn_rows=trainer.rows, step=step,
            samples=bool(every) and step % every == 0,
        )  # fmt: skip
        batch.metrics.update(sampler.take_metrics())
        return batch, time.perf_counter() - t0

    ahead = AsyncRollouts(rollout) if t.async_rollouts else None
    try:
        with StopOnSignal() as stop:
            for step in range(start + 1, t.steps + 1):
                t0 = time.perf_counter()
                if ahead is not None and ahead.pending:
                    (batch, rollout_s), staleness = ahead.result(), 1
                else:
                    (batch, rollout_s), staleness = rollout(step, trainer.params), 0
                wait_s = time.perf_counter() - t0
                samples = batch.metrics.pop("_samples", None)  # rows, not a metric
                streams = None  # with a batch sampled ahead: the data and sampler streams before it
                if ahead is not None and step < t.steps and stop.signum is None:
                    streams = {"data": loader.get_state(), "sampler": sampler.state()}
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
                    ev = evaluate(trainer.params, step)
                    metrics.update({f"eval/{k}": v for k, v in public(ev).items()})
                if step % t.log_every == 0 or step == t.steps:
                    logger.log(step, metrics)
                if samples:
                    logger.log_samples(step, samples)
                # What a resumed run continues from (a batch sampled ahead is sampled again).
                extras = streams or {"data": loader.get_state(), "sampler": sampler.state()}
                extras["metrics"] = public(metrics)
                last = step == t.steps or stop.signum is not None
                if ckpt.save(step, trainer.checkpoint_state(), extras, force=last):
                    logger.flush()  # what the checkpoint covers is on disk too
                if stop.signum is not None and step != t.steps:
                    ckpt.wait()
                    raise RunInterrupted(step, stop.signum, str(ckpt.directory))
        return metrics
    finally:
        if ahead is not None:
            ahead.close()
