"""asyncrl.actors.cpu_heap: memory a swap frees is kept and reused by the next swap.

Each case runs in a fresh interpreter (``mallopt`` is process-wide): it allocates a "model" of
layer-sized blocks with glibc's malloc, touches every page, and then does what a staged swap does on
CPU, version after version: build the next copy while the current one is alive, then free the current
one. Minor page faults count the memory that had to be newly mapped for each version.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.actors import cpu_heap

#: bytes per "layer" (40 MiB is above glibc's largest dynamic mmap threshold, 32 MiB) x layers.
LAYER = [40 << 20, 12 << 20, 3 << 20, 200 << 10]
LAYERS = 3
VERSIONS = 6
PAGE = 4096

CHILD = r"""
import ctypes, ctypes.util, json, resource, sys
keep = sys.argv[1] == "1"
sizes = json.loads(sys.argv[2]) * int(sys.argv[3])
status = "default"
if keep:
    from asyncrl.actors.cpu_heap import keep_freed_memory
    status = keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def build():
    out = []
    for n in sizes:
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)  # every page touched, as a load or a packing does
        out.append(p)
    return out
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
faults, rsss = [], []
live = build()
for _ in range(int(sys.argv[4])):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    new = build()
    for p in live:
        libc.free(p)
    live = new
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    rsss.append(rss())
print(json.dumps({"status": status, "faults": faults, "rss": rsss}))
"""


def _run(keep: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if keep else "0", json.dumps(LAYER), str(LAYERS), str(VERSIONS)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_memory_is_mapped_again_by_default_and_reused_when_kept() -> None:
    pages = sum(LAYER) * LAYERS // PAGE
    default, kept = _run(False), _run(True)
    assert kept["status"] == "kept"
    # glibc's defaults: blocks above its mmap threshold are fresh mappings each version (measured: 0.5-1x
    # a model's pages per version): the later versions map well over two models' worth of new pages.
    assert sum(default["faults"][2:]) >= 2 * pages, default
    # Kept: from the third version on, each version is built in the memory the one before last freed.
    assert max(kept["faults"][2:]) < 0.02 * pages, kept
    # ... and the heap does not grow from version to version (two copies alive at the peak, as staged).
    assert kept["rss"][-1] <= kept["rss"][1] * 1.02, kept
    assert kept["rss"][-1] <= 2.2 * sum(LAYER) * LAYERS, kept


def test_another_allocator_preloaded_is_left_alone(monkeypatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert cpu_heap.keep_freed_memory() == "preloaded: tcmalloc"
