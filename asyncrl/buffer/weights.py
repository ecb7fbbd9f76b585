"""Weight manifests: what the learner publishes and the actors verify before loading.

A manifest names one policy version's weights (a file or a directory of files) with their
sha256 and size, so an actor never loads a half-written or corrupted checkpoint. The
manifest itself travels through Redis (``ReplayBuffer.publish_weights``); the bytes travel
through a :class:`WeightTransport` (shared filesystem by default, implemented in the
learner package). This module imports neither torch nor safetensors.

Directory digest: for a directory the top-level ``sha256`` is the sha256 of the text that
``sha256sum`` prints for its files, sorted by relative POSIX path, i.e. lines
``"<hex>  <relpath>\\n"``. It is reproducible with ``(cd dir && sha256sum $(find . ...))``
and is what :func:`verify` checks after checking every per-file entry.

Broadcast manifests: with ``learner.weight_transport=nccl`` the bytes go straight from the
learner's GPU into the actors' (:mod:`asyncrl.buffer.broadcast`) and are stored nowhere. The
manifest keeps its contract (version, dtype, total bytes; setting it still sets V) with
``path = "nccl://<session>/v<N>"`` and ``digest="none"``; :func:`verify` refuses it (there is no
copy to load or check), which is exactly what a resumed learner needs to re-publish.

Digest kinds (``WeightManifest.digest``): ``"sha256"`` (the default, and the contract of every
transport whose bytes cross a disk or a network) or ``"none"`` for a transport that never leaves
the learner's machine and memory (``/dev/shm``): there :func:`verify` checks presence and sizes,
and the loader checks the version tag inside the file. Hashing 1 GB costs ~0.8 s per side on a
core here, i.e. more than the whole copy it would protect.
"""

from __future__ import annotations

import abc
import hashlib
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

__all__ = [
    "MANIFEST_SCHEMA",
    "MANIFEST_FILENAME",
    "WeightIntegrityError",
    "WeightFileError",
    "WeightFileGone",
    "FileDigest",
    "WeightManifest",
    "sha256_file",
    "sha256_dir",
    "build_manifest",
    "verify",
    "WeightTransport",
    "shm_root",
    "BROADCAST_SCHEME",
    "is_broadcast",
]

MANIFEST_SCHEMA = 1
#: Name a transport may use to store the manifest next to the weights; never hashed.
MANIFEST_FILENAME = "manifest.msgpack"
#: Allowed values of ``WeightManifest.digest`` (see the module doc).
DIGESTS = ("sha256", "none")
_CHUNK = 1 << 20
#: Path prefix of a manifest whose weights were broadcast, not stored (see the module doc).
BROADCAST_SCHEME = "nccl://"


class WeightIntegrityError(RuntimeError):
    """The weights on disk do not match their manifest (missing, wrong size or sha256).

    The actor refuses the manifest (logged, remembered) and keeps serving the weights it has; any
    other error of a swap is the engine's and goes to the actor's supervision."""


class WeightFileError(WeightIntegrityError, ValueError):
    """The file does not hold what the engine serves: tensor names, shapes or dtypes, or a version tag
    other than the one announced, or it cannot be read as safetensors. For the shared-memory transport
    (no sha256) these header checks are the integrity check. A ValueError too: older callers catch that."""


class WeightFileGone(WeightFileError):
    """The file is not there (any more): pruned or recycled after its manifest was registered, e.g.
    while a between_groups swap drained (``verify`` raises it too). Not remembered as refused by the
    swap: the manifest was fine, newer weights replaced it; the actor moves on to the newest manifest."""


@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int


