"""MCP tools: a server's tools declared with their own schemas, called through the executor, and
a crashed or hung server turned into error observations and a restart (tools/mcp.py)."""

import asyncio
import os
import sys
import threading
import time

import pytest

pytest.importorskip("mcp")

from jaxrl_tools import check, setup
from jaxrl_tools.config import ConfigError
from jaxrl_tools.config_loader import load_config
from jaxrl_tools.tools import McpServer, McpTool, ToolCall, ToolExecutor, tool_class

# The server the tests start: SDK 2.x calls FastMCP `MCPServer`.
SERVER = '''
import asyncio, os, threading

try:
    from mcp.server.mcpserver import Image, MCPServer as Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # SDK 1.x
    from mcp.server.fastmcp import FastMCP as Server, Image
    from mcp.server.fastmcp.exceptions import ToolError

server = Server("test", log_level="ERROR")


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Returns the text."""
    return text


@server.tool()
def fail(message: str) -> str:
    """Always fails."""
    raise ToolError(message)


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleeps (on the server's loop, so that it exits as soon as its stdin closes)."""
    await asyncio.sleep(seconds)
    return "woke up"


@server.tool()
def crash() -> str:
    """Kills the server."""
    os._exit(3)


@server.tool()
def exit_soon() -> str:
    """Answers, then the server exits."""
    threading.Timer(0.1, os._exit, (0,)).start()
    return "bye"


@server.tool()
def close_stderr() -> str:
    """Closes the server's stderr; the server lives on."""
    os.close(2)
    return "closed"


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def getenv(variable: str) -> str:
    """An environment variable of the server."""
    return os.environ.get(variable, "<unset>")


@server.tool(structured_output=False)
def picture() -> list:
    """Text and an image."""
    return ["a dot", Image(data=b"0" * 12, format="png")]


if __name__ == "__main__":
    server.run()
'''
NAMES = [
    "add",
    "echo",
    "fail",
    "sleep",
    "crash",
    "exit_soon",
    "close_stderr",
    "pid",
    "getenv",
    "picture",
]


@pytest.fixture(scope="module")
def server_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "server.py"
    path.write_text(SERVER)
    return str(path)


@pytest.fixture(scope="module")
def shared(server_path):
    """One server for the tests that do not break it."""
    server = McpServer([sys.executable, server_path], timeout_s=10)
    yield server, ToolExecutor(server.tools())
    server.stop()


def run(executor, name, **arguments):
    return asyncio.run(executor.execute(ToolCall(name, arguments)))


