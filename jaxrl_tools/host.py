"""The host memory allocator under XLA:CPU.

XLA:CPU takes each executable's temporaries from malloc on every call. glibc serves blocks above
its mmap threshold (at most 32 MiB by default) with fresh pages from the kernel and hands them
back on free, so every decode step paid page faults and page zeroing for its temporaries:
copying the live KV cache of one layer ran at ~2 GB/s instead of the machine's ~30.
`keep_freed_memory` keeps that memory in malloc's heap for the next call instead.
"""

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Has glibc malloc serve blocks below `mmap_threshold` bytes from its heap and never give
    freed heap memory back to the OS, so that the next call reuses pages already mapped. The
    process's RSS then stays at its peak: meant for CPU runs (on a GPU or TPU host it would keep
    e.g. a checkpoint's load buffers). Returns whether glibc took both settings (False on
    another C library)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold)) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)) == 1
    log.info("malloc keeps freed memory (mmap threshold %d MiB): %s", mmap_threshold >> 20, ok)
    return bool(ok)
