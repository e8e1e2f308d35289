"""`jaxrl-tools`: demo, train, check, plan, sft, eval, export, repro, serve, prepare.

Every subcommand takes `--config` (a YAML file or a shipped recipe name) and dotted overrides
(`trainer.steps=10 optim.lr=1e-6`, `--trainer.steps 10`). A mistake in the config, the data,
the model folder or the machine's set-up is one line, `jaxrl-tools: <what and how to fix it>`,
and exit status 2. `repro` exits 1 when a stage differs past its tolerance, `plan` when the run
does not fit.
"""

import argparse
import importlib
import logging
import re
import sys
from pathlib import Path

import jax

from jaxrl_tools import configs, host, setup, sharding, smoke
from jaxrl_tools.commands import COMMANDS, DEMO_CONFIG, command_name
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.data import DataError
from jaxrl_tools.tools import SandboxUnavailableError
from jaxrl_tools.train.signals import RunInterrupted

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


def _dispatch(args, cfg, command) -> int | None:
    if getattr(command, "RUNS_MODEL", False) and not getattr(args, "scripted", None):
        setup.use_compile_cache(cfg)
        if jax.default_backend() == "cpu":
            host.keep_freed_memory()
    if getattr(args, "smoke", False):  # runs/smoke/<run_name> is scratch: start it afresh
        smoke.clear_outputs(cfg)
    return command.run(cfg, args)


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

    modules = {
        command_name(m): importlib.import_module(f"jaxrl_tools.commands.{m}") for m in COMMANDS
    }
    for name, module in modules.items():
        p = sub.add_parser(name, help=module.HELP)
        if getattr(module, "TAKES_CONFIG", True):
            p.add_argument("--config", help=f"YAML file or shipped recipe (default {DEMO_CONFIG})")
            p.add_argument("overrides", nargs="*", help="section.key=value overrides")
            _process_flags(p)
        module.add_arguments(p)
    rest, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(rest)
    args.overrides = [*overrides, *args.overrides]
    # orbax logs every checkpoint step at INFO through absl: keep the console for the run.
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.basicConfig(  # force: importing orbax already gave absl's default handler
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    try:
        command = modules[args.command]
        if not getattr(command, "TAKES_CONFIG", True):  # no config, no devices
            return command.run(args)
        _start_processes(args)
        code = _dispatch(args, _load(args), command)
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
