"""Publishing policy weights: the :class:`WeightTransport` s of the learner and the publish sequence.

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
a 1.0-1.7 s publish in an A/B of two pairs (README); of 1.26 GB alone, 0.52-0.65 s on the GPU boxes
(README, "The learner's CUDA path"), not yet measured inside a publish there.

Atomicity: a version is written into ``.tmp-v{N}-...`` and only then renamed to ``v{N}``; the
manifest naming it is registered in Redis after the rename. A reader that follows a manifest
therefore never sees a partial file, and :func:`asyncrl.buffer.verify` catches anything that
changed the bytes afterwards.

:class:`ShmTransport` is the same layout on ``/dev/shm`` for actors on the learner's machine:
no disk, no fsync, and no hash (manifest ``digest="none"``: sizes are checked, and the loader
checks the version tag in the file's metadata), see :mod:`asyncrl.buffer.weights`.

Invariant: a version number names one set of weights forever (the learner never re-publishes a
version number with different weights; see asyncrl.learner.loop on resume), so a leftover
``v{N}`` directory can only be an unregistered crash leftover and is replaced.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from asyncrl.buffer import (
    ReplayBuffer,
    WeightIntegrityError,
    WeightManifest,
    WeightTransport,
    verify,
)
from asyncrl.buffer.weights import MANIFEST_FILENAME, shm_root
from asyncrl.learner.safetensors_writer import checkpoint_tensor_names, write_safetensors

__all__ = [
    "FilesystemTransport",
    "ShmTransport",
    "Publisher",
    "checkpoint_tensor_names",
    "make_transport",
    "is_local_url",
    "shm_root",
    "write_safetensors",
    "WEIGHTS_FILE",
    "TRANSPORTS",
]

log = logging.getLogger(__name__)
WEIGHTS_FILE = "model.safetensors"
#: Values of ``learner.weight_transport``.
TRANSPORTS = ("auto", "file", "shm", "nccl")
#: Write leases (Linux): how ShmTransport proves that a spare file is no longer open or mapped.
_LEASES = hasattr(fcntl, "F_SETLEASE")


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
        for leftover in self.root.glob(".tmp-v*"):  # a crash mid-write
            shutil.rmtree(leftover, ignore_errors=True)
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
            sha, size = write_safetensors(
                tmp / WEIGHTS_FILE,
                tensors,
                {"format": "pt", "asyncrl_version": str(version)},
                digest=self.digest == "sha256",
                fsync=False,  # below, in the background
                overwrite=self._take_spare(tmp / WEIGHTS_FILE),
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
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if fd is not None:
            self._durability = _Durability(fd, version)
        return manifest

    def wait_durable(self) -> None:
        """Wait until the newest published version's file is fsynced; raises the fsync's error."""
        d, self._durability = self._durability, None
        if d is not None:
            d.wait()

    def close(self) -> None:
        self.wait_durable()

    def fetch(self, manifest: WeightManifest) -> str:
        verify(manifest)
        return manifest.path

    def delete(self, version: int) -> None:
        shutil.rmtree(self.version_dir(version), ignore_errors=True)

    def _take_spare(self, path: Path) -> bool:
        """Move a file to ``path`` that the next write may overwrite; False = none (write a new one)."""
        return False


class ShmTransport(FilesystemTransport):
    """Weights in shared memory (``/dev/shm``) for actors on the learner's machine.

    Same layout, atomic rename and manifest as the file transport, but the bytes never touch a
    disk: no fsync, and no sha256 (``digest="none"``; the directory is private to this user, mode
    0700, and lives only in this host's memory). What is checked instead: sizes (``verify``) and
    the ``asyncrl_version`` tag in the file's metadata (the actors' loader). ``keep_versions``
    bounds the memory held; the directory is removed by :meth:`cleanup`.

    Recycling: writing a new tmpfs file allocates (and zeroes) every page of it, which costs more
    than the copy itself. So a deleted version's file is not unlinked but kept as the *spare* (one
    at most, ``.spare-model.safetensors`` in the root, renamed out of ``v{N}/``: its old path is gone
    for readers exactly as if it had been removed), and the next publish writes over it.
    Invariant: a spare is overwritten only if no other open file or memory mapping of it exists
    anywhere on the host, which the kernel checks atomically: a write lease (``F_SETLEASE``) is
    granted only then. An actor still reading it (an old version it has mapped) makes the lease
    fail, and the spare is unlinked instead (the reader keeps its bytes). The lease is released at
    once: nothing opens the spare's path. Memory: the spare keeps a publish's peak (``keep_versions``
    + 1 files) held between publishes.
    """

    digest = "none"
    fsync = False
    SPARE = ".spare-" + WEIGHTS_FILE

    def __init__(self, root: str | os.PathLike[str], expected_names: set[str] | None = None) -> None:
        super().__init__(root, expected_names)
        os.chmod(self.root, 0o700)

    def delete(self, version: int) -> None:
        spare = self.root / self.SPARE
        if _LEASES and not spare.exists():
            try:  # atomic: a reader opening the old path now gets ENOENT, as after a removal
                os.rename(self.version_dir(version) / WEIGHTS_FILE, spare)
            except OSError:
                pass
        super().delete(version)

    def _take_spare(self, path: Path) -> bool:
        spare = self.root / self.SPARE
        try:
            fd = os.open(spare, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            # Granted only while no other open file or mapping of the inode exists (see the class doc).
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            free = False
        else:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            free = True
        finally:
            os.close(fd)
        if not free:
            spare.unlink(missing_ok=True)  # a reader still has it: it keeps its bytes
            return False
        os.rename(spare, path)
        return True

    def cleanup(self) -> None:
        """Remove every version (the run is over; a resumed learner re-publishes its version)."""
        shutil.rmtree(self.root, ignore_errors=True)

    close = cleanup  # memory is not kept past the learner: a restarted learner re-publishes


def is_local_url(url: str) -> bool:
    """Does this Redis URL point at this host (loopback or a unix socket)? Then so do the actors."""
    from urllib.parse import urlparse

    u = urlparse(url)
    return u.scheme == "unix" or (u.hostname or "") in ("127.0.0.1", "localhost", "::1")


def make_transport(
    kind: str,
    run_dir: str | os.PathLike[str],
    run_name: str,
    expected_names: set[str] | None,
    *,
    local: bool,
    cfg: Any = None,
    redis_client: Any = None,
) -> WeightTransport:
    """The transport ``learner.weight_transport`` names; ``local``: every actor runs on this host.

    ``auto`` is ``shm`` for a local run (actors on this machine) and ``file`` otherwise. ``nccl``
    (CUDA actors; :mod:`asyncrl.learner.nccl_transport`) needs the config and the run's Redis client.
    """
    if kind not in TRANSPORTS:
        raise ValueError(f"learner.weight_transport={kind!r}; expected one of {TRANSPORTS}")
    if kind == "nccl":
        if cfg is None or redis_client is None:
            raise ValueError("learner.weight_transport='nccl' needs the config and the run's Redis client")
        from asyncrl.learner.nccl_transport import from_config

        return from_config(cfg, redis_client, expected_names)
    if kind == "auto":
        kind = "shm" if local and Path("/dev/shm").is_dir() else "file"
    if kind == "shm":
        return ShmTransport(shm_root(run_dir, run_name), expected_names)
    return FilesystemTransport(Path(run_dir) / "weights", expected_names)


class Publisher:
    """Publish sequence of the learner's rank 0: write -> register in Redis (sets V, notifies) -> prune."""

    def __init__(
        self, buffer: ReplayBuffer, transport: WeightTransport, keep_versions: int, dtype: str
    ) -> None:
        self.buffer = buffer
        self.transport = transport
        self.keep_versions = keep_versions
        self.dtype = dtype

    def publish(self, version: int, weights: Mapping[str, Any] | Callable[[], Iterable]) -> WeightManifest:
        manifest = self.transport.publish(version, weights, self.dtype)
        self.buffer.publish_weights(manifest)
        for v in self.buffer.prune_manifests(self.keep_versions):
            self.transport.delete(v)
        return manifest

    def close(self) -> None:
        self.transport.close()

    def usable(self, version: int) -> bool:
        """Is ``version`` registered and are its bytes on disk intact?"""
        m = self.buffer.manifest(version)
        if m is None:
            return False
        try:
            self.transport.fetch(m)
        except (WeightIntegrityError, OSError) as exc:  # missing or corrupt: the caller re-publishes
            log.warning("published weights v%d unusable: %s", version, exc)
            return False
        return True
