"""Isolation stack for model-written code, and the host side of one sandboxed worker.

Stack (default `isolation="bwrap"`, fail-closed), outermost first:

1. (only when the host runs as root and the interpreter lives in a directory that uid 65534 cannot
   traverse, e.g. pyenv under /root mode 700) `unshare --mount` gives a private mount namespace in
   which those directories are bind-mounted onto world-traversable staging points; nothing changes
   in the host's mount table.
2. `setpriv` drops to an unprivileged uid/gid (65534 by default), clears supplementary groups,
   every capability, and sets no_new_privs.
3. `bwrap` (bubblewrap) builds fresh user, pid, net, ipc, uts and cgroup namespaces, a root that
   holds only read-only binds of /usr (+ the /bin, /lib, ... links), /etc/ld.so.cache, the
   interpreter prefix and the venv, a private tmpfs /tmp, its own /proc and a minimal /dev; the
   environment is cleared; it dies with its parent.
4. (root only, where the kernel has them) each worker gets its own memory, pids and cpu cgroup
   (v1 hierarchies, or v2 with those controllers), so N forked snippets times their address-space
   rlimit cannot exhaust host memory, forks are bounded and the worker uses at most
   `worker_cpus` cores. Missing controllers only log a warning: rlimits still bound each snippet.
   The cgroups are removed when the worker is.
5. Inside, `_sandbox_worker.py` has a zygote, forked before any request is read, fork one process
   per snippet (so no earlier call's data is in the snippet's memory), which adds rlimits (CPU,
   address space, nproc, fsize, nofile, core), OOM-killer priority, a Landlock domain (writes
   only in its fresh work dir, no TCP, signals and abstract sockets scoped to itself) and a
   seccomp filter (no sockets but socketpair, no SysV/POSIX IPC objects or memfds, no ptrace,
   mount, namespaces, bpf, CLONE_PARENT, ...); it holds no descriptor but its stdin, stdout and
   stderr. After each snippet the worker SIGKILLs every other process of its pid namespace,
   answers, moves the work dir into a trash dir no snippet can see and takes the next call while
   a cleaner process empties it; a worker whose cleaner falls behind is replaced, and serves on
   until its replacement is up.

At start each worker reports every layer (uid, namespaces, capabilities, no_new_privs, cleared
environment, Landlock, seccomp, cgroups) and runs a probe snippet that tries what a snippet must
not do; if anything is missing the pool refuses to start (`SandboxUnavailableError` names it and
the install command). `isolation="unsafe_process"` runs the worker as a plain child process (the
per-snippet rlimits, Landlock and seccomp still apply where the kernel has them) and logs a loud
warning each time a worker starts; use it only where namespaces cannot be had.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("_sandbox_worker.py")
_STAGE_ROOT = Path("/run/jaxrl_tools_sandbox")
_WORKER_BASE_MB = 256
_READY_SLACK_S = 2.0  # a worker with numpy and sympy imported, and its zygote
_ISOLATIONS = ("bwrap", "unsafe_process")
INSTALL_HINT = (
    "install bubblewrap (`apt-get install -y bubblewrap`), util-linux (setpriv, "
    "unshare, mount; present on Debian) and pyseccomp (`pip install pyseccomp`)"
)


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this machine (the pool refuses to start)."""


