"""The composition root: builds a run's parts from a RunConfig and drives them.

Entry points (the CLI's subcommands) call `sft`, `train`, `evaluate`, `export` and `demo`
here; each only wires library pieces together.
"""

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_tools import data as data_lib
from jaxrl_tools import models, sharding, tasks
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.tokenizer import build_tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ---------------------------------------------------------------------------------- pieces


def make_mesh(cfg: RunConfig):
    """The run's mesh, or None on a single device with the trivial 1x1x1 shape."""
    shape = cfg.trainer.mesh_shape
    if shape is None:
        return sharding.make_mesh((1, -1, 1))
    if shape == (1, 1, 1) and jax.device_count() == 1:
        return None
    return sharding.make_mesh(shape)


def setup_tokenizer(cfg: RunConfig):
    t = cfg.tokenizer
    path = Path(cfg.tokenizer_path)
    if (path / "tokenizer.json").exists() or not t.build:
        return load_tokenizer(path)
    return build_tokenizer(path, vocab_size=t.vocab_size, seed=t.seed)


def tiny_model_config(cfg: RunConfig, tokenizer) -> models.ModelConfig:
    tiny = cfg.model.tiny
    return models.ModelConfig(
        model_type=tiny.model_type,
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        rope_theta=tiny.rope_theta,
        tie_word_embeddings=tiny.tie_word_embeddings,
        attention_bias=tiny.model_type == "qwen2",
        qk_norm=tiny.model_type == "qwen3",
        max_position_embeddings=tiny.max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def setup_model(cfg: RunConfig, tokenizer, mesh=None) -> tuple[models.ModelConfig, Any]:
    """The policy: loaded from `model.path`, or a random-init tiny model."""
    dtype = DTYPES[cfg.model.dtype]
    if cfg.model.path is not None:
        return models.from_pretrained(cfg.model.path, dtype=dtype, mesh=mesh)
    model_cfg = tiny_model_config(cfg, tokenizer)
    params = models.init_params(
        model_cfg, jax.random.key(cfg.model.tiny.seed), dtype=dtype, mesh=mesh
    )
    return model_cfg, params


def setup_tools(cfg: RunConfig) -> list:
    """The tools the config declares (the sandboxed Python tool starts its worker pool here)."""
    from jaxrl_tools.tools import create_tool

    out = []
    for spec in cfg.tools:
        tool = create_tool(spec.cls, dict(spec.config))
        if spec.name:
            tool.name = spec.name
        out.append(tool)
    return out


def make_executor(cfg: RunConfig, tools: list):
    """The ToolExecutor over `tools` (None when there are none: plain generation)."""
    from jaxrl_tools.tools import ToolExecutor

    if not tools:
        return None
    return ToolExecutor(
        tools, max_concurrency=cfg.rollout.tool_concurrency, timeout_s=cfg.rollout.tool_timeout_s
    )


def make_reward(cfg: RunConfig):
    from jaxrl_tools.rewards import CompositeReward

    return CompositeReward([(r.name, r.weight, r.kwargs) for r in cfg.reward])


def task_records(cfg: RunConfig, split: str) -> list[dict]:
    """Records of the generated task (the held-out eval set is drawn from another seed)."""
    d = cfg.data
    n, seed = (
        (d.task_train_size, d.shuffle_seed)
        if split == "train"
        else (d.task_eval_size, d.shuffle_seed + 10_000)
    )
    all_levels = tuple(range(d.task_difficulty + 1))
    levels = all_levels if split == "train" or d.task_eval_all_levels else (d.task_difficulty,)
    # Function calling declares the tool in the system turn; inline protocols need no schema.
    tools = ("python",) if cfg.rollout.protocol in ("qwen", "hermes") else ()
    return [p.to_record(tools=tools) for p in tasks.make_problems(n, seed=seed, difficulty=levels)]


def eval_records(cfg: RunConfig) -> list[dict]:
    if cfg.data.task is not None:
        return task_records(cfg, "eval")
    loader = data_lib.loader_from_config(cfg.data, "eval")
    return [r for batch in loader for r in batch]


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_json_default))


