"""The grid-game demos' data: SFT traces played by a noisy shortest-path oracle, and the text a
tiny model's tokenizer is trained on.

An oracle turn is RAGEN's, `<think>...</think><answer>Down</answer>`, with the next
`max_actions_per_turn` moves of a shortest plan (`envs.oracle`). With probability `noise` a move
is drawn uniformly from the other actions instead, so the traces hold detours, falls into holes
and stuck boxes: the SFT policy plays well but not always, and RL has something to improve.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from jaxrl_tools import envs
from jaxrl_tools.envs import Episodes
from jaxrl_tools.envs.episodes import instructions, window_text
from jaxrl_tools.envs.oracle import shortest_plan

# The thought of every oracle turn, per game: the same each turn, so a tiny policy decides
# once, in the answer.
THOUGHTS = {"frozenlake": "Go to G around O.", "sokoban": "Push X onto O."}
HINTS_PREFIX = "Box from you:"  # envs.Sokoban's hints line


def is_grid_game(env_name: str) -> bool:
    """Whether the oracle can play environment `env_name` (a `GridEnv`)."""
    return issubclass(envs.env_class(env_name), envs.GridEnv)


def turn_text(game: str, moves: Sequence[str], observation: str = "") -> str:
    """A RAGEN turn of `game` making `moves`. Its thought restates the observation's hints line
    (Sokoban's `hints`) when there is one: copying it is easy, and the move then follows from
    the policy's own last tokens instead of a line far back in the prompt. Else the game's
    constant thought."""
    hints = [line for line in observation.splitlines() if line.startswith(HINTS_PREFIX)]
    thought = hints[-1] if hints else THOUGHTS.get(game, "Reach the goal.")
    return f"<think>{thought}</think><answer>{' || '.join(moves)}</answer>"


def oracle_moves(
    game, plan: list[str] | None, rng: random.Random, noise: float, max_actions: int
) -> tuple[list[str], list[str] | None]:
    """One turn's moves of the noisy oracle in `game` (a `GridEnv`), and the plan left after
    them (None after a detour: the next turn searches again). `plan`: a shortest plan from
    the current state, or None to search for one."""
    plan = plan or shortest_plan(game) or [rng.choice(game.actions)]
    moves = []
    for planned in plan[:max_actions]:
        if rng.random() < noise:
            moves.append(rng.choice([a for a in game.actions if a != planned]))
            return moves, None
        moves.append(planned)
    return moves, plan[len(moves) :]


def play(episodes: Episodes, seed: int, rng: random.Random, noise: float) -> list[dict]:
    """The chat messages of one episode played by the noisy oracle: the first user turn, then
    assistant turns and the observations after them (none after the last)."""
    intro, turns = _oracle_turns(episodes, seed, rng, noise)
    messages = [{"role": "user", "content": window_text(intro, [], turns[0][0])}]
    for i, (observation, turn) in enumerate(turns):
        if i:
            messages.append({"role": "user", "content": observation})
        messages.append({"role": "assistant", "content": turn})
    return messages


def conversations(
    episodes: Episodes, seed: int, rng: random.Random, noise: float
) -> list[list[dict]]:
    """One oracle episode as the policy sees it: one conversation (`play`) with full history;
    with windowed history, one per turn, its prompt the rollout's window."""
    if not episodes.windowed:
        return [play(episodes, seed, rng, noise)]
    intro, turns = _oracle_turns(episodes, seed, rng, noise)
    k = episodes.window_turns
    return [
        [
            {"role": "user", "content": window_text(intro, turns[max(0, i - k) : i], obs)},
            {"role": "assistant", "content": turn},
        ]
        for i, (obs, turn) in enumerate(turns)
    ]


def _oracle_turns(
    episodes: Episodes, seed: int, rng: random.Random, noise: float
) -> tuple[str, list[tuple[str, str]]]:
    """The instructions and the (observation, oracle turn) pairs of one noisy-oracle episode."""
    env = episodes.build()
    observation, turns, plan = env.reset(seed), [], None
    while True:
        moves, plan = oracle_moves(env.env, plan, rng, noise, episodes.max_actions_per_turn)
        turns.append((observation, turn_text(episodes.name, moves, observation)))
        res = env.step(turns[-1][1])
        if res.done:
            return instructions(env), turns
        observation = res.observation


def chat_segments(tokenizer, messages: Sequence[dict], system_prompt: str | None) -> list[list]:
    """The conversation rendered by the chat template as [[text, trainable], ...]: the
    assistant turns up to their end-of-turn token are trained, the rest (the newline after
    that token too: the rollout never samples it) is context."""
    msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + list(
        messages
    )
    render = lambda m, gen: tokenizer.apply_chat_template(  # noqa: E731
        m, tokenize=False, add_generation_prompt=gen
    )
    segments, prev = [], ""
    for k, msg in enumerate(msgs):
        if msg["role"] == "assistant":
            context = render(msgs[:k], True)
            turn = render(msgs[: k + 1], False)[len(context) :].rstrip("\n")
            segments += [[context[len(prev) :], False], [turn, True]]
            prev = context + turn
    rest = render(msgs, False)[len(prev) :]
    return [s for s in [*segments, [rest, False]] if s[0]]


def sft_traces(cfg, tokenizer) -> list[list[list[Any]]]:
    """`sft.num_traces` oracle episodes on training seeds past the RL run's (`env.seed +
    env.train_episodes` on), as segment lists (with windowed history, one per turn)."""
    env, sft = cfg.env, cfg.sft
    episodes = Episodes.from_section(env)
    rng = random.Random(cfg.trainer.seed)
    first = env.seed + env.train_episodes
    return [
        chat_segments(tokenizer, messages, cfg.data.system_prompt)
        for i in range(sft.num_traces)
        for messages in conversations(episodes, first + i, rng, sft.oracle_noise)
    ]


def tokenizer_texts(env_section, n: int = 200) -> list[str]:
    """Episodes of random turns as plain text (instructions, grids, turns): a tiny model's
    tokenizer learns their words, so that a grid cell is one token wherever the player is."""
    episodes = Episodes.from_section(env_section)
    rng = random.Random(0)
    first = env_section.seed + env_section.train_episodes + 10_000_000
    texts = []
    for i in range(n):
        env = episodes.start(first + i)
        k = min(len(env.env.actions), episodes.max_actions_per_turn)
        parts = [episodes.prompt(first + i)]
        for _ in range(episodes.max_turns):
            parts.append(turn_text(episodes.name, rng.sample(env.env.actions, k)))
            res = env.step(parts[-1])
            parts.append(res.observation)
            if res.done:
                break
        texts.append("\n".join(parts))
    return texts
