"""`jaxrl-tools serve --openai`: the run's policy over HTTP, OpenAI-compatible.

The recipe's policy (`model.path`, or the run's checkpoint) decodes on the rollout engine
(`make_engine`: the recipe's slots, prompt and response lengths, compute dtype), every request
a sample of one continuously batched driver (`EngineBackend`); chat requests go through the
tokenizer's chat template with the request's tools, and tool calls come back as OpenAI
`tool_calls` read by the recipe's parser (`TemplateChat`). Listens on 127.0.0.1 unless told
otherwise; `--api-key` (or $JAXRL_TOOLS_API_KEY) makes the API ask for a key, and a bind
beyond the loopback without one is warned about.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket

from jaxrl_tools import run
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.gateway.chat import TemplateChat
from jaxrl_tools.gateway.engine_backend import EngineBackend
from jaxrl_tools.rollout.loop import RolloutLimits
from jaxrl_tools.rollout.sampler import declares_tools
from jaxrl_tools.tools import get_parser

log = logging.getLogger(__name__)


API_KEY_ENV = "JAXRL_TOOLS_API_KEY"


def _bound_socket(host: str, port: int) -> socket.socket:
    """The listening socket, opened before the model loads: a taken port is a one-line error
    now, not after minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"serve --openai: cannot listen on {host}:{port} ({e.strerror}): pick another --port "
            "or --host"
        ) from None
    return sock


def unguarded(sock: socket.socket, api_key: str | None) -> bool:
    """Whether `sock` listens beyond this machine with no API key asked for."""
    return api_key is None and not ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def build_app(
    cfg: RunConfig, *, from_checkpoint: bool, step: int | None, api_key: str | None = None
):
    """The policy's ASGI app and its backend (`aclose` it when done)."""
    from jaxrl_tools.gateway.app import make_app  # noqa: PLC0415 -- starlette: [agents]

    mesh = run.make_mesh(cfg)
    model_cfg, params, tokenizer, what = run.load_policy(
        cfg, from_checkpoint=from_checkpoint, step=step, mesh=mesh
    )
    engine = run.policy_engine(cfg, model_cfg, params, tokenizer, mesh)
    protocol = cfg.rollout.protocol
    parser = get_parser(protocol) if protocol != "none" and declares_tools(protocol) else None
    limits = RolloutLimits(max_response_tokens=engine.max_len, chunk_size=cfg.rollout.chunk_size)
    backend = EngineBackend(
        engine, params, tokenizer, model=cfg.trainer.run_name, limits=limits, seed=cfg.trainer.seed
    )
    chat = TemplateChat(tokenizer, parser, eos_ids=engine.eos_token_ids)
    log.info("serving %s (%d slots, %d tokens of context)", what, engine.slots, engine.max_len)
    return make_app(backend, chat, api_key=api_key), backend


def serve_openai(
    cfg: RunConfig,
    *,
    from_checkpoint: bool,
    step: int | None,
    host: str,
    port: int,
    api_key: str | None = None,
) -> None:
    """Serves until interrupted (Ctrl-C); with `api_key` (else $JAXRL_TOOLS_API_KEY) the API
    asks for it."""
    import uvicorn  # noqa: PLC0415 -- the [agents] extra

    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    sock = _bound_socket(host, port)
    if unguarded(sock, api_key):
        log.warning(
            "serve --openai on %s without an API key: anyone who reaches this address can use "
            "the model; set --api-key or $%s",
            host,
            API_KEY_ENV,
        )
    app, backend = build_app(cfg, from_checkpoint=from_checkpoint, step=step, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    print(f"jaxrl-tools serve: OpenAI API on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)

    async def main():
        try:
            await server.serve(sockets=[sock])
        finally:
            await backend.aclose()

    asyncio.run(main())