class WorkerDiedError(RuntimeError):
    """The worker process crashed, hung or was killed; the pool replaces it."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """How sandboxed workers are started and what each snippet may use.

    Attributes:
      isolation: "bwrap" (default; the full stack, fail-closed) or "unsafe_process" (no
        namespaces, no uid drop; loudly logged; only behind this explicit setting).
      uid, gid: unprivileged ids the worker runs as when the host is root.
      timeout_s: default wall-clock limit per snippet (the CPU rlimit follows it).
      memory_mb: address space a snippet may add on top of the preloaded worker's.
      nproc, nofile, fsize_mb: rlimits per snippet (nproc counts in the worker's own user ns).
      max_output_bytes: stdout and stderr are each cut to head + tail of this many bytes.
      kill_output_bytes: a snippet writing more than this in total is killed.
      tmpfs_mb: size of the sandbox's private /tmp (work dirs live there).
      preload: modules imported once by each worker (shared copy-on-write with snippets).
      extra_ro_binds: more host paths made visible read-only inside the sandbox.
      startup_timeout_s: how long a worker may take to start and report.
      worker_memory_mb: memory cgroup limit of one worker with all its snippets (root only;
        0 disables).
      worker_pids: pids cgroup limit of one worker's sandbox (root only; 0 disables).
      worker_cpus: CPU quota of one worker with all its snippets, in cores (root only; 0
        disables).
      cleanup_timeout_s: time a worker's cleaner has, in the background, to empty a call's
        work dir; past it (e.g. millions of files) the worker is replaced, off every caller's
        clock (it serves until its replacement is up).
    """

    isolation: str = "bwrap"
    uid: int = 65534
    gid: int = 65534
    timeout_s: float = 10.0
    memory_mb: int = 1024
    nproc: int = 64
    nofile: int = 128
    fsize_mb: int = 16
    max_output_bytes: int = 65536
    kill_output_bytes: int = 8 * 2**20
    tmpfs_mb: int = 256
    preload: tuple[str, ...] = ("math", "numpy", "sympy")
    extra_ro_binds: tuple[str, ...] = ()
    startup_timeout_s: float = 30.0
    worker_memory_mb: int = 4096
    worker_pids: int = 256
    worker_cpus: float = 1.0
    cleanup_timeout_s: float = 2.0

    def __post_init__(self):
        if self.isolation not in _ISOLATIONS:
            raise ValueError(f"SandboxConfig.isolation={self.isolation!r}; valid: {_ISOLATIONS}")
        for name in (
            "timeout_s",
            "memory_mb",
            "nproc",
            "nofile",
            "fsize_mb",
            "max_output_bytes",
            "kill_output_bytes",
            "tmpfs_mb",
            "cleanup_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")
        # One call may hold memory_mb per process and tmpfs_mb of files; the worker's cgroup
        # must fit one ordinary call beside the preloaded worker, or normal calls get OOM-killed.
        need = self.memory_mb + self.tmpfs_mb + _WORKER_BASE_MB
        if 0 < self.worker_memory_mb < need:
            raise ValueError(
                f"SandboxConfig.worker_memory_mb={self.worker_memory_mb} is below memory_mb + "
                f"tmpfs_mb + {_WORKER_BASE_MB} (the worker itself) = {need}; raise it or set 0"
            )


def check_isolation(config: SandboxConfig) -> list[str]:
    """Lists what is missing for `config.isolation` on this host (empty list: all present)."""
    if config.isolation != "bwrap":
        return []
    problems = []
    tools = ["bwrap"] + (["setpriv", "unshare", "mount"] if os.geteuid() == 0 else [])
    for tool in tools:
        if shutil.which(tool) is None:
            pkg = "bubblewrap" if tool == "bwrap" else "util-linux"
            problems.append(f"`{tool}` not found (apt-get install -y {pkg})")
    try:
        if int(Path("/proc/sys/user/max_user_namespaces").read_text()) == 0:
            problems.append("user namespaces disabled (sysctl user.max_user_namespaces=0)")
    except OSError:
        pass
    knob = Path("/proc/sys/kernel/unprivileged_userns_clone")
    if knob.exists() and knob.read_text().strip() == "0":
        problems.append(
            "unprivileged user namespaces disabled (sysctl kernel.unprivileged_userns_clone=1)"
        )
    return problems


def _traversable_by_others(path: Path) -> bool:
    """True if a uid that is neither owner nor group member can reach and read `path`."""
    parts = path.resolve().parts
    for i in range(1, len(parts) + 1):
        st = os.stat(Path(*parts[:i]))
        need = stat.S_IXOTH | (stat.S_IROTH if i == len(parts) else 0)
        if st.st_mode & need != need:
            return False
    return True


def _python_paths() -> list[Path]:
    """Directories the sandboxed interpreter needs: base prefix (stdlib) and venv prefix."""
    paths = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]
    out: list[Path] = []
    for p in paths:
        if not any(p == q or q in p.parents for q in out):
            out.append(p)
    return out


_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CPU_PERIOD_US = 100_000


def cgroup_dirs(name: str) -> list[Path]:
    """Where a worker's cgroups named `name` live (v2, and each v1 hierarchy)."""
    return [_CGROUP_ROOT / "jaxrl_tools" / name] + [
        _CGROUP_ROOT / ctrl / "jaxrl_tools" / name for ctrl in ("memory", "pids", "cpu")
    ]


def make_cgroups(name: str, config: SandboxConfig) -> list[Path]:
    """Creates this worker's memory/pids/cpu cgroups (v1 hierarchies or v2); [] if unavailable."""
    wanted = {}
    if config.worker_memory_mb > 0:
        wanted["memory"] = config.worker_memory_mb * 2**20
    if config.worker_pids > 0:
        wanted["pids"] = config.worker_pids
    if config.worker_cpus > 0:
        wanted["cpu"] = max(int(config.worker_cpus * _CPU_PERIOD_US), 1000)
    made: list[Path] = []
    v2 = _CGROUP_ROOT / "cgroup.controllers"
    try:
        if v2.exists():  # unified hierarchy
            ctrls = set(v2.read_text().split())
            wanted = {k: v for k, v in wanted.items() if k in ctrls}
            if not wanted:
                return []
            parent = _CGROUP_ROOT / "jaxrl_tools"
            parent.mkdir(exist_ok=True)
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
            d = parent / name
            d.mkdir(exist_ok=True)
            made.append(d)
            if "memory" in wanted:
                (d / "memory.max").write_text(str(wanted["memory"]))
                (d / "memory.swap.max").write_text("0")
            if "pids" in wanted:
                (d / "pids.max").write_text(str(wanted["pids"]))
            if "cpu" in wanted:
                (d / "cpu.max").write_text(f"{wanted['cpu']} {_CPU_PERIOD_US}")
            return made
        for ctrl, value in wanted.items():
            base = _CGROUP_ROOT / ctrl
            if not (base / "cgroup.procs").exists():
                continue
            d = base / "jaxrl_tools" / name
            d.mkdir(parents=True, exist_ok=True)
            made.append(d)
            if ctrl == "memory":
                (d / "memory.limit_in_bytes").write_text(str(value))
            elif ctrl == "pids":
                (d / "pids.max").write_text(str(value))
            else:
                (d / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD_US))
                (d / "cpu.cfs_quota_us").write_text(str(value))
    except OSError as e:
        logger.warning("sandbox cgroups unavailable (%s); rlimits still apply", e)
        remove_cgroups(made)
        return []
    return made


