"""Keep the memory a CPU engine frees on a weight swap, so that the next swap writes into mapped pages.

On CPU every swap builds a new copy of each linear layer's weights (vLLM's oneDNN packing:
``create_onednn_mm`` reorders the weight into memory of its own) and frees the previous one. glibc's
malloc serves allocations of more than ``M_MMAP_THRESHOLD`` (dynamic, at most 32 MiB) with fresh
``mmap`` calls and gives them back with ``munmap``; below it, it trims the top of its heaps beyond
``M_TRIM_THRESHOLD``. Either way the next swap faults a model's worth of new zeroed 4 KiB pages in,
which is most of the packing's cost: packing the 300M bench model's layers in a thread ran at 2.1-2.2
GB/s on fresh memory and at 6.2-6.6 GB/s on memory freed by the previous swap (2-core VM, one core).

:func:`keep_freed_memory` sets ``M_MMAP_MAX = 0`` (no allocation is an mmap of its own: all come from
the heaps, where freed chunks are reused) and ``M_TRIM_THRESHOLD`` to its largest value (2 GiB: a
heap top freed beyond that still goes back). Measured at 300M (``asyncrl bench --weights-only``):
the in-place reload's pause 856 -> 463 ms (shm), the staged build 650 -> 646 ms, its packing alone 320-690
-> 212-243 ms per swap.

Cost: memory a swap freed stays with the engine process (up to the stage's 2x model peak, which the
process reaches on every staged swap anyway) instead of going back to the system between swaps.
Invariant: the allocation pattern of a swap repeats exactly (the same tensor sizes every version),
so the retained chunks are reused and the heap does not grow from swap to swap (tested).

Only for glibc's malloc (another allocator preloaded, e.g. tcmalloc or jemalloc, keeps freed memory
by itself and ignores ``mallopt``). Process-wide, set once in the engine process
(asyncrl.actors.worker_ext), only for a CPU device and a checkpoint of at least :data:`MIN_BYTES`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["keep_freed_memory", "KEPT", "M_MMAP_MAX", "M_TRIM_THRESHOLD", "TRIM_MAX", "MIN_BYTES"]

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: mallopt takes an int: the largest trim threshold it can be given.
TRIM_MAX = 2**31 - 1

#: Checkpoints smaller than this are left to glibc's defaults: their blocks are all under its mmap
#: threshold and a swap frees little, so there is nothing to gain (the 1.3 MB demo model), while an A/B
#: of the demo at max_staleness 1 read -5% with the kept heap (7 pairs of 200 steps, 2 in its favour;
#: within this VM's spread, but with no gain to weigh against it).
MIN_BYTES = 64 << 20
#: What :func:`keep_freed_memory` returns when it set the heap up (anything else says why not).
KEPT = "kept"

#: Allocators that replace glibc's when preloaded (their own retention rules apply).
_OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def keep_freed_memory() -> str:
    """Set glibc's malloc to keep freed memory (see the module doc); returns what was done:
    ``"kept"``, or why nothing was (``"preloaded: <lib>"``, ``"no glibc"``, ``"refused: <option>"``)."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in _OTHER_ALLOCATORS:
        if name in preload:
            return f"preloaded: {name}"
    path = ctypes.util.find_library("c")
    if path is None:
        return "no glibc"
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return "no glibc"
    for option, value, name in (
        (M_MMAP_MAX, 0, "M_MMAP_MAX"),
        (M_TRIM_THRESHOLD, TRIM_MAX, "M_TRIM_THRESHOLD"),
    ):
        if libc.mallopt(option, value) != 1:  # 1 = done
            return f"refused: {name}"
    return KEPT
