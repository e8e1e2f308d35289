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
4. (root only, where the kernel has them) each worker gets its own memory + pids cgroup (v1
   `memory`/`pids` hierarchies, or v2 with those controllers), so N forked snippets times their
   address-space rlimit cannot exhaust host memory and forks are bounded across the sandbox.
   Missing cgroup controllers only log a warning: rlimits and nproc still bound each snippet.
5. Inside, `_sandbox_worker.py` forks one child per snippet, which adds rlimits (CPU, address
   space, nproc, fsize, nofile, core), a Landlock domain (writes only in its fresh work dir, no TCP,
   signals and abstract sockets scoped to itself) and a seccomp filter (no inet sockets, ptrace,
   mount, namespaces, bpf, ...). The worker SIGKILLs every other process of its pid namespace after
   each snippet.

If a piece is missing the pool refuses to start (`SandboxUnavailableError` names it and the
install command). `isolation="unsafe_process"` runs the worker as a plain child process (the
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
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)}")


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


def make_cgroups(name: str, config: SandboxConfig) -> list[Path]:
    """Creates this worker's memory/pids cgroups (v1 hierarchies or v2); [] if unavailable."""
    wanted = {}
    if config.worker_memory_mb > 0:
        wanted["memory"] = config.worker_memory_mb * 2**20
    if config.worker_pids > 0:
        wanted["pids"] = config.worker_pids
    made: list[Path] = []
    v2 = _CGROUP_ROOT / "cgroup.controllers"
    try:
        if v2.exists():  # unified hierarchy
            ctrls = set(v2.read_text().split())
            if not set(wanted) <= ctrls:
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
            else:
                (d / "pids.max").write_text(str(value))
    except OSError as e:
        logger.warning("sandbox cgroups unavailable (%s); rlimits still apply", e)
        remove_cgroups(made)
        return []
    return made


def remove_cgroups(dirs: list[Path]) -> None:
    """Removes (empty) cgroups; retries briefly while their processes finish exiting."""
    for d in dirs:
        for _ in range(50):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
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
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    for k, v in env.items():
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


class SandboxWorker:
    """Host handle on one sandboxed worker process (blocking; used from the pool's threads)."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.hello: dict = {}
        self.calls = 0
        self.cgroups: list[Path] = []

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
        problems = []
        if cfg.isolation == "bwrap":
            if hello.get("uid") == 0 or hello.get("euid") == 0:
                problems.append("worker runs as uid 0")
            if [n for n in hello.get("net_ifaces", []) if n != "lo"]:
                problems.append(f"worker sees network interfaces {hello['net_ifaces']}")
            if not hello.get("seccomp"):
                problems.append(
                    "pyseccomp/libseccomp not importable inside the sandbox "
                    "(pip install pyseccomp; apt-get install libseccomp2)"
                )
            if hello.get("landlock_abi", 0) < 1:
                problems.append("Landlock unavailable (kernel >= 5.13 with lsm=landlock)")
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
