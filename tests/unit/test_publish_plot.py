"""benchmarks/plot_publish_to_serving.py: the projection the README states, and the plot it writes."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from tests.e2e.procs import ROOT

_spec = importlib.util.spec_from_file_location("plot_pts", ROOT / "benchmarks" / "plot_publish_to_serving.py")
pts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pts)
DATA = json.loads((ROOT / "docs" / "publish_to_serving.json").read_text())


def test_projection_is_the_marginal_rate_from_the_largest_measurement():
    b = np.array([1e6, 2e8, 1.2e9])
    t = np.array([0.02, 0.5, 4.5])
    b_a, t_a, rate = pts.fit(b[::-1], t[::-1])  # order-independent
    assert (b_a, t_a) == (1.2e9, 4.5) and rate == pytest.approx(1e9 / 4.0)
    assert pts.project((b_a, t_a, rate), 1.2e9 + 1e9) == pytest.approx(8.5)


def test_readme_table_numbers(tmp_path):
    text = pts.table(DATA)
    # 7B bf16 = 15.23 GB: 1.30 s + (15.23 - 1.209) GB / 0.947 GB/s = ~16 s (file, the marginal rate
    # 1.007 GB / (1.30 - 0.236) s); shm 0.58 s + 14.02 GB / 2.209 GB/s (1.007 / (0.58 - 0.124)) = ~7 s.
    # 32B (65.5 GB): file 1.30 + 64.29 / 0.947 = ~69 s; shm 0.58 + 64.29 / 2.209 = ~30 s.
    assert "| Qwen2.5-7B bf16 (15 GB, **projected**) | ~16 s | ~7 s |" in text
    assert "| Qwen2.5-32B bf16 (66 GB, **projected**) | ~69 s | ~30 s |" in text
    out = pts.plot(DATA, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
