"""MCP tools: the tools of a Model Context Protocol server, started over stdio.

A recipe declares a server; its tools are listed when the run's tools are built, and each one
becomes a Tool of its own (the server's name, description and input schema) sharing the
server's connection::

    tools:
      - class: mcp
        name: fs                      # optional: the tools are declared as fs_<tool>
        config:
          command: [npx, -y, "@modelcontextprotocol/server-filesystem", /data]
          env: {LOG_LEVEL: warn}      # added to the few variables the SDK passes on (PATH, HOME..)
          timeout_s: 30               # one call
          include: [read_file]        # or exclude: [...]; default: all the server's tools

    server = McpServer(command=["python", "server.py"])
    tools = server.tools()            # started and listed; ToolExecutor(tools)
    ...
    server.stop()                     # or `await tool.close()` on any of them

Design:
- A background thread with its own event loop owns the server process and its session. The
  rollout awaits tools on its own loop, and `run_rollouts` starts a fresh loop per call
  (asyncio.run), so a session bound to one of those would be dead at the next; calls are
  submitted to the owner's loop instead and awaited from whatever loop or thread the caller has.
- Failures are observations, never a stuck rollout: a call past `timeout_s` is an error and the
  server is restarted for the next call (calls still running on the old process may finish
  there); a server that exited, during a call or between calls, is restarted by the next call;
  after `max_restarts` restarts in a row without an answer from the server, every call is an
  error saying so.
- A server that does not start, or does not list its tools within `startup_timeout_s`, is a
  ValueError when the tools are built (before any model loads), naming the command and the last
  line the server wrote to stderr.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.util
import json
import logging
import os
import select
import shlex
import threading
import time
from pathlib import Path
from typing import Any

from jaxrl_tools.tools.base import (
    Observation,
    Tool,
    describe_exception,
    last_traceback_line,
    register_tool,
    safe_repr,
    truncate_middle,
)

log = logging.getLogger(__name__)

# The SDK's shutdown of one server is bounded (stdin closed, 2 s, SIGTERM, 2 s, SIGKILL, 2 s).
_STOP_TIMEOUT_S = 10.0
_CONNECTION_CLOSED = -32000  # the JSON-RPC error code of the SDK's "Connection closed"


class _StartError(Exception):
    """The server could not be (re)started; the message says why, in one line."""


def _field(obj: Any, name: str, v1_name: str) -> Any:
    """An attribute of an MCP type: snake_case in SDK 2.x, camelCase in 1.x (read only when
    the 2.x name is missing: 2.x warns on the old one)."""
    return getattr(obj, name) if hasattr(obj, name) else getattr(obj, v1_name, None)


def _innermost(e: BaseException) -> BaseException:
    """The error inside anyio's exception groups (a task group wraps what its body raised)."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def _connection_lost(e: BaseException) -> bool:
    import anyio  # noqa: PLC0415 - a dependency of the optional `mcp` package

    e = _innermost(e)
    code = getattr(getattr(e, "error", None), "code", None)
    lost = (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream)
    return code == _CONNECTION_CLOSED or isinstance(e, (*lost, ConnectionError))


