"""A shortest plan from a grid environment's current state, by breadth-first search.

The demos' SFT traces play it (with noise), and the tests check rooms and lakes are solvable
with it. It copies the environment for each branch, so it needs no model of the game's rules.
"""

from __future__ import annotations

import collections
import copy

from jaxrl_tools.envs.base import GridEnv


def shortest_plan(env: GridEnv, max_states: int = 200_000) -> list[str] | None:
    """A shortest action list from `env`'s current state to success (`info["success"]`), or
    None when there is none within `max_states` distinct states. `env` is not changed."""
    frontier = collections.deque([(env, ())])
    seen = {env.state_key}
    while frontier and len(seen) < max_states:
        node, path = frontier.popleft()
        for action in node.actions:
            child = copy.deepcopy(node)
            res = child.step(action)
            if res.info.get("success"):
                return [*path, action]
            if not res.done and child.state_key not in seen:
                seen.add(child.state_key)
                frontier.append((child, (*path, action)))
    return None