def _json_default(x):
    if isinstance(x, np.generic | np.ndarray):
        return x.tolist()
    return str(x)


# ---------------------------------------------------------------------------------- rollout


class Rollout:
    """Samples trajectories of prompt records with the decode engine and the tools.

    Args:
      cfg: the run config (rollout section: protocol, limits, sampling).
      engine: an `EngineCore` over the policy's architecture.
      tokenizer: the HF tokenizer (chat template, stop strings).
      executor: the ToolExecutor (None: no tools; the protocol is then ignored).
    """

    def __init__(self, cfg: RunConfig, engine, tokenizer, executor):
        from jaxrl_tools.rollout import RolloutLimits

        r = cfg.rollout
        self.cfg, self.engine, self.tokenizer, self.executor = cfg, engine, tokenizer, executor
        self.limits = RolloutLimits(
            max_response_tokens=r.max_response_len,
            max_tool_calls=r.max_tool_calls,
            max_turns=r.max_turns,
            max_obs_tokens=r.max_obs_tokens,
            chunk_size=r.chunk_size,
        )
        # Only the function-calling protocol declares tools in the system turn; inline
        # protocols (ToRL, ReTool, Search-R1) describe them in the prompt.
        function_calling = r.protocol in ("qwen", "hermes")
        self.tools_schema = executor.schemas() if (executor and function_calling) else []
        self.calls = 0

    def __call__(
        self,
        records: Sequence[dict],
        group_size: int,
        params,
        *,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> list:
        from jaxrl_tools.rollout import run_rollouts
        from jaxrl_tools.sampling import SamplingParams

        r = self.cfg.rollout
        temp = r.temperature if temperature is None else temperature
        sampling = SamplingParams(
            temperature=temp, top_k=r.top_k if temp > 0 else 0, top_p=r.top_p if temp > 0 else 1.0
        )
        if seed is None:  # a new key per call, reproducible from the run seed
            seed = self.cfg.trainer.seed * 1_000_003 + self.calls
        self.calls += 1
        prompts = [self.encode_prompt(rec) for rec in records]
        return run_rollouts(
            self.engine,
            params,
            prompts,
            tokenizer=self.tokenizer,
            num_samples=group_size,
            protocol=r.protocol if self.executor is not None else None,
            executor=self.executor,
            limits=self.limits,
            sampling=sampling,
            rng=seed,
        )

    def encode_prompt(self, record: dict) -> list[int]:
        """The record's prompt through the chat template, with its tool declarations."""
        text = data_lib.render_prompt(
            self.tokenizer, record, self.tools_schema or None, self.cfg.data.system_prompt
        )
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        limit = self.cfg.rollout.max_prompt_len
        if len(ids) > limit:
            raise ValueError(
                f"prompt of record {record.get('id', record.get('prompt'))!r} has {len(ids)} "
                f"tokens, more than rollout.max_prompt_len={limit}"
            )
        return ids


def make_engine(cfg: RunConfig, model_cfg, params, tokenizer, mesh=None):
    from jaxrl_tools.engine import EngineCore, next_pow2

    r = cfg.rollout
    prefill = next_pow2(r.max_prompt_len, 16)
    return EngineCore(
        model_cfg,
        params,
        slots=r.slots,
        max_len=prefill + r.max_response_len,
        max_prefill_length=prefill,
        tokenizer=tokenizer,
        mesh=mesh,
        seed=cfg.trainer.seed,
    )


def evaluate(cfg: RunConfig, rollout: Rollout, params, records: Sequence[dict], reward) -> dict:
    """Greedy (or `rollout.eval_temperature`) accuracy and tool statistics on `records`."""
    from jaxrl_tools.rewards import is_correct
    from jaxrl_tools.trainer import rollout_metrics, score_trajectories

    g = cfg.rollout.eval_group_size
    trajs = []
    bs = cfg.data.eval_batch_size
    for i in range(0, len(records), bs):
        trajs += rollout(
            records[i : i + bs],
            g,
            params,
            temperature=cfg.rollout.eval_temperature,
            seed=cfg.trainer.seed + i,
        )
    gts = [records[i // g].get("ground_truth") for i in range(len(trajs))]
    scores, parts = score_trajectories(reward, records, trajs, g)
    metrics = rollout_metrics(trajs, scores, parts)
    metrics["num_problems"] = len(records)
    # Accuracy by the answer alone, whatever the reward (OTC's reward also weighs tool calls).
    kind = "qa" if any(r.name == "qa_em" for r in cfg.reward) else "math"
    correct = np.array([is_correct(t.response_text, gt, kind) for t, gt in zip(trajs, gts)])
    used = np.array([t.num_tool_calls > 0 for t in trajs])
    metrics["reward/accuracy"] = float(correct.mean())
    if g > 1:  # pass@g: any of a problem's g samples correct
        metrics[f"reward/pass@{g}"] = float(correct.reshape(-1, g).any(axis=1).mean())
    levels = np.array([records[i // g].get("difficulty", -1) for i in range(len(trajs))])
    for lv in sorted(set(levels.tolist()) - {-1}):
        sel = levels == lv
        metrics[f"level/{lv}/accuracy"] = float(correct[sel].mean())
        metrics[f"level/{lv}/tool"] = float(used[sel].mean())
    metrics["_examples"] = [
        {
            "prompt": records[i // g].get("prompt"),
            "response": trajs[i].response_text,
            "ground_truth": gts[i],
            "score": float(scores[i]),
        }
        for i in range(min(3, len(trajs)))
    ]
    return metrics


# ---------------------------------------------------------------------------------- stages


def sft_traces(cfg: RunConfig, tokenizer) -> list:
    """SFT traces as segment lists: from `sft.train_files` (jsonl with `segments`) or generated
    for the demo task."""
    if cfg.sft.train_files:
        out = []
        for path in cfg.sft.train_files:
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        out.append(json.loads(line)["segments"])
                    except (json.JSONDecodeError, KeyError) as e:
                        raise ValueError(
                            f"{path}:{n}: not a JSON object with 'segments' ({e})"
                        ) from None
        return out
    problems = tasks.make_problems(
        cfg.sft.num_traces,
        seed=cfg.data.shuffle_seed + 20_000,
        difficulty=tuple(range(cfg.data.task_difficulty + 1)),
    )
    traces = tasks.sft_traces(
        problems,
        tokenizer,
        mix=cfg.sft.tool_mix,
        easy_mix=cfg.sft.easy_tool_mix,
        protocol=cfg.rollout.protocol,
        seed=cfg.data.shuffle_seed,
        system_prompt=cfg.data.system_prompt,
    )
    return [t["segments"] for t in traces]


def run_sft(cfg: RunConfig, model_cfg, params, tokenizer, logger=None, mesh=None):
    from jaxrl_tools import sft

    traces = sft_traces(cfg, tokenizer)
    log.info("SFT on %d traces for %d epochs", len(traces), cfg.sft.epochs)

    def on_step(step, metrics):
        if logger is not None:
            logger.log(step, metrics)
        if step % 20 == 0:
            log.info("SFT step %d: loss %.4f", step, float(metrics["sft/loss"]))

    return sft.train_sft(
        model_cfg,
        params,
        tokenizer,
        traces,
        epochs=cfg.sft.epochs,
        lr=cfg.sft.lr,
        batch_size=cfg.sft.batch_size,
        max_len=cfg.sft.max_len,
        warmup_steps=cfg.sft.warmup_steps,
        micro_batch_size=cfg.optim.micro_batch_size,
        seed=cfg.trainer.seed,
        on_step=on_step,
        mesh=mesh,
    )


def train_records_loader(cfg: RunConfig):
    if cfg.data.task is not None:
        return data_lib.PromptLoader(
            task_records(cfg, "train"), batch_size=cfg.data.batch_size, seed=cfg.data.shuffle_seed
        )
    return data_lib.loader_from_config(cfg.data, "train")


def _strip_private(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("_")}


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
    from jaxrl_tools.checkpoint import Checkpointer
    from jaxrl_tools.metrics import MetricsLogger
    from jaxrl_tools.trainer import RLTrainer

    sharding.initialize_distributed()
    t = cfg.trainer
    run_dir = Path(t.log_dir)
    mesh = make_mesh(cfg)
    tokenizer = setup_tokenizer(cfg)
    model_cfg, params = setup_model(cfg, tokenizer, mesh)
    reward = make_reward(cfg)
    ckpt = Checkpointer(
        t.checkpoint_dir, every=t.checkpoint_every or t.steps or 1, keep=t.keep_checkpoints
    )
    latest = ckpt.latest_step()
    if latest is not None and not t.resume:
        ckpt.close()
        raise ConfigError(
            f"trainer.checkpoint_dir {ckpt.directory} already holds checkpoints of a run (latest "
            f"step {latest}): continue it with --resume (trainer.resume=true), or give "
            "trainer.checkpoint_dir a new folder"
        )
    resuming = latest is not None
    tools = setup_tools(cfg)
    executor = make_executor(cfg, tools)
    engine = make_engine(cfg, model_cfg, params, tokenizer, mesh)
    rollout = Rollout(cfg, engine, tokenizer, executor)
    logger = MetricsLogger(run_dir, total_steps=t.steps, desc=t.run_name)
    summary: dict[str, Any] = {"run_name": t.run_name}
    try:
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
                summary["before"] = evaluate(cfg, rollout, params, evals, reward)
                write_json(before_path, summary["before"])
        if keep_init_params and not resuming:  # the update donates the state's buffers
            summary["init_params"] = jax.tree.map(jnp.copy, params)
        trainer = RLTrainer(
            cfg, model_cfg, params, rollout, reward, pad_id=tokenizer.pad_token_id or 0, mesh=mesh
        )
        loader = train_records_loader(cfg)
        start = 0
        if resuming:
            start, state, extras = ckpt.restore(trainer.checkpoint_state())
            trainer.load_checkpoint_state(state)
            loader.set_state(extras["data"])
            rollout.calls = extras["rollout_calls"]
            log.info("resumed from step %d of %s", start, ckpt.directory)
        metrics: dict = {}
        for step in range(start + 1, t.steps + 1):
            metrics = trainer.step(next(loader))
            if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                ev = evaluate(cfg, rollout, trainer.params, evals, reward)
                metrics.update({f"eval/{k}": v for k, v in _strip_private(ev).items()})
            logger.log(step, metrics)
            extras = {
                "data": loader.get_state(),
                "rollout_calls": rollout.calls,
                "metrics": _strip_private(metrics),
            }
            ckpt.save(step, trainer.checkpoint_state(), extras, force=step == t.steps)
        ckpt.wait()
        summary["final_metrics"] = _strip_private(metrics)
        if evaluate_after:
            summary["after"] = evaluate(cfg, rollout, trainer.params, evals, reward)
        summary["plot"] = str(logger.plot() or "")
        summary["params"] = trainer.params
        summary["model_config"] = model_cfg
        summary["tokenizer"] = tokenizer
        return summary
    finally:
        logger.close()
        ckpt.close()
        for tool in tools:
            _close_tool(tool)


def _close_tool(tool) -> None:
    import asyncio

    try:
        asyncio.run(tool.close())
    except Exception as e:  # noqa: BLE001 - closing must not hide the run's own error
        log.warning("closing tool %s: %s", tool.name, e)


def restore_policy(cfg: RunConfig, step: int | None = None):
    """(model_cfg, params, tokenizer, step) of a run's checkpoint."""
    from jaxrl_tools.checkpoint import Checkpointer
    from jaxrl_tools.trainer import RLTrainer

    mesh = make_mesh(cfg)
    tokenizer = setup_tokenizer(cfg)
    model_cfg, params = setup_model(cfg, tokenizer, mesh)
    reward = make_reward(cfg)
    trainer = RLTrainer(cfg, model_cfg, params, None, reward, pad_id=0, mesh=mesh)
    ckpt = Checkpointer(cfg.trainer.checkpoint_dir)
    try:
        step, state, _ = ckpt.restore(trainer.checkpoint_state(), step)
    finally:
        ckpt.close()
    return model_cfg, state["actor"].params, tokenizer, step


def export(cfg: RunConfig, out: str, step: int | None = None) -> Path:
    """Writes a checkpoint's policy as a Hugging Face folder (weights, config, tokenizer)."""
    model_cfg, params, tokenizer, step = restore_policy(cfg, step)
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
    try:
        executor = make_executor(cfg, tools)
        rollout = Rollout(cfg, make_engine(cfg, model_cfg, params, tokenizer), tokenizer, executor)
        reward = make_reward(cfg)
        return evaluate(cfg, rollout, params, eval_records(cfg), reward)
    finally:
        for tool in tools:
            _close_tool(tool)


def sft_only(cfg: RunConfig, out: str) -> Path:
    """The SFT stage alone; writes the result as a Hugging Face folder (`model.path` for RL)."""
    tokenizer = setup_tokenizer(cfg)
    model_cfg, params = setup_model(cfg, tokenizer)
    params = run_sft(cfg, model_cfg, params, tokenizer)
    models.save_pretrained(model_cfg, params, out)
    tokenizer.save_pretrained(out)
    return Path(out)


# ---------------------------------------------------------------------------------- demo


def _report_row(name: str, m: dict) -> str:
    levels = sorted(k.split("/")[1] for k in m if k.startswith("level/") and k.endswith("/tool"))
    by_level = ", ".join(
        f"L{lv}: {m[f'level/{lv}/accuracy'] * 100:.0f}% / {m[f'level/{lv}/tool'] * 100:.0f}%"
        for lv in levels
    )
    return (
        f"| {name} | {m['reward/accuracy'] * 100:.1f}% | {m['tools/used_frac'] * 100:.1f}% | "
        f"{m['tools/calls_per_response']:.2f} | {m['tools/error_rate']:.2f} | {by_level} |"
    )


def _productivity(m: dict) -> str:
    """OTC's tool productivity: correct answers per tool call."""
    calls = m["tools/calls_per_response"]
    return f"{m['reward/accuracy'] / calls:.2f}" if calls else "n/a (no calls)"


def demo_report(summary: dict, baseline: dict | None = None) -> str:
    """The demo's report: the SFT policy vs the RL policy (and a baseline RL run) on held-out
    problems."""
    b, a = summary["before"], summary["after"]
    acc_b, acc_a = b["reward/accuracy"] * 100, a["reward/accuracy"] * 100
    tool_b, tool_a = b["tools/used_frac"] * 100, a["tools/used_frac"] * 100
    name = f"SFT + RL ({summary['reward_name']})"
    lines = [
        f"# jaxrl-tools demo: {summary['run_name']}",
        "",
        f"Held-out problems: {a['num_problems']} ({summary['eval_desc']}, sandboxed Python tool).",
        "",
        "| policy | accuracy | responses calling the tool | tool calls / response | "
        "tool error rate | by difficulty (accuracy / tool use) |",
        "| --- | --- | --- | --- | --- | --- |",
        _report_row("SFT (before RL)", b),
    ]
    if baseline is not None:
        lines.append(_report_row(f"SFT + RL ({baseline['reward_name']})", baseline["after"]))
    lines += [
        _report_row(name, a),
        "",
        f"RL ({summary['reward_name']}) changed held-out accuracy by {acc_a - acc_b:+.1f} points "
        f"({acc_b:.1f}% -> {acc_a:.1f}%) and the tool-call rate by {tool_a - tool_b:+.1f} points.",
    ]
    if baseline is not None:
        base = baseline["after"]
        calls, base_calls = a["tools/calls_per_response"], base["tools/calls_per_response"]
        change = f" ({(calls / base_calls - 1) * 100:+.0f}%)" if base_calls else ""
        lines.append(
            f"Against RL with {baseline['reward_name']} from the same SFT policy: accuracy "
            f"{(a['reward/accuracy'] - base['reward/accuracy']) * 100:+.1f} points, tool calls "
            f"per response {calls:.2f} vs {base_calls:.2f}{change}, tool productivity (correct "
            f"answers per tool call) {_productivity(a)} vs {_productivity(base)}."
        )
    lines += ["", "Examples after RL:"]
    for ex in a.get("_examples", []):
        lines.append(
            f"- {ex['prompt']!r} -> {ex['response']!r} (answer {ex['ground_truth']}, "
            f"score {ex['score']:g})"
        )
    if summary.get("plot"):
        lines += ["", f"Training curves: {summary['plot']}"]
    return "\n".join(lines) + "\n"


def _reward_name(cfg: RunConfig) -> str:
    return "+".join(r.name for r in cfg.reward)


def demo(cfg: RunConfig, *, baseline_reward: str | None = None) -> dict:
    """SFT cold start, held-out eval, GRPO with the sandbox in the loop, held-out eval, report.

    With `baseline_reward` (e.g. "math"), a second RL run starts from the same SFT policy with
    only that reward, and the report compares the two (OTC vs plain GRPO).
    """
    import dataclasses

    from jaxrl_tools.config import RewardSpec

    t0 = time.perf_counter()
    summary = train(
        cfg, evaluate_before=True, evaluate_after=True, keep_init_params=baseline_reward is not None
    )
    summary["reward_name"] = _reward_name(cfg)
    r = cfg.rollout
    summary["eval_desc"] = (
        "greedy decoding"
        if r.eval_temperature == 0
        else f"sampling at temperature {r.eval_temperature:g}, {r.eval_group_size} per problem"
    )
    out = Path(cfg.trainer.log_dir)
    baseline = None
    if baseline_reward is not None:
        t = cfg.trainer
        base_cfg = dataclasses.replace(
            cfg,
            reward=(RewardSpec(baseline_reward, 1.0, {}),),
            trainer=dataclasses.replace(
                t,
                log_dir=str(out / "baseline"),
                run_name=f"{t.run_name}_baseline",
                checkpoint_dir=str(Path(t.checkpoint_dir) / "baseline"),
            ),
        )
        # A resumed run has no copy of its SFT policy; SFT is deterministic, so the baseline
        # then redoes it (or resumes its own checkpoint).
        baseline = train(
            base_cfg, evaluate_after=True, init_params=summary.pop("init_params", None)
        )
        baseline["reward_name"] = baseline_reward
    summary["wall_time_s"] = time.perf_counter() - t0
    report = demo_report(summary, baseline)
    (out / "report.md").write_text(report)
    keep = lambda d: {k: v for k, v in d.items() if k not in _NOT_JSON}
    write_json(
        out / "report.json", {**keep(summary), "baseline": keep(baseline) if baseline else None}
    )
    print(report)
    print(f"(wall time {summary['wall_time_s']:.0f} s; report in {out / 'report.md'})")
    return summary


_NOT_JSON = ("params", "model_config", "tokenizer", "init_params")
