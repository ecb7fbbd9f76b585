"""Where a run's weights may live: manifest paths read from Redis are confined to these directories.

A weight manifest travels through Redis, and anything that can write to Redis could otherwise point an
actor at any file on its host (``/etc/...``, another run's weights, a path with ``..`` or a symlink
out of the weights directory). Actors load a manifest's path only if, fully resolved (symlinks and
``..`` followed), it lies inside one of the run's weight roots:

* ``<run_dir>/weights`` (the filesystem transport);
* the shared-memory transport's directory of this run, :func:`asyncrl.buffer.weights.shm_root`
  (``asyncrl-<uid>-<run name>-<run dir hash>`` under ``/dev/shm``, or the temp dir where there is
  none): exactly that directory, so neither a run whose name extends this one's (``foo-bar`` for
  ``foo``) nor the same name in another run dir qualifies. ``/dev/shm`` and ``/tmp`` are
  world-writable, so anyone can create a directory of that name first: it must also be a real
  directory (not a symlink) owned by this user and writable by nobody else (the learner makes it
  0700), or nothing in it is loaded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from asyncrl.buffer.weights import WeightIntegrityError, shm_root

__all__ = ["weight_roots", "confine"]


def weight_roots(run_dir: str | os.PathLike[str], run_name: str) -> tuple[Path, Path]:
    """(the run's weights directory, its shared-memory directory), as the learner's transports name them."""
    shm = shm_root(run_dir, run_name)
    # The base is resolved (/dev/shm may be a link to /run/shm), the run's own directory is not: a
    # symlink in its place is refused by confine(), not followed.
    return Path(run_dir).resolve() / "weights", shm.parent.resolve() / shm.name


def _check_shm_owner(root: Path) -> None:
    """Raise unless ``root`` is a real directory of this user that nobody else can write to."""
    try:
        st = os.lstat(root)
    except OSError as e:
        raise WeightIntegrityError(f"shared-memory weights directory {root}: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise WeightIntegrityError(f"shared-memory weights directory {root} is not a directory: refused")
    if st.st_uid != os.getuid():
        raise WeightIntegrityError(
            f"shared-memory weights directory {root} belongs to uid {st.st_uid}, not to this user "
            f"({os.getuid()}): refused"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise WeightIntegrityError(
            f"shared-memory weights directory {root} is writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):o}): refused"
        )


def confine(path: str, roots: tuple[Path, Path]) -> Path:
    """``path`` resolved, or :class:`WeightIntegrityError` when it leaves the run's weight roots."""
    weights_dir, shm_dir = roots
    p = Path(path).resolve()
    if p.is_relative_to(weights_dir) and p != weights_dir:
        return p
    if p.is_relative_to(shm_dir) and p != shm_dir:
        _check_shm_owner(shm_dir)
        return p
    raise WeightIntegrityError(
        f"weights path {path!r} (resolved {p}) is outside this run's weight directories "
        f"({weights_dir} and {shm_dir}): refused"
    )
