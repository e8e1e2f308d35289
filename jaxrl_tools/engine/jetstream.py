"""JetStream's side of the engine: `DecodeEngine` (EngineCore as a JetStream Engine, servable
by its orchestrator) and `HFTokenizer`. Part of the `[serve]` extra: JetStream 0.2.2 imports
TensorFlow through seqio and reconfigures the root logger, so it is imported lazily, on first
use of these names, and never on the training path.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import transformers

from jaxrl_tools.engine.core import EngineCore
from jaxrl_tools.engine.kernels import DecodeState, Params


def _import_jetstream():
    """Imports JetStream's engine API, keeping the root logger and TF's log level as they were."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from jetstream.engine import (  # noqa: PLC0415  (the [serve] extra, lazily)
            engine_api,
            token_utils,
            tokenizer_api,
            tokenizer_pb2,
        )
    finally:
        root.setLevel(level)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
    return engine_api, token_utils, tokenizer_api, tokenizer_pb2


def import_orchestrator():
    """`jetstream.core.orchestrator` (it reconfigures the root logger on import; undone here)."""
    _import_jetstream()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        from jetstream.core import orchestrator  # noqa: PLC0415  (the [serve] extra, lazily)
    finally:
        root.setLevel(level)
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
    if not hasattr(jax, "tree_map"):
        # JetStream 0.2.2 frees prefixes with jax.tree_map, removed in current JAX.
        def delete_pytree(p):
            jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, p)

        orchestrator.delete_pytree = delete_pytree
    return orchestrator


@functools.cache
def _classes():
    engine_api, token_utils, tokenizer_api, tokenizer_pb2 = _import_jetstream()

    class HFTokenizer(tokenizer_api.Tokenizer):
        """JetStream Tokenizer over a Hugging Face tokenizer.

        Args:
          tokenizer: the HF tokenizer.
          stop_ids: token ids that end generation (default: EOS).
          render: text -> the prompt text to tokenize (e.g. the chat template around a user
            message, `jaxrl_tools.serve`); None tokenizes the text as it is.
        """

        def __init__(
            self,
            tokenizer,
            stop_ids: Sequence[int] | None = None,
            render: Callable[[str], str] | None = None,
        ):
            self.hf = tokenizer
            self._stop = set(stop_ids) if stop_ids else {self.eos_id}
            self.render = render

        def encode(self, s: str, **kwargs):
            is_bos = kwargs.pop("is_bos", False) and self.bos_id is not None
            if self.render is not None:
                s = self.render(s)
            ids = np.asarray(self.hf.encode(s, add_special_tokens=False), np.int32)
            return token_utils.pad_tokens(
                ids,
                self.bos_id if is_bos else 0,
                self.pad_id,
                is_bos=is_bos,
                prefill_lengths=kwargs.pop("prefill_lengths", None),
                max_prefill_length=kwargs.pop("max_prefill_length", None),
                jax_padding=kwargs.pop("jax_padding", True),
            )

        def decode(self, token_ids: list[int], **kwargs) -> str:
            return self.hf.decode(list(token_ids), skip_special_tokens=False)

        @property
        def pad_id(self) -> int:
            pad = self.hf.pad_token_id
            return self.eos_id if pad is None else pad

        @property
        def eos_id(self) -> int:
            return self.hf.eos_token_id

        @property
        def bos_id(self):
            return self.hf.bos_token_id

        @property
        def stop_tokens(self) -> set[int]:
            return set(self._stop)

    class DecodeEngine(EngineCore, engine_api.Engine):
        """`EngineCore` as a `jetstream.engine.engine_api.Engine` (servable by its Driver).

        `render_prompt` (text -> prompt text), when set, is applied by the tokenizer JetStream
        builds to requests that arrive as text."""

        render_prompt: Callable[[str], str] | None = None

        def generate(self, params: Params, decode_state: DecodeState):
            """Engine API step: `steps_per_generate` tokens per slot as JetStream ResultTokens.

            Lengths reported per slot are the number of tokens sampled in it so far.
            """
            decode_state, out = self.generate_steps(params, decode_state)
            n = out.tokens.shape[1]
            data = jnp.concatenate(
                [out.tokens, out.valid.astype(jnp.int32), decode_state.sampled[:, None]], axis=1
            )
            result = engine_api.ResultTokens(
                data=data,
                tokens_idx=(0, n),
                valid_idx=(n, 2 * n),
                length_idx=(2 * n, 2 * n + 1),
                samples_per_slot=1,
            )
            return decode_state, result

        def get_tokenizer(self):
            path = getattr(self.tokenizer, "name_or_path", "") if self.tokenizer else ""
            return tokenizer_pb2.TokenizerParameters(path=str(path or self.path or ""))

        def build_tokenizer(self, metadata) -> HFTokenizer:
            tok = self.tokenizer
            if tok is None:
                if not metadata.path:
                    raise ValueError("build_tokenizer: the engine has no tokenizer and no path")
                tok = transformers.AutoTokenizer.from_pretrained(metadata.path)
            return HFTokenizer(tok, stop_ids=self.eos_token_ids or None, render=self.render_prompt)

    return DecodeEngine, HFTokenizer


def __getattr__(name: str):
    # `DecodeEngine` / `HFTokenizer` subclass JetStream classes: built on first access only.
    if name == "DecodeEngine":
        return _classes()[0]
    if name == "HFTokenizer":
        return _classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["import_orchestrator"]  # and DecodeEngine, HFTokenizer (module __getattr__)