def _content_text(block: Any) -> str:
    """One content block of a result as text; what is not text is described briefly."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return block.text
    if kind in ("image", "audio"):
        size = len(getattr(block, "data", "") or "") * 3 // 4  # base64
        return f"[{kind} {_field(block, 'mime_type', 'mimeType')}, {size} bytes]"
    if kind == "resource_link":
        return f"[resource {block.uri}" + (f": {block.name}" if block.name else "") + "]"
    if kind == "resource":
        resource = block.resource
        text = getattr(resource, "text", None)
        if text is not None:
            return text
        mime = _field(resource, "mime_type", "mimeType") or "binary"
        return f"[resource {resource.uri}, {mime}]"
    return f"[{kind} content]"


def _observation(result: Any, shown: str) -> Observation:
    parts = [_content_text(b) for b in result.content or ()]
    structured = _field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        parts.append(json.dumps(structured, ensure_ascii=False))
    text = "\n".join(parts)
    if _field(result, "is_error", "isError"):
        return Observation.error(f"Error in tool {shown!r}: {text or 'failed (no message)'}")
    return Observation(text=text)


class _StderrTail:
    """A server's stderr through a pipe: a thread keeps its last lines (for error messages) and
    logs them at debug level, so a server that logs a lot fills neither a disk nor the run's log.
    """

    def __init__(self, label: str, max_lines: int = 40):
        read_fd, write_fd = os.pipe()
        self.writer = os.fdopen(write_fd, "w")
        self._probe = select.poll()  # on a read end of our own, which the reader cannot close
        self._probe_fd = os.dup(read_fd)
        self._probe.register(self._probe_fd, select.POLLIN)
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._thread = threading.Thread(
            target=self._read, args=(read_fd, label), daemon=True, name="mcp-stderr"
        )
        self._thread.start()

    def _read(self, fd: int, label: str) -> None:
        with open(fd, encoding="utf-8", errors="replace") as f:
            for line in f:
                self.lines.append(line.rstrip())
                log.debug("MCP server %s: %s", label, line.rstrip())

    def close_writer(self) -> None:
        # Once spawned, the server holds its own copy: the reader sees EOF when it exits.
        if not self.writer.closed:
            self.writer.close()

    def hung_up(self) -> bool:
        """Every writer closed: the server exited (or closed its own stderr). Unlike the
        transport's streams, this needs no turn of the event loop to be seen."""
        if self._probe_fd < 0:
            return True
        return any(ev & select.POLLHUP for _, ev in self._probe.poll(0))

    def close(self) -> None:
        self.close_writer()
        if self._probe_fd >= 0:
            os.close(self._probe_fd)
            self._probe_fd = -1

    def last_line(self, wait_s: float = 0.0) -> str:
        self._thread.join(wait_s)  # an exited server: let the reader take its last words
        return truncate_middle(last_traceback_line("\n".join(self.lines)), 300)


@dataclasses.dataclass(eq=False)
class _Connection:
    """One server process and its session, owned by the task `task` (anyio's scopes must be
    left by the task that entered them)."""

    stderr: _StderrTail
    ready: asyncio.Future
    stop: asyncio.Event
    task: asyncio.Task | None = None
    session: Any = None
    read: Any = None  # the transport's receive stream: its sender closes when the server exits
    listing: list = dataclasses.field(default_factory=list)
    inflight: int = 0
    retired: bool = False
    stderr_closed: bool = False  # the server closed its stderr and lives on

    async def settle(self, wait_s: float = 0.5) -> None:
        """A server whose stderr hung up has (nearly always) exited, but the transport sees its
        stdout end only on a later turn of the loop: give it that turn before trusting `alive`."""
        if self.stderr_closed or not self.stderr.hung_up():
            return
        deadline = time.monotonic() + wait_s
        while self.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.stderr_closed = self.alive()

    def alive(self) -> bool:
        if self.retired or self.session is None or self.task is None or self.task.done():
            return False
        stats = getattr(self.read, "statistics", None)
        return stats is None or stats().open_send_streams > 0


