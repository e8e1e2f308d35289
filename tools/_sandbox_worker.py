"""Sandbox worker: runs INSIDE the sandbox (bwrap namespaces, unprivileged uid).

Started once per pool slot by `sandbox.py`; imports numpy/sympy/math once, then serves requests
read from stdin as length-prefixed JSON frames. Each snippet runs in a forked child that, before
running model code, gets: its own process group, a fresh work dir, rlimits (CPU, address space,
nproc, fsize, nofile, core), a Landlock domain (read-only view, writes only in its work dir, no
TCP, no signals or abstract sockets outside its own domain) and a seccomp filter (no inet
sockets, ptrace, mount, namespaces, bpf, ...). After each snippet every process in the sandbox's
pid namespace except this worker is SIGKILLed (`kill(-1)`), so nothing outlives a call.

Self-contained on purpose (standard library + pyseccomp only): it is bound into the sandbox as a
single file, the jaxrl_tools package is not visible there.
"""

import ctypes
import errno
import gc
import json
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

# --- Landlock (uapi/linux/landlock.h); x86_64 and aarch64 share these syscall numbers -------
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ALL_V1 = (1 << 13) - 1
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2


def landlock_abi() -> int:
    """Landlock ABI version of the running kernel (0 if unsupported)."""
    abi = _libc.syscall(
        _SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_RULESET_VERSION)
    )
    return max(int(abi), 0)


def _fs_all(abi: int) -> int:
    bits = _FS_ALL_V1
    if abi >= 2:
        bits |= _FS_REFER
    if abi >= 3:
        bits |= _FS_TRUNCATE
    if abi >= 5:
        bits |= _FS_IOCTL_DEV
    return bits


def landlock_rules(abi: int, read_paths, write_dirs, write_files) -> list[tuple[int, int]]:
    """(O_PATH fd, allowed access) per existing path; open once, reuse for every snippet."""
    handled = _fs_all(abi)
    read_dir = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    file_bits = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
    wanted = [(p, read_dir) for p in read_paths] + [(p, handled) for p in write_dirs]
    wanted += [
        (p, _FS_WRITE_FILE | _FS_READ_FILE | (_FS_TRUNCATE if abi >= 3 else 0)) for p in write_files
    ]
    rules = []
    for path, access in wanted:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rules.append((fd, access if os.path.isdir(path) else access & file_bits))
    return rules