def remove_cgroups(dirs: list[Path], timeout_s: float = 5.0) -> None:
    """Removes cgroups, killing what is left in them; retries while their processes exit."""
    end = time.monotonic() + timeout_s
    for d in dirs:
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if time.monotonic() > end:
                    logger.error("cannot remove sandbox cgroup %s: %s", d, e)
                    break
                try:
                    for pid in (d / "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
                time.sleep(0.01)


def build_command(
    config: SandboxConfig, worker_cfg: dict, script_fd: int, cgroups: list[Path] = ()
) -> list[str]:
    """The argv that starts one sandboxed worker (the worker source is read from `script_fd`).

    As root, a tiny /bin/sh step first joins the worker's `cgroups` and performs the staging
    bind mounts (in a private mount namespace), then execs setpriv -> bwrap.
    """
    python = str(Path(sys.prefix) / "bin" / "python")
    if not Path(python).exists():
        python = sys.executable
    args = json.dumps(worker_cfg)
    if config.isolation == "unsafe_process":
        return [python, "-I", "-c", _BOOT.format(fd=script_fd), args]
    root = os.geteuid() == 0
    binds: list[tuple[str, str]] = []  # (source as bwrap sees it, destination in the sandbox)
    stage: list[tuple[str, str]] = []  # root-only pre-binds in a private mount namespace
    needed = _python_paths() + [Path(p).resolve() for p in config.extra_ro_binds]
    for i, p in enumerate(needed):
        if root and not _traversable_by_others(p):
            point = _STAGE_ROOT / str(i)
            point.mkdir(parents=True, exist_ok=True)
            os.chmod(_STAGE_ROOT, 0o755)
            stage.append((str(p), str(point)))
            binds.append((str(point), str(p)))
        else:
            binds.append((str(p), str(p)))
    bw = [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
        "--clearenv",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            bw += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            bw += ["--ro-bind", str(host), f"/{top}"]
    if Path("/etc/ld.so.cache").exists():
        bw += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    # The private /tmp first: an interpreter or venv that lives under /tmp is bound on top of it.
    bw += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(config.tmpfs_mb * 2**20),
        "--tmpfs",
        "/tmp",
    ]
    for src, dst in binds:
        bw += ["--ro-bind", src, dst]
    bw += ["--chdir", "/tmp"]
    for k, v in SANDBOX_ENV.items():
        bw += ["--setenv", k, v]
    bw += ["--", python, "-I", "-c", _BOOT.format(fd=script_fd), args]
    if not root:
        return bw
    drop = [
        "setpriv",
        f"--reuid={config.uid}",
        f"--regid={config.gid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]
    script = "set -e\n" + "".join(
        f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}\n" for d in cgroups
    )
    script += "".join(f"mount --bind {shlex.quote(a)} {shlex.quote(b)}\n" for a, b in stage)
    script += 'exec "$@"\n'
    if not stage and not cgroups:
        return drop + bw
    sh = ["/bin/sh", "-c", script, "sandbox-launch"]
    if not stage:
        return sh + drop + bw
    return ["unshare", "--mount", "--propagation", "private", "--"] + sh + drop + bw


# The worker's source comes through an inherited pipe: no host path has to be visible inside.
_BOOT = (
    "import os,sys;f=os.fdopen({fd},'rb');s=f.read();f.close();"
    "sys.argv=['_sandbox_worker']+sys.argv[1:];g={{'__name__':'__main__'}};"
    "exec(compile(s,'_sandbox_worker.py','exec'),g)"
)


# Start-up check of the per-snippet layers: each worker runs this as its first snippet, under the
# full set-up (rlimits, Landlock, seccomp, from the zygote), and the pool refuses to start unless
# every check reads "ok". Each line tries something a snippet must not be able to do.
PROBE_CHECKS = (
    "inet_socket",
    "unix_socket",
    "sysv_shm",
    "posix_mqueue",
    "memfd",
    "write_outside_workdir",
    "read_zygote_memory",
    "read_worker_memory",
    "ptrace",
    "new_namespace",
    "address_space_limit",
    "process_limit",
    "oom_killer_takes_snippet",
)
PROBE_CODE = r"""
import ctypes, json, os, resource, socket
libc = ctypes.CDLL(None, use_errno=True)
with open(f"/proc/{os.getppid()}/stat") as fh:  # the zygote's parent: the worker
    worker = int(fh.read().rsplit(")", 1)[1].split()[1])

def refused(attempt):
    try:
        got = attempt()
    except OSError:
        return "ok"
    return "ok" if got == -1 else f"allowed: {got!r}"

def limited(res):
    soft, _ = resource.getrlimit(res)
    return "ok" if soft != resource.RLIM_INFINITY else "unlimited"

checks = {
    "inet_socket": refused(lambda: socket.socket(socket.AF_INET)),
    "unix_socket": refused(lambda: socket.socket(socket.AF_UNIX)),
    "sysv_shm": refused(lambda: libc.shmget(0, 4096, 0o1600)),
    "posix_mqueue": refused(lambda: libc.mq_open(b"/probe", os.O_CREAT | os.O_RDWR, 0o600, None)),
    "memfd": refused(lambda: os.memfd_create("probe")),
    "write_outside_workdir": refused(lambda: open("/tmp/probe", "w")),
    "read_zygote_memory": refused(lambda: open(f"/proc/{os.getppid()}/mem", "rb")),
    "read_worker_memory": refused(lambda: open(f"/proc/{worker}/mem", "rb")),
    "ptrace": refused(lambda: libc.ptrace(0, 0, 0, 0)),
    "new_namespace": refused(lambda: libc.unshare(0x10000000)),
    "address_space_limit": limited(resource.RLIMIT_AS),
    "process_limit": limited(resource.RLIMIT_NPROC),
    "oom_killer_takes_snippet": (
        "ok" if open("/proc/self/oom_score_adj").read().strip() == "1000" else "not first"
    ),
}
print(json.dumps(checks))
"""
# What the sandbox's environment may hold (build_command sets exactly these).
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}
_NAMESPACES = ("user", "pid", "net", "ipc", "uts", "mnt", "cgroup")


