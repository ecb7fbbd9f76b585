"""Manifest paths read from Redis are confined to the run's weight directories (asyncrl.buffer.paths)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from asyncrl.buffer import WeightIntegrityError
from asyncrl.buffer.paths import confine, weight_roots
from asyncrl.buffer.weights import shm_root


@pytest.fixture
def shm_dirs():
    """Directories made under /dev/shm (or the temp dir) by a test, removed after it."""
    made: list[Path] = []

    def make(path: Path, mode: int = 0o700) -> Path:
        path.mkdir(parents=True)
        os.chmod(path, mode)  # whatever the umask: the mode under test
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def test_inside_the_run_is_accepted(tmp_path: Path, shm_dirs) -> None:
    roots = weight_roots(tmp_path / "run", "demo")
    v3 = tmp_path / "run" / "weights" / "v3"
    v3.mkdir(parents=True)
    assert confine(str(v3 / "model.safetensors"), roots) == (v3 / "model.safetensors").resolve()
    # The shared-memory transport's directory of this run, made as the learner makes it (0700).
    ok = shm_dirs(shm_root(tmp_path / "run", "demo")) / "v3" / "model.safetensors"
    assert confine(str(ok), roots) == ok.resolve()


@pytest.mark.parametrize("case", ["other run dir", "longer run name", "name-evil", "tmp name-zz"])
def test_another_shm_directory_is_refused(tmp_path: Path, shm_dirs, case: str) -> None:
    """Each of these matched the old check (the prefix ``asyncrl-<uid>-<run name>-`` only)."""
    run, name, uid = tmp_path / "run", f"foo{os.getpid()}", os.getuid()
    shm_dirs(shm_root(run, name))  # this run's own directory exists: the others are refused anyway
    top = {
        "other run dir": shm_root(tmp_path / "other", name),
        "longer run name": shm_root(run, f"{name}-bar"),
        "name-evil": Path("/dev/shm") / f"asyncrl-{uid}-{name}-evil",
        "tmp name-zz": Path(tempfile.gettempdir()) / f"asyncrl-{uid}-{name}-zz",
    }[case]
    if not top.parent.is_dir():
        pytest.skip(f"no {top.parent} here")
    bad = shm_dirs(top) / "v1" / "model.safetensors"
    with pytest.raises(WeightIntegrityError, match="outside this run's weight directories"):
        confine(str(bad), weight_roots(run, name))


def test_a_shm_directory_others_can_write_is_refused(tmp_path: Path, shm_dirs) -> None:
    """Anyone may create a directory in /dev/shm: one writable by others is not trusted."""
    run = tmp_path / "run"
    root = shm_dirs(shm_root(run, "demo"), mode=0o777)
    with pytest.raises(WeightIntegrityError, match="writable by others"):
        confine(str(root / "v1" / "model.safetensors"), weight_roots(run, "demo"))


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a directory to another user")
def test_a_shm_directory_of_another_user_is_refused(tmp_path: Path, shm_dirs) -> None:
    run = tmp_path / "run"
    root = shm_dirs(shm_root(run, "demo"))
    os.chown(root, 65534, 65534)  # nobody
    with pytest.raises(WeightIntegrityError, match="belongs to uid 65534"):
        confine(str(root / "v1" / "model.safetensors"), weight_roots(run, "demo"))


def test_a_symlink_in_place_of_the_shm_directory_is_refused(tmp_path: Path, shm_dirs) -> None:
    run = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = shm_root(run, "demo")
    link.symlink_to(elsewhere)
    try:
        with pytest.raises(WeightIntegrityError):
            confine(str(link / "v1" / "model.safetensors"), weight_roots(run, "demo"))
    finally:
        link.unlink()


@pytest.mark.parametrize(
    "rel",
    [
        "/etc/passwd",
        "{run}/weights/../config.yaml",
        "{run}/weights",
        "{run}/model/model.safetensors",
        "{other}/weights/v1/model.safetensors",
        "/dev/shm/asyncrl-{uid}-other-0123abcd/v1/model.safetensors",
        "/dev/shm/asyncrl-{uid}-demo-0123abcd/v1/model.safetensors",
        "/dev/shm/asyncrl-{uid}-demo-",
        "/dev/shm/x/asyncrl-{uid}-demo-0123abcd/v1",
    ],
)
def test_outside_the_run_is_refused(tmp_path: Path, rel: str) -> None:
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    path = rel.format(run=run, other=tmp_path / "other", uid=os.getuid())
    with pytest.raises(WeightIntegrityError, match="outside this run's weight directories"):
        confine(path, weight_roots(run, "demo"))


def test_a_symlink_out_of_the_weights_dir_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "weights").mkdir(parents=True)
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    (run / "weights" / "v9").symlink_to(secret)
    with pytest.raises(WeightIntegrityError):
        confine(str(run / "weights" / "v9"), weight_roots(run, "demo"))
