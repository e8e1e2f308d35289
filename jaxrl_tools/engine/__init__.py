"""The decode engine: its settings, weights and empty state (`base`), the operations on a decode
state (`core.EngineCore`: prefill, insert, N-step generate, slot writes, park/unpark), its jitted
kernels (`kernels`, `decode_step`, `slot_writes`), the serving copy of the weights (`serving`),
sampling (`sampling`), the same engine as JetStream's (`jetstream`, the [serve] extra), and the
calls its users make (`protocol.Engine`). The rollout loop, the gateway and `plan` decode on it."""

from typing import TYPE_CHECKING

from jaxrl_tools._lazy import lazy_api

if TYPE_CHECKING:
    from jaxrl_tools.engine.core import EngineCore
    from jaxrl_tools.engine.kernels import DecodeState, Prefix, StepOutput
    from jaxrl_tools.engine.protocol import Engine
    from jaxrl_tools.engine.sampling import GREEDY, SamplingParams

__all__ = [
    "DecodeState",
    "Engine",
    "EngineCore",
    "GREEDY",
    "Prefix",
    "SamplingParams",
    "StepOutput",
]

__getattr__, __dir__ = lazy_api(__name__)