class _Supervisor:
    """A thread running an event loop that owns the server's connections, and the restart
    policy. All state below is touched only on that loop."""

    def __init__(self, server: McpServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, daemon=True, name=f"mcp {server.label}"
        )
        self.lock = asyncio.Lock()
        self.conn: _Connection | None = None  # the one new calls go to
        self.conns: set[_Connection] = set()  # every process not yet shut down
        self.failures = 0  # crashes, hangs and failed starts since the server last answered
        self.thread.start()

    def submit(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def live(self) -> _Connection:
        """The current connection, (re)started if there is none or it died."""
        async with self.lock:
            conn = self.conn
            if conn is not None:
                await conn.settle()
            if conn is not None and conn.alive():
                return conn
            if conn is not None:
                self.fail(conn)  # it exited since its last call
            s = self.server
            if self.failures > s.max_restarts:
                raise _StartError(
                    f"the MCP server `{s.label}` failed {self.failures} time"
                    f"{'s' if self.failures > 1 else ''} in a row (exited, "
                    f"hung or did not start); it is not restarted again "
                    f"(max_restarts={s.max_restarts})"
                )
            try:
                self.conn = await self.connect()
            except _StartError:
                self.failures += 1
                raise
            return self.conn

    def fail(self, conn: _Connection) -> None:
        """Retires a connection that crashed or hung: new calls get a fresh server; calls still
        running on it finish (or time out) before it is shut down."""
        if conn.retired:
            return
        conn.retired = True
        if self.conn is conn:
            self.conn = None
        self.failures += 1
        if conn.inflight == 0:
            conn.stop.set()

    async def connect(self) -> _Connection:
        from mcp import StdioServerParameters  # noqa: PLC0415 - the optional `mcp` extra

        s = self.server
        loop = asyncio.get_running_loop()
        conn = _Connection(_StderrTail(s.label), loop.create_future(), asyncio.Event())
        params = StdioServerParameters(
            command=s.command[0], args=list(s.command[1:]), env=s.env, cwd=s.cwd
        )
        conn.task = asyncio.create_task(self.serve(conn, params))
        self.conns.add(conn)
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), s.startup_timeout_s)
        except TimeoutError:
            conn.task.cancel()  # the SDK still shuts the process down (shielded, bounded)
            line = conn.stderr.last_line()
            raise _StartError(
                f"the MCP server `{s.label}` did not start and list its tools within "
                f"startup_timeout_s={s.startup_timeout_s:g} s (is it an MCP server on stdio?"
                + (f" its stderr ends: {line}" if line else "")
                + ")"
            ) from None
        except Exception as e:  # noqa: BLE001 -- any failure to start is one line for the user
            e = _innermost(e)
            if isinstance(e, OSError):
                raise _StartError(
                    f"could not start the MCP server `{s.label}`: {describe_exception(e)}"
                ) from None
            what = (
                "exited before listing its tools"
                if _connection_lost(e)
                else f"failed to start: {describe_exception(e, 300)}"
            )
            line = conn.stderr.last_line(wait_s=0.5)
            raise _StartError(
                f"the MCP server `{s.label}` {what}"
                + (f" (its stderr ends: {line})" if line else "")
            ) from None
        return conn

    async def serve(self, conn: _Connection, params: Any) -> None:
        from mcp import ClientSession, stdio_client  # noqa: PLC0415

        try:
            async with stdio_client(params, errlog=conn.stderr.writer) as (read, write):
                conn.stderr.close_writer()
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    conn.listing = await _list_tools(session)
                    conn.session, conn.read = session, read
                    conn.ready.set_result(None)
                    await conn.stop.wait()
        except Exception as e:  # noqa: BLE001 -- reported through `ready`, or logged
            if not conn.ready.done():
                conn.ready.set_exception(e)
            else:
                log.debug("MCP server %s: connection ended: %s", self.server.label, e)
        finally:
            conn.stderr.close()
            self.conns.discard(conn)
            if not conn.ready.done():
                conn.ready.cancel()

    async def call(self, remote: str, shown: str, arguments: dict) -> Observation:
        """Calls the server's tool `remote` (`shown`: the name the model used); never raises."""
        import anyio  # noqa: PLC0415

        try:
            conn = await self.live()
        except _StartError as e:
            return Observation.error(f"Error in tool {shown!r}: {e}", server_down=1.0)
        except asyncio.CancelledError:  # stop() ends the calls it finds waiting
            return Observation.error(f"Error in tool {shown!r}: the MCP server was closed")
        conn.inflight += 1
        try:
            with anyio.fail_after(self.server.timeout_s):
                result = await conn.session.call_tool(remote, arguments)
        except TimeoutError:
            self.fail(conn)
            return Observation.error(
                f"Error in tool {shown!r}: no answer within timeout_s={self.server.timeout_s:g} "
                "s; the MCP server is restarted for the next call",
                timeout=1.0,
            )
        except asyncio.CancelledError:
            return Observation.error(f"Error in tool {shown!r}: the MCP server was closed")
        except Exception as e:  # noqa: BLE001 -- errors are data for the model
            if _connection_lost(e) or not conn.alive():
                self.fail(conn)
                return Observation.error(
                    f"Error in tool {shown!r}: the MCP server exited during the call; it is "
                    "restarted for the next call",
                    server_exit=1.0,
                )
            return Observation.error(f"Error in tool {shown!r}: {describe_exception(e)}")
        finally:
            conn.inflight -= 1
            if conn.retired and conn.inflight == 0:
                conn.stop.set()
        self.failures = 0  # it answered: a healthy server
        return _observation(result, shown)

    async def shutdown(self) -> None:
        self.conn = None
        for conn in list(self.conns):
            conn.retired = True
            conn.stop.set()
        tasks = [c.task for c in self.conns if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
            for task in pending:
                task.cancel()
        # Calls still waiting (for a start, or a session now closed) must not hang their caller.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=_STOP_TIMEOUT_S)

    def close(self) -> None:
        try:
            self.submit(self.shutdown()).result(2 * _STOP_TIMEOUT_S + 5)
        except Exception as e:  # noqa: BLE001 -- closing must not hide the run's own error
            log.warning("stopping MCP server %s: %s", self.server.label, describe_exception(e))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5.0)
            if not self.thread.is_alive():
                self.loop.close()


