"""Sweep-file loading: YAML errors and step marks a cell cannot reach are ConfigErrors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.sweep_spec import load_spec

REPO = Path(__file__).resolve().parents[2]
GRID = "  grid: {max_staleness: [1], objective: [full]}\n"


def test_a_duplicate_key_in_the_sweep_file_is_a_config_error(tmp_path: Path):
    p = tmp_path / "s.yaml"
    p.write_text(f"sweep:\n{GRID}  objectives:\n    full: []\n    full: [learner.lr=1]\n")
    with pytest.raises(ConfigError) as e:  # was yaml's ConstructorError, a traceback
        load_spec(p)
    assert (
        str(e.value)
        == f"sweep config {p}: not a valid YAML file: found duplicate key full (line 5, column 5)"
    )
    p.write_text(f"sweep:\n{GRID}\tobjectives: {{full: []}}\n")  # a tab
    with pytest.raises(
        ConfigError, match=rf"^sweep config {p}: not a valid YAML file: .*\(line 3, column 1\)"
    ):
        load_spec(p)
