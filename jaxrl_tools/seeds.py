"""The run's random streams: one seed (`trainer.seed`), one key per purpose.

Each purpose draws from its own key, `fold_in(key(seed), purpose)`, so more draws for one
purpose (another rollout, another mini-batch) never shift another's. Both running streams are
checkpointed: the update's key lives in the RL state (`RLState.rng`, split each step) and the
rollout stream is counted by the sampler (`Sampler.state()`), so a resumed run draws what the
uninterrupted one would. The data order has its own seed (`data.shuffle_seed`, the loader's
checkpointed state).
"""

from __future__ import annotations

import jax

# update: the RL step's key (mini-batch permutations, dropout); rollout: sampler call k draws
# fold_in(key, k); eval: evaluations and probes, keyed by their own call seed, so the same
# prompts get the same draws at every evaluation; adapters: fresh LoRA weights.
PURPOSES = ("update", "rollout", "eval", "adapters")


def purpose_key(seed: int, purpose: str) -> jax.Array:
    """The raw (uint32[2]) key of `purpose`'s stream under run seed `seed`."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown random stream {purpose!r}; valid: {', '.join(PURPOSES)}")
    return jax.random.key_data(jax.random.fold_in(jax.random.key(seed), PURPOSES.index(purpose)))


def call_key(seed: int, purpose: str, k: int) -> jax.Array:
    """Draw `k` of `purpose`'s stream (a raw key): e.g. the k-th sampler call's key."""
    return jax.random.fold_in(purpose_key(seed, purpose), k)
