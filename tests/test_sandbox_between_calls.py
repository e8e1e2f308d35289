"""Nothing of one sandboxed call reaches the next, and no call can hurt its worker or the next
caller: each attack runs as call A, then call B on the same worker (a 1-worker pool) must see
none of A's state and be served at its normal latency."""

import asyncio
import os
import platform
import socket
import threading
import time
import uuid

import pytest
from fakes import wait_until

from jaxrl_tools.tools import PythonTool, SandboxConfig, SandboxPool, SandboxUnavailableError
from jaxrl_tools.tools import sandbox as sandbox_mod

# Normal latency of print(1+1) is ~10 ms here; a loaded CI machine gets this much slack.
NORMAL_LATENCY_S = 0.5


@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(1, SandboxConfig(timeout_s=3.0, memory_mb=512))
    yield p
    p.close()


def restarts(pool) -> int:
    return pool.metrics().get("worker_restarts", 0)


def assert_next_call_normal(pool):
    res = pool.run_sync("print(6 * 7)")
    assert res.ok and res.stdout == "42\n", res
    assert res.latency_s < NORMAL_LATENCY_S, res.latency_s


def tmpfs_inodes_used(pool) -> int:
    res = pool.run_sync("import os; s = os.statvfs('.'); print(s.f_files - s.f_ffree)")
    assert res.ok, res
    return int(res.stdout)


def settled_tmpfs_inodes(pool, reads: int = 5) -> int:
    """The fewest inodes of several spaced reads: a snippet process still exiting holds its
    deleted work dir for a moment (longer on a loaded machine), so one read can be a few high;
    what a call leaves behind stays in every read."""
    counts = []
    for _ in range(reads):
        counts.append(tmpfs_inodes_used(pool))
        time.sleep(0.2)
    return min(counts)


# --------------------------------------------------------------------------- work-dir cleanup
def test_unremovable_and_deep_trees_are_cleaned_without_losing_the_worker(pool):
    base = settled_tmpfs_inodes(pool)
    before = restarts(pool)
    hostile = (
        "import os\n"
        "os.makedirs('locked/inner'); open('locked/inner/f', 'w').write('x')\n"
        "os.chmod('locked/inner', 0); os.chmod('locked', 0o500)\n"
        "os.mkdir('deep'); os.chdir('deep')\n"
        "for _ in range(3000):\n"  # deeper than PATH_MAX and than Python's recursion limit
        "    os.mkdir('d'); os.chdir('d')\n"
        "open('bottom', 'w').write('y')\n"
        "os.chmod('.', 0)\n"
        "os.chdir('/'); os.chmod(os.environ['HOME'], 0)\n"
        "print('done')"
    )
    res = pool.run_sync(hostile)
    assert res.ok and res.stdout == "done\n", res
    assert_next_call_normal(pool)
    assert restarts(pool) == before  # cleaned, not worker-lost
    # Nothing of A is left in the sandbox's /tmp.
    assert wait_until(lambda: settled_tmpfs_inodes(pool) == base, timeout=10.0)


def busy_making(kind: str, seconds: float) -> str:
    """A snippet that makes empty files or directories in its work dir for `seconds`."""
    make = "open(f'e{n}', 'w').close()" if kind == "files" else "os.mkdir(f'e{n}')"
    return (
        f"import os, time\nend = time.monotonic() + {seconds}\nn = 0\n"
        f"while time.monotonic() < end:\n    {make}\n    n += 1\nprint(n)"
    )


def test_slow_cleanup_of_a_call_never_lands_on_the_next_callers_clock():
    with SandboxPool(1, SandboxConfig(timeout_s=5.0, memory_mb=512, preload=("math",))) as p:
        base = settled_tmpfs_inodes(p)
        res = p.run_sync(busy_making("dirs", 1.5))
        assert res.ok and int(res.stdout) > 1000, res
        latencies = []
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # while A's dirs are removed (or its worker replaced)
            res = p.run_sync("print(1 + 1)")
            assert res.ok and res.stdout == "2\n", res
            latencies.append(round(res.latency_s, 3))
            time.sleep(0.2)
        assert max(latencies) < NORMAL_LATENCY_S, latencies
        assert p.metrics().get("worker_restarts", 0) == 0
        assert wait_until(lambda: settled_tmpfs_inodes(p) == base, timeout=30.0)


