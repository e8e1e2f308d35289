"""Python interpreter tool on the sandbox pool, stateless (ToRL) or per-trajectory session.

Session mode design: **replay**. Every call still runs in a fresh forked child (the pool never
keeps model state in a process between calls); the tool remembers, per session id, the snippets
of that trajectory that finished without error and the worker re-executes them, output
suppressed, in the same child just before the new snippet. Why: no process per trajectory to
babysit, no cross-trajectory state possible (a session's history lives only under its id, and is
dropped by `close_session`), and any worker can serve any session. Costs: each call pays for
re-running the earlier cells (bounded by `max_session_cells`), and side effects or randomness in
earlier cells are re-done (a seeded RNG gives the same values; time/random without a seed may
differ). A replay that fails reports "SessionReplayError".
"""

from __future__ import annotations

import asyncio

from jaxrl_tools.tools.base import (
    Observation,
    Tool,
    last_traceback_line,
    register_tool,
    string_argument,
    truncate_middle,
)
from jaxrl_tools.tools.pool import SandboxPool
from jaxrl_tools.tools.sandbox import SandboxConfig


@register_tool("python")
class PythonTool(Tool):
    """Runs Python code in the sandbox; returns stdout (and the error's last line on failure).

    Args:
      mode: "stateless" (each call fresh, ToRL) or "session" (variables persist within one
        session id, i.e. one trajectory).
      pool: a SandboxPool to share; default: a new pool built from the other arguments
        (owned and closed by this tool).
      n_workers, timeout_s, memory_mb: used only when the tool builds its own pool
        (timeout_s/memory_mb also apply per call).
      max_output_chars: observation text is cut to head + "..." + tail of this size.
      full_traceback: return the whole traceback instead of its last line.
      max_session_cells: a session refuses more cells than this (replay cost bound).
      max_call_s: time limit of one session call, the replay of its earlier cells included
        (default 2 x timeout_s); a call past it fails with a timeout, and its cell is not kept.
      tool_schema: optional override of the declaration (name/description/parameters).
    """

    name = "python"  # the name the parsers and the chat-template schema use
    description = (
        "Execute Python code and return what it prints to stdout (and the error on "
        "failure). numpy and sympy are available; no network, no files outside the "
        "working directory."
    )
    parameters = string_argument("code", "The Python code to execute.")

    def __init__(
        self,
        mode: str = "stateless",
        pool: SandboxPool | None = None,
        *,
        n_workers: int | None = None,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        max_output_chars: int = 2000,
        full_traceback: bool = False,
        max_session_cells: int = 32,
        max_call_s: float | None = None,
        tool_schema: dict | None = None,
    ):
        super().__init__(tool_schema=tool_schema)
        if mode not in ("stateless", "session"):
            raise ValueError(f"PythonTool mode={mode!r}; valid: 'stateless', 'session'")
        self.mode = mode
        self._own_pool = pool is None
        self._pool = pool
        self._n_workers = n_workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.full_traceback = full_traceback
        self.max_session_cells = max_session_cells
        self.max_call_s = max_call_s
        self._history: dict[str, list[str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        code = arguments.get("code")
        if not isinstance(code, str):
            return Observation.error("Error: argument 'code' must be a string")
        if self.mode == "stateless" or session_id is None:
            return self._observe(await self._run(code, []))
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        async with lock:  # cells of one trajectory run in order
            history = self._history.setdefault(session_id, [])
            if len(history) >= self.max_session_cells:
                return Observation.error(
                    f"Error: session has {len(history)} cells, the limit "
                    f"is {self.max_session_cells}"
                )
            res = await self._run(code, list(history))
            if res.ok and session_id in self._history:
                history.append(code)
            obs = self._observe(res)
            obs.metrics["session_cells"] = float(len(history))
            return obs

    def start(self) -> None:
        self.pool  # noqa: B018 - starts the workers (and checks the isolation) now

    @property
    def pool(self) -> SandboxPool:
        """The worker pool, started on first use (building the tool, e.g. to check a config,
        starts no process)."""
        if self._pool is None:
            cfg = SandboxConfig(
                **({"timeout_s": self.timeout_s} if self.timeout_s else {}),
                **({"memory_mb": self.memory_mb} if self.memory_mb else {}),
            )
            self._pool = SandboxPool(self._n_workers, cfg)
        return self._pool

    async def _run(self, code, replay):
        return await self.pool.run(
            code,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            replay=replay,
            max_call_s=self.max_call_s,
        )

    def _observe(self, res) -> Observation:
        metrics = {
            "exec_time_s": res.execution_time,
            "timeout": float(res.status == "TimeLimitExceeded"),
        }
        if res.status == "TimeLimitExceeded":
            text = (
                res.stdout.rstrip("\n") + "\n" if res.stdout.strip() else ""
            ) + "TimeoutError: execution exceeded the time limit"
            return Observation(
                truncate_middle(text, self.max_output_chars), ok=False, metrics=metrics
            )
        if res.status == "SandboxError":
            return Observation(
                truncate_middle(res.stderr or "SandboxError", self.max_output_chars),
                ok=False,
                metrics=metrics,
            )
        if res.ok:
            return Observation(
                truncate_middle(res.stdout, self.max_output_chars), ok=True, metrics=metrics
            )
        err = res.stderr if self.full_traceback else last_traceback_line(res.stderr)
        if not err:
            err = f"Process exited with code {res.return_code}"
        text = (res.stdout.rstrip("\n") + "\n" if res.stdout.strip() else "") + err
        return Observation(truncate_middle(text, self.max_output_chars), ok=False, metrics=metrics)

    async def close_session(self, session_id: str) -> None:
        self._history.pop(session_id, None)
        self._locks.pop(session_id, None)

    async def close(self) -> None:
        self._history.clear()
        if self._own_pool and self._pool is not None:
            self._pool.close()
