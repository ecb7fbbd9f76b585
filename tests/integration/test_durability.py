"""Durability of the learner on real Redis + real DeepSpeed (CPU): the ledger and the checkpoint fallback.

- A Redis crash can undo acknowledgements (README, "Durability"): the same groups are delivered again
  after their effect is already in the checkpoint. Re-putting them plays that redelivery: the resumed
  learner recognises them from the checkpoint's ledger, skips them (acknowledged, not credited) and
  trains only the new ones.
- The newest checkpoint corrupted on disk: the resume warns, falls back to the previous one, credits
  the groups lost with it back to admission, and the ledger lists every trained group once.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncrl.buffer import ReplayBuffer, encode
from asyncrl.learner.checkpoint import TrainedLedger, read_latest
from asyncrl.learner.logprobs import load_hf_model
from asyncrl.learner.loop import _credit_lost, learn
from asyncrl.learner.records import DISCARDED_FILE, LEDGER_FILE, METRICS_FILE, MetricsWriter, read_jsonl
from asyncrl.tinymodel import resolve_model_path
from tests.integration.learner_helpers import dist_env, sample_groups, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    d = tmp_path_factory.mktemp("sampler")
    return load_hf_model(resolve_model_path(tiny_config(d), d))


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """Warnings logged under ``asyncrl`` (a handler on the logger itself: whatever the root does)."""
    msgs: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: msgs.append(r.getMessage())  # type: ignore[method-assign]
    lg = logging.getLogger("asyncrl")
    lg.addHandler(handler)
    for name in ("asyncrl.learner.feed", "asyncrl.learner.loop", "asyncrl.learner.checkpoint"):
        logging.getLogger(name).disabled = False
    try:
        yield msgs
    finally:
        lg.removeHandler(handler)


def _trained(rdir: Path) -> list[str]:
    return [gid for line in read_jsonl(rdir / LEDGER_FILE) for gid in line["group_ids"]]


@pytest.mark.timeout(300)
def test_redelivered_groups_are_not_retrained_and_a_corrupt_checkpoint_falls_back(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    rdir = tmp_path / "run"
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=1)
    cfg.buffer.max_staleness = 100
    buf = ReplayBuffer(redis_client, run_name)
    dist_env()
    first = sample_groups(sampler, 6, max_tokens=6, seed=41)
    for g in first:
        buf.put(g)
    cfg.run.max_steps = 3
    assert learn(cfg, rdir).step == 3
    assert buf.stats()["depth"] == 0  # all acknowledged with the checkpoints
    _, ckpt3 = read_latest(rdir)
    assert ckpt3.step == 3 and set(ckpt3.trained_ids) == {g.group_id for g in first}

    # 1) Redelivery: step 3's two groups come back (a lost XACK), with two new ones behind them.
    again = [g for g in first if g.group_id in set(ckpt3.group_ids)]
    fresh = sample_groups(sampler, 2, max_tokens=6, seed=42, version=3)
    for g in again:  # put() would deduplicate by group id; the raw append is what a lost XACK looks like
        buf.put_raw(encode(g))
    for g in fresh:
        buf.put(g)
    credits = buf.stats()["credits"]
    cfg.run.max_steps = 4
    with _warnings() as msgs:
        assert learn(cfg, rdir, resume=True).step == 4
    assert sum("already trained" in m for m in msgs) == 2, msgs
    ledger = read_jsonl(rdir / LEDGER_FILE)
    assert sorted(ledger[-1]["group_ids"]) == sorted(g.group_id for g in fresh)
    trained = _trained(rdir)
    assert len(trained) == len(set(trained)) == 8
    st = buf.stats()
    assert st["depth"] == 0 and st["pending"] == 0 and st["credits"] == credits  # skipped, never credited

    # 2) Corrupt the newest checkpoint (step 4) on disk: truncate every DeepSpeed file of its tag.
    tag4, ckpt4 = read_latest(rdir)
    assert ckpt4.step == 4
    shards = list(tag4.glob("*.pt"))
    assert shards
    for f in shards:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    more = sample_groups(sampler, 4, max_tokens=6, seed=43, version=4)
    for g in more:
        buf.put(g)
    cfg.run.max_steps = 5
    with _warnings() as msgs:
        state = learn(cfg, rdir, resume=True)
    assert any("step00000004" in m and "falling back" in m for m in msgs), msgs
    assert any("of the 2 groups trained in steps 4-4, 2 are lost" in m for m in msgs), msgs
    # Restored step 3, then trained steps 4 and 5 of the new lineage on the 4 new groups.
    assert state.step == 5
    assert [p.name.split(".")[0] for p in (rdir / "checkpoints").glob("step00000004.corrupt-*")] == [
        "step00000004"
    ]
    assert json.loads((rdir / "checkpoints" / "latest.json").read_text())["tag"] == "step00000005"
    ledger = read_jsonl(rdir / LEDGER_FILE)
    assert [line["step"] for line in ledger] == [1, 2, 3, 4, 5]
    assert sorted(ledger[3]["group_ids"] + ledger[4]["group_ids"]) == sorted(g.group_id for g in more)
    discarded = read_jsonl(rdir / DISCARDED_FILE)
    assert [line["step"] for line in discarded] == [4]
    assert sorted(discarded[0]["group_ids"]) == sorted(g.group_id for g in fresh)
    trained = _trained(rdir)
    assert len(trained) == len(set(trained)) == 10
    assert [r["step"] for r in read_jsonl(rdir / METRICS_FILE)] == [1, 2, 3, 4, 5]
    st = buf.stats()
    # The 2 groups lost with step 4's checkpoint give their admission slots back; the fork from v3 to v5
    # (v4 was published) debits 2 versions of 2 groups (admission.py, "Forks").
    assert st["depth"] == 0 and st["pending"] == 0 and st["version_skew"] == 2
    assert st["credits"] == credits + 2 - 2 * 2
    buf.delete_run()


def test_a_fallback_credits_only_the_groups_whose_entries_were_acknowledged(
    redis_client, run_name, tmp_path, make_group
) -> None:
    """The checkpoint of step 6 commits, the learner dies before acknowledging step 6's entries, and that
    checkpoint then does not load (fall-back to step 4). Step 5's groups were acknowledged: they are lost
    and their slots come back as credits. Step 6's are still pending to the consumer: the restarted
    learner reads and trains them again, so crediting them too would count their slots twice.
    """
    buf = ReplayBuffer(redis_client, run_name)
    groups = [make_group() for _ in range(8)]
    ids = [buf.put(g) for g in groups]
    got = buf.read("learner", 8, block_ms=None)
    assert [e.entry_id for e in got] == ids
    writer = MetricsWriter(tmp_path, "s")
    writer.ledger(5, 5, [g.group_id for g in groups[:4]], ids[:4])
    writer.ledger(6, 6, [g.group_id for g in groups[4:]], ids[4:])
    assert buf.ack(ids[:4]) == 4  # step 5's ack happened; step 6's did not
    r0 = SimpleNamespace(buffer=buf, writer=writer)  # the two parts of Rank0 the fall-back uses
    credits = buf.stats()["credits"]
    with _warnings() as msgs:
        _credit_lost(r0, "learner", 4, 6)
    assert any("of the 8 groups trained in steps 5-6, 4 are lost" in m and "4 were never acknowledged" in m
               for m in msgs), msgs  # fmt: skip
    assert buf.stats()["credits"] == credits + 4
    # A second fall-back before the ledger was truncated (a crash in between) credits nothing again.
    _credit_lost(r0, "learner", 4, 6)
    assert buf.stats()["credits"] == credits + 4
    # A fresh reader (the restarted learner) gets step 6's entries back first: they are trained again.
    restarted = ReplayBuffer(redis_client, run_name)
    assert [e.entry_id for e in restarted.read("learner", 8, block_ms=None)] == ids[4:]
    buf.delete_run()


def test_trained_ledger_keeps_the_newest_ids_in_order() -> None:
    led = TrainedLedger(3, ["a", "b"])
    led.extend(["c", "d", "b"])
    assert led.ids() == ["c", "d", "b"] and len(led) == 3
    assert "a" not in led and "b" in led and "d" in led
    led.extend([f"x{i}" for i in range(10)])
    assert led.ids() == ["x7", "x8", "x9"]


def _run_with_groups(redis_url, redis_client, run_name, sampler, rdir, n, seed, **learner):
    """A learner config checkpointing every step and a buffer holding ``n`` fresh groups."""
    cfg = tiny_config(rdir, redis_url, run_name, checkpoint_every=1, **learner)
    cfg.buffer.max_staleness = 100
    buf = ReplayBuffer(redis_client, run_name)
    dist_env()
    for g in sample_groups(sampler, n, max_tokens=6, seed=seed):
        buf.put(g)
    return cfg, buf


@pytest.mark.timeout(300)
def test_no_loadable_checkpoint_raises_on_every_resume_and_renames_nothing(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    """Every committed checkpoint fails to load (here: truncated shards; in life also an OOM while
    loading, or a changed world size): the resume raises and leaves them as they were, so the next
    attempt (the supervisor restarts the learner with --resume) raises again instead of finding no
    step* directory and starting from step 0, which truncated metrics.jsonl and the ledger."""
    rdir = tmp_path / "run"
    cfg, buf = _run_with_groups(redis_url, redis_client, run_name, sampler, rdir, 4, 51)
    cfg.run.max_steps = 2
    assert learn(cfg, rdir).step == 2
    ckpt = rdir / "checkpoints"
    tags = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert tags == ["step00000001", "step00000002"]
    for f in ckpt.glob("step*/*.pt"):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    metrics = (rdir / METRICS_FILE).read_text()
    cfg.run.max_steps = 4
    for attempt in range(2):
        with pytest.raises(RuntimeError, match="no checkpoint in .* loads"):
            learn(cfg, rdir, resume=True)
        assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == tags, attempt  # nothing renamed
        assert (rdir / METRICS_FILE).read_text() == metrics  # the run's history is intact
    # A pointer whose checkpoints are gone altogether raises too (it never means "start over").
    for t in tags:
        (ckpt / t).rename(ckpt / f"{t}.moved")
    with pytest.raises(RuntimeError, match="names a committed checkpoint"):
        learn(cfg, rdir, resume=True)
    buf.delete_run()


@pytest.mark.timeout(300)
def test_a_checkpoint_past_its_version_is_published_as_a_new_one_and_leftovers_do_not_rotate_good_ones_out(
    redis_url, redis_client, run_name, sampler, tmp_path
) -> None:
    """publish_every 2, stopped after step 3: the checkpoint holds step 3's weights, one step past v1
    (since_publish 1, checkpointed). On resume v1's file is gone (a transport that frees its versions
    on exit, a lost disk): the restored weights are published as v2, never as a second v1 (actors
    serving v1 would not look at it, and v1 would name two sets of weights); the taken policy's and
    A-3PO's step count resumes from the checkpoint. And an uncommitted step* leftover newer than the
    pointer (a crash while saving) is garbage at the next save: it never pushes a good checkpoint out."""
    rdir = tmp_path / "run"
    cfg, buf = _run_with_groups(redis_url, redis_client, run_name, sampler, rdir, 10, 61, publish_every=2)
    cfg.run.max_steps = 3
    state = learn(cfg, rdir)
    assert (state.step, state.version, state.since_publish) == (3, 1, 1)
    v1 = buf.manifest(1)
    assert v1 is not None
    import shutil

    shutil.rmtree(Path(v1.path).parent)  # v1's weights are gone; its manifest stays registered
    leftover = rdir / "checkpoints" / "step00000009"  # a crashed save, newer than the pointer
    leftover.mkdir()
    (leftover / "partial.pt").write_bytes(b"\0" * 16)
    cfg.run.max_steps = 4
    with _warnings() as msgs:
        state = learn(cfg, rdir, resume=True)
    assert any("publishing the restored weights as v2" in m for m in msgs), msgs
    assert buf.manifest(1) == v1  # v1 still names what it named
    # v2 = step 3's weights (the fork); step 4 publishes v3 (publish_every counts steps: 4 % 2 == 0).
    assert (state.step, state.version, state.since_publish) == (4, 3, 0)
    assert buf.manifest(2) is not None and buf.manifest(2).sha256 != v1.sha256 and buf.version() == 3
    tags = sorted(p.name for p in (rdir / "checkpoints").iterdir() if p.is_dir())
    assert tags == ["step00000003", "step00000004"], tags  # the leftover is gone, two good ones kept
    buf.delete_run()
