"""Process memory: glibc's allocator told to give freed large buffers back, and the RSS.

A gateway that reads megabyte bodies frees megabyte strings all the time. glibc serves a
large allocation with its own mmap only below a threshold it raises to the size of the last
such block freed (up to 32 MiB), so after the first large body later ones come from the heap,
and a heap only shrinks from its top: RSS then stays near its high-water mark although Python
freed the memory. Fixing the mmap and trim thresholds (`mallopt`, the same as the
`MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` environment variables, but settable after
start) keeps large buffers in their own mappings, returned to the system when freed. Measured
on the reliability benchmark's large-prompt scenario (40 distinct ~0.9 MB prompts): plateau
~215-225 MB with glibc's defaults, ~170-180 MB with a 128 KiB threshold; over 120 prompts
176-183 MB at 128 KiB and 190-194 MB at 1 MiB, the default in front of upstreams
(`GatewayConfig.malloc_threshold`: below it, small bodies' parse buffers are mapped afresh on
every request). On a C library without `mallopt` (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") else None


def tune_malloc(threshold_bytes: int) -> bool:
    """Fix glibc's mmap and trim thresholds at `threshold_bytes` (process-wide; 0 leaves
    glibc's dynamic defaults). True when applied."""
    lib = _libc()
    if threshold_bytes <= 0 or lib is None:
        return False
    ok = lib.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold_bytes))
    return bool(ok and lib.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(threshold_bytes)))


def trim() -> bool:
    """Give free heap memory back to the system now (`malloc_trim(0)`); True when some was."""
    lib = _libc()
    return bool(lib is not None and lib.malloc_trim(ctypes.c_size_t(0)))


def rss_bytes() -> int:
    """This process's resident set size now, in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
    except OSError:
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")
