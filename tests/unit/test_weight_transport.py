"""The learner's weight transports: streamed safetensors + hash-while-writing, one fsync, shm.

No Redis, no vLLM: the bytes on disk against safetensors' own reader and hashlib.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from asyncrl.buffer import WeightIntegrityError, WeightManifest, sha256_file, verify
from asyncrl.learner.publisher import (
    FilesystemTransport,
    ShmTransport,
    make_transport,
    shm_root,
    write_safetensors,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "b.f32": torch.randn(7, 5, generator=g),
        "a.bf16": torch.randn(3, 33, generator=g).to(torch.bfloat16),
        "c.f16": torch.randn(4, generator=g).to(torch.float16),
        "d.i64": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "e.bool": torch.rand(5, generator=g) > 0.5,
        "f.empty": torch.empty(0, 3),
        "g.scalar": torch.tensor(3.5),
        # a non-contiguous view is written as its logical (contiguous) values
        "h.t": torch.randn(4, 6, generator=g).t().contiguous(),
    }


def test_streamed_file_is_safetensors_and_hash_equals_a_reread(tmp_path: Path) -> None:
    ts = _tensors()
    path = tmp_path / "x.safetensors"
    sha, size = write_safetensors(path, ts, {"asyncrl_version": "7", "format": "pt"})
    assert size == path.stat().st_size
    assert sha == sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_file(str(path))
    assert back.keys() == ts.keys()
    for k, t in ts.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"asyncrl_version": "7", "format": "pt"}
    # header is 8-byte aligned (safetensors' own writer pads the same way)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert n % 8 == 0


def test_no_digest_mode_writes_identical_bytes(tmp_path: Path) -> None:
    ts = _tensors(1)
    a, b = tmp_path / "a", tmp_path / "b"
    sha, _ = write_safetensors(a, ts, {"k": "v"})
    empty, size = write_safetensors(b, ts, {"k": "v"}, digest=False, fsync=False)
    assert empty == "" and a.read_bytes() == b.read_bytes() and size == b.stat().st_size


@pytest.mark.parametrize(
    ("min_bytes", "cpus", "threaded"), [(0, {0, 1}, True), (0, {0}, False), (1 << 40, {0, 1}, False)]
)
def test_threaded_hash_is_the_same_digest_and_used_only_with_a_spare_cpu(
    tmp_path: Path, monkeypatch, min_bytes: int, cpus: set, threaded: bool
) -> None:
    import asyncrl.learner.safetensors_writer as writer

    seen: list[bool] = []

    class Spy(writer._Sha256):
        def __init__(self, threaded: bool) -> None:
            seen.append(threaded)
            super().__init__(threaded)

    monkeypatch.setattr(writer, "_HASH_THREAD_MIN", min_bytes)
    monkeypatch.setattr(writer, "_Sha256", Spy)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    monkeypatch.setattr(writer, "_CHUNK", 64)  # many queued chunks per tensor
    ts = _tensors(2)
    sha, _ = write_safetensors(tmp_path / "x", ts, {"k": "v"})
    assert seen == [threaded]
    assert sha == hashlib.sha256((tmp_path / "x").read_bytes()).hexdigest()


def test_threaded_sha256_matches_hashlib_on_random_chunks() -> None:
    from asyncrl.learner.safetensors_writer import _Sha256

    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g).numpy().tobytes()
    cuts = sorted(torch.randint(0, len(data), (200,), generator=g).tolist())
    h = _Sha256(threaded=True)
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        h.update(memoryview(data)[a:b])
    assert h.hexdigest() == hashlib.sha256(data).hexdigest()
    h.close()  # idempotent after hexdigest


def test_unsupported_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "c", {"z": torch.zeros(2, dtype=torch.complex64)}, {})


def test_file_transport_one_fsync_manifest_and_tamper(tmp_path: Path, monkeypatch) -> None:
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    tr = FilesystemTransport(tmp_path / "w", expected_names={"b.f32", "a.bf16"})
    ts = {"b.f32": torch.randn(3, 3), "a.bf16": torch.randn(2).to(torch.bfloat16), "extra": torch.ones(1)}
    with pytest.raises(ValueError, match="not float32"):
        tr.publish(1, ts, "float32")  # a.bf16 is not the announced dtype
    ts["a.bf16"] = ts["a.bf16"].float()
    m = tr.publish(1, lambda: iter(ts.items()), "float32")
    tr.wait_durable()
    assert len(calls) == 1  # the weights file, once; no directory fsyncs
    assert m.digest == "sha256" and m.sha256 == sha256_file(m.path) and m.size == Path(m.path).stat().st_size
    assert set(load_file(m.path)) == {"b.f32", "a.bf16"}  # only the served names
    on_disk = WeightManifest.from_bytes((Path(m.path).parent / "manifest.msgpack").read_bytes())
    assert on_disk == m
    verify(m)
    data = bytearray(Path(m.path).read_bytes())
    data[-1] ^= 0xFF
    Path(m.path).write_bytes(bytes(data))
    with pytest.raises(WeightIntegrityError, match="sha256"):
        verify(m)
    with pytest.raises(ValueError, match="no tensor"):
        tr.publish(2, {"b.f32": torch.ones(1)}, "float32")
    assert not list((tmp_path / "w").glob(".tmp-*"))  # a failed publish leaves nothing behind


def test_file_transport_fsyncs_after_the_publish_one_at_a_time_and_raises_a_failed_one(
    tmp_path: Path, monkeypatch
) -> None:
    # The real fsync, held until released (os.fsync is only wrapped, to see when and on what it runs;
    # a disk that refuses an fsync is the one thing stood in for, at the end).
    release, started, failing = threading.Event(), threading.Event(), threading.Event()
    synced: list[tuple[int, str]] = []
    real = os.fsync

    def held_fsync(fd: int) -> None:
        started.set()
        assert release.wait(10.0)
        if failing.is_set():
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)
        synced.append((os.fstat(fd).st_ino, threading.current_thread().name))

    monkeypatch.setattr(os, "fsync", held_fsync)
    tr = FilesystemTransport(tmp_path / "w")
    w1 = torch.randn(64, 64)
    m1 = tr.publish(1, {"w": w1}, "float32")
    assert started.wait(10.0) and synced == []  # published (readable, verified) while it is held
    verify(m1)
    assert torch.equal(load_file(m1.path)["w"], w1)
    # The next publish waits for it: one fsync at a time.
    second = threading.Thread(target=lambda: tr.publish(2, {"w": torch.randn(64, 64)}, "float32"))
    second.start()
    second.join(0.3)
    assert second.is_alive() and not (tmp_path / "w" / "v2").exists()
    release.set()
    second.join(10.0)
    assert not second.is_alive()
    tr.wait_durable()
    inodes = [Path(m1.path).stat().st_ino, (tmp_path / "w" / "v2" / "model.safetensors").stat().st_ino]
    assert synced == [(ino, "asyncrl-fsync") for ino in inodes]  # each file once, off the publishing thread
    # A failed fsync (the disk refused the data) stops the run at the next publish, naming the version.
    failing.set()
    tr.publish(3, {"w": torch.ones(2)}, "float32")
    with pytest.raises(OSError, match="fsync of published weights v3 failed"):
        tr.publish(4, {"w": torch.ones(2)}, "float32")
    failing.clear()
    tr.publish(4, {"w": torch.ones(2)}, "float32")  # reported once; the next one runs normally
    tr.close()  # waits for v4's
    assert len(synced) == 3


def test_shm_transport_no_fsync_no_hash_sizes_checked(tmp_path: Path, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(fd))
    root = shm_root(tmp_path, "unit")
    tr = ShmTransport(root)
    try:
        m = tr.publish(3, {"w": torch.ones(4, 4)}, "float32")
        assert calls == [] and m.digest == "none" and m.sha256 == ""
        assert Path(m.path).is_relative_to(root)
        if Path("/dev/shm").is_dir():
            assert str(root).startswith("/dev/shm/")
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        with safe_open(m.path, framework="pt") as fh:
            assert fh.metadata()["asyncrl_version"] == "3"
        verify(m)
        back = WeightManifest.from_bytes(m.to_bytes())
        assert back == m and back.digest == "none"
        with open(m.path, "r+b") as f:
            f.truncate(m.size - 4)
        with pytest.raises(WeightIntegrityError, match="size"):
            verify(m)
    finally:
        tr.cleanup()
    assert not root.exists()


def test_shm_root_that_cannot_be_removed_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The end of a run frees the shared memory; what cannot be removed is named in a warning (it was
    rmtree(ignore_errors=True): the weights stayed in RAM unseen)."""
    root = shm_root(tmp_path, "unremovable")
    tr = ShmTransport(root)
    m = tr.publish(1, {"w": torch.ones(4, 4)}, "float32")
    undo = _make_undeletable(Path(m.path).parent)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncrl.learner.shm_transport"):
            tr.cleanup()
        assert f"could not remove {root}" in caplog.text and "shared memory" in caplog.text
        assert Path(m.path).exists()
    finally:
        undo()
    shutil.rmtree(root)


