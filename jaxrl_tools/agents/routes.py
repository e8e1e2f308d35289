"""The gateway's routes over every agent run of a rollout, each run under its own path
(`/run/<name>/v1/...`), in process or on a loopback port (`http_base_url`)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import socket
from typing import TYPE_CHECKING

from jaxrl_tools.gateway.backend import Completion, Generation, OnTokens
from jaxrl_tools.gateway.chat import TemplateChat
from jaxrl_tools.gateway.engine_backend import EngineBackend

if TYPE_CHECKING:
    from jaxrl_tools.agents.rollouts import _EpisodeBackend


_RUN = contextvars.ContextVar("agent_run")  # the run a request on the shared routes is from
CURRENT_GATEWAY = contextvars.ContextVar("agent_gateway")  # the rollout's, for `http_base_url`
_RUN_PATH = re.compile(r"/run/([^/]+)(/.*)")


class Runs:
    """The `Backend` of the shared routes: each request goes to its run's `_EpisodeBackend`
    (named by the path its client sends to)."""

    def __init__(self, shared: EngineBackend):
        self.tokenizer, self.model = shared.tokenizer, shared.model
        self.max_context = shared.max_context
        self.runs: dict[str, _EpisodeBackend] = {}  # by run name

    async def generate(self, gen: Generation, on_tokens: OnTokens | None = None) -> Completion:
        return await self.runs[_RUN.get()].generate(gen, on_tokens)


class Gateway:
    """The gateway's routes over every run of a rollout, each run under its own path
    (`/run/<name>/v1/...`): in process for the official client (one app and one HTTP client
    for all runs: a client each costs milliseconds), and on a loopback port once an agent asks
    for one (`http_base_url`)."""

    def __init__(self, runs: Runs, chat: TemplateChat):
        import httpx  # noqa: PLC0415 -- the [agents] extra
        import openai  # noqa: PLC0415

        from jaxrl_tools.gateway.app import make_app  # noqa: PLC0415 -- starlette: [agents]

        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
        self.app = make_app(runs, chat)
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.routed), base_url="http://policy", timeout=None
        )
        self.client = openai.AsyncOpenAI(
            base_url="http://policy/v1", api_key="in-process", http_client=self.http, max_retries=0
        )
        self._server, self._serving, self._started = None, None, None

    async def routed(self, scope, receive, send):
        match = _RUN_PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if match is not None:
            _RUN.set(match[1])
            scope = {**scope, "path": match[2], "raw_path": match[2].encode()}
        await self.app(scope, receive, send)

    def client_for(self, run: str):
        return self.client.with_options(base_url=f"http://policy/run/{run}/v1")

    async def loopback(self) -> str:
        if self._started is None:  # one server, however many runs ask at once
            self._started = asyncio.ensure_future(self._serve())
        return await asyncio.shield(self._started)

    async def _serve(self) -> str:
        import uvicorn  # noqa: PLC0415 -- the [agents] extra

        sock = socket.create_server(("127.0.0.1", 0))
        config = uvicorn.Config(self.routed, log_level="warning", lifespan="off", interface="asgi3")
        self._server = uvicorn.Server(config)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # it failed to start: its error
            await asyncio.sleep(0.005)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def aclose(self) -> None:
        if self._serving is not None:
            self._server.should_exit = True
            await asyncio.gather(self._serving, return_exceptions=True)
        await self.client.close()


async def http_base_url(client) -> str:
    """The gateway of the run `client` (the agent's) belongs to, as an OpenAI base URL over
    HTTP on 127.0.0.1 (".../v1"), served for this rollout from the first call on: for agents
    whose model calls leave the process or go through another HTTP client. No authentication:
    the port is the loopback's, for the rollout's length."""
    gateway = CURRENT_GATEWAY.get(None)
    if gateway is None:
        raise RuntimeError("http_base_url: only a rollout.agent run has a gateway")
    return await gateway.loopback() + client.base_url.path.rstrip("/")
