"""`jaxrl-tools serve`: the policy over JetStream's gRPC orchestrator, or (--openai) an
OpenAI-compatible HTTP API."""

import os
import signal
import sys

from jaxrl_tools.config import ConfigError

HELP = (
    "serve the policy (model.path, or the run's checkpoint) through JetStream's gRPC "
    "orchestrator; text requests get the recipe's chat template (the [serve] extra)"
)
RUNS_MODEL = True


def add_arguments(p) -> None:
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


def run(cfg, args) -> int | None:
    # Ctrl-C is how serve stops, even when started by a process that ignores or blocks
    # SIGINT (both are inherited, and Python then never raises KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.openai:
        return _openai(cfg, args)
    from jaxrl_tools import serve  # noqa: PLC0415  (the [serve] extra)

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
        print(
            f"jaxrl-tools serve: {serve.describe(args.host, args.port)} (Ctrl-C stops)", flush=True
        )
        server.wait_for_termination()  # stops the server when interrupted
    except KeyboardInterrupt:  # the way to stop it: one line, not a traceback
        print("jaxrl-tools: serve stopped (Ctrl-C)", file=sys.stderr, flush=True)
        # JetStream's driver threads are not daemons: one still starting up when Ctrl-C
        # came would hold the process open. Nothing is left to save.
        os._exit(130)  # 128 + SIGINT, the shell's convention
    return None


def _openai(cfg, args) -> int | None:
    from jaxrl_tools import serve_openai  # noqa: PLC0415  (the [agents] extra)

    if args.tools:
        raise ConfigError(
            "serve --openai --tools: with --openai the client runs the tools it declares "
            "(tool calls come back as tool_calls); drop --tools"
        )
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
    return None
