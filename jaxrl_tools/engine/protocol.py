"""What the rollout driver, the sampler and both servers ask of a decode engine: JetStream's
Engine API calls (`prefill`, `insert`, `init_decode_state`, the descriptive attributes) and ours
(`generate_steps` with a slot mask and log-probs, `write_slots`, `park`/`unpark`, `view`).
`EngineCore` and JetStream's `DecodeEngine` both satisfy it (tests/test_engine_protocol.py
checks their signatures and that the callers use nothing else)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from jaxrl_tools.engine.kernels import DecodeState, Params, Parked, Prefix, StepOutput
from jaxrl_tools.engine.sampling import SamplingParams


class Engine(Protocol):
    slots: int  # decode rows
    max_len: int  # cache positions of a row: the prompt bucket and the response
    eos_token_ids: tuple[int, ...]
    tokenizer: Any

    @property
    def max_prefill_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def init_decode_state(self, *args, **kwargs) -> DecodeState: ...  # (Engine API: unused)

    def prefill(
        self,
        *,
        params: Params,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array,
        true_length: int,
        sampling: SamplingParams | None = None,
        rng: jax.Array | None = None,
    ) -> Prefix: ...

    def insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slot: int,
        *,
        rng: jax.Array | None = None,
        seq_id: int | None = None,
    ) -> DecodeState: ...

    def generate_steps(
        self,
        params: Params,
        decode_state: DecodeState,
        num_steps: int | None = None,
        *,
        active: np.ndarray | None = None,
    ) -> tuple[DecodeState, StepOutput]: ...

    def write_slots(
        self,
        params: Params,
        decode_state: DecodeState,
        slots: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        *,
        starts: Sequence[int] | None = None,
        sampled: Sequence[int] | None = None,
        reset: Sequence[tuple[jax.Array, SamplingParams]] | None = None,
        seq_ids: Sequence[int] | None = None,
    ) -> DecodeState: ...

    def park(self, decode_state: DecodeState, slot: int, length: int) -> Parked: ...

    def unpark(self, decode_state: DecodeState, slot: int, parked: Parked) -> DecodeState: ...

    def view(self) -> Engine: ...
