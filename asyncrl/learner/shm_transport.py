"""The shared-memory transport of published weights: :class:`ShmTransport` (``/dev/shm``), for actors on
the learner's machine. Split out of :mod:`asyncrl.learner.publisher`; the layout, the atomic rename and
the manifest are :class:`asyncrl.learner.file_transport.FilesystemTransport`'s.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.learner.file_transport import WEIGHTS_FILE, FilesystemTransport, remove_tree
from asyncrl.learner.safetensors_writer import safetensors_header, write_into
from asyncrl.proc_identity import start_time

__all__ = ["ShmTransport", "reap_orphaned_roots"]

log = logging.getLogger(__name__)

#: In each shm root: the learner that owns it ("<pid> <start time in clock ticks> <pid namespace>"), so
#: a later learner can tell a root whose learner was killed (kill -9: no clean-up ran) from a live one.
OWNER_FILE = ".owner"

#: Write leases (Linux): how ShmTransport proves that a spare file is no longer open or mapped.
_LEASES = hasattr(fcntl, "F_SETLEASE")


@dataclass
class _Mapped:
    """The learner's own read-write descriptor of one of its files, and its shared mapping."""

    fd: int
    mm: mmap.mmap

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view of it is still alive (a failed copy's traceback): unmapped when freed
            pass
        os.close(self.fd)


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

    Writing over the spare through a mapping the learner keeps. ``write()`` into existing tmpfs pages
    runs at the kernel's copy speed (1.2 GB: 168 ms on the 2-core VM with 1, 2 or 3 threads alike),
    a fresh mapping pays a write fault per 4 KiB page (465 ms), and a mapping kept from one recycle
    to the next is a plain memcpy (66 ms, the copy floor). So the first time a spare of the right size
    is recycled the learner maps it (``MAP_POPULATE``, once per file: the few files in rotation are all
    mapped after a few publishes) and keeps that mapping while the file exists; later recycles copy
    the new version into it. The lease is then asked on the descriptor that backs the mapping: the
    kernel counts open files, and a mapping shares its descriptor's, so the learner's own mapping
    never makes the lease fail while any actor's open file or mapping still does. A mapping is
    dropped as soon as its file is unlinked (a busy spare, a second spare, :meth:`cleanup`), so it
    never keeps a removed file's memory alive (files removed some other way are forgotten at the next
    publish). A file of another size is written as before.
    """

    digest = "none"
    fsync = False
    SPARE = ".spare-" + WEIGHTS_FILE

    def __init__(self, root: str | os.PathLike[str], expected_names: set[str] | None = None) -> None:
        super().__init__(root, expected_names)
        os.chmod(self.root, 0o700)
        (self.root / OWNER_FILE).write_text(_identity(os.getpid()) or "")
        reap_orphaned_roots(self.root)
        self._maps: dict[int, _Mapped] = {}  # inode -> the learner's mapping of that file
        self.mapped_writes = 0  # versions copied into a kept mapping (tests, benchmarks)

    # ------------------------------------------------------------------ writing

    def _write(self, path: Path, tensors: dict[str, Any], metadata: dict[str, str]) -> tuple[str, int]:
        self._forget_unlinked()
        head, order, data = safetensors_header(tensors, metadata)
        m = self._mapped_spare(len(head) + data)
        if m is None:
            return super()._write(path, tensors, metadata)
        os.rename(self.root / self.SPARE, path)
        try:
            write_into(m.mm, tensors, head, order)
        except BaseException:  # publish removes the half-written file: its mapping must not outlive it
            self._drop(os.fstat(m.fd).st_ino)
            raise
        self.mapped_writes += 1
        return "", len(head) + data

    def _mapped_spare(self, size: int) -> _Mapped | None:
        """The spare, mapped read-write, if it exists, has exactly ``size`` bytes and nobody else has it
        open or mapped; else None (a busy spare is unlinked; one of another size is left to the
        ``write()`` path, which cuts it to size)."""
        if not _LEASES:
            return None
        spare = self.root / self.SPARE
        try:
            st = os.stat(spare, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if st.st_size != size:
            return None
        m = self._maps.get(st.st_ino)
        fd = m.fd if m is not None else os.open(spare, os.O_RDWR | os.O_NOFOLLOW)
        if not self._lease_free(fd):
            if m is None:
                os.close(fd)
            self._drop(st.st_ino)
            spare.unlink(missing_ok=True)  # a reader still has it: it keeps its bytes
            return None
        if m is None:
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except BaseException:
                os.close(fd)
                raise
            m = self._maps[st.st_ino] = _Mapped(fd, mm)
        return m

    @staticmethod
    def _lease_free(fd: int) -> bool:
        """Granted only while no other open file or mapping of the inode exists (see the class doc);
        released at once."""
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError:
            return False
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True

    def _take_spare(self, path: Path) -> bool:
        spare = self.root / self.SPARE
        try:
            fd = os.open(spare, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            ino = os.fstat(fd).st_ino
            # Another size: the write() path cuts it; the kept mapping would no longer fit it.
            self._drop(ino)
            free = self._lease_free(fd)
        finally:
            os.close(fd)
        if not free:
            spare.unlink(missing_ok=True)  # a reader still has it: it keeps its bytes
            return False
        os.rename(spare, path)
        return True

    # ------------------------------------------------------------------ removal

    def delete(self, version: int) -> None:
        spare = self.root / self.SPARE
        file = self.version_dir(version) / WEIGHTS_FILE
        if _LEASES and not spare.exists():
            try:  # atomic: a reader opening the old path now gets ENOENT, as after a removal
                os.rename(file, spare)
            except OSError:
                pass
        try:  # still there: it is removed below, and so is the learner's mapping of it
            self._drop(os.stat(file, follow_symlinks=False).st_ino)
        except FileNotFoundError:
            pass
        super().delete(version)

    def _forget_unlinked(self) -> None:
        """Drop the mappings of files removed by any other way than :meth:`delete` (a publish that failed
        after its write removes its temporary directory; a person cleaning /dev/shm)."""
        for ino, m in list(self._maps.items()):
            if os.fstat(m.fd).st_nlink == 0:
                self._drop(ino)

    def _drop(self, ino: int) -> None:
        m = self._maps.pop(ino, None)
        if m is not None:
            m.close()

    def cleanup(self) -> None:
        """Remove every version (the run is over; a resumed learner re-publishes its version)."""
        for ino in list(self._maps):
            self._drop(ino)
        errors = remove_tree(self.root)
        if errors:  # shared memory held past the run: say where, so it can be freed by hand
            log.warning("could not remove %s (%d error(s), first: %s): its weights stay in shared memory "
                        "until removed", self.root, len(errors), errors[0])  # fmt: skip

    close = cleanup  # memory is not kept past the learner: a restarted learner re-publishes


def _identity(pid: int) -> str | None:
    """``"<pid> <start time> <pid namespace>"`` of a live process (None: gone). The start time (field 22
    of /proc/<pid>/stat) tells a reused pid apart; the namespace, a process this one cannot see."""
    start = start_time(pid, zombies=True)  # a zombie still holds its pid: not yet free for reuse
    try:
        ns = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return None if start is None else f"{pid} {start} {ns}"


def reap_orphaned_roots(own: Path) -> list[Path]:
    """Remove this user's other shm roots (``asyncrl-<uid>-*`` beside ``own``) whose learner died without
    its clean-up (kill -9, OOM): their weights held ``keep_versions`` model copies of RAM until that run
    was resumed, and for good if it never was. Returns the removed roots.

    Only a root whose owner file names a process of this pid namespace that no longer exists (or is
    another process now) goes: a root without one (being created, another tool) or of a learner in
    another pid namespace (a container sharing /dev/shm) is left alone. A reaped run loses nothing: a
    resumed learner publishes its version again, and an actor that mapped a removed file keeps its bytes.
    """
    own_ns = os.readlink("/proc/self/ns/pid") if os.path.exists("/proc/self/ns/pid") else None
    prefix = f"asyncrl-{os.getuid()}-"
    removed = []
    for root in own.parent.glob(prefix + "*"):
        if root == own or not root.is_dir() or root.is_symlink():
            continue
        try:
            pid, start, ns = (root / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        if own_ns is None or ns != own_ns or _identity(int(pid)) == f"{pid} {start} {ns}":
            continue
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
        errors = remove_tree(root)
        if errors:
            log.warning("could not remove %s of a learner (pid %s) that died without its clean-up (%d "
                        "error(s), first: %s)", root, pid, len(errors), errors[0])  # fmt: skip
            continue
        log.warning("removed %s (%.1f MiB): weights of a learner (pid %s) that died without its clean-up",
                    root, size / 2**20, pid)  # fmt: skip
        removed.append(root)
    return removed