def test_cleanup_that_overruns_its_budget_replaces_the_worker_off_every_callers_clock():
    cfg = SandboxConfig(timeout_s=5.0, memory_mb=512, cleanup_timeout_s=0.05, preload=("math",))
    with SandboxPool(1, cfg) as p:
        first = p.worker_pids()
        assert int(p.run_sync(busy_making("files", 1.0)).stdout) > 1000
        # The only worker serves on while its cleaner is behind and its replacement starts.
        end = time.monotonic() + 20.0
        while p.worker_pids() == first and time.monotonic() < end:
            assert_next_call_normal(p)
            time.sleep(0.05)
        assert p.worker_pids() != first
        assert p.metrics().get("worker_recycled", 0) == 1
        assert_next_call_normal(p)
        assert wait_until(lambda: p._idle.qsize() == 1, timeout=15)
        assert p.metrics().get("worker_restarts", 0) == 0


# --------------------------------------------------------------------------- descriptors
OPEN_FDS = (
    "import os\nopen_fds = []\nfor name in os.listdir('/proc/self/fd'):\n"
    "    try:\n        os.fstat(int(name))\n"
    "    except OSError:\n        continue  # the listing's own descriptor, closed by now\n"
    "    open_fds.append(int(name))\nprint(sorted(fd for fd in open_fds if fd > 2))"
)


def test_no_descriptor_of_the_worker_or_an_earlier_call_reaches_a_call(pool):
    hoard = (
        "import os, time\nfds = [os.open('/dev/null', os.O_RDONLY) for _ in range(40)]\n"
        "r, w = os.pipe()\nfor i, fd in enumerate(fds + [r, w]):\n"
        "    os.dup2(fd, 60 + i)  # inheritable\n"
        "os.dup2(w, 19)\nos.dup2(r, 3)\n"
        "if os.fork() == 0:  # a child inherits them all and tries to outlive the call\n"
        "    os.setsid()\n    time.sleep(30)\n    os._exit(0)\n"
        "print(len(os.listdir('/proc/self/fd')))"
    )
    res = pool.run_sync(hoard)
    assert res.ok and int(res.stdout) > 40, res
    for _ in range(2):  # the same worker, a fresh snippet process each time
        res = pool.run_sync(OPEN_FDS)
        assert res.ok and res.stdout == "[]\n", res


# --------------------------------------------------------------------------- processes
def processes_under(roots) -> list[str]:
    """State and command of every process below `roots` (the workers' outermost processes)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], list(roots)
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    out.append(fh.read().rsplit(")", 1)[1].split()[0] + f" {pid}")
            except OSError:
                pass
    return out


_CLONE = {"x86_64": 56, "aarch64": 220}.get(platform.machine())
HOSTILE_CALLS = {
    "daemon": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(60)\n    os._exit(0)\ntime.sleep(0.2)\nprint('ok')"
    ),
    "kill_all": "import os\nos.kill(-1, 9)",
    # clone(CLONE_PARENT | SIGCHLD): a sibling of the snippet process, i.e. a child of the
    # zygote, outside the snippet's own process tree.
    "sibling": (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        f"pid = libc.syscall({_CLONE}, 0x8000 | 17, 0, 0, 0, 0)\n"
        "if pid == 0:\n    libc.pause()\nprint(pid)"
    ),
}


def settled_processes(pool) -> list[str]:
    """The processes under the pool's only worker once it is idle again (it forks its next
    snippet process after the answer, off the caller's clock)."""
    assert wait_until(lambda: pool._idle.qsize() == 1)
    return processes_under(pool.worker_pids())


@pytest.mark.skipif(_CLONE is None, reason="clone's syscall number unknown on this machine")
def test_hostile_calls_leave_no_process_behind(pool):
    assert_next_call_normal(pool)
    before = settled_processes(pool)
    for name, code in HOSTILE_CALLS.items():
        res = pool.run_sync(code)
        assert res.status != "SandboxError", (name, res)
        assert wait_until(lambda: len(settled_processes(pool)) == len(before)), (
            name,
            before,
            settled_processes(pool),
        )
        assert_next_call_normal(pool)


# --------------------------------------------------------------------------- IPC and memory
def test_sysv_and_posix_ipc_objects_cannot_be_made_or_survive(pool):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "out = [libc.shmget(0, 64 << 20, 0o1600), libc.msgget(0, 0o1600), "
        "libc.semget(0, 1, 0o1600)]\n"
        "rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
        "out.append(rt.mq_open(b'/q', os.O_CREAT | os.O_RDWR, 0o600, None))\n"
        "print(out)"
    )
    res = pool.run_sync(code)
    assert res.ok and res.stdout.strip() == "[-1, -1, -1, -1]", res
    res = pool.run_sync(
        "print(sum(len(open(f'/proc/sysvipc/{k}').read().splitlines()) - 1 "
        "for k in ('shm', 'msg', 'sem')))"
    )
    assert res.ok and res.stdout == "0\n", res


