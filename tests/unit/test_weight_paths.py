"""Manifest paths read from Redis are confined to the run's weight directories (asyncrl.buffer.paths)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.buffer import WeightIntegrityError
from asyncrl.buffer.paths import confine, weight_roots


def test_inside_the_run_is_accepted(tmp_path: Path) -> None:
    roots = weight_roots(tmp_path / "run", "demo")
    v3 = tmp_path / "run" / "weights" / "v3"
    v3.mkdir(parents=True)
    assert confine(str(v3 / "model.safetensors"), roots) == (v3 / "model.safetensors").resolve()
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    ok = shm / f"asyncrl-{os.getuid()}-demo-0123abcd" / "v3" / "model.safetensors"
    assert confine(str(ok), roots) == ok.resolve()


@pytest.mark.parametrize(
    "rel",
    [
        "/etc/passwd",
        "{run}/weights/../config.yaml",
        "{run}/weights",
        "{run}/model/model.safetensors",
        "{other}/weights/v1/model.safetensors",
        "/dev/shm/asyncrl-{uid}-other-0123abcd/v1/model.safetensors",
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
