"""Sandbox worker: runs INSIDE the sandbox (bwrap namespaces, unprivileged uid).

Started once per pool slot by `sandbox.py`; imports numpy/sympy/math once, forks its zygote, then
serves requests read from stdin as length-prefixed JSON frames. The zygote, which never sees a
request's data, forks one process per snippet, ahead of the call (it waits on a pipe for its
job). Before running model code that process gets: its own process group, a fresh work dir,
rlimits (CPU, address space, nproc, fsize, nofile, core), first place for the OOM killer, a
Landlock domain (read-only view, writes only in its work dir, no TCP, no signals or abstract
sockets outside its own domain) and a seccomp filter (no sockets but socketpair, no IPC objects
or memfds, no ptrace, mount, namespaces, bpf, CLONE_PARENT, ...) and no descriptor but its 0-2.
After each snippet every process in the sandbox but the worker, its zygote and its cleaner is
SIGKILLed, the answer is sent, the work dir is moved into a trash dir that the cleaner process
empties in the background, the next snippet process is forked, and a "ready" frame tells the host
the worker can take the next call (and whether it asks to be recycled: its cleanup fell behind).

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
import signal
import socket
import stat
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
    # No IPC object may outlive a call (SysV and POSIX message queues live in the sandbox's
    # IPC namespace, shared by every call of a worker), and no memory outside RLIMIT_AS.
    "shmget",
    "shmat",
    "shmctl",
    "shmdt",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
    "memfd_create",
    "memfd_secret",
    # No sockets at all: Landlock does not cover connecting to a bound unix-socket file.
    # socketpair (already connected) stays; sendto with an address is refused below.
    "socket",
    "connect",
    "bind",
    "listen",
    "accept",
    "accept4",
    "sendmsg",
    "sendmmsg",
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
# A sibling of the snippet process would be a child of the zygote, outside every kill and reap.
_CLONE_PARENT = 0x00008000


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
    f.add_rule(sc.ERRNO(errno.EPERM), "sendto", sc.Arg(4, sc.NE, 0))  # an address given
    # clone3's flags live in memory seccomp cannot read: ENOSYS makes libc fall back to clone.
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_NS_FLAGS + (_CLONE_PARENT,):
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


class ZygoteLost(RuntimeError):
    """The zygote process is gone (e.g. a snippet signalled it): this worker must be replaced."""


class Worker:
    """Serves requests; its zygote forks the snippet processes.

    The zygote is forked before any request is read and never receives a request's data, so a
    snippet, a copy of the zygote's memory, cannot find an earlier call's code, stdin, files or
    output there (a fork of this process could: its heap keeps freed request data). The next
    snippet process is forked ahead, between calls, and waits on its own pipe for its job: the
    fork is off the caller's clock. So is the cleanup: a call's work dir is moved into a trash
    dir (no snippet may see it: Landlock lets each one see only its own work dir) and emptied by
    the cleaner, another process forked at start, while the worker already serves the next call.
    """

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
        self.n = 0
        self.cleanup_s = float(cfg.get("cleanup_timeout_s", 2.0))
        # /tmp is the sandbox's own tmpfs under bwrap; private dirs keep unsafe mode sane. The
        # base holds the work dirs of calls; after each call they go to the trash.
        self.base = tempfile.mkdtemp(prefix="sbx_", dir="/tmp")
        self.trash = tempfile.mkdtemp(prefix="sbx_trash_", dir="/tmp")
        self.trashed = 0
        self.uncleaned: dict[int, float] = {}  # trash batch -> when the cleaner was told
        self.cleaner_failed = False
        # Forked before any request, like the zygote: no call's data is in its memory.
        self.cleaner_sock, csock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.cleaner = os.fork()
        if self.cleaner == 0:
            try:
                self.cleaner_sock.close()
                os.close(in_fd)
                os.close(out_fd)
                _cleaner_loop(csock, self.trash)
            finally:
                os._exit(0)
        csock.close()
        self.ctrl, zsock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.zygote = os.fork()
        if self.zygote == 0:
            try:
                self.ctrl.close()
                self.cleaner_sock.close()
                os.close(in_fd)
                os.close(out_fd)
                self._zygote_loop(zsock)
            finally:
                os._exit(0)
        zsock.close()
        self.next: tuple[int, int, int, int] | None = None  # pid, job, stdout, stderr fds
        self._fork_next()
        self.probe = self._probe()
        self._fork_next()

    def hello(self) -> dict:
        status = _proc_status()
        return {
            "ok": True,
            "uid": os.getuid(),
            "euid": os.geteuid(),
            "pid": os.getpid(),
            "landlock_abi": self.abi,
            "seccomp": self.seccomp is not None,
            "net_ifaces": sorted(n for _, n in socket.if_nameindex()),
            "namespaces": {
                k: os.readlink(f"/proc/self/ns/{k}")
                for k in ("user", "pid", "net", "ipc", "uts", "mnt", "cgroup")
            },
            "capabilities": {k: int(status.get(k, "0"), 16) for k in ("CapEff", "CapBnd")},
            "no_new_privs": status.get("NoNewPrivs") == "1",
            "env": sorted(os.environ),
            "probe": self.probe,
            "base_vm_mb": self.base_vm // 2**20,
        }

    def serve(self) -> None:
        _send(self.out_fd, self.hello())
        nul = os.open(os.devnull, os.O_RDWR)
        os.dup2(nul, 2)  # the host stops reading our stderr once we are up
        os.close(nul)
        while True:
            try:
                req = _recv(self.in_fd)
            except EOFError:
                self._close()
                return
            lost = False
            try:
                resp = self.run(req)
            except Exception as e:  # noqa: BLE001 -- the worker must keep serving
                lost = isinstance(e, ZygoteLost)
                resp = _error(f"worker error: {e!r}")
            _send(self.out_fd, resp)
            # The host hands this worker to the next caller after the "ready" frame, which waits
            # for no cleanup: the cleaner empties the trash meanwhile. A worker whose cleaner
            # fell behind by more than cleanup_s asks to be recycled (it keeps serving until its
            # replacement is up).
            ready = not lost and self._trash_work_dirs()
            try:
                ready = ready and self._fork_next()
            except ZygoteLost:
                ready = False
            _send(self.out_fd, {"ready": ready, "recycle": self._cleanup_behind()})
            if not ready:
                return

    def _trash_work_dirs(self) -> bool:
        """Moves the work dirs into the trash and tells the cleaner; False if it could not."""
        try:
            names = os.listdir(self.base)
            if not names:
                return True
            self.trashed += 1
            for name in names:
                # A snippet may have made its work dir unwritable: moving it updates its "..".
                os.chmod(f"{self.base}/{name}", 0o700)
                os.rename(f"{self.base}/{name}", f"{self.trash}/{self.trashed}_{name}")
            self.cleaner_sock.send(struct.pack("<I", self.trashed), socket.MSG_NOSIGNAL)
        except OSError:
            return False
        self.uncleaned[self.trashed] = time.monotonic()
        return True

    def _cleanup_behind(self) -> bool:
        """True if the cleaner failed, or has not emptied a batch given to it cleanup_s ago."""
        while True:
            try:
                msg = self.cleaner_sock.recv(8, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                msg = b""
            if len(msg) != 5:  # the cleaner is gone
                self.cleaner_failed = True
                break
            done, ok = struct.unpack("<I?", msg)
            self.cleaner_failed |= not ok
            self.uncleaned = {k: t for k, t in self.uncleaned.items() if k > done}
        oldest = min(self.uncleaned.values(), default=time.monotonic())
        return self.cleaner_failed or time.monotonic() - oldest > self.cleanup_s

    def _close(self) -> None:
        """On the host's EOF: stops the cleaner and empties what is left (bounded in time)."""
        try:
            os.kill(self.cleaner, signal.SIGKILL)
            os.waitpid(self.cleaner, 0)
        except (OSError, ChildProcessError):
            pass
        deadline = time.monotonic() + self.cleanup_s
        for top in (self.base, self.trash):
            if _empty_dir(top, deadline):
                try:
                    os.rmdir(top)
                except OSError:
                    pass

    # ----------------------------------------------------------------------------------
    def run(self, req: dict) -> dict:
        self.n += 1
        workdir = f"{self.base}/run_{self.n}"
        os.mkdir(workdir, 0o700)
        for rel, data in (req.get("files") or {}).items():
            path = os.path.normpath(os.path.join(workdir, rel))
            if not path.startswith(workdir + os.sep):
                return _error(f"bad file path {rel!r}")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(bytes.fromhex(data))
        stdin_path = os.path.join(workdir, ".stdin")
        with open(stdin_path, "w") as fh:
            fh.write(req.get("stdin") or "")
        timeout = float(req.get("timeout", 10.0))
        job = {
            "code": req["code"],
            "replay": list(req.get("replay") or []),
            "workdir": workdir,
            "stdin_path": stdin_path,
            "timeout": timeout,
            "total_timeout": float(req.get("total_timeout") or timeout),
            **{k: req[k] for k in _LIMITS if k in req},
        }
        return self._execute(
            job,
            int(req.get("max_output_bytes", 65536)),
            int(req.get("kill_output_bytes", 8 * 2**20)),
        )

    def _probe(self) -> dict:
        """Runs the host's probe snippet under the full per-snippet setup (start-up check)."""
        code = self.cfg.get("probe_code")
        if not code:
            return {}
        workdir = f"{self.base}/probe"
        os.mkdir(workdir, 0o700)
        stdin_path = os.path.join(workdir, ".stdin")
        open(stdin_path, "w").close()
        job = {
            "code": code,
            "replay": [],
            "workdir": workdir,
            "stdin_path": stdin_path,
            "timeout": 10.0,
            "total_timeout": 10.0,
            "memory_mb": 256,
        }
        resp = self._execute(job, 65536, 2**20)
        _empty_dir(self.base, time.monotonic() + self.cleanup_s)
        try:
            return json.loads(resp["stdout"])
        except ValueError:
            return {"error": (resp["stderr"] or resp["status"])[-500:]}

    def _fork_next(self) -> bool:
        """Has the zygote fork the next snippet process, which waits for its job."""
        self.ctrl.send(b"fork", socket.MSG_NOSIGNAL)
        while True:
            msg, fds, _, _ = socket.recv_fds(self.ctrl, 16, 3)
            if not msg:
                raise ZygoteLost("zygote exited")
            if msg[:1] == b"f" and len(fds) == 3:
                (pid,) = struct.unpack("<i", msg[1:5])
                self.next = (pid, *fds)
                return True
            for fd in fds:  # an exit report of an earlier process: already accounted for
                os.close(fd)

    def _spawn(self, job: dict) -> tuple[int, int, int]:
        """Gives `job` to the waiting snippet process: (pid, stdout fd, stderr fd)."""
        if self.next is None:
            raise ZygoteLost("no snippet process is waiting")
        (pid, job_w, out_r, err_r), self.next = self.next, None
        try:
            view = memoryview(json.dumps(job).encode())
            while view:
                view = view[os.write(job_w, view) :]
        except OSError as e:
            for fd in (out_r, err_r):
                os.close(fd)
            raise ZygoteLost(f"the waiting snippet process is gone ({e})") from None
        finally:
            os.close(job_w)
        return pid, out_r, err_r

    def _reported_exit(self, pid: int):
        """`pid`'s wait status if the zygote has reported it (reads what is there, never
        blocks); reports of earlier processes are dropped."""
        while True:
            try:
                msg = self.ctrl.recv(16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            if not msg:
                raise ZygoteLost("zygote exited")
            if msg[:1] == b"s":
                done, status = struct.unpack("<ii", msg[1:9])
                if done == pid:
                    return status

    def _await_exit(self, pid: int, timeout: float):
        """The snippet's wait status, killing it after `timeout`; None if it never exits."""
        for grace in (timeout, 2.0):
            end = time.monotonic() + grace
            while select.select([self.ctrl], [], [], max(end - time.monotonic(), 0.0))[0]:
                status = self._reported_exit(pid)
                if status is not None:
                    return status
            _kill_pg(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return None

    def _execute(self, job: dict, cap: int, kill_bytes: int) -> dict:
        t0 = time.monotonic()
        pid, out_r, err_r = self._spawn(job)
        caps = {out_r: _Capture(cap), err_r: _Capture(cap)}
        # The exit is known from the zygote's wait status (a snippet holds no descriptor of
        # ours to report it faster); then what is left to read is drained.
        waiting = [out_r, err_r, self.ctrl]
        deadline = t0 + job["total_timeout"]
        timed_out = over_output = False
        status_code = None
        while True:
            exited = status_code is not None
            left = deadline - time.monotonic()
            if not exited and left <= 0:
                timed_out = True
                break
            pipes = [fd for fd in waiting if fd in (out_r, err_r)]
            if exited and not pipes:
                break
            ready, _, _ = select.select(
                pipes if exited else waiting, [], [], 0.0 if exited else left
            )
            if exited and not ready:
                break  # drained (a leftover process may still hold the pipes: it is killed)
            for fd in ready:
                if fd is self.ctrl:
                    status_code = self._reported_exit(pid)
                    continue
                b = os.read(fd, 1 << 16)
                if b:
                    caps[fd].feed(b)
                else:
                    waiting.remove(fd)
            if caps[out_r].total + caps[err_r].total > kill_bytes:
                over_output = True
                break
        if timed_out or over_output:
            _kill_pg(pid)
            status_code = None
        if status_code is None:
            status_code = self._await_exit(pid, max(deadline - time.monotonic(), 0.0) + 0.5)
        elapsed = time.monotonic() - t0
        # Nothing may outlive the call: kill every process of the sandbox but us, the zygote
        # and the cleaner (the snippet process is killed too, and its zygote reaps it).
        _kill_pg(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        _kill_all_others(
            bool(self.cfg.get("own_pid_namespace")), spare=(self.zygote, self.cleaner, pid)
        )
        for fd in (out_r, err_r):
            os.close(fd)
        stdout, stderr = caps[out_r].text(), caps[err_r].text()
        if status_code is None:  # unkillable?! report and let the host replace us
            raise ZygoteLost("snippet did not exit")
        rc = os.waitstatus_to_exitcode(status_code)
        if timed_out or rc in (-signal.SIGXCPU, -signal.SIGALRM):
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

    # ---------------------------------------------------------------------------- zygote
    def _zygote_loop(self, sock: socket.socket) -> None:
        """Forks snippet processes on request and reports their exits; runs until the worker
        closes the socket."""
        waiting: dict[int, int] = {}  # pidfd -> pid of forked processes
        while True:
            ready, _, _ = select.select([sock, *waiting], [], [])
            for r in ready:
                if r is sock:
                    if not sock.recv(16):
                        return
                    pid, fds = self._fork_snippet(sock)
                    waiting[os.pidfd_open(pid)] = pid
                    socket.send_fds(sock, [b"f" + struct.pack("<i", pid)], fds)
                    for fd in fds:
                        os.close(fd)
                else:
                    pid = waiting.pop(r)
                    os.close(r)
                    _, status = os.waitpid(pid, 0)
                    sock.send(b"s" + struct.pack("<ii", pid, status))

    def _fork_snippet(self, sock) -> tuple[int, list[int]]:
        """A snippet process that waits for its job: (pid, the worker's ends of its job, stdout
        and stderr pipes)."""
        job_r, job_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the snippet process: never returns
            try:
                sock.close()
                for fd in (job_w, out_r, err_r):
                    os.close(fd)
                with os.fdopen(job_r, "rb") as fh:
                    job = json.loads(fh.read())
                self._child(job, out_w, err_w)
            except BaseException as e:  # noqa: BLE001 -- setup failed: never run the code
                try:
                    os.write(err_w, f"SandboxError: snippet setup failed: {e!r}\n".encode())
                except OSError:
                    pass
            finally:
                os._exit(120)
        for fd in (job_r, out_w, err_w):
            os.close(fd)
        return pid, [job_w, out_r, err_r]

    def _child(self, job: dict, out_w: int, err_w: int) -> None:
        os.setpgid(0, 0)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # writing into a closed pipe ends the snippet
        # The kernel's OOM killer takes snippet processes (and their children) first.
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")
        workdir, timeout = job["workdir"], job["timeout"]
        total = job["total_timeout"]
        fd_in = os.open(job["stdin_path"], os.O_RDONLY)
        os.dup2(fd_in, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        rules = (
            self.static_rules + landlock_rules(self.abi, [], [workdir], []) if self.abi >= 1 else []
        )
        _close_fds_but({fd for fd, _ in rules})  # the rule fds are closed once applied
        os.chdir(workdir)
        os.environ["HOME"] = workdir
        os.environ["TMPDIR"] = workdir
        tempfile.tempdir = workdir
        mem = int(job.get("memory_mb", 1024)) * 2**20
        limits = [
            (resource.RLIMIT_CPU, (int(total) + 1, int(total) + 2)),
            (resource.RLIMIT_AS, _vm_size() + mem),
            (resource.RLIMIT_NPROC, int(job.get("nproc", 64))),
            (resource.RLIMIT_FSIZE, int(job.get("fsize_mb", 16)) * 2**20),
            (resource.RLIMIT_NOFILE, int(job.get("nofile", 128))),
            (resource.RLIMIT_CORE, 0),
        ]
        for res, val in limits:
            resource.setrlimit(res, val if isinstance(val, tuple) else (val, val))
        if self.abi >= 1:
            apply_landlock(self.abi, rules)
            for fd, _ in rules:
                os.close(fd)
        if self.seccomp is not None:
            self.seccomp.load()
        # Fresh interpreter-level state for the snippet (sys.argv, streams on the new fds).
        sys.stdin = open(0, closefd=False)
        # Line-buffered by default: what was printed before a timeout kill is still returned.
        line = 1 if job.get("line_buffered", True) else -1
        sys.stdout = open(1, "w", closefd=False, buffering=line)
        sys.stderr = open(2, "w", closefd=False)
        sys.argv = ["<snippet>"]
        sys.path.insert(0, workdir)
        ns = None
        for i, cell in enumerate(job["replay"]):  # session mode: rebuild state, output suppressed
            ns = _run_code(cell, f"<cell {i + 1}>", quiet=True, ns=ns)
            if not isinstance(ns, dict):
                sys.stderr.write(
                    "SessionReplayError: an earlier cell of this session failed when replayed\n"
                )
                sys.stderr.flush()
                os._exit(121)
        if job["replay"]:  # the new cell still gets only its own time limit
            signal.setitimer(signal.ITIMER_REAL, timeout)
        ok = _run_code(job["code"], "<snippet>", quiet=False, ns=ns)
        code = 0 if ok is not None else 1
        if isinstance(ok, int):
            code = ok
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def _close_fds_but(keep: set[int]) -> None:
    """Closes every descriptor above 2 but `keep`, at any number: nothing the zygote or the
    worker holds may reach a snippet."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc (both sandbox modes have it)
        fds = range(3, 65536)
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _cleaner_loop(sock: socket.socket, trash: str) -> None:
    """The cleaner process: empties the trash when told, reports the last batch it covered;
    runs until the worker closes the socket."""
    os.nice(19)  # the snippet of the next call comes first
    nul = os.open(os.devnull, os.O_RDWR)
    os.dup2(nul, 2)  # the host does not read this stderr
    os.close(nul)
    while True:
        msg = sock.recv(8)
        if not msg:
            return
        while True:  # batches trashed meanwhile are covered by this one emptying
            try:
                more = sock.recv(8, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if not more:
                break
            msg = more
        (batch,) = struct.unpack("<I", msg)
        sock.send(struct.pack("<I?", batch, _empty_dir(trash, float("inf"))))


_LIMITS = ("memory_mb", "nproc", "nofile", "fsize_mb", "line_buffered")


def _error(message: str) -> dict:
    return {
        "status": "SandboxError",
        "stdout": "",
        "stderr": message,
        "return_code": None,
        "execution_time": 0.0,
    }


def _proc_status() -> dict:
    with open("/proc/self/status") as fh:
        return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)


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


def _empty_dir(top: str, deadline: float) -> bool:
    """Deletes everything in `top` before `deadline`; False if it could not (never raises).

    Iterative and relative to open directories, so neither depth (past PATH_MAX or the recursion
    limit) nor permissions a snippet set (chmod 0) can stop it: each subdirectory met is opened
    up (chmod 700, we own it) and moved into `top` itself, to be emptied there in turn.
    """
    moved = 0
    try:
        tfd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        while names := os.listdir(tfd):
            for name in names:
                if time.monotonic() > deadline:
                    return False
                if not stat.S_ISDIR(os.stat(name, dir_fd=tfd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=tfd)
                    continue
                os.chmod(name, 0o700, dir_fd=tfd)
                dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=tfd)
                try:
                    with os.scandir(dfd) as it:
                        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                    for child, is_dir in entries:
                        if time.monotonic() > deadline:
                            return False
                        if is_dir:
                            os.chmod(child, 0o700, dir_fd=dfd)
                            moved += 1
                            os.rename(child, f".up{moved}", src_dir_fd=dfd, dst_dir_fd=tfd)
                        else:
                            os.unlink(child, dir_fd=dfd)
                finally:
                    os.close(dfd)
                os.rmdir(name, dir_fd=tfd)
        return True
    except Exception:  # noqa: BLE001 -- anything unexpected: the host replaces this worker
        return False
    finally:
        os.close(tfd)


def _vm_size() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


def _kill_pg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _kill_all_others(own_pid_namespace: bool, spare: tuple[int, ...]) -> None:
    """Kills every process a snippet started, directly or not, and reaps them (not `spare`)."""
    me = os.getpid()
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        if own_pid_namespace:  # the sandbox's own /proc: every process but init is ours
            others = [int(p) for p in os.listdir("/proc") if p.isdigit()]
            others = [p for p in others if p != 1 and p != me and p not in spare]
        else:  # no pid namespace: orphans of snippets come to us (we are a subreaper)
            others = [p for p in _children(me) if p not in spare]
        if not others:
            return
        for pid in others:
            _kill_pg(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap()
        time.sleep(0.0005)


def _reap() -> None:
    """Reaps the dead among our children (without blocking)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


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
    _libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of snippets come to us
    Worker(cfg, in_fd, out_fd).serve()


if __name__ == "__main__":
    main()
