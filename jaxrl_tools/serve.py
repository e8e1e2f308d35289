"""`jaxrl-tools serve`: a run's policy behind JetStream's orchestrator, over gRPC.

JetStream's own client (``jetstream.core.proto.jetstream_pb2_grpc.OrchestratorStub``) sends a
``DecodeRequest``: text, which the server puts through the recipe's chat template (with its
system prompt) before tokenizing, or token ids, taken as they are. Decoding is the training
engine's (``rollout.jetstream.DecodeEngine``) with the recipe's eval sampling settings, on the
compute-dtype copy of the weights. Part of the ``[serve]`` extra. Tools are not run server-side:
a response that calls one ends there, as text, for the client to act on.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxrl_tools import prompts, run
from jaxrl_tools.config import RunConfig
from jaxrl_tools.rollout.kernels import next_pow2
from jaxrl_tools.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)


def _driver_class(orchestrator):
    class Driver(orchestrator.Driver):
        """JetStream 0.2.2's Driver with two changes.

        Token ids are made an array (JetStream's padding needs one), and no BOS is added to a
        request: a text request's chat template already has the one the
        model was trained with (if any), and token ids are taken as sent (JetStream would
        prepend one to every new conversation, and fails on a tokenizer without one, as Qwen's).

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
                    if self._generate_slots[idx].qsize() < self._generate_engines[idx].slots:
                        raise  # a slot is busy: a real failure
                    log.info("generate thread %d: all slots came free mid-step (%s)", idx, e)

    return Driver


def make_engine(cfg: RunConfig, model_cfg, params, tokenizer, mesh=None):
    """The JetStream engine of a run's policy: its slots and lengths, eval sampling settings,
    prompts rendered through the chat template with the recipe's system prompt."""
    from jaxrl_tools.rollout.jetstream import DecodeEngine  # noqa: PLC0415  (the [serve] extra)

    r = cfg.rollout
    prefill = next_pow2(r.max_prompt_len, 16)
    sampling = SamplingParams(
        temperature=r.eval_temperature,
        top_k=r.top_k if r.eval_temperature > 0 else 0,
        top_p=r.top_p if r.eval_temperature > 0 else 1.0,
    )
    dtypes = cfg.model.dtypes
    engine = DecodeEngine(
        model_cfg,
        params,  # cast to dtype once, by the engine
        slots=r.slots,
        max_len=prefill + r.max_response_len,
        max_prefill_length=prefill,
        tokenizer=tokenizer,
        mesh=mesh,
        dtype=dtypes.compute_dtype,
        cache_dtype=dtypes.cache_dtype,
        sampling=sampling,
        seed=cfg.trainer.seed,
        # JetStream stops a request when the length after a generate call passes max_tokens,
        # dropping that call's tokens: one token per call keeps max_tokens exact.
        steps_per_generate=1,
    )
    system = cfg.data.system_prompt
    engine.render_prompt = lambda text: prompts.render_prompt(
        tokenizer, {"prompt": text}, None, system
    )
    return engine


def start_server(cfg: RunConfig, *, from_checkpoint: bool, step: int | None, port: int):
    """Loads the policy (the run's checkpoint, or ``model.path``) and starts the gRPC server on
    ``port``; returns JetStream's server object (``stop()``, ``wait_for_termination()``)."""
    import grpc  # noqa: PLC0415  (the [serve] extra)

    from jaxrl_tools.rollout.jetstream import import_orchestrator  # noqa: PLC0415

    orchestrator = import_orchestrator()
    from jetstream.core import server_lib  # noqa: PLC0415  (after the logging fix-up above)

    mesh = run.make_mesh(cfg)
    if from_checkpoint:
        model_cfg, params, tokenizer, step = run.restore_policy(cfg, step)
        what = f"{cfg.trainer.checkpoint_dir} step {step}"
    else:
        tokenizer = run.setup_tokenizer(cfg)
        model_cfg, params = run.setup_model(cfg, tokenizer, mesh)
        what = cfg.model.path or "a random tiny model"
    engine = make_engine(cfg, model_cfg, params, tokenizer, mesh)
    driver = _driver_class(orchestrator)(
        prefill_engines=[engine],
        generate_engines=[engine],
        prefill_params=[params],
        generate_params=[params],
        interleaved_mode=True,
    )
    server = server_lib.JetStreamServer(
        driver, max(engine.slots, 8), port, grpc.insecure_server_credentials()
    )
    server.start()
    log.info("serving %s on port %d (%d slots)", what, port, engine.slots)
    return server
