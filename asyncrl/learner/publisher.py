"""Publishing policy weights: the shared-filesystem :class:`WeightTransport` and the publish sequence.

Layout under the transport root (``<run_dir>/weights`` by default)::

    v{N}/model.safetensors     every tensor of the served checkpoint, HF names, module dtype
    v{N}/manifest.msgpack      the manifest (also stored in Redis), for humans and recovery

Atomicity: a version is written into ``.tmp-v{N}-...``, fsynced, hashed, and only then renamed
to ``v{N}``; the manifest naming it is registered in Redis after the rename. A reader that
follows a manifest therefore never sees a partial file, and :func:`asyncrl.buffer.verify` catches
anything that changed the bytes afterwards.

Invariant: a version number names one set of weights forever (the learner never re-publishes a
version number with different weights; see asyncrl.learner.loop on resume), so a leftover
``v{N}`` directory can only be an unregistered crash leftover and is replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from asyncrl.buffer import (
    ReplayBuffer,
    WeightIntegrityError,
    WeightManifest,
    WeightTransport,
    build_manifest,
    verify,
)
from asyncrl.buffer.weights import MANIFEST_FILENAME

__all__ = ["FilesystemTransport", "Publisher", "checkpoint_tensor_names", "WEIGHTS_FILE"]

log = logging.getLogger(__name__)
WEIGHTS_FILE = "model.safetensors"


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilesystemTransport(WeightTransport):
    """Weights on a filesystem every actor can read (local disk, NFS, a shared volume)."""

    def __init__(self, root: str | os.PathLike[str], expected_names: set[str] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.expected_names = expected_names or None
        for leftover in self.root.glob(".tmp-v*"):  # a crash mid-write
            shutil.rmtree(leftover, ignore_errors=True)

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    def publish(self, version: int, state_dict: Any, dtype: str) -> WeightManifest:
        """Write ``v{version}/model.safetensors`` atomically and return its manifest.

        ``state_dict``: a name -> tensor mapping, or a zero-argument callable returning
        ``(name, tensor)`` pairs; the iterable is always consumed to the end (ZeRO-3 ranks gather
        inside it). With ``expected_names`` only those names are written, and all must be present.
        """
        from safetensors.torch import save_file

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
        tmp = self.root / f".tmp-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            file = tmp / WEIGHTS_FILE
            save_file(tensors, str(file), metadata={"format": "pt", "asyncrl_version": str(version)})
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())
            final = self.version_dir(version)
            manifest = dataclasses.replace(
                build_manifest(version, file, dtype), path=str(final / WEIGHTS_FILE)
            )
            (tmp / MANIFEST_FILENAME).write_bytes(manifest.to_bytes())
            _fsync_dir(tmp)
            if final.exists():
                log.warning("replacing unregistered leftover %s", final)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return manifest

    def fetch(self, manifest: WeightManifest) -> str:
        verify(manifest)
        return manifest.path

    def delete(self, version: int) -> None:
        shutil.rmtree(self.version_dir(version), ignore_errors=True)


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