async def _list_tools(session: Any) -> list:
    """All the server's tools (every page of the listing)."""
    from mcp import types  # noqa: PLC0415

    found, cursor = [], None
    while True:
        if cursor is None:
            page = await session.list_tools()
        else:
            page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        found += page.tools
        cursor = _field(page, "next_cursor", "nextCursor")
        if not cursor:
            return found


def _text(value: Any, key: str) -> str:
    """A string of the command line or environment; YAML reads `--port 8080`'s 8080 as a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {safe_repr(value)}")
    return value


def _names(value: Any, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of tool names, got {safe_repr(value)}")
    return tuple(value)


@register_tool("mcp")
class McpServer(Tool):
    """An MCP server started over stdio. Not called itself: `tools()` declares each of the
    server's tools as a Tool of its own (the run's tools are built so: `setup.setup_tools`); a
    recipe entry's `name` prefixes them ("<name>_<tool>"), which two servers with a tool of the
    same name need.

    Args:
      command: the server's command line, e.g. ["python", "server.py"].
      env: extra environment variables of the server (it gets only these and the SDK's
        defaults: HOME, PATH, SHELL, TERM, USER, LOGNAME).
      cwd: the server's working directory (default: this process's).
      timeout_s: limit of one call; past it the call is an error and the server is restarted.
      startup_timeout_s: limit to start the server and list its tools.
      include, exclude: the server's tools to declare, by the server's names (default: all).
      max_restarts: restarts in a row without an answer from the server before giving up on it.
    """

    name = "mcp"
    description = "The tools of an MCP server (declared one by one once the server lists them)."

    def __init__(
        self,
        command: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float = 30.0,
        startup_timeout_s: float = 30.0,
        include: list[str] | None = None,
        exclude: list[str] | None = None,
        max_restarts: int = 3,
    ):
        super().__init__()
        if importlib.util.find_spec("mcp") is None:
            raise ValueError(
                "the mcp tool needs the MCP SDK: pip install 'jaxrl-tools[mcp]' (or 'mcp')"
            )
        if not isinstance(command, (list, tuple)) or not command or not command[0]:
            raise ValueError(
                "command must be the server's command line as a non-empty list of strings, "
                f"e.g. [python, server.py]; got {safe_repr(command)}"
            )
        command = [_text(c, f"command[{i}]") for i, c in enumerate(command)]
        if env is not None:
            if not isinstance(env, dict) or not all(isinstance(k, str) for k in env):
                raise ValueError(f"env must map names to strings, got {safe_repr(env)}")
            env = {k: _text(v, f"env.{k}") for k, v in env.items()}
        if cwd is not None and not Path(cwd).is_dir():
            raise ValueError(f"cwd={cwd} is not a directory: give the server's working directory")
        for key, value in (("timeout_s", timeout_s), ("startup_timeout_s", startup_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{key} must be a number of seconds > 0, got {safe_repr(value)}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {safe_repr(max_restarts)}")
        self.command = tuple(command)
        self.env = dict(env) if env is not None else None
        self.cwd = None if cwd is None else str(cwd)
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.include = _names(include, "include")
        self.exclude = _names(exclude, "exclude")
        self.max_restarts = max_restarts
        self.label = truncate_middle(shlex.join(self.command), 120)
        self._supervisor: _Supervisor | None = None
        self._supervisor_lock = threading.Lock()

    def _sup(self) -> _Supervisor:
        with self._supervisor_lock:
            if self._supervisor is None:
                self._supervisor = _Supervisor(self)
            return self._supervisor

    def start(self) -> None:
        """Starts the server and lists its tools, unless it runs (blocking).

        Raises:
          ValueError: it did not start or list its tools within `startup_timeout_s`.
        """
        self._listing()

    def _listing(self) -> list:
        async def live():
            try:
                return (await sup.live()).listing
            except _StartError as e:
                raise ValueError(str(e)) from None

        sup = self._sup()
        return sup.submit(live()).result()

    def tools(self, prefix: str | None = None) -> list[McpTool]:
        """The server's tools (started now if needed, and left running), each declared with its
        own schema; `prefix` declares them as "<prefix>_<name>".

        Raises:
          ValueError: the server did not start, `include`/`exclude` name tools it does not
            have, or none is left (the server is then stopped).
        """
        try:
            listing = self._listing()
            names = [t.name for t in listing]
            for key, wanted in (("include", self.include), ("exclude", self.exclude)):
                unknown = sorted(set(wanted or ()) - set(names))
                if unknown:
                    raise ValueError(
                        f"{key} names tools that the MCP server `{self.label}` does not have: "
                        f"{unknown}; its tools: {names}"
                    )
            kept = [
                t
                for t in listing
                if (self.include is None or t.name in self.include)
                and t.name not in (self.exclude or ())
            ]
            if not kept:
                raise ValueError(
                    f"the MCP server `{self.label}` declares no tools"
                    + (" left by include/exclude" if listing else "")
                )
        except BaseException:
            self.stop()
            raise
        return [
            McpTool(
                self,
                t.name,
                f"{prefix}_{t.name}" if prefix else t.name,
                t.description or "",
                _field(t, "input_schema", "inputSchema"),
            )
            for t in kept
        ]

    async def call_tool(
        self, remote: str, arguments: dict, shown: str | None = None
    ) -> Observation:
        """Calls the server's tool `remote` from any thread or event loop; never raises."""
        sup = self._sup()
        fut = sup.submit(sup.call(remote, shown or remote, arguments))
        # Shielded: a caller that stops waiting (e.g. the executor's own timeout) leaves the call
        # to end or time out on the server's loop, so that a hung server is still restarted.
        return await asyncio.shield(asyncio.wrap_future(fut))

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        return Observation.error(
            "Error: the 'mcp' entry is a server, not a tool: declare its tools with "
            "McpServer.tools() (the run's setup does)"
        )

    def stop(self) -> None:
        """Shuts the server down (blocking); a later call starts it again, with a fresh
        restart budget."""
        with self._supervisor_lock:
            sup, self._supervisor = self._supervisor, None
        if sup is not None:
            sup.close()

    async def close(self) -> None:
        await asyncio.to_thread(self.stop)


class McpTool(Tool):
    """One tool of an MCP server, declared with the server's own description and input schema;
    the tools of one server share its connection (`McpServer`), and closing one closes it."""

    def __init__(
        self, server: McpServer, remote_name: str, name: str, description: str, parameters: Any
    ):
        super().__init__()
        self.server = server
        self.remote_name = remote_name  # the server's name (`name` may carry a prefix)
        self.name = name
        self.description = description
        self.parameters = (
            parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
        )

    async def _call(self, arguments: dict, session_id: str | None) -> Observation:
        return await self.server.call_tool(self.remote_name, arguments, shown=self.name)

    def start(self) -> None:
        self.server.start()

    async def close(self) -> None:
        await self.server.close()