def test_manifest_digest_field_is_validated_and_defaults_to_sha256() -> None:
    d = WeightManifest(1, "/x", "ab", 3, "float32").to_dict()
    assert "digest" not in d  # older readers see the schema they know
    assert WeightManifest.from_dict(d).digest == "sha256"
    with pytest.raises(ValueError, match="manifest.digest"):
        WeightManifest.from_dict({**d, "digest": "md5"})
    with pytest.raises(ValueError, match="manifest.digest"):
        WeightManifest(1, "/x", "ab", 3, "float32", digest="crc")


def test_make_transport_picks_shm_only_for_local_runs(tmp_path: Path) -> None:
    names = {"w"}
    remote = make_transport("auto", tmp_path, "r", names, local=False)
    assert type(remote) is FilesystemTransport and remote.root == tmp_path / "weights"
    local = make_transport("auto", tmp_path, "r", names, local=True)
    try:
        assert isinstance(local, ShmTransport) == Path("/dev/shm").is_dir()
        assert type(make_transport("file", tmp_path, "r", names, local=True)) is FilesystemTransport
    finally:
        if isinstance(local, ShmTransport):
            local.cleanup()
    with pytest.raises(ValueError, match="learner.weight_transport"):
        make_transport("nfs", tmp_path, "r", names, local=True)