@dataclass(frozen=True)
class WeightManifest:
    """One published policy version.

    ``path`` is where the weights live (a file or a directory), ``size`` the total bytes,
    ``dtype`` the parameter dtype as a string (e.g. ``"bfloat16"``), ``created`` a unix time.
    ``files`` maps relative path -> digest for a directory, and is None for a single file.
    ``digest`` is ``"sha256"`` (``sha256`` fields hold hex digests) or ``"none"`` (same-host memory
    transport: the ``sha256`` fields are empty and only sizes are checked).
    """

    version: int
    path: str
    sha256: str
    size: int
    dtype: str
    created: float = field(default_factory=time.time)
    files: dict[str, FileDigest] | None = None
    digest: str = "sha256"

    def __post_init__(self) -> None:
        if self.digest not in DIGESTS:
            raise ValueError(f"manifest.digest: {self.digest!r}; expected one of {DIGESTS}")

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-safe dict (plain str/int/float/dict values)."""
        d: dict[str, Any] = {
            "schema": MANIFEST_SCHEMA,
            "version": self.version,
            "path": self.path,
            "sha256": self.sha256,
            "size": self.size,
            "dtype": self.dtype,
            "created": self.created,
        }
        if self.digest != "sha256":  # omitted by default: older readers keep working
            d["digest"] = self.digest
        if self.files is not None:
            d["files"] = {name: {"sha256": f.sha256, "size": f.size} for name, f in self.files.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WeightManifest:
        """Inverse of :meth:`to_dict`; raises ValueError naming the bad field."""
        if not isinstance(d, Mapping):
            raise ValueError(f"manifest: expected a map, got {type(d).__name__}")
        if d.get("schema", MANIFEST_SCHEMA) != MANIFEST_SCHEMA:
            raise ValueError(f"manifest.schema: unsupported {d.get('schema')!r}")
        expected = {"version": int, "path": str, "sha256": str, "size": int, "dtype": str}
        for name, typ in expected.items():
            if name not in d:
                raise ValueError(f"manifest.{name}: missing field")
            if isinstance(d[name], bool) or not isinstance(d[name], typ):
                raise ValueError(f"manifest.{name}: expected {typ.__name__}, got {type(d[name]).__name__}")
        if d["version"] < 0 or d["size"] < 0:
            raise ValueError("manifest: version and size must be >= 0")
        created = d.get("created", 0.0)
        if isinstance(created, bool) or not isinstance(created, int | float):
            raise ValueError("manifest.created: expected a number")
        files = None
        if d.get("files") is not None:
            if not isinstance(d["files"], Mapping):
                raise ValueError("manifest.files: expected a map")
            files = {}
            for name, f in d["files"].items():
                try:
                    files[str(name)] = FileDigest(sha256=str(f["sha256"]), size=int(f["size"]))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"manifest.files[{name!r}]: malformed ({exc})") from None
        digest = d.get("digest", "sha256")
        if digest not in DIGESTS:
            raise ValueError(f"manifest.digest: {digest!r}; expected one of {DIGESTS}")
        return cls(
            version=d["version"],
            path=d["path"],
            sha256=d["sha256"],
            size=d["size"],
            dtype=d["dtype"],
            created=float(created),
            files=files,
            digest=digest,
        )

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> WeightManifest:
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:
            raise ValueError(f"manifest: not valid msgpack ({exc})") from None
        return cls.from_dict(d)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, streamed in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _dir_files(root: Path) -> list[str]:
    names = []
    for dirpath, _dirs, filenames in os.walk(root):
        for fn in filenames:
            rel = (Path(dirpath) / fn).relative_to(root).as_posix()
            if rel != MANIFEST_FILENAME:
                names.append(rel)
    return sorted(names)


def _combine(files: Mapping[str, FileDigest]) -> str:
    text = "".join(f"{files[name].sha256}  {name}\n" for name in sorted(files))
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_dir(path: str | os.PathLike[str]) -> tuple[str, dict[str, FileDigest]]:
    """(combined digest, per-file digests) of every regular file under ``path``."""
    root = Path(path)
    files = {
        name: FileDigest(sha256_file(root / name), (root / name).stat().st_size) for name in _dir_files(root)
    }
    return _combine(files), files


def build_manifest(version: int, path: str | os.PathLike[str], dtype: str) -> WeightManifest:
    """Hash the weights at ``path`` (file or directory) into a manifest."""
    p = Path(path)
    if p.is_dir():
        digest, files = sha256_dir(p)
        return WeightManifest(
            version, str(p), digest, sum(f.size for f in files.values()), dtype, files=files
        )
    if p.is_file():
        return WeightManifest(version, str(p), sha256_file(p), p.stat().st_size, dtype)
    raise FileNotFoundError(f"weights for version {version}: {p} does not exist")


def verify(manifest: WeightManifest, path: str | os.PathLike[str] | None = None) -> None:
    """Raise :class:`WeightIntegrityError` unless the weights match ``manifest``.

    ``path`` overrides ``manifest.path`` (e.g. a local copy a transport fetched).
    Sizes are checked before hashing so a truncated file fails fast. With ``digest == "none"``
    only presence and sizes are checked (see the module doc).
    """
    if path is None and is_broadcast(manifest):
        raise WeightIntegrityError(
            f"weights v{manifest.version} were broadcast over NCCL ({manifest.path}); no stored copy to load"
        )
    p = Path(path if path is not None else manifest.path)
    tag = f"weights v{manifest.version} at {p}"
    hashed = manifest.digest == "sha256"
    if manifest.files is None:
        if not p.is_file():
            raise WeightFileGone(f"{tag}: file does not exist")
        size = p.stat().st_size
        if size != manifest.size:
            raise WeightIntegrityError(f"{tag}: size {size} != expected {manifest.size}")
        if not hashed:
            return
        got = sha256_file(p)
        if got != manifest.sha256:
            raise WeightIntegrityError(f"{tag}: sha256 {got} != expected {manifest.sha256}")
        return
    if not p.is_dir():
        raise WeightFileGone(f"{tag}: directory does not exist")
    for name, want in sorted(manifest.files.items()):
        fp = p / name
        if not fp.is_file():
            raise WeightFileGone(f"{tag}: missing file {name}")
        size = fp.stat().st_size
        if size != want.size:
            raise WeightIntegrityError(f"{tag}: {name} size {size} != expected {want.size}")
        if not hashed:
            continue
        got = sha256_file(fp)
        if got != want.sha256:
            raise WeightIntegrityError(f"{tag}: {name} sha256 {got} != expected {want.sha256}")
    combined = _combine(manifest.files)
    if hashed and combined != manifest.sha256:
        raise WeightIntegrityError(f"{tag}: file list digest {combined} != expected {manifest.sha256}")
    total = sum(f.size for f in manifest.files.values())
    if total != manifest.size:
        raise WeightIntegrityError(f"{tag}: total size {total} != expected {manifest.size}")


def is_broadcast(manifest: WeightManifest) -> bool:
    """Were these weights broadcast to the actors (NCCL) rather than stored at ``manifest.path``?"""
    return manifest.path.startswith(BROADCAST_SCHEME)


def shm_root(run_dir: str | os.PathLike[str], run_name: str) -> Path:
    """Where the shared-memory transport keeps a run's weights: a per-run directory in /dev/shm.

    Here (not in the learner) so that an actor can tell an allowed weights path from any other:
    the run dir's hash keeps two runs of one name apart, the uid two users.
    """
    tag = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"asyncrl-{os.getuid()}-{run_name}-{tag}"


class WeightTransport(abc.ABC):
    """Moves weight bytes from the learner to the actors. Knows nothing about Redis.

    The learner calls :meth:`publish`, then announces the returned manifest with
    ``ReplayBuffer.publish_weights``; an actor that sees a new version calls :meth:`fetch`
    and loads from the returned local path. Implementations: a shared filesystem
    (``asyncrl.learner``), or anything else (object store, NCCL broadcast...) behind the
    same two calls. This ABC is typed loosely so that ``asyncrl.buffer`` stays torch-free.
    """

    #: Where :meth:`publish` wants the tensors: ``"cpu"`` for host copies (a file or shared memory is
    #: written from them), ``None`` for the learner module's own device (NCCL broadcasts from the GPU).
    #: ``None`` tensors may be the live parameters: the transport reads them inside ``publish`` (no
    #: optimizer step runs meanwhile) and keeps no reference afterwards.
    weights_device: str | None = "cpu"

    @abc.abstractmethod
    def publish(self, version: int, state_dict: Any, dtype: str) -> WeightManifest:
        """Write version ``version``'s weights and return their manifest.

        ``state_dict`` is a mapping name -> tensor, or a zero-argument callable returning
        an iterable of ``(name, tensor)`` pairs (so a sharded engine can stream gathered
        parameters without holding a full copy). The write must be atomic from a reader's
        point of view (write to a temporary name, fsync, then rename): a manifest must
        never point at partially written data.
        """

    @abc.abstractmethod
    def fetch(self, manifest: WeightManifest) -> str:
        """Make the weights of ``manifest`` available locally and return their path.

        Must call :func:`verify` (or equivalent) and raise :class:`WeightIntegrityError`
        rather than return weights that do not match the manifest.
        """

    def delete(self, version: int) -> None:  # noqa: B027 - optional hook, no-op by default
        """Free the storage of an old version (called once the registry no longer lists it)."""

    def stored_versions(self) -> list[int]:
        """The versions whose storage this transport holds (a transport that stores nothing: none)."""
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """The learner is done publishing: release what only lives while it runs (shared memory)."""