def server_pid(executor, name="pid") -> int:
    obs = run(executor, name)
    assert obs.ok, obs.text
    return int(obs.text)


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """The process ended (and was reaped) within `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_registered_and_declares_the_servers_own_schemas(shared):
    assert tool_class("mcp") is McpServer
    server, executor = shared
    assert list(executor.tools) == NAMES
    schema = executor.tools["add"].schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "add" and fn["description"] == "Adds two integers."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["a", "b"]
    assert {k: v["type"] for k, v in params["properties"].items()} == {
        "a": "integer",
        "b": "integer",
    }
    assert all(isinstance(t, McpTool) and t.server is server for t in executor.tools.values())


def test_calls_through_the_executor(shared):
    _, executor = shared
    obs = run(executor, "add", a=2, b=3)
    assert obs.ok and obs.text == "5"
    obs = run(executor, "echo", text="héllo\nworld")
    assert obs.ok and obs.text == "héllo\nworld"
    obs = run(executor, "picture")  # text parts joined, an image described
    assert obs.ok and obs.text == "a dot\n[image image/png, 12 bytes]"


def test_executor_validates_arguments_against_the_servers_schema(shared):
    _, executor = shared
    obs = run(executor, "add", a="two", b=3)
    assert not obs.ok and obs.metrics == {"invalid_args": 1.0}
    assert "a must be of type integer" in obs.text
    obs = run(executor, "add", a=1)
    assert not obs.ok and "missing required argument 'b'" in obs.text


def test_tool_error_is_an_error_observation(shared):
    _, executor = shared
    obs = run(executor, "fail", message="disk full")
    assert not obs.ok and obs.text.startswith("Error in tool 'fail': ")
    assert obs.text.endswith("disk full")  # the server's own message
    assert run(executor, "add", a=1, b=1).text == "2"  # the server still serves


def test_calls_from_several_event_loops_and_threads(shared):
    """A run starts a fresh event loop per rollout (asyncio.run): the connection outlives them."""
    _, executor = shared

    async def many():
        calls = [ToolCall("add", {"a": i, "b": 1}) for i in range(8)]
        return await executor.execute_many(calls)

    assert [o.text for o in asyncio.run(many())] == [str(i + 1) for i in range(8)]
    assert run(executor, "echo", text="again").text == "again"  # another loop
    found = []
    threads = [
        threading.Thread(target=lambda i=i: found.append(run(executor, "add", a=i, b=0).text))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(found) == ["0", "1", "2", "3"]


def test_timeout_is_an_error_and_the_server_restarts(server_path):
    server = McpServer([sys.executable, server_path], timeout_s=1.0)
    tools = server.tools(prefix="srv")
    executor = ToolExecutor(tools)
    try:
        first = server_pid(executor, "srv_pid")
        # The executor's own (shorter) limit: its caller moves on, the server keeps serving,
        # and the abandoned call still times out on the server's loop, which restarts it.
        obs = run(ToolExecutor(tools, timeout_s=0.2), "srv_sleep", seconds=60)
        assert not obs.ok and obs.metrics == {"timeout": 1.0}
        assert server_pid(executor, "srv_pid") == first
        deadline = time.monotonic() + 10
        while (second := server_pid(executor, "srv_pid")) == first and time.monotonic() < deadline:
            time.sleep(0.1)
        assert second != first
        t0 = time.monotonic()
        obs = run(executor, "srv_sleep", seconds=60)  # the tool's own limit
        assert time.monotonic() - t0 < 5
        assert not obs.ok and obs.metrics == {"timeout": 1.0}
        assert "'srv_sleep'" in obs.text and "timeout_s=1 s" in obs.text
        assert "restarted" in obs.text
        assert run(executor, "srv_add", a=1, b=2).text == "3"
        assert server_pid(executor, "srv_pid") not in (first, second)
        assert gone(first) and gone(second)  # the hung processes were shut down
    finally:
        server.stop()


def test_crash_and_exit_restart_the_server_until_max_restarts(server_path):
    server = McpServer([sys.executable, server_path], max_restarts=1)
    executor = ToolExecutor(server.tools())
    try:
        first = server_pid(executor)
        obs = run(executor, "crash")
        assert not obs.ok and obs.metrics == {"server_exit": 1.0}
        assert "'crash'" in obs.text and "exited during the call" in obs.text
        assert run(executor, "add", a=1, b=2).text == "3"  # restarted
        second = server_pid(executor)
        assert second != first and gone(first)
        assert run(executor, "exit_soon").text == "bye"
        assert gone(second)  # exited between calls: the next call restarts it
        assert run(executor, "add", a=2, b=2).text == "4"
        assert server_pid(executor) != second
        # Restarts in a row without an answer are bounded (each answer resets the count).
        assert not run(executor, "crash").ok
        assert not run(executor, "crash").ok  # after the one restart allowed
        obs = run(executor, "add", a=1, b=2)
        assert not obs.ok and obs.metrics == {"server_down": 1.0}
        assert "failed 2 times in a row" in obs.text and "max_restarts=1" in obs.text
        assert run(executor, "echo", text="x").text == obs.text.replace("'add'", "'echo'")
    finally:
        server.stop()


def test_a_server_that_closes_its_stderr_is_not_taken_for_dead(server_path):
    # A closed stderr is how an exit is seen before the transport's stdout ends (under load the
    # call could reach the dead session first); a live server without stderr keeps serving.
    server = McpServer([sys.executable, server_path], max_restarts=0)
    executor = ToolExecutor(server.tools())
    try:
        first = server_pid(executor)
        assert run(executor, "close_stderr").text == "closed"
        for a in range(3):
            assert run(executor, "add", a=a, b=1).text == str(a + 1)
        assert server_pid(executor) == first
    finally:
        server.stop()


def test_server_that_does_not_start_is_a_clear_error_at_build(tmp_path):
    with pytest.raises(ValueError, match=r"could not start the MCP server `/no/such/server --x`"):
        McpServer(["/no/such/server", "--x"]).tools()
    crashing = [sys.executable, "-c", "raise SystemExit('bad config: no API key')"]
    with pytest.raises(ValueError, match=r"exited before listing its tools.*no API key"):
        McpServer(crashing).tools()
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"did not start .* within startup_timeout_s=0.5 s"):
        McpServer(silent, startup_timeout_s=0.5).tools()
    assert time.monotonic() - t0 < 8  # 0.5 s, then the SDK's bounded shutdown of the process
    with pytest.raises(ValueError, match=r"command must be .* list of strings"):
        McpServer("python server.py")
    with pytest.raises(ValueError, match=r"env.DEBUG must be a string, got True"):
        McpServer(["x"], env={"DEBUG": True})
    assert McpServer(["srv", "--port", 8080], env={"PORT": 8080}).env == {"PORT": "8080"}


def test_exclude_of_a_tool_the_server_lacks_is_an_error(server_path):
    server = McpServer([sys.executable, server_path], exclude=["crash", "nope"])
    with pytest.raises(ValueError, match=r"exclude names tools .* does not have: \['nope'\]"):
        server.tools()
    assert server._supervisor is None  # stopped


def recipe(tmp_path, tools_yaml: str):
    path = tmp_path / "run.yaml"
    path.write_text(f"tokenizer: {{path: tok}}\ntools:\n{tools_yaml}")
    return load_config(path)


def test_recipe_declares_and_runs_mcp_tools(tmp_path, server_path):
    cfg = recipe(
        tmp_path,
        f"  - class: mcp\n    name: calc\n    config:\n"
        f"      command: [{sys.executable}, {server_path}]\n"
        f"      env: {{GREETING: hi}}\n      include: [add, pid, getenv]\n      timeout_s: 5\n",
    )
    built = check.build_tools(cfg)  # preflight: listed, then the server is stopped
    assert [t.name for t in built] == ["calc_add", "calc_pid", "calc_getenv"]
    assert built[0].server._supervisor is None
    started = setup.setup_tools(cfg)
    try:
        executor = ToolExecutor(started)
        assert run(executor, "calc_add", a=20, b=22).text == "42"
        assert [s["function"]["name"] for s in executor.schemas()] == [t.name for t in built]
        assert run(executor, "calc_getenv", variable="GREETING").text == "hi"
        pid = server_pid(executor, "calc_pid")
    finally:
        setup.close_tools(started)
    assert gone(pid)  # the run's end shuts the server down


def test_recipe_errors(tmp_path, server_path):
    with pytest.raises(ConfigError, match=r"tools\[0\]\.config has unknown key 'timeout'"):
        recipe(tmp_path, "  - {class: mcp, config: {command: [x], timeout: 3}}\n")
    cfg = recipe(tmp_path, "  - {class: mcp, config: {command: [/no/such/server]}}\n")
    with pytest.raises(ConfigError, match=r"^tools\[0\] \(mcp\): could not start the MCP server"):
        check.build_tools(cfg)
    with pytest.raises(ConfigError, match=r"^tools\[0\] \(mcp\): could not start the MCP server"):
        setup.setup_tools(cfg)
    cfg = recipe(
        tmp_path,
        "  - {class: calculator, name: add}\n"
        f"  - {{class: mcp, config: {{command: [{sys.executable}, {server_path}]}}}}\n",
    )
    with pytest.raises(
        ConfigError, match=r"tools\[1\] \(mcp\) declares a tool 'add', as tools\[0\]"
    ):
        check.build_tools(cfg)