def test_shm_transport_overwrites_a_deleted_version_only_when_no_reader_has_it(tmp_path: Path) -> None:
    """ShmTransport recycles a deleted version's tmpfs file (no page allocation on the next publish),
    but never one that a reader still has open or mapped: that reader keeps its bytes."""
    import mmap

    tr = ShmTransport(shm_root(tmp_path, "spare"))
    try:
        ts = {"w": torch.randn(64, 64)}
        m1 = tr.publish(1, ts, "float32")
        ino1 = os.stat(m1.path).st_ino
        tr.delete(1)
        assert not Path(m1.path).exists() and (tr.root / tr.SPARE).exists()
        ts2 = {"w": torch.randn(32, 64), "b": torch.randn(3)}  # smaller: the file is cut to size
        m2 = tr.publish(2, ts2, "float32")
        assert os.stat(m2.path).st_ino == ino1 and not (tr.root / tr.SPARE).exists()
        write_safetensors(tmp_path / "fresh", ts2, {"format": "pt", "asyncrl_version": "2"}, fsync=False)
        assert Path(m2.path).read_bytes() == (tmp_path / "fresh").read_bytes()
        verify(m2)
        # A reader maps v2 and closes its descriptor (as safetensors does); v2 is deleted under it.
        with open(m2.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        before = bytes(mapped)
        tr.delete(2)
        m3 = tr.publish(3, {"w": torch.randn(32, 64), "b": torch.randn(3)}, "float32")
        ino3 = os.stat(m3.path).st_ino
        assert ino3 != ino1 and not (tr.root / tr.SPARE).exists()  # not overwritten but unlinked
        assert bytes(mapped) == before  # the reader's version is intact
        mapped.close()
        tr.delete(3)
        m4 = tr.publish(4, ts, "float32")  # v3's file has no reader: recycled
        assert os.stat(m4.path).st_ino == ino3 and load_file(m4.path)["w"].equal(ts["w"])
    finally:
        tr.cleanup()


def test_shm_transport_copies_recycled_versions_into_the_mapping_it_keeps(tmp_path: Path) -> None:
    """From a file's first recycle on, the learner keeps a read-write mapping of it and copies later
    versions into it (a memcpy, not write() calls): every file is byte for byte what write_safetensors
    writes. The lease is asked on the descriptor behind that mapping, so the learner's own mapping never
    blocks a recycle, while a reader's mapping still does; the mapping of an unlinked file is dropped,
    and a version of another size goes the write() way."""
    import mmap

    tr = ShmTransport(shm_root(tmp_path, "mapped"))

    def weights(v: int, rows: int = 64) -> dict:
        g = torch.Generator().manual_seed(v)
        return {"w": torch.randn(rows, 64, generator=g), "b": torch.randn(7, generator=g)}

    def check(m, v: int, rows: int = 64) -> None:
        ref = tmp_path / f"ref{v}"
        write_safetensors(ref, weights(v, rows), {"format": "pt", "asyncrl_version": str(v)}, fsync=False)
        assert Path(m.path).read_bytes() == ref.read_bytes()
        verify(m)

    try:
        ms = {}
        for v in range(6):  # one version kept, as Publisher with keep_versions=1: publish v, delete v-1
            ms[v] = tr.publish(v, weights(v), "float32")
            check(ms[v], v)
            if v:
                tr.delete(v - 1)
        # v0 and v1 are new files; v2..v5 went into the two files' kept mappings.
        assert tr.mapped_writes == 4 and len(tr._maps) == 2
        inos = {5: os.stat(ms[5].path).st_ino}
        # A reader maps v5 and closes its descriptor (as safetensors does); v5 is deleted under it.
        with open(ms[5].path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        before = bytes(mapped)
        ms[6] = tr.publish(6, weights(6), "float32")  # into v4's file: nobody reads it
        check(ms[6], 6)
        assert tr.mapped_writes == 5
        tr.delete(5)
        ms[7] = tr.publish(7, weights(7), "float32")  # v5's file is still mapped by the reader
        check(ms[7], 7)
        assert tr.mapped_writes == 5 and os.stat(ms[7].path).st_ino != inos[5]
        assert inos[5] not in tr._maps and len(tr._maps) == 1  # unlinked: the learner's mapping is gone
        assert bytes(mapped) == before  # the reader's version is intact
        mapped.close()
        tr.delete(6)
        ms[8] = tr.publish(8, weights(8), "float32")
        check(ms[8], 8)
        assert tr.mapped_writes == 6
        tr.delete(7)
        ms[9] = tr.publish(9, weights(9, rows=32), "float32")  # another size: write(), cut to size
        check(ms[9], 9, rows=32)
        assert tr.mapped_writes == 6 and len(tr._maps) == 1
        # A mapped file removed behind the transport's back (v8's, still served) is forgotten at the
        # next publish: its memory is not kept alive by the learner.
        os.unlink(ms[8].path)
        ms[10] = tr.publish(10, weights(10), "float32")
        check(ms[10], 10)
        assert not tr._maps
    finally:
        tr.cleanup()
    assert not tr._maps and not tr.root.exists()


def _make_undeletable(version_dir: Path):
    """Make the version's file impossible to remove, for real, and return the undo. A read-only
    directory stops a normal user; root ignores permissions, so as root the file gets the immutable
    attribute (chattr +i: EPERM for everyone, root included). Skipped where neither is possible."""
    if os.geteuid() != 0:
        version_dir.chmod(0o555)
        return lambda: version_dir.chmod(0o755)
    file = version_dir / "model.safetensors"
    chattr = shutil.which("chattr")
    r = subprocess.run([chattr, "+i", str(file)], capture_output=True, text=True) if chattr else None
    if r is None or r.returncode != 0:
        pytest.skip(
            f"running as root and chattr +i is refused here: {r.stderr.strip() if r else 'no chattr'}"
        )
    return lambda: subprocess.run([chattr, "-i", str(file)], check=True)


def test_a_version_that_cannot_be_removed_is_logged_counted_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Freeing a version is cleanup in the learner's step loop: it must not raise, but a failure must not
    be silent either (before: ``rmtree(ignore_errors=True)``, and an undeletable version kept a full
    model copy on the disk for good). It is logged naming the directory, counted, still listed by
    stored_versions (a successor's first publish sweeps it), and retried after the next publish until
    it goes."""
    tr = FilesystemTransport(tmp_path / "w")
    for v in (1, 2):
        tr.publish(v, {"w": torch.ones(4)}, "float32")
    v1 = tr.version_dir(1)
    undo = _make_undeletable(v1)
    try:
        caplog.set_level(logging.INFO, logger="asyncrl.learner.file_transport")
        tr.delete(1)  # returns: nothing raises into the step loop
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and str(v1) in r.getMessage()]
        assert len(warned) == 1 and "could not remove" in warned[0].getMessage(), caplog.text
        assert v1.is_dir() and tr.delete_failures == 1 and tr.undeleted() == [v1]
        assert tr.stored_versions() == [1, 2]
        tr.delete(99)  # a version already gone is no failure
        assert tr.delete_failures == 1
        # Still stuck: the free after the next publish retries it (once), and counts it again.
        tr.publish(3, {"w": torch.ones(4)}, "float32")
        tr.delete(2)
        assert not tr.version_dir(2).exists() and v1.is_dir() and tr.delete_failures == 2
    finally:
        undo()
    tr.publish(4, {"w": torch.ones(4)}, "float32")
    tr.delete(3)
    assert not v1.exists() and tr.undeleted() == [] and tr.stored_versions() == [4]
    assert f"removed {v1} after 2 failed attempt(s)" in caplog.text
    tr.close()
