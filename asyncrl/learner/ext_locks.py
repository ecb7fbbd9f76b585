"""Stale build locks of torch's C++ extensions, cleared before DeepSpeed loads its ops.

Why: DeepSpeed loads its CPU ops (the shared-memory comm op on CPU) through
``torch.utils.cpp_extension.load``, which takes a lock file in the op's build directory
(``torch.utils.file_baton.FileBaton``: created with O_EXCL, its descriptor open while held, removed on
release) even when the op is already built. A learner stopped during that load (a SIGTERM or Ctrl-C
in a run's first seconds, kill -9, the OOM killer) leaves the file behind, and every later learner on
the machine, of any run, waits on it for ever without a word (FileBaton.wait polls while the file
exists). Seen on this VM: a run stopped at its start hung the learners of every run after it for 22
minutes, until the file was deleted by hand.

Invariant used: a live holder has the lock file open (FileBaton keeps the descriptor of its O_EXCL
create until release), so a lock that no process has open is stale. A lock younger than
``MIN_AGE_S`` is left alone: FileBaton.release closes the descriptor before it removes the file, and
removing it in between would make that release fail. Only locks owned by this process's user are
judged: their creator, the holder, was one of this user's processes, whose descriptors /proc shows.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["MIN_AGE_S", "clear_stale_extension_locks", "extensions_root"]

#: A lock file no process has open is removed only once it is this old (see the module doc).
MIN_AGE_S = 5.0


def extensions_root() -> Path:
    """Where torch builds its extensions (``TORCH_EXTENSIONS_DIR``, else its default root): the op
    build directories are one level (``TORCH_EXTENSIONS_DIR``) or two levels (``py311_cpu/``) below."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _open_anywhere(files: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which of ``files`` ((st_dev, st_ino) pairs) some process whose descriptors this user can read has
    open. By inode, not path: a holder that opened the file through a bind mount shows another path."""
    held: set[tuple[int, int]] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except (FileNotFoundError, PermissionError):  # exited meanwhile; another user's
            continue
        for fd in fds:
            try:
                st = os.stat(f"{fd_dir}/{fd}")
            except OSError:  # closed meanwhile
                continue
            if (st.st_dev, st.st_ino) in files:
                held.add((st.st_dev, st.st_ino))
    return held


#: File systems that machines (or containers) share: a lock there may be held by a process this /proc
#: does not show, so it is removed only at NETWORK_MIN_AGE_S (longer than any op build).
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "gpfs", "beegfs",
                        "fuse.sshfs", "fuse.glusterfs", "fuse.ceph", "9p", "virtiofs"})  # fmt: skip
NETWORK_MIN_AGE_S = 600.0


def _fs_type(path: Path) -> str:
    """The file-system type of ``path``'s mount (the longest mount point above it, /proc/mounts)."""
    best, kind = "", ""
    target = str(path.resolve())
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return ""
    return kind


def clear_stale_extension_locks(root: Path | None = None, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove the build locks under ``root`` (default :func:`extensions_root`) of this user that no
    process holds, once they are ``min_age_s`` old (an unheld younger one is waited for: a learner
    restarted right after its predecessor died would find it young); returns the removed paths, each
    logged as a warning. Linux only (it reads /proc); elsewhere nothing is removed."""
    if not sys.platform.startswith("linux"):
        return []
    root = root if root is not None else extensions_root()
    if root.exists() and _fs_type(root) in NETWORK_FS:
        min_age_s = max(min_age_s, NETWORK_MIN_AGE_S)
    removed: list[Path] = []
    waited_logged = False
    while True:
        locks: dict[Path, os.stat_result] = {}
        for p in (*root.glob("*/lock"), *root.glob("*/*/lock")):
            try:
                locks[p] = p.stat()
            except FileNotFoundError:  # released meanwhile
                continue
        if not locks:
            return removed
        held = _open_anywhere({(st.st_dev, st.st_ino) for st in locks.values()})
        young = 0.0  # the longest an unheld lock still has to age
        for p, st in locks.items():
            if (st.st_dev, st.st_ino) in held or st.st_uid != os.getuid():
                continue
            age = time.time() - st.st_mtime
            if age < min_age_s:
                young = max(young, min_age_s - age)
                if min_age_s - age > 5.0 and not waited_logged:
                    waited_logged = True
                    log.warning("waiting up to %.0f s for the build lock %s: no process here holds it (one on "
                                "another machine sharing %s may); removed then", min_age_s - age, p, root)  # fmt: skip
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            log.warning("removed a stale build lock of a torch extension, %.0f s old, held by no process: %s "
                        "(left by a process stopped while it loaded the op: every later load waited on it)",
                        age, p)  # fmt: skip
            removed.append(p)
        if young <= 0.0:
            return removed
        time.sleep(min(young, 0.5))
