"""Pruning old checkpoint tags: what cannot be removed is logged and retried, never silently kept."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncrl.learner.checkpoint import prune_checkpoints
from tests.unit.test_weight_transport import _make_undeletable


def _tags(root: Path, steps: list[int]) -> None:
    for s in steps:
        d = root / f"step{s:08d}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 64)


def test_old_tags_go_uncommitted_newer_go_the_kept_stay(tmp_path: Path) -> None:
    _tags(tmp_path, [10, 20, 30, 40, 50])
    (tmp_path / "latest").mkdir()  # not a tag: never touched
    assert prune_checkpoints(tmp_path, "step00000030", keep=2) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step00000020", "step00000030"]


def test_a_tag_that_cannot_be_removed_is_logged_and_retried_at_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _tags(tmp_path, [10, 20, 30])
    undo = _make_undeletable(tmp_path / "step00000010")
    try:
        with caplog.at_level(logging.WARNING, logger="asyncrl.learner.checkpoint"):
            failed = prune_checkpoints(tmp_path, "step00000030", keep=1)
        assert failed == [tmp_path / "step00000010"]
        assert not (tmp_path / "step00000020").exists()  # the others still go
        assert "step00000010 could not be removed" in caplog.text and "retried" in caplog.text
    finally:
        undo()
    _tags(tmp_path, [40])
    assert prune_checkpoints(tmp_path, "step00000040", keep=1) == []  # the next save removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000040"]
