"""The learner loop end to end on real Redis + real DeepSpeed (CPU): records, delivery, DP, resume.

- DP 1 (in-process) and DP 2 (torchrun, 2 CPU ranks) train one step on the same groups, with a token
  budget that forces a padding micro-batch on one rank, and must publish the same v1 weights.
- kill -9 between checkpoints, then resume: every group is trained exactly once relative to the
  restored checkpoint (none lost, none twice), and versions stay monotonic.
- A stop request finishes the step, checkpoints and acknowledges.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.buffer import ReplayBuffer
from asyncrl.buffer.admission import admission_bound_formula
from asyncrl.config import to_yaml
from asyncrl.learner.batching import plan_mini_batch
from asyncrl.learner.checkpoint import read_latest
from asyncrl.learner.logprobs import load_hf_model
from asyncrl.learner.loop import learn
from asyncrl.learner.records import DISCARDED_FILE, LEDGER_FILE, METRICS_FILE, StepRecord, read_jsonl
from asyncrl.tinymodel import resolve_model_path
from tests.integration.learner_helpers import child_env, dist_env, free_port, sample_groups, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    d = tmp_path_factory.mktemp("sampler")
    # Same spec and seed as tiny_config -> the same initial weights as every learner run here.
    return load_hf_model(resolve_model_path(tiny_config(d), d))


def _write_cfg(cfg, path: Path) -> Path:
    path.write_text(to_yaml(cfg))
    return path


def _weights(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "weights" / f"v{version}" / "model.safetensors"))


def _delta(run_dir: Path) -> torch.Tensor:
    w0, w1 = _weights(run_dir, 0), _weights(run_dir, 1)
    return torch.cat([(w1[k] - w0[k]).reshape(-1) for k in sorted(w0)])


def test_dp1_and_dp2_train_the_same_step(redis_url, redis_client, run_name, sampler, tmp_path) -> None:
    # 9 sequences over 2 ranks: with this budget one rank runs a padding micro-batch.
    groups = sample_groups(sampler, 3, group_size=3, max_tokens=8, temperature=0.7, seed=7)
    lengths = [len(g.prompt_token_ids) + c.num_tokens for g in groups for c in g.completions]
    budget = next(b for b in range(28, 400, 2)
                  if any(mb == [] for rp in plan_mini_batch(lengths, range(len(lengths)), 2, b) for mb in rp))  # fmt: skip
    runs = {}
    for world in (1, 2):
        name = f"{run_name}-dp{world}"
        rdir = tmp_path / name
        # ZeRO-3 + exact prox: the most collective-heavy path (gathered forwards, sharded publish).
        cfg = tiny_config(rdir, redis_url, name, lr=1e-2, grad_clip=0.0, adam_eps=1.0, zero_stage=3,
                          exact_prox=True, micro_batch_tokens=budget, checkpoint_every=5)  # fmt: skip
        cfg.run.max_steps = 1
        cfg.buffer.groups_per_step = 3
        cfg.actors.group_size = 3  # the learner validates the group size against the run
        buf = ReplayBuffer(redis_client, name)
        for g in groups:
            buf.put(g)
        if world == 1:
            dist_env()
            state = learn(cfg, rdir, start_time=time.time() - 100.0)
            assert state.step == 1 and state.version == 1
        else:
            port = free_port()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                   "--master_addr", "127.0.0.1", "--master_port", str(port),
                   "-m", "asyncrl.learner", "--config", str(_write_cfg(cfg, tmp_path / "dp2.yaml"))]  # fmt: skip
            p = subprocess.run(cmd, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
        stats = buf.stats()
        assert stats["pending"] == 0 and stats["depth"] == 0 and stats["version"] == 1
        recs = read_jsonl(rdir / METRICS_FILE)
        assert len(recs) == 1
        runs[world] = (rdir, recs[0])
        buf.delete_run()

    rec1, rec2 = runs[1][1], runs[2][1]
    assert set(rec1) == set(StepRecord.field_names())
    assert (
        rec1["step"] == 1 and rec1["version"] == 1 and rec1["groups"] == 3 and rec1["trained_group_ids"] == 3
    )
    assert rec1["time"] >= 100.0 and rec1["checkpointed"] and rec1["published"]
    assert abs(rec1["ratio_mean"] - 1) < 1e-5 and rec1["mismatch_kl"] < 1e-6
    assert rec1["staleness_max"] == 0 and rec1["dropped_stale"] == 0 and rec1["skipped_nonfinite"] == 0
    assert rec2["padding_micro_batches"] >= 1  # the padding path ran on some rank
    assert rec1["tokens"] == rec2["tokens"]
    assert abs(rec1["loss"] - rec2["loss"]) <= 1e-5 * max(1.0, abs(rec1["loss"]))
    assert abs(rec1["grad_norm"] - rec2["grad_norm"]) <= 1e-5 * rec1["grad_norm"]
    d1, d2 = _delta(runs[1][0]), _delta(runs[2][0])
    assert d1.norm() > 1e-4
    rel = float((d1 - d2).norm() / d1.norm())
    assert rel < 1e-5, rel
    ledger = read_jsonl(runs[2][0] / LEDGER_FILE)
    assert sorted(ledger[0]["group_ids"]) == sorted(g.group_id for g in groups)

    # `asyncrl export` from the 2-rank ZeRO-3 checkpoint (sharded parameters reassembled by DeepSpeed's
    # zero_to_fp32) once the published file is gone equals what the actors were served for v1.
    from asyncrl.export import export_version, weight_sources

    published = _weights(runs[2][0], 1)
    shutil.rmtree(runs[2][0] / "weights" / "v1")
    assert {(s.kind, s.since_publish) for s in weight_sources(runs[2][0]) if s.version == 1} == {
        ("checkpoint", 0)
    }
    (runs[2][0] / "config.yaml").write_text(to_yaml(cfg))  # `asyncrl run` writes it; learn alone does not
    out = export_version(runs[2][0], tmp_path / "export-z3", version=1)
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    assert set(exported) == set(published) - {"lm_head.weight"} or set(exported) == set(published)
    for k, v in exported.items():
        assert torch.equal(v, published[k]), k


def _wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    t0 = time.monotonic()
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"learner exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_kill9_between_checkpoints_then_resume_trains_each_group_once(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=2)
    cfg.buffer.max_staleness = 100
    buf = ReplayBuffer(redis_client, run_name)
    first = sample_groups(sampler, 6, max_tokens=6, seed=11)
    for g in first:
        buf.put(g)
    log = open(tmp_path / "learner.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.learner", "--config", str(_write_cfg(cfg, tmp_path / "c.yaml"))],
                            env=child_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        # 6 groups = 3 steps; checkpoints at step 2; then it blocks on the empty buffer.
        _wait_for(lambda: len(read_jsonl(rdir / LEDGER_FILE)) >= 3, 240, "3 trained steps", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    tag_dir, ckpt = read_latest(rdir)
    assert ckpt.step == 2 and ckpt.version == 2 and len(ckpt.group_ids) == 4
    assert buf.stats()["pending"] == 2  # step 3's groups: trained, never acknowledged
    second = sample_groups(sampler, 6, max_tokens=6, seed=12)
    for g in second:
        buf.put(g)

    cfg.run.max_steps = 6
    dist_env()
    state = learn(cfg, rdir, resume=True)

    ledger = read_jsonl(rdir / LEDGER_FILE)
    sessions = list(dict.fromkeys(line["session"] for line in ledger))
    assert len(sessions) == 2
    # The killed lineage's step 3 was redone: its line moved to the discarded audit trail.
    before = [line for line in ledger if line["session"] == sessions[0]] + read_jsonl(rdir / DISCARDED_FILE)
    after = [line for line in ledger if line["session"] == sessions[1]]
    assert [line["step"] for line in before] == [1, 2, 3] and [line["step"] for line in after] == [3, 4, 5, 6]
    in_ckpt = {gid for line in before if line["step"] <= ckpt.step for gid in line["group_ids"]}
    assert in_ckpt == set(ckpt.group_ids)
    trained_after = [gid for line in after for gid in line["group_ids"]]
    all_ids = {g.group_id for g in first + second}
    assert len(trained_after) == len(set(trained_after)), "a group was trained twice after the resume"
    everything = [gid for line in ledger for gid in line["group_ids"]]
    assert len(everything) == len(set(everything)) == 12, "trained.jsonl lists each group once"
    assert set(trained_after) == all_ids - in_ckpt, "lost or repeated groups relative to the checkpoint"
    assert set(before[2]["group_ids"]) <= set(trained_after)  # the killed step's groups were redone
    # v3 was published by the lost lineage -> the resume forks to v4, then 4 steps -> v8.
    assert state.step == 6 and state.version == 8 and buf.version() == 8
    assert buf.manifest_versions() == [6, 7, 8]  # keep_versions = 3
    stats = buf.stats()
    assert stats["pending"] == 0 and stats["depth"] == 0
    # The fork skipped v3 (a jump of 2 from the checkpoint's v2): admission debits 2 versions' worth of
    # slots, so its window is that of an unforked run at step 6, not 2 versions (4 groups) wider.
    assert stats["version_skew"] == 2 and stats["credits"] == -2 * 2
    eta = cfg.buffer.max_staleness
    assert admission_bound_formula(stats["version"], eta, 2, stats["credits"]) == (state.step + eta + 1) * 2
    assert read_latest(rdir)[1].version_skew == 2  # carried by the checkpoint
    assert [r["step"] for r in read_jsonl(rdir / METRICS_FILE)] == [1, 2, 3, 4, 5, 6]
    buf.delete_run()


def test_filters_fill_window_and_stop_event(redis_url, redis_client, run_name, sampler, tmp_path) -> None:
    """Staleness drop + dynamic sampling (acked, credited), fill_window, and a clean stop."""
    rdir = tmp_path / "run"
    cfg = tiny_config(
        rdir, redis_url, run_name, checkpoint_every=100, dynamic_sampling=True, fill_window=True
    )
    cfg.buffer.max_staleness = 1  # window = (1 + 1) * 2 = 4 unread groups
    cfg.actors.group_size = 2  # the learner validates the group size against the run
    buf = ReplayBuffer(redis_client, run_name)
    good = sample_groups(sampler, 6, group_size=2, max_tokens=6, seed=21)
    good += sample_groups(sampler, 2, group_size=2, max_tokens=6, seed=24, version=2)  # fresh at V = 2
    for g in good:
        g.completions[0].reward, g.completions[1].reward = 1.0, 0.0
    stale = sample_groups(sampler, 1, group_size=2, max_tokens=6, seed=22, version=0)[0]
    stale.completions[0].reward = 1.0
    flat = sample_groups(sampler, 1, group_size=2, max_tokens=6, seed=23, version=2)[0]
    for c in flat.completions:
        c.reward = 0.5  # zero reward variance
    stop = threading.Event()
    seen: list[StepRecord] = []
    waits: list[float] = []  # on_wait: the time a wait for a batch began, 0.0 once it has one
    out: dict = {}
    dist_env()

    def run() -> None:
        try:
            out["state"] = learn(cfg, rdir, stop_event=stop, on_step=[seen.append], on_wait=[waits.append])
        except BaseException as exc:  # surfaced below
            out["error"] = exc

    for g in good[:3]:
        buf.put(g)
    t = threading.Thread(target=run)
    t.start()
    try:
        _wait_for(lambda: buf.learner_status().get("state") == "waiting" or "error" in out, 240, "learner up")
        time.sleep(1.0)
        assert seen == []  # 3 unread < window 4: fill_window holds the step back
        # Waiting, live: the wait's start was reported (the callback runs right after the status write
        # the test polled for, on a thread that may still be descheduled) and no end yet.
        _wait_for(lambda: len(waits) >= 1 or "error" in out, 60, "on_wait")
        assert len(waits) == 1 and time.time() - 300 < waits[0] < time.time(), waits
        buf.put(good[3])
        _wait_for(lambda: len(seen) >= 1 or "error" in out, 60, "step 1")
        assert waits[1] == 0.0 and all(w > 0 for w in waits[2::2]), waits  # had its batch; waits again
        for g in good[4:6]:
            buf.put(g)
        _wait_for(lambda: len(seen) >= 2 or "error" in out, 60, "step 2")
        # Step 2 trained good[2:4]; at V = 2 the v0 groups good[4:6] and ``stale`` are 2 > max_staleness
        # stale, and ``flat`` has zero reward variance: step 3 drops 3 + 1 and trains good[6:8].
        for g in [stale, flat, *good[6:8]]:
            buf.put(g)
        _wait_for(lambda: len(seen) >= 3 or "error" in out, 60, "step 3")
        assert buf.stats()["pending"] == 6  # trained, not yet checkpointed
    finally:
        stop.set()
        t.join(120)
    assert not t.is_alive() and "error" not in out, out.get("error")
    assert [r.step for r in seen] == [1, 2, 3] and not any(r.checkpointed for r in seen)
    assert [(r.dropped_stale, r.dropped_filtered) for r in seen] == [(0, 0), (0, 0), (3, 1)]
    assert seen[-1].groups == 2 and seen[-1].dropped_stale_total == 3 and seen[-1].version == 3
    assert out["state"].step == 3 and read_latest(rdir)[1].step == 3
    stats = buf.stats()
    assert stats["pending"] == 0 and stats["depth"] == 0 and stats["credits"] == 4
    status = buf.learner_status()
    assert status["state"] == "stopped" and status["step"] == 3 and status["version"] == 3
    assert np.isfinite(seen[-1].loss)
    with pytest.raises(RuntimeError, match="resume"):
        learn(cfg, rdir)  # published weights + checkpoint, no resume: refuse to start over
    buf.delete_run()


def test_sigterm_checkpoints_acks_and_exits_zero(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=100)
    cfg.actors.group_size = 2  # the learner validates the group size against the run
    buf = ReplayBuffer(redis_client, run_name)
    for g in sample_groups(sampler, 2, group_size=2, max_tokens=6, seed=31):
        buf.put(g)
    cmd = [sys.executable, "-m", "asyncrl.learner", "--config", str(_write_cfg(cfg, tmp_path / "c.yaml"))]
    proc = subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: len(read_jsonl(rdir / METRICS_FILE)) >= 1, 240, "1 step", proc)
        assert buf.stats()["pending"] == 2
        proc.send_signal(signal.SIGTERM)  # while it waits for more data
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert read_latest(rdir)[1].step == 1
    assert buf.stats()["pending"] == 0 and buf.learner_status()["state"] == "stopped"
    buf.delete_run()


def test_publish_policy_taken_waits_for_the_actors_and_keeps_the_window_per_step(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    """learner.publish_policy=taken on real Redis + DeepSpeed: a step publishes only when no live actor
    lags behind the newest version (its heartbeat after the swap), or after publish_max_steps steps;
    every step without a publication gives groups_per_step credits back (the window moves per step),
    and the skew is in the checkpoint and survives a resume."""
    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=100, publish_policy="taken",
                      publish_max_steps=3)  # fmt: skip
    cfg.run.max_steps = 6
    eta, gps = cfg.buffer.max_staleness, cfg.buffer.groups_per_step
    buf = ReplayBuffer(redis_client, run_name)
    for g in sample_groups(sampler, 12, group_size=4, max_tokens=6, seed=41):
        buf.put(g)
    buf.heartbeat("actor-0", {"version": 0, "state": "running"})  # live, serving v0, never swaps alone
    buf.heartbeat("actor-dead", {"version": 0, "state": "running", "time": time.time() - 10_000})
    bounds: list[tuple[int, int, int]] = []

    def on_step(rec: StepRecord) -> None:
        st = buf.stats()
        bounds.append((st["version_skew"], st["credits"], buf.admission_bound(eta, gps)))
        if rec.step == 4:  # actor-0 swaps in v2 (published at step 4) before step 5 ends
            buf.heartbeat("actor-0", {"version": 2, "state": "running"})

    dist_env()
    state = learn(cfg, rdir, on_step=[on_step])
    recs = read_jsonl(rdir / METRICS_FILE)
    # Step 1: actor-0 serves v0 = V -> publish v1. Steps 2-3: it lags (v0 < v1), nothing published;
    # step 4: the cap (3 steps since v1). Step 5: it serves v2 -> v3. Step 6: it lags again.
    assert [r["published"] for r in recs] == [True, False, False, True, True, False]
    assert [r["version"] for r in recs] == [1, 1, 1, 2, 3, 3]
    assert [r["publish_s"] > 0 for r in recs] == [r["published"] for r in recs]
    # versions - steps, per step; each silent step credited gps slots: the window is (step + eta + 1) * gps.
    assert [b[0] for b in bounds] == [0, -1, -2, -2, -2, -3]
    assert [b[1] for b in bounds] == [0, 2, 4, 4, 4, 6]
    assert [b[2] for b in bounds] == [(s + eta + 1) * gps for s in range(1, 7)]
    assert all(r["staleness_max"] <= eta for r in recs)
    assert state.version_skew == -3 and read_latest(rdir)[1].version_skew == -3
    assert sorted(p.name for p in (rdir / "weights").iterdir())[-1] == "v3"
    # Resume from that checkpoint: the same skew is set again (idempotent), nothing moves.
    cfg.run.max_steps = 6
    state2 = learn(cfg, rdir, resume=True)
    assert state2.step == 6 and state2.version == 3 and buf.stats()["version_skew"] == -3
    assert buf.stats()["credits"] == 6
    buf.delete_run()


def test_publish_policy_taken_publishes_every_step_at_max_staleness_0(tmp_path) -> None:
    """At max_staleness 0 the actors sampled the step's data with V, so taken publishes without asking
    Redis (a heartbeat in flight must not make a synchronous run train on data one step behind)."""
    from asyncrl.learner.loop import _publish_due

    cfg = tiny_config(tmp_path, publish_policy="taken", publish_max_steps=4)
    cfg.buffer.max_staleness = 0
    assert all(_publish_due(cfg, None, step, 0, 1, 1) for step in range(1, 5))  # r0=None: no Redis read
    cfg.learner.publish_policy, cfg.learner.publish_every = "steps", 3
    assert [_publish_due(cfg, None, s, 0, 1, 1) for s in range(1, 7)] == [False, False, True] * 2


def test_unregistered_weights_are_freed_before_the_learner_waits(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    """A publish unregisters the oldest version and frees its storage at the top of the next step,
    while the actors generate (asyncrl.learner.publisher): by the time the learner waits for a batch,
    the weights on disk are exactly the registered ones. A single rank never encodes its batch."""
    from asyncrl.learner import loop

    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=100, keep_versions=2)
    cfg.run.max_steps = 4
    buf = ReplayBuffer(redis_client, run_name)
    for g in sample_groups(sampler, 8, seed=31):
        buf.put(g)
    seen: list[tuple[list[int], list[int]]] = []

    def on_wait(now: float) -> None:
        if now:
            on_disk = sorted(int(d.name[1:]) for d in (rdir / "weights").glob("v*") if d.is_dir())
            seen.append((on_disk, buf.manifest_versions()))

    def no_encode(group):  # a one-rank learner trains on the groups it read: nothing to send
        raise AssertionError("a single rank encoded its batch")

    dist_env()
    real = loop.encode
    loop.encode = no_encode
    try:
        state = learn(cfg, rdir, on_wait=[on_wait])
    finally:
        loop.encode = real
    assert state.step == 4 and state.version == 4
    assert [r for _d, r in seen] == [[0], [0, 1], [1, 2], [2, 3]]
    assert all(d == r for d, r in seen), seen
    assert buf.manifest_versions() == [3, 4]
    assert sorted(d.name for d in (rdir / "weights").glob("v*")) == ["v3", "v4"]  # close freed v2


def test_weights_that_cannot_be_freed_are_counted_in_the_records_and_on_metrics(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    """A version whose storage cannot be removed (NFS, permissions) keeps a full model copy on disk; the
    transport logs and retries it, and the learner reports each failed attempt: per step and run-wide in
    metrics.jsonl, and as asyncrl_learner_weights_delete_failures_total (AsyncrlWeightsNotFreed)."""
    from asyncrl.metrics_export import LearnerExporter, learner_collectors
    from tests.unit.test_weight_transport import _make_undeletable

    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=100, keep_versions=2)
    cfg.run.max_steps = 4
    buf = ReplayBuffer(redis_client, run_name)
    for g in sample_groups(sampler, 8, seed=33):
        buf.put(g)
    undo: list = []

    def on_wait(now: float) -> None:  # v0 published, before the first step: v0 can no longer be removed
        if now and not undo:
            undo.append(_make_undeletable(rdir / "weights" / "v0"))

    exporter = LearnerExporter(cfg.buffer.max_staleness)
    dist_env()
    try:
        state = learn(cfg, rdir, on_wait=[on_wait], on_step=[exporter])
    finally:
        for u in undo:
            u()
    assert state.step == 4
    recs = read_jsonl(rdir / METRICS_FILE)
    # v0 leaves the registry with step 2's publish; its free fails at step 3's top and again (the retry
    # after a publish) at step 4's. v1, freed beside it at step 4, goes.
    assert [r["weights_delete_failures"] for r in recs] == [0, 0, 1, 1]
    assert [r["weights_delete_failures_total"] for r in recs] == [0, 0, 1, 2]
    (col, _buf) = learner_collectors(exporter, dict)
    got = {s.name: s.value for fam in col.collect() for s in fam.samples if not s.labels}
    assert got["asyncrl_learner_weights_delete_failures_total"] == 2
    assert sorted(d.name for d in (rdir / "weights").glob("v*")) == ["v0", "v3", "v4"]
