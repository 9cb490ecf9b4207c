"""The host allocator: glibc's malloc held at the thresholds it grows to by itself, from the runner's start.

glibc gives the free memory at the top of its heap back to the system once more than its trim threshold is free
there, and serves an allocation above its mmap threshold with a fresh mapping. Both start low (128 KiB) and rise only
to the largest block freed so far (the trim threshold to twice that), up to 32 MiB and 64 MiB on 64-bit. A training
step allocates and frees the same large host buffers every step (ZeRO-3's gathered parameters and gradient buckets,
activations on the CPU), so with thresholds a few MiB high the heap is trimmed after a step and grown again in the next,
and every page of it faults again. Measured on 2 gloo ranks (benchmarks/README.md, issue 37): ZeRO-3 of a 1M-parameter
MLP took hundreds of page faults a step more in the runner's loop than in a hand-written one (whose heap, laid out
differently, trimmed less), 1.09-1.15x its time per step; with the thresholds held, 1.00x, and both loops faster.

`hold_malloc_thresholds` sets both to those ceilings at once (`mallopt`), which is where a long run's thresholds
would end anyway for blocks of that size, so the heap is kept between steps: at most 64 MiB of free heap stays with
the process, and blocks over 32 MiB are still mapped and unmapped. The runner calls it first thing in `__init__`, on
every rank (worker processes forked later inherit it). It leaves malloc alone where the user chose: when the
environment sets a glibc malloc variable (`MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TOP_PAD_`,
`MALLOC_MMAP_MAX_`, or `glibc.malloc.*` in `GLIBC_TUNABLES`), and it does nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h> parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the dynamic threshold's ceiling
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets with it
USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_chose_malloc(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment sets glibc's malloc thresholds itself (then they are the user's)."""
    return any(environ.get(name) for name in USER_VARIABLES) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def hold_malloc_thresholds() -> bool:
    """Set glibc's mmap and trim thresholds to their dynamic ceilings (module docstring); True when set. Nothing is
    changed when the user chose them (`user_chose_malloc`) or the C library is not glibc."""
    if not sys.platform.startswith("linux") or user_chose_malloc():
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  # glibc only: musl has mallopt but not this
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
