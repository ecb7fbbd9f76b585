"""summary.json of `asyncrl run` (asyncrl.orchestrator.write_summary): a resumed run's rate is its own."""

from __future__ import annotations

import json

import pytest

from asyncrl.orchestrator import write_summary


def _rec(step: int, t: float, tokens: int, reward: float = 0.5) -> dict:
    return {"step": step, "version": step, "step_time": t, "tokens": tokens, "reward_mean": reward,
            "staleness_max": 1}  # fmt: skip


def test_a_resumed_start_rates_only_its_own_steps(tmp_path) -> None:
    # First start: steps 1-10 at t 100..109, 1000 tokens each. The resume starts at t 500 and trains
    # steps 11-15 by t 510, 400 tokens each.
    records = [_rec(s, 99.0 + s, 1000) for s in range(1, 11)] + [
        _rec(s, 495.0 + s, 400) for s in range(11, 16)
    ]
    out = write_summary(tmp_path, records, start=500.0, end=510.0, extra={"status": "finished"})
    assert out["steps"] == 15 and out["trained_tokens"] == 12_000 and out["wall_s"] == 10.0
    assert out["trained_tokens_per_s"] == pytest.approx(2000 / 10.0)  # before: 12000 / 10
    assert json.loads((tmp_path / "summary.json").read_text()) == out
    # A first start: every step counts.
    out = write_summary(tmp_path, records[:10], start=99.5, end=110.0, extra={})
    assert out["trained_tokens_per_s"] == pytest.approx(10_000 / 10.5)
    assert write_summary(tmp_path, [], start=0.0, end=1.0, extra={})["trained_tokens_per_s"] == 0.0
