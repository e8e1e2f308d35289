"""`jaxrl-tools serve`: a run's policy behind JetStream's orchestrator, over gRPC.

JetStream's own client (``jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub``) sends a
``DecodeRequest``: text, which the server puts through the recipe's chat template (with its
system prompt) before tokenizing, or token ids, taken as they are. Decoding is the training
engine's (``engine.jetstream.DecodeEngine``) with the recipe's eval sampling settings, on the
compute-dtype copy of the weights. Part of the ``[serve]`` extra.

With ``tools`` (``jaxrl-tools serve --tools``) the recipe's tools run server-side, in the
project's sandbox: each text request goes through the training agent loop (``rollout.Sampler``:
the recipe's protocol, tool budget, observations appended to the context), and the answer is one
message with the whole response (tool outputs included) and its token ids. That path is the
gRPC service JetStream's client speaks (``ToolServicer``), without JetStream's orchestrator,
which has no way to pause a request for a tool. Without ``tools`` a response that calls a tool
ends there, as text, for the client to act on.

The server speaks plain-text gRPC without authentication, so it listens on 127.0.0.1 unless
told otherwise (``--host``). A request it cannot serve as sent (no content, a token id outside
the model's vocabulary, a prompt longer than the engine takes) is refused with
INVALID_ARGUMENT and a message naming what is wrong, before it reaches the engine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
from concurrent import futures

import numpy as np

from jaxrl_tools import prompts, run
from jaxrl_tools.config import ConfigError, RunConfig
from jaxrl_tools.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def describe(host: str, port: int) -> str:
    """Where the server listens, with a warning when that is reachable from other machines."""
    if is_loopback(host):
        return f"JetStream gRPC on {address(host, port)}"
    return (
        f"JetStream gRPC on {address(host, port)}, plain text and no authentication: anyone "
        "who can reach this address can use the model"
    )


def _listen(server, host: str, port: int) -> None:
    where = address(host, port)
    try:
        bound = server.add_insecure_port(where)
    except RuntimeError:  # grpc's "Failed to bind": the port is taken, or not our address
        bound = 0
    if not bound:
        raise ConfigError(
            f"serve: cannot listen on {where}: the port is in use or --host is not an address "
            "of this machine; pick another --port or --host"
        )


class BadRequest(ValueError):
    """A request the server refuses (INVALID_ARGUMENT); the message says what to send."""


NO_CONTENT = "the request has no content: set text_content.text or token_content.token_ids"


def check_prompt(ids, *, vocab_size: int, limit: int, max_prompt_len: int) -> list[int]:
    """A request's prompt ids, or BadRequest naming the first id outside the vocabulary, or
    the prompt's length when it is longer than the engine takes (JetStream would keep its last
    `limit` tokens without a word; its response has no field to say so, the status does)."""
    ids = list(ids)
    if not ids:
        raise BadRequest(NO_CONTENT)
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise BadRequest(
                f"token id {t} (position {i}) is outside the model's vocabulary, ids "
                f"0..{vocab_size - 1}: send ids of this model's tokenizer"
            )
    if len(ids) > limit:
        raise BadRequest(too_long(len(ids), limit, max_prompt_len))
    return ids


def too_long(n: int, limit: int, max_prompt_len: int) -> str:
    rounded = f", rounded up to {limit}" if limit != max_prompt_len else ""
    return (
        f"the prompt is {n} tokens, more than this server takes ({limit}: "
        f"rollout.max_prompt_len={max_prompt_len}{rounded}): shorten it, or serve with a larger "
        "rollout.max_prompt_len"
    )


def _driver_class(orchestrator):
    class Driver(orchestrator.Driver):
        """JetStream 0.2.2's Driver with three changes.

        Token ids are made an array (JetStream's padding needs one). No BOS is added to a
        request: a text request's chat template already has the one the model was trained with
        (if any), and token ids are taken as sent (JetStream would prepend one to every new
        conversation, and fails on a tokenizer without one, as Qwen's).

        Its generate thread is restarted when it asserts: the generate loop asserts that some
        slot is busy after looking for new requests; when the detokenize thread frees the last
        busy slot in between (a request just finished), the assertion fails and JetStream kills
        the process. Every slot is free at that point, so entering the loop again, with a fresh
        decode state, loses nothing.
        """

        def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
            if not isinstance(request.prefill_content, str):  # gRPC's ids come as a list
                request.prefill_content = np.asarray(request.prefill_content, np.int32)
            return super()._process_prefill_content(request, tokenizer, False, max_prefill_length)

        def _generate_thread(self, idx: int):
            while self.live:
                try:
                    return super()._generate_thread(idx)
                except AssertionError as e:
                    slots = self._generate_engines[idx].max_concurrent_decodes
                    if self._generate_slots[idx].qsize() < slots:
                        raise  # a slot is busy: a real failure
                    log.info("generate thread %d: all slots came free mid-step (%s)", idx, e)

    return Driver


def _orchestrator_class(orchestrator):
    import grpc  # noqa: PLC0415  (the [serve] extra)

    class Orchestrator(orchestrator.LLMOrchestrator):
        """JetStream's servicer, refusing (INVALID_ARGUMENT) what the Driver would fail on or
        decode wrongly. A text request is tokenized here (chat template included) to check its
        length, and goes on as those ids (the Driver pads them as it would the text's)."""

        def __init__(self, driver, engine, max_prompt_len: int):
            super().__init__(driver=driver)
            self.engine, self.max_prompt_len = engine, max_prompt_len

        def _get_prefill_content(self, request):
            which = request.WhichOneof("content")
            if which == "text_content":
                text = request.text_content.text
                if not text:
                    raise BadRequest(NO_CONTENT)
                render = self.engine.render_prompt
                text = render(text) if render is not None else text
                ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
                return self._check(ids), False  # False: the response carries text
            if which == "token_content":
                return self._check(request.token_content.token_ids), True
            raise BadRequest(NO_CONTENT)

        def _check(self, ids):
            return check_prompt(
                ids,
                vocab_size=self.engine.vocab_size,
                limit=self.engine.max_prefill_length,
                max_prompt_len=self.max_prompt_len,
            )

        async def Decode(self, request, context=None):  # noqa: N802  (the gRPC method's name)
            # JetStream's Decode reads the request (our checks) before its first await: a bad
            # request raises at the first step, before anything is queued.
            responses = super().Decode(request, context)
            try:
                first = await anext(responses)
            except BadRequest as e:
                if context is None:  # called directly, not over gRPC
                    raise
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except StopAsyncIteration:
                return
            yield first
            async for response in responses:
                yield response

    return Orchestrator


def _server_class(server_lib):
    import grpc  # noqa: PLC0415  (the [serve] extra)
    from jetstream.core.proto import jetstream_pb2_grpc  # noqa: PLC0415

    class Server(server_lib.JetStreamServer):
        """JetStream 0.2.2's server, with the servicer given and listening on `host` (its own
        binds every interface, [::], with its plain LLMOrchestrator)."""

        def __init__(self, driver, servicer, threads: int, host: str, port: int):
            self._driver = driver
            self._executor = futures.ThreadPoolExecutor(max_workers=threads)
            self._loop = asyncio.new_event_loop()
            self._loop.set_default_executor(self._executor)
            self._loop_thread = threading.Thread(target=self._loop.run_forever)
            self._loop_thread.start()

            async def init():
                server = grpc.aio.server(self._executor)
                jetstream_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
                _listen(server, host, port)
                return server

            try:
                self._grpc_server = asyncio.run_coroutine_threadsafe(init(), self._loop).result()
            except BaseException:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop_thread.join()
                raise

    return Server


def jetstream_engine(cfg: RunConfig, model_cfg, params, tokenizer, mesh=None):
    """The run's engine as JetStream's (`run.policy_engine`), with the eval sampling settings,
    prompts rendered through the chat template with the recipe's system prompt."""
    r = cfg.rollout
    sampling = SamplingParams(
        temperature=r.eval_temperature,
        top_k=r.top_k if r.eval_temperature > 0 else 0,
        top_p=r.top_p if r.eval_temperature > 0 else 1.0,
    )
    engine = run.policy_engine(
        cfg,
        model_cfg,
        params,
        tokenizer,
        mesh,
        engine="jetstream",
        sampling=sampling,
        # JetStream stops a request when the length after a generate call passes max_tokens,
        # dropping that call's tokens: one token per call keeps max_tokens exact.
        steps_per_generate=1,
    )
    system = cfg.data.system_prompt
    engine.render_prompt = lambda text: prompts.render_prompt(
        tokenizer, {"prompt": text}, None, system
    )
    return engine


def tool_servicer(sampler, params, temperature: float):
    """JetStream's gRPC ``Orchestrator`` service over the agent loop (tools run server-side).

    Requests are served one at a time (the sampler's engine is not shared); ``max_tokens`` is
    the recipe's ``rollout.max_response_len``. Token-id requests are refused: tool calls are
    found in the text.
    """
    import grpc  # noqa: PLC0415  (the [serve] extra)
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc  # noqa: PLC0415

    class ToolServicer(jetstream_pb2_grpc.OrchestratorServicer):
        def __init__(self):
            self.lock = threading.Lock()

        def Decode(self, request, context):  # noqa: N802  (the gRPC method's name)
            which = request.WhichOneof("content")
            if which is None or (which == "text_content" and not request.text_content.text):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, NO_CONTENT)
            if which != "text_content":
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "serve --tools takes text requests (tool calls are found in the text)",
                )
            record = {"prompt": request.text_content.text}
            # The length the sampler would refuse with a DataError (an UNKNOWN status), told.
            ids = prompts.encode_prompt(
                sampler.tokenizer, record, sampler.tools_schema or None, sampler.system_prompt
            )
            limit = sampler.settings.max_prompt_len
            if len(ids) > limit:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, too_long(len(ids), limit, limit))
            with self.lock:
                traj = sampler([record], 1, params, temperature=temperature)[0]
            sample = jetstream_pb2.DecodeResponse.StreamContent.Sample(
                text=sampler.tokenizer.decode(traj.response_ids), token_ids=traj.response_ids
            )
            content = jetstream_pb2.DecodeResponse.StreamContent(samples=[sample])
            yield jetstream_pb2.DecodeResponse(stream_content=content)

        def HealthCheck(self, request, context):  # noqa: N802
            return jetstream_pb2.HealthCheckResponse(is_live=True)

    return ToolServicer()