def isolation_problems(config: SandboxConfig, hello: dict, cgroups: list[Path], pid: int):
    """What a started worker's report shows to be missing, layer by layer ([]: all there)."""
    if config.isolation != "bwrap":
        return []
    problems = []
    if hello.get("uid") == 0 or hello.get("euid") == 0:
        problems.append("worker runs as uid 0")
    for ns in _NAMESPACES:
        if hello.get("namespaces", {}).get(ns) == os.readlink(f"/proc/self/ns/{ns}"):
            problems.append(f"worker shares the host's {ns} namespace")
    if [n for n in hello.get("net_ifaces", []) if n != "lo"]:
        problems.append(f"worker sees network interfaces {hello['net_ifaces']}")
    if any(hello.get("capabilities", {"?": 1}).values()):
        problems.append(f"worker has capabilities {hello.get('capabilities')}")
    if not hello.get("no_new_privs"):
        problems.append("no_new_privs is not set")
    extra = set(hello.get("env", ["?"])) - set(SANDBOX_ENV) - {"PWD"}  # bwrap's --chdir sets PWD
    if extra:
        problems.append(f"environment not cleared: {sorted(extra)}")
    if not hello.get("seccomp"):
        problems.append(
            "pyseccomp/libseccomp not importable inside the sandbox "
            "(pip install pyseccomp; apt-get install libseccomp2)"
        )
    if hello.get("landlock_abi", 0) < 1:
        problems.append("Landlock unavailable (kernel >= 5.13 with lsm=landlock)")
    probe = hello.get("probe", {})
    failed = {k: probe.get(k, "not checked") for k in PROBE_CHECKS if probe.get(k) != "ok"}
    if failed:
        problems.append(
            f"snippet probe: {failed}" + (f" {probe['error']}" if "error" in probe else "")
        )
    try:
        joined = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        joined = ""
    for d in cgroups:
        if f":/jaxrl_tools/{d.name}\n" not in joined:
            problems.append(f"worker is not in its cgroup {d}")
    return problems


