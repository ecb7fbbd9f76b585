"""The file transport of published weights: :class:`FilesystemTransport` (split out of
:mod:`asyncrl.learner.publisher`, which holds the publish sequence).

Layout under a transport root (``<run_dir>/weights`` for files, ``/dev/shm/asyncrl-...`` for shm)::

    v{N}/model.safetensors     every tensor of the served checkpoint, HF names, module dtype
    v{N}/manifest.msgpack      the manifest (also stored in Redis), for humans and recovery

Write path (one pass over the bytes): the safetensors file is streamed tensor by tensor and
hashed while it is written (:func:`write_safetensors`), then fsynced once; no second read to
hash, no directory fsyncs. Why one fsync is enough: Redis, not the directory, is the record of
what was published, and a version whose rename was lost in a power cut is simply missing on
restart, which ``Publisher.usable`` detects and the learner re-publishes.

The fsync runs in the background, after the rename, while the version is registered and served
(:class:`_Durability`): it is not what makes a version correct, the sha256 is. Every reader verifies
the bytes against the manifest (from the page cache while the fsync runs), and a power cut before
it finished leaves a file that fails its sha256, which ``Publisher.usable`` detects on restart
exactly as a lost rename, so the learner re-publishes. What it bounds is how much unsynced data a
run leaves behind: the next publish (and ``close``) first waits for the previous fsync, one at a
time, and raises its error (the disk refused the data: the run stops as it did when the fsync was
inline). What it takes off a publish: the fsync of the demo's 1.3 MB costs 0.3-1.7 ms on the 2-core
VM (an A/B there showed no change in the learner's publish); at 300M (1.2 GB) on that VM, 0.2-0.3 s of
a 1.0-1.7 s publish in an A/B of two pairs (docs/benchmarks.md); of 1.26 GB alone, 0.52-0.65 s on the GPU boxes
(README, "The learner's CUDA path"), not yet measured inside a publish there.

Atomicity: a version is written into ``.tmp-v{N}-...`` and only then renamed to ``v{N}``; the
manifest naming it is registered in Redis after the rename. A reader that follows a manifest
therefore never sees a partial file, and :func:`asyncrl.buffer.verify` catches anything that
changed the bytes afterwards.

:class:`asyncrl.learner.shm_transport.ShmTransport` is the same layout on ``/dev/shm`` for actors on
the learner's machine: no disk, no fsync, and no hash (manifest ``digest="none"``: sizes are checked,
and the loader checks the version tag in the file's metadata), see :mod:`asyncrl.buffer.weights`.

Invariant: a version number names one set of weights forever (the learner never re-publishes a
version number with different weights; see asyncrl.learner.loop on resume), so a leftover
``v{N}`` directory can only be an unregistered crash leftover and is replaced.

Freeing storage never raises (it is cleanup, run from the learner's step loop): a directory that cannot
be removed (NFS, permissions) is logged with its error, counted (:attr:`FilesystemTransport.delete_failures`)
and retried at the next free after a publish and at :meth:`~FilesystemTransport.close`; a learner that
stops before it succeeds leaves it listed by ``stored_versions``, which its successor's first publish
sweeps (``Publisher.publish``). Before, the removal ignored its errors: a version that failed to go kept
a full model copy on the disk, silently, for good.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from asyncrl.buffer import WeightManifest, WeightTransport, verify
from asyncrl.buffer.weights import MANIFEST_FILENAME
from asyncrl.learner.safetensors_writer import write_safetensors

__all__ = ["FilesystemTransport", "WEIGHTS_FILE", "remove_tree"]

log = logging.getLogger(__name__)
WEIGHTS_FILE = "model.safetensors"


def remove_tree(path: Path) -> list[OSError]:
    """Remove ``path`` and everything under it, as far as possible; returns the errors (a path that is
    already gone is no error: a version may be freed twice, a retry may find it removed by someone else)."""
    errors: list[OSError] = []

    def failed(_fn: Any, _path: str, exc_info: Any) -> None:  # Python 3.11: ``onerror``, not ``onexc``
        if not isinstance(exc_info[1], FileNotFoundError):
            errors.append(exc_info[1])

    shutil.rmtree(path, onerror=failed)
    return errors


class _Durability:
    """One published file's fsync in a daemon thread; :meth:`wait` joins it and raises its error.

    Owns ``fd`` (a read-only descriptor of the file, which fsync accepts on Linux) and closes it.
    """

    def __init__(self, fd: int, version: int) -> None:
        self.version = version
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, args=(fd,), name="asyncrl-fsync", daemon=True)
        self._thread.start()

    def _run(self, fd: int) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:  # re-raised by wait, on the publishing thread
            self._error = exc
        finally:
            os.close(fd)

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise OSError(
                self._error.errno,
                f"fsync of published weights v{self.version} failed: {self._error.strerror}",
            ) from self._error


class FilesystemTransport(WeightTransport):
    """Weights on a filesystem every actor can read (local disk, NFS, a shared volume)."""

    #: Manifest digest kind; the shared-memory subclass sets "none".
    digest = "sha256"
    #: fsync the weights file (in the background after the rename; pointless on tmpfs).
    fsync = True

    def __init__(self, root: str | os.PathLike[str], expected_names: set[str] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.expected_names = expected_names or None
        #: Failed attempts to remove storage (a version, a crashed write's leftover); each is logged
        #: and retried (see the module doc).
        self.delete_failures = 0
        self._undeleted: dict[Path, int] = {}  # what could not be removed yet -> failed attempts
        self._retry_due = False  # a publish since the last retry: the next delete retries _undeleted
        for leftover in self.root.glob(".tmp-v*"):  # a crash mid-write
            self._remove(leftover)
        self._durability: _Durability | None = None  # the newest version's fsync, while it runs

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    def publish(self, version: int, state_dict: Any, dtype: str) -> WeightManifest:
        """Write ``v{version}/model.safetensors`` atomically and return its manifest.

        ``state_dict``: a name -> tensor mapping, or a zero-argument callable returning
        ``(name, tensor)`` pairs; the iterable is always consumed to the end (ZeRO-3 ranks gather
        inside it). With ``expected_names`` only those names are written, and all must be present.
        """
        items: Iterable = state_dict.items() if isinstance(state_dict, Mapping) else state_dict()
        tensors = {}
        for name, t in items:
            if self.expected_names is None or name in self.expected_names:
                tensors[name] = t.detach().to("cpu").contiguous()
        if self.expected_names is not None:
            missing = sorted(self.expected_names - tensors.keys())
            if missing:
                raise ValueError(
                    f"weights v{version}: model has no tensor(s) {missing[:5]} of the served checkpoint"
                )
        bad = sorted(n for n, t in tensors.items() if str(t.dtype).removeprefix("torch.") != dtype)
        if bad:
            raise ValueError(f"weights v{version}: tensors {bad[:3]} are not {dtype}")
        self.wait_durable()  # one fsync at a time; the previous one's error stops the run here
        tmp = self.root / f".tmp-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            final = self.version_dir(version)
            sha, size = self._write(
                tmp / WEIGHTS_FILE, tensors, {"format": "pt", "asyncrl_version": str(version)}
            )
            manifest = WeightManifest(
                version, str(final / WEIGHTS_FILE), sha, size, dtype, digest=self.digest
            )
            # A copy for humans and recovery; Redis holds the authoritative one, so no fsync.
            (tmp / MANIFEST_FILENAME).write_bytes(manifest.to_bytes())
            if final.exists():
                log.warning("replacing unregistered leftover %s", final)
                shutil.rmtree(final)
            # The file, not its path: the fsync reaches exactly these bytes even if the version is
            # pruned meanwhile.
            fd = os.open(tmp / WEIGHTS_FILE, os.O_RDONLY) if self.fsync else None
            try:
                os.rename(tmp, final)
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
        except BaseException:
            self._remove(tmp)  # never raises: the publish's own error is the one that propagates
            raise
        # ``final`` is this version's storage now: a retry must never remove it (defensive: versions
        # only grow within a process, so a failed delete of the same path cannot be pending).
        self._undeleted.pop(final, None)
        self._retry_due = True
        if fd is not None:
            self._durability = _Durability(fd, version)
        return manifest

    def wait_durable(self) -> None:
        """Wait until the newest published version's file is fsynced; raises the fsync's error."""
        d, self._durability = self._durability, None
        if d is not None:
            d.wait()

    def close(self) -> None:
        try:
            self.wait_durable()
        finally:
            self._retry_undeleted()  # a last try; what remains is swept by the next learner's first publish

    def fetch(self, manifest: WeightManifest) -> str:
        verify(manifest)
        return manifest.path

    def delete(self, version: int) -> None:
        """Free ``version``'s storage; never raises (see the module doc). Also retries, once per publish
        (not once per version freed: a first publish's sweep may free many), what failed to go before."""
        if self._retry_due:
            self._retry_due = False
            self._retry_undeleted()
        self._remove(self.version_dir(version))

    def undeleted(self) -> list[Path]:
        """The directories whose removal failed and is still to be retried."""
        return sorted(self._undeleted)

    def _retry_undeleted(self) -> None:
        for path in list(self._undeleted):
            self._remove(path)

    def _remove(self, path: Path) -> None:
        """Remove ``path``'s tree; on failure log it (the first failure of a path, then at attempts 2, 4,
        8, ...: a stuck mount is visible without a line per step), count it and keep it for a retry."""
        errors = remove_tree(path)
        if not errors:
            failed = self._undeleted.pop(path, 0)
            if failed:
                log.info("removed %s after %d failed attempt(s)", path, failed)
            return
        self.delete_failures += 1
        attempts = self._undeleted[path] = self._undeleted.get(path, 0) + 1
        if attempts & (attempts - 1) == 0:
            log.warning("could not remove %s (attempt %d; %d error(s), first: %s): its storage stays in use "
                        "until a retry succeeds", path, attempts, len(errors), errors[0])  # fmt: skip

    def stored_versions(self) -> list[int]:
        """The ``v<N>`` directories under the root (a publish's temporary directories are not versions)."""
        if not self.root.is_dir():
            return []
        return sorted(
            int(d.name[1:]) for d in self.root.iterdir() if d.name[1:].isdigit() and d.name[0] == "v"
        )

    def _write(self, path: Path, tensors: dict[str, Any], metadata: dict[str, str]) -> tuple[str, int]:
        """Write the version's file at ``path`` (inside its temporary directory): (sha256 or "", size)."""
        return write_safetensors(
            path,
            tensors,
            metadata,
            digest=self.digest == "sha256",
            fsync=False,  # in the background, after the rename (publish)
            overwrite=self._take_spare(path),
        )

    def _take_spare(self, path: Path) -> bool:
        """Move a file to ``path`` that the next write may overwrite; False = none (write a new one)."""
        return False