def apply_landlock(abi: int, rules: list[tuple[int, int]]) -> None:
    """Restricts this process (and its future children) with a new Landlock domain."""
    attr = struct.pack("<Q", _fs_all(abi))
    if abi >= 4:
        attr += struct.pack("<Q", _NET_BIND_TCP | _NET_CONNECT_TCP)
    if abi >= 6:
        attr += struct.pack("<Q", _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    rfd = _libc.syscall(_SYS_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if rfd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for fd, access in rules:
            rule = ctypes.create_string_buffer(struct.pack("<Qi", access, fd), 12)
            if (
                _libc.syscall(
                    _SYS_ADD_RULE,
                    ctypes.c_int(rfd),
                    ctypes.c_int(_RULE_PATH_BENEATH),
                    rule,
                    ctypes.c_uint32(0),
                )
                < 0
            ):
                raise OSError(ctypes.get_errno(), f"landlock_add_rule failed (fd {fd})")
        if _libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(rfd), ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(rfd)


# --- seccomp ------------------------------------------------------------------------------
_DENY_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "keyctl",
    "add_key",
    "request_key",
    "userfaultfd",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "open_by_handle_at",
    "name_to_handle_at",
    "fsopen",
    "fsmount",
    "fsconfig",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "settimeofday",
    "clock_settime",
    "adjtimex",
    "syslog",
    "vhangup",
    "personality",
)
_CLONE_NS_FLAGS = (
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class CompiledSeccomp:
    """A seccomp filter compiled to BPF once; `load()` installs it with one prctl (fast)."""

    def __init__(self, bpf: bytes):
        self.buf = ctypes.create_string_buffer(bpf, len(bpf))
        self.prog = _SockFprog(len(bpf) // 8, ctypes.addressof(self.buf))

    def load(self) -> None:
        if _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS (required by seccomp)
            raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
        # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        if _libc.prctl(22, 2, ctypes.byref(self.prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "seccomp filter load failed")


def build_seccomp_filter():
    """Builds the per-snippet seccomp filter as compiled BPF; None if pyseccomp is missing."""
    try:
        import pyseccomp as sc  # noqa: PLC0415 - optional: reported, and the host fails closed
    except Exception:  # noqa: BLE001 -- reported in the hello message, host fails closed
        return None
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in _DENY_SYSCALLS:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except Exception:  # noqa: BLE001 -- syscall unknown on this arch
            pass
    # Only AF_UNIX sockets (no TCP/UDP/raw/netlink, even though the netns is empty anyway).
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    # clone3's flags live in memory seccomp cannot read: ENOSYS makes libc fall back to clone.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        bpf = fh.read()
    return CompiledSeccomp(bpf)


# --- protocol -----------------------------------------------------------------------------
def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        b = os.read(fd, n)
        if not b:
            raise EOFError
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _recv(fd: int):
    (n,) = struct.unpack(">I", _read_exact(fd, 4))
    return json.loads(_read_exact(fd, n))


def _send(fd: int, obj) -> None:
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


class _Capture:
    """Keeps the first and last `cap // 2` bytes of a stream and counts the rest."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, b: bytes) -> None:
        self.total += len(b)
        room = self.half - len(self.head)
        if room > 0:
            self.head += b[:room]
            b = b[room:]
        if b:
            self.tail += b
            del self.tail[: -self.half]

    def text(self) -> str:
        head = self.head.decode("utf-8", "replace")
        if self.total <= len(self.head) + len(self.tail):
            return head + self.tail.decode("utf-8", "replace")
        return head + "\n...\n" + self.tail.decode("utf-8", "replace")


class Worker:
    def __init__(self, cfg: dict, in_fd: int, out_fd: int):
        self.cfg = cfg
        self.in_fd, self.out_fd = in_fd, out_fd
        self.abi = landlock_abi()
        self.seccomp = build_seccomp_filter()
        self.read_paths = cfg["read_paths"]
        self.static_rules = (
            landlock_rules(self.abi, self.read_paths + ["/proc", "/dev"], [], ["/dev/null"])
            if self.abi >= 1
            else []
        )
        self.base_vm = _vm_size()
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.to_delete: list[str] = []
        self.n = 0
        # /tmp is the sandbox's own tmpfs under bwrap; a private base dir keeps unsafe mode sane.
        self.base = tempfile.mkdtemp(prefix="sbx_", dir="/tmp")

    def hello(self) -> dict:
        return {
            "ok": True,
            "uid": os.getuid(),
            "euid": os.geteuid(),
            "pid": os.getpid(),
            "landlock_abi": self.abi,
            "seccomp": self.seccomp is not None,
            "net_ifaces": sorted(n for _, n in socket.if_nameindex()),
            "base_vm_mb": self.base_vm // 2**20,
        }

    def serve(self) -> None:
        _send(self.out_fd, self.hello())
        os.dup2(self.devnull, 2)  # the host stops reading our stderr once we are up
        while True:
            try:
                req = _recv(self.in_fd)
            except EOFError:
                _rmtree(self.base)
                return
            try:
                resp = self.run(req)
            except Exception as e:  # noqa: BLE001 -- the worker must keep serving
                resp = {
                    "status": "SandboxError",
                    "stdout": "",
                    "stderr": f"worker error: {e!r}",
                    "return_code": None,
                    "execution_time": 0.0,
                }
            _send(self.out_fd, resp)
            for d in self.to_delete:  # cleanup off the caller's critical path
                _rmtree(d)
            self.to_delete.clear()

    # ----------------------------------------------------------------------------------
    def run(self, req: dict) -> dict:
        timeout = float(req.get("timeout", 10.0))
        replay = list(req.get("replay") or [])
        total_timeout = timeout * (1 + len(replay))
        self.n += 1
        workdir = f"{self.base}/run_{self.n}"
        os.mkdir(workdir, 0o700)
        for rel, data in (req.get("files") or {}).items():
            path = os.path.normpath(os.path.join(workdir, rel))
            if not path.startswith(workdir + os.sep):
                shutil.rmtree(workdir, ignore_errors=True)
                return {
                    "status": "SandboxError",
                    "stdout": "",
                    "stderr": f"bad file path {rel!r}",
                    "return_code": None,
                    "execution_time": 0.0,
                }
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(bytes.fromhex(data))
        stdin_path = os.path.join(workdir, ".stdin")
        with open(stdin_path, "w") as fh:
            fh.write(req.get("stdin") or "")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # child: never returns
            try:
                os.close(out_r)
                os.close(err_r)
                self._child(req, workdir, stdin_path, out_w, err_w, total_timeout, replay)
            except BaseException as e:  # noqa: BLE001 -- setup failed: never run the code
                try:
                    os.write(2, f"SandboxError: snippet setup failed: {e!r}\n".encode())
                except OSError:
                    pass
            finally:
                os._exit(120)
        os.close(out_w)
        os.close(err_w)
        cap = int(req.get("max_output_bytes", 65536))
        kill_bytes = int(req.get("kill_output_bytes", 8 * 2**20))
        caps = {out_r: _Capture(cap), err_r: _Capture(cap)}
        open_fds = [out_r, err_r]
        pidfd = os.pidfd_open(pid)
        deadline = t0 + total_timeout
        timed_out = over_output = exited = False
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select(
                open_fds + ([] if exited else [pidfd]), [], [], 0.0 if exited else left
            )
            if exited and not ready:
                break  # child gone and its pipes drained (a leftover may still hold them)
            for fd in ready:
                if fd == pidfd:
                    exited = True
                    continue
                b = os.read(fd, 1 << 16)
                if not b:
                    open_fds.remove(fd)
                    continue
                caps[fd].feed(b)
            if caps[out_r].total + caps[err_r].total > kill_bytes:
                over_output = True
                break
        if timed_out or over_output:
            _kill_pg(pid)
        status_code = _wait(pid, max(deadline - time.monotonic(), 0.0) + 0.5)
        elapsed = time.monotonic() - t0
        # Nothing may outlive the call: kill every process of this pid namespace but us.
        _kill_all_others(bool(self.cfg.get("own_pid_namespace")))
        os.close(out_r)
        os.close(err_r)
        os.close(pidfd)
        self.to_delete.append(workdir)
        stdout, stderr = caps[out_r].text(), caps[err_r].text()
        if status_code is None:  # unkillable?! report and let the host replace us
            return {
                "status": "SandboxError",
                "stdout": stdout,
                "stderr": "child did not exit",
                "return_code": None,
                "execution_time": elapsed,
            }
        rc = os.waitstatus_to_exitcode(status_code)
        if timed_out or rc == -signal.SIGXCPU:
            status = "TimeLimitExceeded"
        elif over_output:
            status = "Error"
            stderr += f"\nOutputLimitExceeded: more than {kill_bytes} bytes of output"
        elif rc == 121:
            status = "Error"  # replay of the session's earlier snippets failed
        else:
            status = "Finished"
        return {
            "status": status,
            "stdout": stdout,
            "stderr": stderr,
            "return_code": rc,
            "execution_time": elapsed,
            "output_bytes": caps[out_r].total + caps[err_r].total,
        }

    def _child(self, req, workdir, stdin_path, out_w, err_w, timeout, replay) -> None:
        os.setpgid(0, 0)
        fd_in = os.open(stdin_path, os.O_RDONLY)
        os.dup2(fd_in, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        rules = (
            self.static_rules + landlock_rules(self.abi, [], [workdir], []) if self.abi >= 1 else []
        )
        keep = sorted(fd for fd, _ in rules)
        lo = 3
        for fd in keep:  # close everything inherited from the worker but the rule fds
            os.closerange(lo, fd)
            lo = fd + 1
        os.closerange(lo, 65536)
        os.chdir(workdir)
        os.environ["HOME"] = workdir
        os.environ["TMPDIR"] = workdir
        tempfile.tempdir = workdir
        mem = int(req.get("memory_mb", 1024)) * 2**20
        limits = [
            (resource.RLIMIT_CPU, (int(timeout) + 1, int(timeout) + 2)),
            (resource.RLIMIT_AS, _vm_size() + mem),
            (resource.RLIMIT_NPROC, int(req.get("nproc", 64))),
            (resource.RLIMIT_FSIZE, int(req.get("fsize_mb", 16)) * 2**20),
            (resource.RLIMIT_NOFILE, int(req.get("nofile", 128))),
            (resource.RLIMIT_CORE, 0),
        ]
        for res, val in limits:
            resource.setrlimit(res, val if isinstance(val, tuple) else (val, val))
        if self.abi >= 1:
            apply_landlock(self.abi, rules)
            for fd in keep:
                os.close(fd)
        if self.seccomp is not None:
            self.seccomp.load()
        # Fresh interpreter-level state for the snippet (sys.argv, streams on the new fds).
        sys.stdin = open(0, closefd=False)
        # Line-buffered by default: what was printed before a timeout kill is still returned.
        line = 1 if req.get("line_buffered", True) else -1
        sys.stdout = open(1, "w", closefd=False, buffering=line)
        sys.stderr = open(2, "w", closefd=False)
        sys.argv = ["<snippet>"]
        sys.path.insert(0, workdir)
        ns = None
        for i, cell in enumerate(replay):  # session mode: rebuild state, output suppressed
            ns = _run_code(cell, f"<cell {i + 1}>", quiet=True, ns=ns)
            if not isinstance(ns, dict):
                sys.stderr.write(
                    "SessionReplayError: an earlier cell of this session failed when replayed\n"
                )
                sys.stderr.flush()
                os._exit(121)
        ok = _run_code(req["code"], "<snippet>", quiet=False, ns=ns)
        code = 0 if ok is not None else 1
        if isinstance(ok, int):
            code = ok
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def _run_code(code: str, filename: str, quiet: bool, ns):
    """Executes `code`; returns its globals dict, an int exit code (SystemExit), or None."""
    if ns is None:
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
    saved = None
    if quiet:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = (os.dup(1), os.dup(2))
        nul = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nul, 1)
        os.dup2(nul, 2)
        os.close(nul)
    try:
        exec(compile(code, filename, "exec"), ns)  # noqa: S102 -- this is the sandbox
        result = ns
    except SystemExit as e:
        c = e.code
        result = ns if c in (None, 0) else (c if isinstance(c, int) else 1)
        if not isinstance(c, int) and c is not None:
            print(c, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename not in (filename,):
            tb = tb.tb_next  # hide the worker's own frames
        traceback.print_exception(type(e), e, tb)
        result = None
    finally:
        if saved is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return result


def _rmtree(path: str) -> None:
    """rmtree that also removes what a snippet made unwritable (chmod 000 dirs)."""

    def fix(func, p, _exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)
    if os.path.exists(path):
        shutil.rmtree(path, onerror=fix)


def _vm_size() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


def _kill_pg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _wait(pid: int, timeout: float):
    """waitpid with a timeout; SIGKILLs the child's group after it; None if it never exits."""
    for grace in (timeout, 2.0):
        end = time.monotonic() + grace
        while True:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return 0
            if done:
                return status
            if time.monotonic() > end:
                break
            time.sleep(0.0005)
        _kill_pg(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return None


def _kill_all_others(own_pid_namespace: bool) -> None:
    """Kills every process this worker started, directly or not, and reaps them."""
    if own_pid_namespace and os.getpid() <= 3:  # we are bwrap's child in a fresh pid namespace
        try:
            os.kill(-1, signal.SIGKILL)  # all of the namespace except us and its init
        except OSError:
            pass
        _reap(2.0)  # killed orphans come to us (subreaper): collect them, leave no zombies
        return
    else:  # no pid namespace: never kill(-1); we are a subreaper, so orphans are our children
        for _ in range(100):
            kids = _children(os.getpid())
            if not kids:
                break
            for pid in kids:
                _kill_pg(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            _reap()
    _reap()


def _reap(wait_s: float = 0.0) -> None:
    """Reaps dead children; with wait_s > 0, waits (up to it) until no child is left at all."""
    end = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() >= end:
                return
            time.sleep(0.0005)


def _children(ppid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == ppid:
                out.append(int(name))
    return out


def main() -> None:
    # Keep the protocol pipes away from fds 0-2 so snippets cannot reach them.
    in_fd = os.dup(0)
    out_fd = os.dup(1)
    os.set_inheritable(in_fd, False)
    os.set_inheritable(out_fd, False)
    nul = os.open(os.devnull, os.O_RDWR)
    os.dup2(nul, 0)
    os.dup2(nul, 1)
    os.close(nul)
    cfg = json.loads(sys.argv[1])
    for mod in cfg.get("preload", []):
        try:
            __import__(mod)
        except Exception:  # noqa: BLE001 -- a missing optional module only costs speed
            pass
    gc.collect()
    gc.freeze()  # preloaded objects never scanned by a child's GC: fewer copy-on-write faults
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of snippets come to us
    Worker(cfg, in_fd, out_fd).serve()


if __name__ == "__main__":
    main()
