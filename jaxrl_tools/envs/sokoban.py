"""Sokoban as RAGEN plays it: small procedurally generated rooms, text grids, step rewards.

A room is drawn from the seed: a random walk carves the floor out of solid wall, targets and the
player are placed on it, and the boxes, starting on their targets, are *pulled* by a random walk
of the player (`search_depth` reverse moves). Reversed, that walk is a solution, so every room is
solvable; the room kept is the one whose boxes ended farthest from their targets.

`min_moves` redraws a room whose shortest solution is shorter (harder rooms: a random walk
rarely solves one). `hints` adds a line under the grid saying where each box is from the player
and where its nearest free target is from the box ("Box from you: 1 below, 2 right. Target from
box: 0 above, 1 left."): a tiny policy trained from scratch cannot read positions off the grid
(its move loss stays at ln 4), but it can read them there. The words are not the action words,
which every prompt lists, so that only the line's words say where to go.

Symbols (RAGEN's): `#` wall, `_` floor, `O` target, `X` box, `√` box on target, `P` player,
`S` player on target. Rewards (gym-sokoban's, which RAGEN uses): -0.1 per step, +1 for pushing
a box onto a target, -1 for pushing one off, +10 when every box is on a target (done).
"""

from __future__ import annotations

import numpy as np

from jaxrl_tools.envs.base import GridEnv, StepResult, register_env
from jaxrl_tools.envs.oracle import shortest_plan

MOVES = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
STEP_PENALTY, BOX_ON, BOX_OFF, SOLVED = -0.1, 1.0, -1.0, 10.0


def _add(p, d):
    return (p[0] + d[0], p[1] + d[1])


def _offset(a, b) -> str:
    """Where cell b is from cell a, rows then columns: "1 below, 0 left". Always both, so the
    line has the same tokens at the same places whatever the room."""
    dr, dc = b[0] - a[0], b[1] - a[1]
    return f"{abs(dr)} {'below' if dr > 0 else 'above'}, {abs(dc)} {'right' if dc > 0 else 'left'}"


@register_env("sokoban")
class Sokoban(GridEnv):
    """Args: dim_room (rows, cols, walls included), num_boxes, max_steps (moves before the
    episode ends), search_depth (reverse moves that scatter the boxes: harder rooms),
    min_moves (the fewest moves a room's solution takes), hints (the positions line)."""

    actions = tuple(MOVES)
    instructions = (
        "You are the player (P) in a Sokoban room. Push every box (X) onto a target (O). "
        "# is a wall, _ is floor, √ a box on a target, S you on a target. You can only push "
        "boxes, never pull them."
    )

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        search_depth: int = 30,
        min_moves: int = 0,
        hints: bool = False,
    ):
        rows, cols = dim_room
        if rows < 4 or cols < 4 or num_boxes < 1:
            raise ValueError(f"Sokoban needs a room of at least 4x4 and a box, got {dim_room}")
        self.dim_room, self.num_boxes = (rows, cols), num_boxes
        self.max_steps, self.search_depth = max_steps, search_depth
        self.min_moves, self.hints = min_moves, hints
        self.steps = 0

    # ------------------------------------------------------------------ generation
    def reset(self, seed: int) -> str:
        rng = np.random.default_rng(seed)
        self.steps = 0  # before the search below: it steps copies of the room
        for _ in range(1000):
            if self._generate(rng) and (
                self.min_moves <= 0 or len(shortest_plan(self) or ()) >= self.min_moves
            ):
                return self.render()
        solution = f" whose solution takes >= {self.min_moves} moves" if self.min_moves > 0 else ""
        raise ValueError(
            f"no Sokoban room of {self.dim_room}{solution} in 1000 draws for seed {seed}: lower "
            "min_moves or search_depth, or enlarge dim_room"
        )

    def _generate(self, rng) -> bool:
        rows, cols = self.dim_room
        floor = np.zeros((rows, cols), bool)
        p = (int(rng.integers(1, rows - 1)), int(rng.integers(1, cols - 1)))
        d = list(MOVES.values())[int(rng.integers(4))]
        for _ in range(int(1.5 * (rows + cols))):
            if rng.random() < 0.35:
                d = list(MOVES.values())[int(rng.integers(4))]
            q = _add(p, d)
            if 1 <= q[0] < rows - 1 and 1 <= q[1] < cols - 1:
                p = q
            floor[p] = True
        cells = [tuple(int(x) for x in c) for c in np.argwhere(floor)]
        if len(cells) < 2 * self.num_boxes + 2:
            return False
        picks = rng.choice(len(cells), self.num_boxes + 1, replace=False)
        targets = [cells[i] for i in picks[:-1]]
        self.walls = ~floor
        self.targets = frozenset(targets)
        best, best_score = None, 0
        for _ in range(3):  # a few reverse walks; keep the most scattered boxes
            player, boxes = cells[picks[-1]], list(targets)
            for _ in range(self.search_depth):
                e = list(MOVES.values())[int(rng.integers(4))]
                to = _add(player, e)
                if self.walls[to] or to in boxes:
                    continue
                behind = _add(player, (-e[0], -e[1]))
                if behind in boxes:  # pulled: reversed, the player pushes it from `to`
                    boxes[boxes.index(behind)] = player
                player = to
            moved = [abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets)]
            score = sum(moved) if all(moved) else 0
            if score > best_score:
                best, best_score = (player, frozenset(boxes)), score
        if best is None:
            return False
        self.player, self.boxes = best
        return True

    # ------------------------------------------------------------------ play
    @property
    def solved(self) -> bool:
        return self.boxes == self.targets

    def render(self) -> str:
        rows, cols = self.dim_room
        out = []
        for r in range(rows):
            line = []
            for c in range(cols):
                p, target = (r, c), (r, c) in self.targets
                if self.walls[p]:
                    line.append("#")
                elif p == self.player:
                    line.append("S" if target else "P")
                elif p in self.boxes:
                    line.append("√" if target else "X")
                else:
                    line.append("O" if target else "_")
            out.append(" ".join(line))
        if self.hints:
            out.append(self._hint_line())
        return "\n".join(out)

    def _hint_line(self) -> str:
        """Where each box off target is from the player, and its nearest free target from it."""
        free = sorted(self.targets - self.boxes)
        parts = []
        for box in sorted(self.boxes - self.targets):
            target = min(free, key=lambda t: abs(t[0] - box[0]) + abs(t[1] - box[1]))
            parts.append(
                f"Box from you: {_offset(self.player, box)}. "
                f"Target from box: {_offset(box, target)}."
            )
        return " ".join(parts) or "Every box is on a target."

    def step(self, action_text: str) -> StepResult:
        anchor = self.state_key
        d = MOVES[action_text]
        reward = STEP_PENALTY
        to = _add(self.player, d)
        if not self.walls[to]:
            if to not in self.boxes:
                self.player = to
            else:
                beyond = _add(to, d)
                if not self.walls[beyond] and beyond not in self.boxes:
                    self.boxes = (self.boxes - {to}) | {beyond}
                    self.player = to
                    reward += BOX_ON * (beyond in self.targets) + BOX_OFF * (to in self.targets)
        self.steps += 1
        if self.solved:
            reward += SOLVED
        done = self.solved or self.steps >= self.max_steps
        return StepResult(
            self.render(), reward, done, {"anchor_state": anchor, "success": self.solved}
        )