class ToolServer:
    """A gRPC server of ``tool_servicer`` (``stop()``, ``wait_for_termination()``, like
    JetStream's); stopping it closes the tools."""

    def __init__(self, servicer, port: int, tools: list, host: str = DEFAULT_HOST):
        import grpc  # noqa: PLC0415
        from jetstream.core.proto import jetstream_pb2_grpc  # noqa: PLC0415

        self.tools = tools
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        jetstream_pb2_grpc.add_OrchestratorServicer_to_server(servicer, self.server)
        try:
            _listen(self.server, host, port)
        except ConfigError:
            run.close_tools(tools)
            raise
        self.server.start()

    def stop(self):
        self.server.stop(grace=5).wait()
        run.close_tools(self.tools)

    def wait_for_termination(self):
        try:
            self.server.wait_for_termination()
        finally:
            self.stop()


def start_server(
    cfg: RunConfig,
    *,
    from_checkpoint: bool,
    step: int | None,
    port: int,
    tools: bool = False,
    host: str = DEFAULT_HOST,
):
    """Loads the policy (the run's checkpoint, or ``model.path``) and starts the gRPC server on
    ``host:port`` (``stop()``, ``wait_for_termination()``): JetStream's orchestrator, or with
    ``tools`` the agent loop with the recipe's tools run server-side (``tool_servicer``)."""
    from jaxrl_tools.engine.jetstream import import_orchestrator  # noqa: PLC0415

    if tools and not cfg.tools:  # before anything loads
        raise ConfigError("serve --tools: the recipe declares no tools (its `tools:` section)")
    orchestrator = import_orchestrator()
    from jetstream.core import server_lib  # noqa: PLC0415  (after the logging fix-up above)

    mesh = run.make_mesh(cfg)
    model_cfg, params, tokenizer, what = run.load_policy(
        cfg, from_checkpoint=from_checkpoint, step=step, mesh=mesh
    )
    if tools:
        started = run.setup_tools(cfg)
        sampler = run.make_sampler(cfg, model_cfg, params, tokenizer, started, mesh)
        servicer = tool_servicer(sampler, params, cfg.rollout.eval_temperature)
        server = ToolServer(servicer, port, started, host)
        names = ", ".join(t.name for t in started)
        where = address(host, port)
        log.info("serving %s on %s with tools run server-side: %s", what, where, names)
        return server
    engine = jetstream_engine(cfg, model_cfg, params, tokenizer, mesh)
    driver = _driver_class(orchestrator)(
        prefill_engines=[engine],
        generate_engines=[engine],
        prefill_params=[params],
        generate_params=[params],
        interleaved_mode=True,
    )
    servicer = _orchestrator_class(orchestrator)(driver, engine, cfg.rollout.max_prompt_len)
    try:
        server = _server_class(server_lib)(driver, servicer, max(engine.slots, 8), host, port)
        server.start()
    except BaseException:  # a port in use, or Ctrl-C during start-up
        driver.stop()  # its detokenize thread would keep the process alive
        raise
    log.info("serving %s on %s (%d slots)", what, address(host, port), engine.slots)
    return server
