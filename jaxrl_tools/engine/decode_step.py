"""The engine's decode step: `num_steps` sampled tokens for every active slot in one jitted scan
(the body of `kernels.generate_kernel`), built once per (config, max_len, logits hook, mesh,
rules) by `make_decode_step`.

The models' activation constraints (`sharding.constrain`) read the mesh of `sharding.use_mesh`
while tracing, and jax's trace cache does not know about it, so the step is one jitted function
per mesh, traced and lowered inside that mesh's `use_mesh` block: the module-level
`generate_kernel` would keep the constraints of the first mesh it was traced under. The engine
calls this object (`EngineCore.decode_step`) and `plan` lowers it: the decode step planned is the
decode step run.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxrl_tools import sharding
from jaxrl_tools.engine.kernels import DecodeState, LogitsHook, Params, StepOutput, generate_kernel


class DecodeStep:
    """The jitted decode step of one model and cache length on one mesh: call it, or lower it.

    Calls take `(params, state, hook_data, *, num_steps, mode, attend_len)`: the state is donated;
    `num_steps`, the sampling `mode` (`sampling.MODES`) and `attend_len` (the cache positions
    each step reads, None: whole rows) are static; `hook_data` is traced.

    Attributes:
      config: the ModelConfig.
      max_len: KV cache positions per slot.
      hook: the engine's `logits_hook` (or None).
      mesh, rules: the mesh it is traced for (None: one device, no activation constraints).
    """

    def __init__(self, config, max_len: int, hook: LogitsHook | None = None, mesh=None, rules=None):
        self.config, self.max_len, self.hook = config, int(max_len), hook
        self.mesh, self.rules = mesh, rules
        self._jitted = jax.jit(
            functools.partial(
                generate_kernel.__wrapped__, config=config, max_len=self.max_len, hook=hook
            ),
            static_argnames=("num_steps", "mode", "attend_len"),
            donate_argnums=(1,),
        )

    def __call__(
        self,
        params: Params,
        state: DecodeState,
        hook_data: Any,
        *,
        num_steps: int,
        mode: str,
        attend_len: int | None = None,
    ) -> tuple[DecodeState, StepOutput]:
        """(new state, StepOutput [slots, num_steps]); `state` is donated."""
        return sharding.call_in_mesh(
            self.mesh,
            self.rules,
            self._jitted,
            params,
            state,
            hook_data,
            num_steps=num_steps,
            mode=mode,
            attend_len=attend_len,
        )

    def lower(
        self,
        params: Params,
        state: DecodeState,
        hook_data: Any,
        *,
        num_steps: int,
        mode: str,
        attend_len: int | None = None,
    ):
        """The step lowered for these arguments (arrays or ShapeDtypeStructs with shardings)."""
        return sharding.call_in_mesh(
            self.mesh,
            self.rules,
            self._jitted.lower,
            params,
            state,
            hook_data,
            num_steps=num_steps,
            mode=mode,
            attend_len=attend_len,
        )


def _rules_key(rules) -> tuple | None:
    return None if rules is None else tuple(sorted(rules.items()))


@functools.cache
def _cached_step(config, max_len: int, hook, mesh, rules_key) -> DecodeStep:
    return DecodeStep(config, max_len, hook, mesh, None if rules_key is None else dict(rules_key))


def make_decode_step(
    config, max_len: int, hook: LogitsHook | None = None, mesh=None, rules=None
) -> DecodeStep:
    """The `DecodeStep` of these settings: one object per (config, max_len, hook, mesh, rules),
    so engines of the same settings share its compiles and `plan` lowers the object the engine
    calls. (Unbounded, like the module-level jits' caches it replaces.)"""
    return _cached_step(config, int(max_len), hook, mesh, _rules_key(rules))
