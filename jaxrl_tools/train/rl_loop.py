"""The RL loop: steps `start + 1 .. trainer.steps`, each a sampled batch and one update.

`run_steps` samples each step's batch (`collect_batch`, DAPO's rounds included), runs the
trainer's step, logs, evaluates every `trainer.eval_every` steps and checkpoints what a resumed
run continues from (the policy, the data and sampler streams). With `trainer.max_staleness: k`
the batches are sampled up to k policy versions ahead of the updates, in a worker thread
(`rollout.ahead.RolloutsAhead`), and the update's device work takes its turn in the worker's
sequence of device calls.
`run.train` builds the parts and calls it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jaxrl_tools import algorithms
from jaxrl_tools.config import RunConfig
from jaxrl_tools.rollout import RolloutsAhead, Sampler
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

    def streams() -> dict:
        return {"data": loader.get_state(), "sampler": sampler.state()}

    ahead = None
    if t.max_staleness and start < t.steps:
        ahead = RolloutsAhead(
            rollout,
            sampler.engine.serving_copy(trainer.params),
            start=start,
            last=t.steps,
            max_staleness=t.max_staleness,
            partial=t.partial_rollouts,
            streams=streams,
        )

    def update(step: int, batch):
        """Dispatches update `step`; with rollouts ahead, publishes its weights for them."""
        dispatched = trainer.dispatch(batch)
        if ahead is not None and ahead.wanted(step):
            ahead.publish(step, sampler.engine.serving_copy(trainer.params))
        return dispatched

    # Device work of this thread: with rollouts ahead, in its turn of the worker's sequence.
    turn = (lambda work: work()) if ahead is None else ahead.turn
    try:
        with StopOnSignal() as stop:
            for step in range(start + 1, t.steps + 1):
                t0 = time.perf_counter()
                if ahead is not None:
                    (batch, rollout_s), pipeline = ahead.take(step)
                else:
                    (batch, rollout_s), pipeline = rollout(step, trainer.params), {}
                samples = batch.metrics.pop("_samples", None)  # rows, not a metric
                metrics = trainer.finish(turn(lambda: update(step, batch)))  # noqa: B023
                if diverged := trainer.diverged(metrics):  # nothing of this step is saved
                    logger.log(step, metrics)
                    ckpt.wait()
                    raise NonFiniteUpdate(step, diverged, ckpt.latest_step(), str(ckpt.directory))
                metrics["time/rollout_s"] = rollout_s
                n_tokens = batch.metrics["rollout/tokens"]
                metrics["throughput/rollout_tokens_per_s"] = n_tokens / max(rollout_s, 1e-9)
                metrics.update(pipeline, **_staleness(metrics, step))
                metrics["time/step_s"] = time.perf_counter() - t0
                if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                    ev = turn(lambda: evaluate(trainer.params, step))  # noqa: B023
                    metrics.update({f"eval/{k}": v for k, v in public(ev).items()})
                if step % t.log_every == 0 or step == t.steps:
                    logger.log(step, metrics)
                if samples:
                    logger.log_samples(step, samples)
                # What a resumed run continues from: the streams before the batches sampled
                # ahead (those are sampled again, with the checkpoint's weights).
                before = ahead.streams_before(step + 1) if ahead is not None else None
                extras = before or streams()
                extras["metrics"] = public(metrics)
                last = step == t.steps or stop.signum is not None
                state = trainer.checkpoint_state()
                if turn(lambda: ckpt.save(step, state, extras, force=last)):  # noqa: B023
                    logger.flush()  # what the checkpoint covers is on disk too
                if stop.signum is not None and step != t.steps:
                    ckpt.wait()
                    raise RunInterrupted(step, stop.signum, str(ckpt.directory))
        return metrics
    finally:
        if ahead is not None:
            ahead.close()


def _staleness(metrics: dict, step: int) -> dict[str, float]:
    """How many versions older than the update's starting weights (version step - 1) the
    batch's model tokens are: the most and the mean (`Trajectory.versions`)."""
    if "rollout/version_min" not in metrics:
        return {}
    return {
        "async/staleness_max": step - 1 - metrics.pop("rollout/version_min"),
        "async/staleness_mean": step - 1 - metrics.pop("rollout/version_mean"),
    }
