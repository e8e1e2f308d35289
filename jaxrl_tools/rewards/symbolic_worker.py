"""A worker process of symbolic answer checks (`rewards.deadline.SymbolicChecker`).

Run as a script by path, not as a package module, so that it imports math-verify and nothing
of ours (the package's imports take seconds). Reads (pred, gold, seconds) frames from stdin
and writes a result frame each to stdout: True / False, or None when math-verify cannot parse
one side.
math-verify's own timeouts are off: the parent bounds every check and kills this process when
a check runs past it, so a slow parse is never mistaken for a wrong answer.
"""

import logging
import pickle
import resource
import signal
import struct
import sys

from math_verify import parse, verify

_HEADER = struct.Struct("<I")


def read_frame(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    return pickle.loads(stream.read(_HEADER.unpack(head)[0]))


def write_frame(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def symbolic_equal(pred: str, gold: str) -> bool | None:
    """math-verify's equivalence of two answers; None: one side does not parse."""
    gold_p = parse(f"\\boxed{{{gold}}}", parsing_timeout=None) or parse(gold, parsing_timeout=None)
    pred_p = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
    if not gold_p or not pred_p:
        return None
    return bool(verify(gold_p, pred_p, timeout_seconds=None))


def _cpu_bound(seconds: float) -> None:
    """The kernel ends this process once a check has used `seconds` more of CPU time: the
    parent kills it at the deadline, but a parent killed with -9 cannot, and a check in C code
    (a huge power) holds the GIL, so no thread of ours could notice."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (int(used + seconds) + 2, hard))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    # Long answers (a sum of 2,000 terms) recurse deeply in the LaTeX parser: with Python's
    # default limit it gives up and math-verify compares them as text. The deadline bounds them.
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))
    sys.setrecursionlimit(50_000)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": ours
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not corrupt the frames
    symbolic_equal("1", "1")  # loads the parsers: a check's time is its own
    write_frame(stdout, "ready")
    while (task := read_frame(stdin)) is not None:
        pred, gold, seconds = task
        _cpu_bound(seconds)
        try:
            write_frame(stdout, ("ok", symbolic_equal(pred, gold)))
        except Exception as e:  # noqa: BLE001 -- reported to the parent, which raises it
            write_frame(stdout, ("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    main()
