"""Episodes with windowed history (`env.history` last_k / state): a fresh prompt every turn.

Turn by turn, every live episode's user message is rebuilt (`envs.episodes.window_text`: the
instructions, the last k (observation, answer) pairs, the current observation), the engine
samples one turn for all of them (`arun_rollouts`, continuously batched, ending at the turn's
end token), and the host steps their environments with the turn's text. The prompt stays
bounded however long the episode, so 30-100 turn horizons cost no more per turn than the
first. Truncation: a window over `max_prompt_len` tokens drops its oldest pairs until it fits;
an episode whose current observation does not fit even alone ends there ("budget").

Each turn is a `Trajectory` of its own (its prompt, its tokens: what is trained); the episode's
trajectory holds them in `turns`, with the environment's rewards, anchor states and success,
and every turn's tokens back to back (for rewards and statistics). An episode ends when the
environment says done ("done"), or when a turn does not end with the end token ("length" /
"budget": that turn reaches no environment step, as in one-sequence episodes).

With several processes (multi-controller), every process steps every environment with the same
turn text, so they agree without exchanging results; that needs environments that are
deterministic in the text (grid games are; code an environment runs in a sandbox could time out
in one process only, which this does not guard against).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import jax

from jaxrl_tools.data import DataError
from jaxrl_tools.engine.sampling import SamplingParams
from jaxrl_tools.envs.episodes import Episodes, instructions, window_text
from jaxrl_tools.rollout.loop import RolloutLimits, arun_rollouts
from jaxrl_tools.rollout.resolver import step_environment
from jaxrl_tools.types import Trajectory


class _Episode:
    """Host state of one episode: its environment, its turns so far."""

    def __init__(self, traj: Trajectory, env, observation: str):
        self.traj, self.env, self.observation = traj, env, observation
        self.intro = instructions(env)
        self.earlier: list[tuple[str, str]] = []  # (observation, answer) of past turns


async def arun_windowed(
    engine,
    params,
    episodes: Episodes,
    seeds: Sequence[int],
    *,
    encode: Callable[[str], list[int]],
    max_prompt_len: int,
    tokenizer,
    num_samples: int = 1,
    limits: RolloutLimits | None = None,
    sampling: SamplingParams | None = None,
    rng: int | jax.Array = 0,
) -> list[Trajectory]:
    """`num_samples` episodes per seed, played with windowed history (inside an event loop).

    Args:
      engine, params, tokenizer, sampling: as `arun_rollouts`.
      episodes: the environment's episodes; `episodes.window_turns` earlier turns are shown.
      seeds: one episode seed per prompt group.
      encode: a user message -> its prompt tokens through the chat template (no length check).
      max_prompt_len: the prompt's token budget (older pairs are dropped to fit).
      limits: `max_response_tokens`, `chunk_size` and `max_context_tokens` bound one turn.
      rng: a raw key (or an int seed); turn k's samples use fold_in(rng, k).

    Returns:
      Episode trajectories sorted by (prompt_index, sample_index), each with its `turns`.
    """
    limits = limits or RolloutLimits()
    turn_limits = RolloutLimits(
        max_response_tokens=limits.max_response_tokens,
        max_tool_calls=0,
        max_turns=1,
        max_obs_tokens=limits.max_obs_tokens,
        chunk_size=limits.chunk_size,
        max_context_tokens=limits.max_context_tokens,
    )
    key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    live: list[_Episode] = []
    for pi, seed in enumerate(seeds):
        for g in range(num_samples):
            env = episodes.build()
            first = env.reset(int(seed))
            traj = Trajectory(pi, g, [], env_seed=int(seed), turns=[])
            live.append(_Episode(traj, env, first))
    done: list[Trajectory] = []
    for k in range(episodes.max_turns + 1):
        if not live:
            break
        if k == episodes.max_turns:  # the environment did not end its episode
            for e in live:
                e.traj.finish_reason = "turns"
            done += [e.traj for e in live]
            break
        prompts, fits = [], []
        for e in live:
            ids = _window_ids(e, episodes.window_turns, encode, max_prompt_len)
            if len(ids) <= max_prompt_len:
                prompts.append(ids)
                fits.append(e)
            elif not e.traj.turns:
                raise DataError(
                    f"prompt of episode {e.traj.env_seed} has {len(ids)} tokens, more than "
                    f"rollout.max_prompt_len={max_prompt_len}"
                )
            else:
                e.traj.finish_reason = "budget"
                done.append(e.traj)
        live = fits
        if not live:
            break
        turns = await arun_rollouts(
            engine,
            params,
            prompts,
            tokenizer=tokenizer,
            limits=turn_limits,
            sampling=sampling,
            rng=jax.random.fold_in(key, k),
        )
        live = await _step_episodes(live, turns, tokenizer, done)
    for t in done:
        t.response_text = "\n".join(turn.response_text for turn in t.turns)
        t.model_text = "\n".join(turn.model_text for turn in t.turns)
    done.sort(key=lambda t: (t.prompt_index, t.sample_index))
    return done


async def _step_episodes(
    live: list[_Episode], turns: list[Trajectory], tokenizer, done: list[Trajectory]
) -> list[_Episode]:
    """Adds each episode's turn and steps its environment with the turn's text (concurrently);
    an episode whose turn did not end with the end token, or whose environment is done, goes
    to `done`. Returns the episodes that go on."""
    steps, texts = [], []
    for e, turn in zip(live, turns, strict=True):
        turn.prompt_index, turn.sample_index = e.traj.prompt_index, e.traj.sample_index
        if not e.traj.prompt_ids:
            e.traj.prompt_ids = list(turn.prompt_ids)
        e.traj.add_turn(turn)
        ended = turn.finish_reason == "eos"
        # The environment gets the turn's text without its end token.
        texts.append(tokenizer.decode(turn.response_ids[:-1], skip_special_tokens=False))
        steps.append(step_environment(e.env, texts[-1], e.traj) if ended else None)
    results = iter(await asyncio.gather(*(s for s in steps if s is not None)))
    still = []
    for e, turn, step, text in zip(live, turns, steps, texts, strict=True):
        if step is None:
            e.traj.finish_reason = turn.finish_reason
            done.append(e.traj)
            continue
        observation, _, is_done = next(results)  # (recorded in e.traj by step_environment)
        if is_done:
            e.traj.finish_reason = "done"
            done.append(e.traj)
            continue
        e.earlier.append((e.observation, text))
        e.observation = observation
        still.append(e)
    return still


def _window_ids(e: _Episode, k: int, encode, max_prompt_len: int) -> list[int]:
    """The turn's prompt with the last `k` earlier pairs, fewer if it would pass the budget
    (with none, it may still pass it)."""
    n = min(k, len(e.earlier))
    while True:
        shown = e.earlier[len(e.earlier) - n :] if n else []
        ids = encode(window_text(e.intro, shown, e.observation))
        if len(ids) <= max_prompt_len or n == 0:
            return ids
        n -= 1


def run_windowed(engine, params, episodes: Episodes, seeds: Sequence[int], **kwargs):
    """`arun_windowed` in a fresh event loop (same arguments)."""
    return asyncio.run(arun_windowed(engine, params, episodes, seeds, **kwargs))