MEMORY_SCAN = r"""
import re
found = set()
with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
    for line in maps:
        fields = line.split()
        if 'r' not in fields[1]:
            continue
        lo, hi = (int(x, 16) for x in fields[0].split('-'))
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            continue
        found.update(m.decode() for m in re.findall(rb'LEAK-[0-9a-f]{32}', data))
        found.update(bytes.fromhex(m.decode()).decode(errors='replace')
                     for m in re.findall(rb'4c45414b2d(?:[0-9a-f]{2}){32}', data))
print(sorted(found))
"""


def test_a_snippet_cannot_read_earlier_calls_from_memory(pool):
    secrets = {k: f"LEAK-{uuid.uuid4().hex}" for k in ("code", "stdin", "out", "file", "cell")}
    pool.run_sync(
        f"s = {secrets['code']!r}; print({secrets['out']!r}); input()",
        stdin=secrets["stdin"] + "\n",
        files={"data.txt": secrets["file"].encode()},
    )
    tool = PythonTool(mode="session", pool=pool, timeout_s=20)

    async def session_calls():
        await tool.call({"code": f"x = {secrets['cell']!r}"}, "other-session")
        await tool.call({"code": "print(len(x))"}, "other-session")  # replays the cell
        await tool.call({"code": "y = 1"}, "scanner")
        return await tool.call({"code": MEMORY_SCAN}, "scanner")  # a session's call

    in_session = asyncio.run(session_calls())
    res = pool.run_sync(MEMORY_SCAN, timeout_s=20)
    assert res.ok, res
    assert res.stdout.startswith("[") and in_session.text.startswith("["), (res, in_session)
    leaked = [s for s in secrets.values() if s in res.stdout + in_session.text]
    assert not leaked, f"{leaked} readable in a later call's memory"
    # The scan works: this call's own marker is found.
    own = f"LEAK-{uuid.uuid4().hex}"
    res = pool.run_sync(f"mine = {own!r}\n" + MEMORY_SCAN, timeout_s=20)
    assert own in res.stdout, res


def test_memory_outside_the_address_space_limit_is_refused_or_counted(pool):
    code = (
        "import os, errno\nout = []\n"
        "try:\n    os.memfd_create('m')\n    out.append('memfd')\n"
        "except OSError as e:\n    out.append(errno.errorcode[e.errno])\n"
        "try:\n    open('/dev/shm/x', 'wb').write(b'x')\n    out.append('shm')\n"
        "except OSError as e:\n    out.append(errno.errorcode[e.errno])\n"
        "print(out)"
    )
    res = pool.run_sync(code)
    assert res.ok, res
    assert "memfd" not in res.stdout and "shm" not in res.stdout, res.stdout
    assert_next_call_normal(pool)


def test_out_of_memory_kills_the_snippet_never_the_worker():
    if os.geteuid() != 0 or not sandbox_mod.make_cgroups("oomprobe", SandboxConfig()):
        pytest.skip("needs root and a memory cgroup")
    sandbox_mod.remove_cgroups(sandbox_mod.cgroup_dirs("oomprobe"))
    cfg = SandboxConfig(
        timeout_s=10.0, memory_mb=300, tmpfs_mb=64, worker_memory_mb=700, preload=("math",)
    )
    with SandboxPool(1, cfg) as p:
        # Five 200 MB children: each is within its own rlimit, together over the worker's limit.
        code = (
            "import os, time\nkids = []\nfor _ in range(5):\n    pid = os.fork()\n"
            "    if pid == 0:\n        b = bytearray(200 * 2**20)\n        time.sleep(0.5)\n"
            "        os._exit(0)\n    kids.append(pid)\n"
            "print([os.waitstatus_to_exitcode(os.waitpid(k, 0)[1]) for k in kids])"
        )
        res = p.run_sync(code)
        assert res.ok and "-9" in res.stdout, res  # the kernel killed some of the children
        assert p.metrics().get("worker_restarts", 0) == 0
        assert_next_call_normal(p)


# --------------------------------------------------------------------------- sessions
def test_session_call_has_a_total_budget_including_replay():
    cfg = SandboxConfig(timeout_s=1.0, memory_mb=512, preload=("math",))
    with SandboxPool(1, cfg) as p:
        tool = PythonTool(mode="session", pool=p, timeout_s=1.0, max_call_s=2.0)

        async def go():
            for _ in range(4):
                ok = await tool.call({"code": "import time; time.sleep(0.8)"}, "slow")
                if not ok.ok:
                    return ok
            return None

        t0 = time.monotonic()
        refused = asyncio.run(go())
        # Calls 1-2 fit (0.8 s, then 1.6 s with the replay); call 3 would need 2.4 s.
        assert refused is not None and "time limit" in refused.text, refused
        assert time.monotonic() - t0 < 0.8 + 1.6 + 2.0 + 1.5
        assert_next_call_normal(p)