class SandboxWorker:
    """Host handle on one sandboxed worker process (blocking; used from the pool's threads)."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.hello: dict = {}
        self.calls = 0
        self.cgroups: list[Path] = []
        self.recycle = False  # its last "ready" frame asked for a replacement
        self.retired = False  # replaced: killed once it is not serving a call

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, spawner=None) -> dict:
        """Starts the worker and checks its report; raises SandboxUnavailableError on failure.

        Args:
          spawner: optional `spawner(fn) -> fn()` that runs the Popen on a long-lived thread.
            bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that
            forked it exits, so workers must not be spawned from short-lived threads.
        """
        cfg = self.config
        if cfg.isolation == "unsafe_process":
            logger.warning(
                "SANDBOX DISABLED: isolation='unsafe_process' runs model code without "
                "namespaces or uid drop (rlimits/Landlock/seccomp per snippet only)"
            )
        worker_cfg = {
            "read_paths": [str(p) for p in _python_paths()]
            + ["/usr", "/etc"]
            + list(cfg.extra_ro_binds),
            "preload": list(cfg.preload),
            "own_pid_namespace": cfg.isolation == "bwrap",
            "cleanup_timeout_s": cfg.cleanup_timeout_s,
            "probe_code": PROBE_CODE,
        }
        r, w = os.pipe()
        src = WORKER_SCRIPT.read_bytes()
        if len(src) >= 65536:  # must fit in the pipe buffer since nobody reads yet
            raise RuntimeError("worker script too large for the boot pipe")
        os.write(w, src)
        os.close(w)
        if cfg.isolation == "bwrap" and os.geteuid() == 0:
            self.cgroups = make_cgroups(f"w{os.getpid()}_{id(self):x}_{time.monotonic_ns()}", cfg)
            if not self.cgroups and (cfg.worker_memory_mb or cfg.worker_pids):
                logger.warning(
                    "no memory/pids cgroup for sandbox workers on this host; "
                    "per-snippet rlimits only"
                )
        argv = build_command(cfg, worker_cfg, r, self.cgroups)
        # Empty environment: nothing of the host's (tokens, keys) reaches any process below.
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
        }
        try:

            def spawn():
                return subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(r,),
                    env=env,
                    cwd="/",
                    start_new_session=True,
                )

            self.proc = spawner(spawn) if spawner else spawn()
        except OSError as e:
            os.close(r)
            raise SandboxUnavailableError(
                f"cannot start sandbox worker ({e}); {INSTALL_HINT}"
            ) from e
        os.close(r)
        try:
            hello = self._read(cfg.startup_timeout_s)
        except WorkerDiedError as e:
            err = self._stderr_tail()
            self.kill()
            raise SandboxUnavailableError(
                f"sandbox worker failed to start: {e}; stderr: {err.strip()[-800:]!r}; "
                f"{INSTALL_HINT}"
            ) from None
        self.hello = hello
        problems = isolation_problems(cfg, hello, self.cgroups, self.proc.pid)
        if problems:
            self.kill()
            raise SandboxUnavailableError("sandbox checks failed: " + "; ".join(problems))
        if hello.get("landlock_abi", 0) < 6:
            logger.warning(
                "Landlock ABI %s < 6: snippets can signal their own worker (it is then replaced)",
                hello.get("landlock_abi"),
            )
        # stderr of the worker is not read during operation: drop it to avoid a full pipe.
        return hello

    def request(self, req: dict, timeout_s: float) -> dict:
        """Sends one request and waits up to `timeout_s` for its answer.

        Raises:
          WorkerDiedError: the worker exited, hung past the timeout or broke the protocol (the
            caller must discard this worker).
        """
        if self.proc is None or self.proc.poll() is not None:
            raise WorkerDiedError("worker is not running")
        data = json.dumps(req).encode()
        try:
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDiedError(f"worker pipe closed ({e})") from None
        self.calls += 1
        return self._read(timeout_s)

    def wait_ready(self) -> bool:
        """Waits until the worker can take the next call; False: replace it now.

        A ready worker may still set `recycle`: its background cleanup fell behind, so it should
        be replaced, but it can serve until its replacement is up.
        """
        try:
            frame = self._read(self.config.cleanup_timeout_s + _READY_SLACK_S)
        except WorkerDiedError:
            return False
        self.recycle = bool(frame.get("recycle"))
        return bool(frame.get("ready"))

    def _read(self, timeout_s: float) -> dict:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        buf = b""
        need = 4
        header = True
        while True:
            while len(buf) < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerDiedError(f"worker did not answer within {timeout_s:.1f} s")
                ready, _, _ = select.select([fd], [], [], left)
                if not ready:
                    continue
                chunk = os.read(fd, need - len(buf))
                if not chunk:
                    code = self.proc.poll()
                    raise WorkerDiedError(f"worker exited (code {code})")
                buf += chunk
            if header:
                (need,) = struct.unpack(">I", buf[:4])
                buf = buf[4:]
                header = False
                continue
            try:
                return json.loads(buf[:need])
            except ValueError as e:
                raise WorkerDiedError(f"bad frame from worker: {e}") from None

    def _stderr_tail(self) -> str:
        if self.proc is None or self.proc.stderr is None:
            return ""
        fd = self.proc.stderr.fileno()
        out = b""
        while select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
        return out.decode("utf-8", "replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, graceful: bool = False) -> None:
        """Kills the worker and its whole sandbox (bwrap's pid namespace dies with it).

        Args:
          graceful: first close its stdin and give it 0.5 s to clean up and exit.
        """
        if self.proc is None:
            return
        if graceful and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=0.5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("sandbox worker %s did not die", self.proc.pid)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        remove_cgroups(self.cgroups)
