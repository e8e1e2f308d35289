"""FrozenLake (gymnasium's, wrapped): walk from the start to the goal without falling in a hole.

The map is drawn from the seed (gymnasium's `generate_random_map`, always solvable), so one seed
is one episode: the same map and, on slippery ice, the same slips for the same actions.
Rendered as RAGEN does: `P` player, `_` frozen, `O` hole, `G` goal, `X` player in a hole,
`√` player on the goal. Reward 1 on reaching the goal, else 0.
"""

from __future__ import annotations

import copy

from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

from jaxrl_tools.envs.base import GridEnv, StepResult, register_env

_ACTIONS = ("Left", "Down", "Right", "Up")  # gymnasium's action ids 0..3


@register_env("frozenlake")
class FrozenLake(GridEnv):
    """Args: size (the map is size x size), frozen_prob (a tile's chance of being frozen when
    the map is drawn), slippery (gymnasium's: a move goes sideways 2 times in 3),
    max_steps (the episode ends after this many moves)."""

    actions = _ACTIONS
    instructions = (
        "You are on a frozen lake (P). Reach the goal (G) without stepping into a hole (O). "
        "_ is frozen ground."
    )

    def __init__(
        self, size: int = 4, frozen_prob: float = 0.8, slippery: bool = False, max_steps: int = 20
    ):
        if size < 2:
            raise ValueError(f"FrozenLake size must be >= 2, got {size}")
        self.size, self.frozen_prob, self.slippery = size, frozen_prob, slippery
        self.max_steps = max_steps
        self._env: FrozenLakeEnv | None = None
        self.steps = 0

    def reset(self, seed: int) -> str:
        desc = generate_random_map(size=self.size, p=self.frozen_prob, seed=seed)
        self._env = FrozenLakeEnv(desc=desc, is_slippery=self.slippery)
        self._env.reset(seed=seed)
        self.steps = 0
        return self.render()

    def __deepcopy__(self, memo):
        """A copy that shares the map and transition table (they never change) and copies the
        position and the slip generator (the oracle's search copies the lake per branch)."""
        new = copy.copy(self)
        new._env = copy.copy(self._env)
        new._env._np_random = copy.deepcopy(self._env._np_random, memo)
        return new

    @property
    def position(self) -> tuple[int, int]:
        return divmod(int(self._env.unwrapped.s), self.size)

    def render(self) -> str:
        desc = self._env.unwrapped.desc.astype(str)
        r, c = self.position
        rows = []
        for i, row in enumerate(desc):
            cells = []
            for j, tile in enumerate(row):
                here = (i, j) == (r, c)
                if tile == "H":
                    cells.append("X" if here else "O")
                elif tile == "G":
                    cells.append("√" if here else "G")
                else:
                    cells.append("P" if here else "_")
            rows.append(" ".join(cells))
        return "\n".join(rows)

    def step(self, action_text: str) -> StepResult:
        anchor = self.state_key
        _, reward, terminated, _, _ = self._env.step(_ACTIONS.index(action_text))
        self.steps += 1
        done = bool(terminated) or self.steps >= self.max_steps
        info = {"anchor_state": anchor, "success": bool(reward > 0)}
        return StepResult(self.render(), float(reward), done, info)
