"""Where a run's weights may live: manifest paths read from Redis are confined to these directories.

A weight manifest travels through Redis, and anything that can write to Redis could otherwise point an
actor at any file on its host (``/etc/...``, another run's weights, a path with ``..`` or a symlink
out of the weights directory). Actors load a manifest's path only if, fully resolved (symlinks and
``..`` followed), it lies inside one of the run's weight roots:

* ``<run_dir>/weights`` (the filesystem transport);
* ``<shm>/asyncrl-<uid>-<run name>-<tag>`` directories directly under ``/dev/shm`` (or the temp dir
  where there is none): the shared-memory transport's per-run directories of this user.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from asyncrl.buffer.weights import WeightIntegrityError

__all__ = ["weight_roots", "confine"]


def _shm_bases() -> list[Path]:
    return [Path(p).resolve() for p in ("/dev/shm", tempfile.gettempdir()) if Path(p).is_dir()]


def weight_roots(run_dir: str | os.PathLike[str], run_name: str) -> tuple[Path, str]:
    """(the run's weights directory, the name prefix of its shared-memory directories)."""
    return Path(run_dir).resolve() / "weights", f"asyncrl-{os.getuid()}-{run_name}-"


def confine(path: str, roots: tuple[Path, str]) -> Path:
    """``path`` resolved, or :class:`WeightIntegrityError` when it leaves the run's weight roots."""
    weights_dir, shm_prefix = roots
    p = Path(path).resolve()
    if p.is_relative_to(weights_dir) and p != weights_dir:
        return p
    for base in _shm_bases():
        if p.is_relative_to(base) and p != base:
            top = p.relative_to(base).parts[0]
            if top.startswith(shm_prefix) and len(top) > len(shm_prefix):
                return p
    raise WeightIntegrityError(
        f"weights path {path!r} (resolved {p}) is outside this run's weight directories "
        f"({weights_dir} and {shm_prefix}* under /dev/shm): refused"
    )
