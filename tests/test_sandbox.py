"""Adversarial tests of the sandbox: each attack must fail, leave the host untouched, and the pool
must still answer a normal call afterwards."""

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from fakes import wait_until

from jaxrl_tools.tools import (
    PythonTool,
    SandboxConfig,
    SandboxPool,
    SandboxUnavailableError,
    sandbox_fusion,
)
from jaxrl_tools.tools import pool as pool_mod
from jaxrl_tools.tools import sandbox as sandbox_mod

SECRET_ENV = "JAXRL_TEST_SECRET_TOKEN"
SECRET = "s3cr3t-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def pool():
    os.environ[SECRET_ENV] = SECRET  # the parent's environment must not reach snippets
    p = SandboxPool(2, SandboxConfig(timeout_s=2.0, memory_mb=512))
    yield p
    p.close()
    os.environ.pop(SECRET_ENV, None)


def run(pool, code, **kw):
    return pool.run_sync(code, **kw)


def assert_pool_ok(pool):
    res = run(pool, "print(6 * 7)")
    assert res.ok and res.stdout == "42\n", res


def host_procs_with(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return [p for p in out if p != os.getpid()]


def uid_procs(uid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    out.add(int(d.name))
            except OSError:
                pass
    return out


def descendants(roots) -> set[int]:
    """Every process below `roots` (a sandboxed process's orphans stay below its worker: the
    pid namespace's init adopts them, and dies with the worker)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def describe(pids) -> dict[int, str]:
    """pid -> its state and command line, for a failure message."""
    out = {}
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80]
            out[pid] = f"{state} {cmd.decode(errors='replace')}"
        except OSError:
            out[pid] = "gone"
    return out


def pool_sandbox_procs(pool, workers) -> set[int]:
    """The pool's sandboxed processes (uid 65534 below its workers): other tests' pools,
    running in other pytest workers at the same time, do not count."""
    return uid_procs(65534) & descendants(set(workers) | set(pool.worker_pids()))


# --------------------------------------------------------------------------- basics
def test_worker_identity_and_basic_run(pool):
    res = run(
        pool,
        "import os, numpy, sympy; print(os.getuid(), numpy.arange(4).sum(), "
        "sympy.integrate(sympy.Symbol('x'), sympy.Symbol('x')))",
    )
    assert res.ok, res
    uid, s, integral = res.stdout.split()
    assert uid != "0" and s == "6" and integral == "x**2/2"
    for w in pool._all:
        assert w.hello["uid"] != 0 and w.hello["net_ifaces"] == ["lo"]
        assert w.hello["seccomp"] and w.hello["landlock_abi"] >= 1


def test_error_gives_traceback(pool):
    res = run(pool, "x = 1\n1 / 0")
    assert res.status == "Finished" and res.return_code == 1
    assert res.stderr.strip().splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert "_sandbox_worker" not in res.stderr  # worker frames hidden


def test_state_does_not_leak_between_snippets(pool):
    assert run(pool, "import numpy; numpy.pi = 3; leak = 1; print(numpy.pi)").stdout == "3\n"
    res = run(pool, "import numpy; print(numpy.pi, 'leak' in globals())")
    assert res.stdout.startswith("3.14159") and "False" in res.stdout


# --------------------------------------------------------------------------- network
def test_tcp_to_host_listener_fails(pool):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'pwned')\nprint('connected')"
    )
    res = run(pool, code)
    assert not res.ok and "connected" not in res.stdout
    with pytest.raises(TimeoutError):
        srv.accept()
    srv.close()
    assert_pool_ok(pool)


def test_udp_to_host_listener_fails(pool):
    srv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    srv.bind(("127.0.0.1", 0))
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    code = (
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"s.sendto(b'pwned', ('127.0.0.1', {port}))\nprint('sent')"
    )
    res = run(pool, code)
    assert not res.ok and "sent" not in res.stdout
    with pytest.raises(TimeoutError):
        srv.recvfrom(100)
    srv.close()
    assert_pool_ok(pool)


# --------------------------------------------------------------------------- filesystem
def test_writes_outside_workdir_fail(pool):
    tag = uuid.uuid4().hex
    targets = [
        f"/root/pwned_{tag}",
        f"/tmp/pwned_{tag}",
        f"/dev/shm/pwned_{tag}",
        f"/work/pwned_{tag}",
        f"{os.path.dirname(os.__file__)}/pwned_{tag}",
    ]
    code = (
        f"import os\nok = []\nfor p in {targets!r}:\n"
        "    try:\n        open(p, 'w').write('x'); ok.append(p)\n"
        "    except OSError:\n        pass\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print('WROTE', ok, os.path.exists('inside.txt'))"
    )
    res = run(pool, code)
    assert res.ok, res
    assert "WROTE [] True" in res.stdout
    for t in targets:
        assert not os.path.exists(t), t


def test_workdir_is_fresh_and_deleted(pool):
    res1 = run(pool, "import os; open('f.txt', 'w').write('1'); print(os.getcwd())")
    res2 = run(pool, "import os; print(os.getcwd(), os.listdir('.'))")
    assert res1.ok and res2.ok
    assert "f.txt" not in res2.stdout
    assert not os.path.exists(res1.stdout.strip())  # not on the host either


def test_secret_file_and_env_not_readable(pool, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    code = (
        f"import os, glob\nout = []\ntry:\n    out.append(open({str(secret)!r}).read())\n"
        "except OSError as e:\n    out.append(type(e).__name__)\n"
        "out.append(repr(dict(os.environ)))\n"
        "for p in glob.glob('/proc/*/environ'):\n"
        "    try:\n        out.append(open(p, 'rb').read().decode(errors='replace'))\n"
        "    except OSError:\n        pass\n"
        "for p in ['/root/.bashrc', '/etc/shadow', '/etc/passwd']:\n"
        "    try:\n        out.append(open(p).read())\n    except OSError:\n        pass\n"
        "print('\\n'.join(out))"
    )
    res = run(pool, code)
    assert res.ok, res
    assert SECRET not in res.stdout and SECRET not in res.stderr
    assert "FileNotFoundError" in res.stdout or "PermissionError" in res.stdout
    assert SECRET_ENV not in res.stdout
    assert_pool_ok(pool)


# --------------------------------------------------------------------------- resources
def test_fork_bomb_contained(pool):
    # Counted once every worker is idle: a worker back from the last test's call forks its next
    # snippet process only after cleaning up, later on a loaded machine.
    assert wait_until(lambda: pool._idle.qsize() == pool.n_workers, timeout=20.0)
    workers = pool.worker_pids()
    before = pool_sandbox_procs(pool, workers)
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    t0 = time.monotonic()
    res = run(pool, code, timeout_s=1.0)
    assert res.status == "TimeLimitExceeded", res
    assert time.monotonic() - t0 < 5
    # As many sandbox processes as before (each worker's next snippet process is a new one).
    # Killing and reaping a few thousand forks takes seconds on a loaded 2-core machine.
    left = lambda: pool_sandbox_procs(pool, workers)  # noqa: E731
    assert wait_until(lambda: len(left()) <= len(before), timeout=20.0), describe(left() - before)
    assert_pool_ok(pool)


def test_allocate_10gb_fails(pool):
    res = run(pool, "x = bytearray(10 * 2**30)\nprint('allocated')")
    assert not res.ok and "allocated" not in res.stdout
    assert "MemoryError" in res.stderr
    assert_pool_ok(pool)


def test_infinite_loop_times_out(pool):
    t0 = time.monotonic()
    res = run(pool, "while True:\n    pass", timeout_s=1.0)
    dt = time.monotonic() - t0
    assert res.status == "TimeLimitExceeded" and 0.9 < dt < 3.0, (res, dt)
    assert_pool_ok(pool)


def test_print_100mb_is_capped(pool):
    t0 = time.monotonic()
    res = run(pool, "import sys\nsys.stdout.write('x' * 100_000_000)\nprint('done')")
    assert not res.ok and res.status in ("Error", "TimeLimitExceeded")
    assert len(res.stdout) <= pool.config.max_output_bytes + 10
    assert time.monotonic() - t0 < 4
    assert_pool_ok(pool)


def test_background_process_does_not_outlive_call(pool):
    marker = "bgmarker" + uuid.uuid4().hex
    code = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000) # {marker}'],"
        " start_new_session=True)\n"
        f"subprocess.Popen(['/bin/sh', '-c', 'sleep 1000; echo {marker}'])\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 999 # {marker}'])\n"
        "time.sleep(0.3)\nprint('spawned')"
    )
    res = run(pool, code)
    assert res.ok and "spawned" in res.stdout, res
    assert wait_until(lambda: not host_procs_with(marker)), host_procs_with(marker)
    assert_pool_ok(pool)


# --------------------------------------------------------------------------- the parent
@pytest.mark.parametrize(
    "attack",
    [
        "import os\nos.kill(os.getppid(), 9)",
        "import os\nos.kill(-1, 9)",
        "import subprocess\nsubprocess.run('kill -9 -1', shell=True)",
        "import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
    ],
)
def test_killing_the_parent_fails(pool, attack):
    pids_before = pool.worker_pids()
    res = run(pool, attack + "\nprint('alive')")
    assert res.status != "SandboxError", res  # the worker survived
    assert pool.worker_pids() == pids_before
    assert_pool_ok(pool)


def test_ctypes_libc_is_contained(pool):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.socket(2, 1, 0), libc.socket(10, 2, 0), libc.kill(os.getppid(), 9),"
        " libc.setuid(0), libc.unshare(0x10000000), libc.ptrace(0, 0, 0, 0),"
        " libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))"
    )
    res = run(pool, code)
    assert res.ok, res
    assert res.stdout.split() == ["-1"] * 7, res.stdout
    assert_pool_ok(pool)


def test_killed_worker_is_replaced_and_call_reports_error(pool):
    async def go():
        task = asyncio.ensure_future(pool.run("import time; time.sleep(5)", timeout_s=8))
        await asyncio.sleep(0.3)
        busy = [w for w in pool._all if w not in list(pool._idle.queue)]
        assert busy
        os.killpg(busy[0].pid, 9)
        return await task

    res = asyncio.run(go())
    assert res.status == "SandboxError" and "worker lost" in res.stderr
    assert wait_until(lambda: pool._idle.qsize() == 2, timeout=10)
    assert_pool_ok(pool)
    assert pool.metrics()["worker_restarts"] >= 1


def test_hung_worker_is_replaced(pool, monkeypatch):
    monkeypatch.setattr(pool_mod, "_HOST_SLACK_S", -1.5)  # host gives up before the worker
    res = run(pool, "import time; time.sleep(3)", timeout_s=2.0)
    assert res.status == "SandboxError", res
    monkeypatch.undo()
    assert wait_until(lambda: pool._idle.qsize() == 2, timeout=10)
    assert_pool_ok(pool)


# --------------------------------------------------------------------------- sessions
def test_session_mode_persists_within_and_never_across(pool):
    tool = PythonTool(mode="session", pool=pool)

    async def go():
        a1 = await tool.call({"code": "x = 41\nimport numpy as np\nv = np.ones(3)"}, "traj-A")
        a2 = await tool.call({"code": "print(x + 1, v.sum())"}, "traj-A")
        b1 = await tool.call({"code": "print(x)"}, "traj-B")
        a3 = await tool.call({"code": "1/0"}, "traj-A")  # failed cells are not replayed
        a4 = await tool.call({"code": "x += 1\nprint(x)"}, "traj-A")
        await tool.close_session("traj-A")
        a5 = await tool.call({"code": "print(x)"}, "traj-A")
        return a1, a2, b1, a3, a4, a5

    a1, a2, b1, a3, a4, a5 = asyncio.run(go())
    assert a1.ok and a1.text == ""
    assert a2.ok and a2.text.strip() == "42 3.0"
    assert not b1.ok and b1.text == "NameError: name 'x' is not defined"
    assert not a3.ok and a3.text == "ZeroDivisionError: division by zero"
    assert a4.ok and a4.text.strip() == "42"
    assert not a5.ok and "NameError" in a5.text


def test_stateless_mode_forgets(pool):
    tool = PythonTool(mode="stateless", pool=pool)

    async def go():
        await tool.call({"code": "y = 1"}, "s")
        return await tool.call({"code": "print(y)"}, "s")

    assert "NameError" in asyncio.run(go()).text


def test_sandbox_fusion_shape(pool):
    ok = sandbox_fusion.run_code_sync(
        {
            "code": "print(input()[::-1])",
            "language": "python",
            "stdin": "abc",
            "run_timeout": 2,
            "memory_limit_MB": 256,
        },
        pool,
    )
    assert ok["status"] == "Success"
    assert ok["run_result"]["status"] == "Finished" and ok["run_result"]["stdout"] == "cba\n"
    assert ok["run_result"]["return_code"] == 0
    slow = sandbox_fusion.run_code_sync({"code": "while 1: pass", "run_timeout": 1}, pool)
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    bad = sandbox_fusion.run_code_sync({"code": "print(1)", "language": "cpp"}, pool)
    assert bad["status"] == "SandboxError" and "cpp" in bad["message"]


def test_concurrent_calls_and_metrics(pool):
    async def go():
        return await asyncio.gather(*(pool.run(f"print({i} * 2)") for i in range(8)))

    results = asyncio.run(go())
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(8)]
    m = pool.metrics()
    assert m["calls"] >= 8 and m["latency_p50_s"] > 0 and m["throughput_per_s"] > 0


# --------------------------------------------------------------------------- fail-closed
def test_missing_bwrap_refuses_to_start(monkeypatch):
    real = sandbox_mod.shutil.which
    monkeypatch.setattr(
        sandbox_mod.shutil, "which", lambda name: None if name == "bwrap" else real(name)
    )
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        SandboxPool(1, SandboxConfig())


def test_unsafe_mode_only_explicit_and_loud(caplog):
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="none")
    with caplog.at_level(logging.WARNING):
        p = SandboxPool(1, SandboxConfig(isolation="unsafe_process", preload=()))
    try:
        assert "SANDBOX DISABLED" in caplog.text
        assert p.run_sync("print(1)").stdout == "1\n"
    finally:
        p.close()


def test_pool_threads_do_not_block_event_loop(pool):
    ticks = []

    async def ticker():
        for _ in range(5):
            ticks.append(time.monotonic())
            await asyncio.sleep(0.05)

    async def go():
        await asyncio.gather(pool.run("import time; time.sleep(0.4)"), ticker())

    asyncio.run(go())
    assert len(ticks) == 5 and ticks[-1] - ticks[0] < 0.4
    assert threading.active_count() < 50


def test_http_front_speaks_sandbox_fusion(pool):
    import json
    import urllib.request

    server = sandbox_fusion.make_http_server(pool, "127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
        req = urllib.request.Request(
            url,
            data=json.dumps({"code": "print(sum(range(5)))", "language": "python"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            out = json.loads(r.read())
        assert out["status"] == "Success" and out["run_result"]["stdout"] == "10\n"
    finally:
        server.shutdown()
        server.server_close()


def test_http_front_binds_localhost_by_default_and_says_where(pool, caplog):
    with caplog.at_level(logging.INFO, logger=sandbox_fusion.__name__):
        server = sandbox_fusion.make_http_server(pool, port=0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        said = [r.getMessage() for r in caplog.records if "listening" in r.getMessage()]
        assert said == [f"sandbox /run_code front listening on http://127.0.0.1:{port}/run_code"]
    finally:
        server.server_close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=sandbox_fusion.__name__):
        server = sandbox_fusion.make_http_server(pool, host="0.0.0.0", port=0)  # never served
    try:
        assert server.server_address[0] == "0.0.0.0"
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "http://0.0.0.0:" in warned[0], warned
    finally:
        server.server_close()