# --------------------------------------------------------------------------- sockets
def test_connecting_to_a_bound_unix_socket_is_denied(tmp_path):
    tmp_path.chmod(0o755)
    path = tmp_path / "host.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    path.chmod(0o777)
    srv.listen(1)
    srv.settimeout(0.5)
    dgram = tmp_path / "host.dgram"
    drx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    drx.bind(str(dgram))
    dgram.chmod(0o777)
    drx.settimeout(0.5)
    cfg = SandboxConfig(timeout_s=3.0, preload=("math",), extra_ro_binds=(str(tmp_path),))
    code = (
        "import socket\nout = []\n"
        "try:\n    s = socket.socket(socket.AF_UNIX)\n"
        f"    s.connect({str(path)!r})\n    out.append('connected')\n"
        "except OSError as e:\n    out.append(type(e).__name__)\n"
        "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "try:\n"
        f"    a.sendto(b'hi', {str(dgram)!r})\n    out.append('sent')\n"
        "except OSError as e:\n    out.append(type(e).__name__)\n"
        "print(out)"
    )
    try:
        with SandboxPool(1, cfg) as p:
            res = p.run_sync(code)
        assert res.ok, res
        assert "connected" not in res.stdout and "sent" not in res.stdout, res.stdout
        with pytest.raises(TimeoutError):
            srv.accept()
        with pytest.raises(TimeoutError):
            drx.recv(16)
    finally:
        srv.close()
        drx.close()


# --------------------------------------------------------------------------- worker lifecycle
def test_cgroups_are_removed_on_close_and_bound_the_workers_cpu():
    if os.geteuid() != 0 or not sandbox_mod.make_cgroups("cpuprobe", SandboxConfig()):
        pytest.skip("needs root and cgroups")
    sandbox_mod.remove_cgroups(sandbox_mod.cgroup_dirs("cpuprobe"))
    cfg = SandboxConfig(timeout_s=5.0, preload=("math",), worker_cpus=0.5)
    p = SandboxPool(1, cfg)
    dirs = list(p._all[0].cgroups)
    try:
        assert dirs and all(d.is_dir() for d in dirs)
        # Two processes spin for 1.5 s of wall time; half a CPU gives them ~0.75 s in all.
        code = (
            "import os, time\nkids = []\nfor _ in range(2):\n    pid = os.fork()\n"
            "    if pid == 0:\n        end = time.monotonic() + 1.5\n"
            "        while time.monotonic() < end: pass\n        os._exit(0)\n"
            "    kids.append(pid)\nfor k in kids: os.waitpid(k, 0)\n"
            "t = os.times(); print(t.children_user + t.children_system)"
        )
        res = p.run_sync(code)
        assert res.ok, res
        assert float(res.stdout) < 1.05, res.stdout
    finally:
        p.close()
    assert not [d for d in dirs if d.exists()]


def test_startup_check_covers_every_layer(monkeypatch):
    real = sandbox_mod.build_command

    def without_ipc_namespace(*args, **kwargs):
        argv = real(*args, **kwargs)
        i = argv.index("--unshare-all")
        return (
            argv[:i] + [f"--unshare-{ns}" for ns in ("user", "pid", "net", "uts")] + argv[i + 1 :]
        )

    monkeypatch.setattr(sandbox_mod, "build_command", without_ipc_namespace)
    with pytest.raises(SandboxUnavailableError, match="ipc namespace"):
        SandboxPool(1, SandboxConfig(preload=("math",)))


def test_probe_report_lists_every_layer():
    with SandboxPool(1, SandboxConfig(preload=("math",))) as p:
        probe = p._all[0].hello["probe"]
    assert probe == dict.fromkeys(sandbox_mod.PROBE_CHECKS, "ok"), probe


def test_http_front_callers_do_not_see_each_other(pool):
    """Two users of one worker through the `/run_code` front: B cannot find A's data."""
    import json
    import urllib.request

    server = sandbox_pool_http(pool)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
        secret = f"LEAK-{uuid.uuid4().hex}"

        def post(code):
            req = urllib.request.Request(
                url,
                data=json.dumps({"code": code, "language": "python"}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read())

        assert post(f"print({secret!r})")["run_result"]["stdout"] == secret + "\n"
        out = post(MEMORY_SCAN)["run_result"]
        assert out["stdout"].startswith("[") and secret not in out["stdout"], out
    finally:
        server.shutdown()
        server.server_close()


def sandbox_pool_http(pool):
    from jaxrl_tools.tools import sandbox_fusion

    server = sandbox_fusion.make_http_server(pool, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
