"""Writing a safetensors file in one pass, hashed while written; the tensor names of a checkpoint.

Split out of :mod:`asyncrl.learner.publisher` (its transports call :func:`write_safetensors`), so
that module holds the transports and the publish sequence. Imports torch lazily: the benchmarks and
the reference-model path use it without a learner.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_CHUNK = 4 << 20  # hash-and-write granularity: stays in cache between the two passes
#: From this many bytes on, with a second CPU in the process's affinity, sha256 runs in a helper
#: thread beside the writes (hashlib and file writes both release the GIL), so a publish costs
#: max(write, hash) instead of their sum: 1.2 GB on the 2-core VM, 1.18-1.29 s -> 0.89-0.94 s (the
#: hash alone). On one CPU the two would only take turns.
_HASH_THREAD_MIN = 64 << 20
# torch dtype name -> safetensors dtype code.
_ST_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str],
    *,
    digest: bool = True,
    fsync: bool = True,
    overwrite: bool = False,
) -> tuple[str, int]:
    """Stream ``tensors`` (CPU, contiguous) into a safetensors file; returns (sha256 hex or "", size).

    Each tensor's bytes are hashed and written chunk by chunk from its own memory: no serialized
    copy of the whole model is built (``safetensors.torch.save`` would), and the file is never
    read back. The header is safetensors' format: u64 LE length, JSON (padded to 8 bytes with
    spaces), then the tensors back to back in the header's (sorted-name) order.

    ``overwrite``: ``path`` exists and nobody else has it open; it is written over from the start and
    cut to size, keeping its pages (a tmpfs file then costs a copy, not a page allocation per 4 KiB).
    """
    import torch

    head, order, offset = safetensors_header(tensors, metadata)
    h = _Sha256(threaded=offset >= _HASH_THREAD_MIN and len(os.sched_getaffinity(0)) > 1) if digest else None
    try:
        with open(path, "r+b" if overwrite else "wb") as f:
            for part in (head[:8], head[8:]):
                if h is not None:
                    h.update(part)
                f.write(part)
            for name in order:
                t = tensors[name]
                if t.numel() == 0:
                    continue
                mv = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                for i in range(0, len(mv), _CHUNK):
                    chunk = mv[i : i + _CHUNK]
                    if h is not None:
                        h.update(chunk)
                    f.write(chunk)
            if overwrite:
                f.truncate()
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        sha = h.hexdigest() if h is not None else ""
    finally:
        if h is not None:
            h.close()
    return sha, len(head) + offset


def safetensors_header(
    tensors: Mapping[str, Any], metadata: Mapping[str, str]
) -> tuple[bytes, list[str], int]:
    """The file's first bytes (u64 LE length + JSON header padded to 8 bytes with spaces), the tensor
    names in file order (sorted), and the number of data bytes after the header."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    order = sorted(tensors)
    offset = 0
    for name in order:
        t = tensors[name]
        code = _ST_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors code")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, order, offset


def write_into(buf: Any, tensors: Mapping[str, Any], head: bytes, order: list[str]) -> None:
    """Copy a safetensors file (``head`` and ``order`` from :func:`safetensors_header`) into the
    writable buffer ``buf`` (a shared mapping of a file of exactly that size): a memcpy per tensor,
    no system call per chunk."""
    import torch

    buf[: len(head)] = head
    pos = len(head)
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        if n:  # no name bound to the view: nothing keeps ``buf`` exported after the call
            torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=pos).copy_(
                t.reshape(-1).view(torch.uint8)
            )
        pos += n


class _Sha256:
    """sha256 of the bytes given to :meth:`update`, in order, in this thread or a helper thread.

    Threaded: ``update`` only queues the chunk (a memoryview of the caller's tensor memory, which
    the caller keeps alive and unchanged until :meth:`hexdigest`); one helper thread hashes the
    queue in FIFO order, so the digest is that of the same bytes in the same order.
    """

    def __init__(self, threaded: bool) -> None:
        self._h = hashlib.sha256()
        self._q: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        if threaded:
            self._q = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="asyncrl-sha256", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._q is not None
        while (chunk := self._q.get()) is not None:
            if self._error is None:
                try:
                    self._h.update(chunk)
                except BaseException as exc:  # re-raised by hexdigest: never a digest of fewer bytes
                    self._error = exc

    def update(self, data: Any) -> None:
        if self._q is None:
            self._h.update(data)
        else:
            self._q.put(data)

    def hexdigest(self) -> str:
        self.close()
        if self._error is not None:
            raise self._error
        return self._h.hexdigest()

    def close(self) -> None:
        """Stop the helper (after hashing what was queued); idempotent."""
        if self._thread is not None:
            assert self._q is not None
            self._q.put(None)
            self._thread.join()
            self._thread = None


def checkpoint_tensor_names(model_dir: str | os.PathLike[str]) -> set[str]:
    """Tensor names of the safetensors files of a HF model directory (what the actors serve).

    Publishing exactly these names keeps tied aliases (``lm_head.weight`` of a tied model) out of
    the file, as ``save_pretrained`` does; the actors refuse a file whose names differ.
    """
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.update(fh.keys())
    return names
