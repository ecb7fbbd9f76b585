"""Publishing policy weights: the publish sequence (:class:`Publisher`) and the choice of transport.

The transports: :class:`asyncrl.learner.file_transport.FilesystemTransport` (its module doc has the
layout, the one-pass write, the background fsync and the atomicity), and
:class:`asyncrl.learner.shm_transport.ShmTransport` (the same layout in ``/dev/shm`` for actors on the
learner's machine), both re-exported here; ``nccl`` is :mod:`asyncrl.learner.nccl_transport`.

Invariant: a version number names one set of weights forever (the learner never re-publishes a
version number with different weights; see asyncrl.learner.loop on resume), so a leftover
``v{N}`` directory can only be an unregistered crash leftover and is replaced.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from asyncrl.buffer import ReplayBuffer, WeightIntegrityError, WeightManifest, WeightTransport
from asyncrl.buffer.weights import shm_root
from asyncrl.learner.file_transport import WEIGHTS_FILE, FilesystemTransport
from asyncrl.learner.safetensors_writer import checkpoint_tensor_names, write_safetensors
from asyncrl.learner.shm_transport import ShmTransport

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
#: Values of ``learner.weight_transport``.
TRANSPORTS = ("auto", "file", "shm", "nccl")


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
    """Publish sequence of the learner's rank 0: free the versions the last publish unregistered ->
    write -> register in Redis, prune the registry to ``keep_versions``, notify (one script call).

    Nothing follows the notification: it wakes the actors, whose swap is the critical path of a
    synchronous run and shared the learner's cores with what came after it (two more round trips to
    prune, then the deletes: 2-5 ms of a ~65 ms demo step). The storage of the versions a publish
    unregistered is freed by :meth:`free_unregistered`, which the learner calls at the top of its next
    step while the actors generate (else the next publish, or :meth:`close`, does): no reader finds such a
    version through the registry any more. The shm transport recycles that file for the next version
    just the same.

    A learner killed before that (or a retried script call whose first reply was lost, naming versions a
    previous process wrote) would leave them stored for good: the first publish of a publisher also
    frees every stored version the registry does not list and that is older than the one it registered.
    """

    def __init__(
        self, buffer: ReplayBuffer, transport: WeightTransport, keep_versions: int, dtype: str
    ) -> None:
        self.buffer = buffer
        self.transport = transport
        self.keep_versions = keep_versions
        self.dtype = dtype
        self._written: list[int] = []  # versions this publisher wrote and has not freed, ascending
        self._unregistered: set[int] = set()  # dropped from the registry, storage not freed yet
        self._swept = False  # the first publish looked for stored versions nobody will free

    def publish(self, version: int, weights: Mapping[str, Any] | Callable[[], Iterable]) -> WeightManifest:
        self.free_unregistered()
        manifest = self.transport.publish(version, weights, self.dtype)
        self._written.append(version)
        _, dropped = self.buffer.publish_weights_pruned(manifest, self.keep_versions)
        # Also this publisher's own versions beyond the newest kept: a retried script call (a lost
        # reply) reports nothing it dropped the first time.
        self._unregistered.update(dropped, self._written[: -self.keep_versions])
        if not self._swept:  # once, after the notification: one HKEYS and a directory listing
            registered = set(self.buffer.manifest_versions())
            self._unregistered.update(
                v for v in self.transport.stored_versions() if v not in registered and v < version
            )
            self._swept = True
        return manifest

    def free_unregistered(self) -> None:
        """Free the storage of the versions the registry no longer lists (see the class doc)."""
        for v in sorted(self._unregistered):
            self.transport.delete(v)
            self._unregistered.discard(v)
            if v in self._written:
                self._written.remove(v)

    def close(self) -> None:
        try:
            self.free_unregistered()
        finally:
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
