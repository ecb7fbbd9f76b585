"""Poison records against the learner's real read path (feed.Rank0.gather, real redis-server, the real
tiny model's vocabulary): 20 of each kind that decodes but does not fit the run, plus records the codec
rejects, all land in the dead-letter stream with their reason and return their admission credit; the
learner gets exactly the good groups and never trains on a bad one."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np

from asyncrl.buffer import Completion, Group, ReplayBuffer, encode
from asyncrl.learner.feed import Rank0
from asyncrl.tinymodel import resolve_model_path
from tests.integration.learner_helpers import tiny_config

PER_KIND = 20


def _group(
    i: int, vocab: int, n: int = 4, prompt=(3, 4, 5), tokens=(6, 7, 8), version: int = 0, **meta
) -> Group:
    comps = [
        Completion(
            token_ids=np.array(tokens, dtype=np.uint32),
            logprobs=np.full(len(tokens), -1.0, dtype=np.float32),
            versions=np.full(len(tokens), version, dtype=np.uint32),
            reward=float(c % 2),
            finish_reason="stop",
        )
        for c in range(n)
    ]
    return Group(
        f"g{i}", f"p{i}", np.array(prompt, dtype=np.uint32), comps, meta={"temperature": 1.0, **meta}
    )


def test_twenty_poison_records_of_each_kind_are_dead_lettered_with_credit(
    tmp_path: Path, redis_url: str
) -> None:
    run = f"poison-{tmp_path.name[-8:]}"
    cfg = tiny_config(tmp_path / "run", redis_url, run_name=run)
    cfg.model.max_model_len = 32
    cfg.buffer.max_staleness = 200  # admission room for every record of the test
    model_path = resolve_model_path(cfg, tmp_path / "run")
    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    r0 = Rank0(cfg, tmp_path / "run", model_path, "float32")
    buf: ReplayBuffer = r0.buffer
    try:
        kinds = {
            "completions: 3 completions": lambda i: _group(i, vocab, n=3),
            "prompt_token_ids: empty prompt": lambda i: _group(i, vocab, prompt=()),
            "prompt_token_ids: token id": lambda i: _group(i, vocab, prompt=(3, vocab + i)),
            "completions[0].token_ids: token id": lambda i: _group(i, vocab, tokens=(6, vocab)),
            "completions[0]: prompt + completion": lambda i: _group(i, vocab, tokens=[6] * 30),
            "completions[0].versions: token sampled by v1": lambda i: _group(i, vocab, version=1),
            "meta['temperature']": lambda i: _group(i, vocab, temperature=0.0),
            # Sort keys of the batch: these raised inside gather and crash-looped the learner.
            "meta['actor_index']": lambda i: _group(i, vocab, actor_index="x"),
            "meta['prompt_seq']": lambda i: _group(
                i, vocab, prompt_seq=float("inf") if i % 2 else float("nan")
            ),
        }
        codec = {  # rejected before validation, by the wire codec
            "record: not valid msgpack": lambda i: b"\xc1" + bytes([i]),
            "completions[0].reward: must be finite": lambda i: _nan_reward(_group(i, vocab)),
            # Finite in float64, yet inf in the fp32 step (advantages; the k2 rollout-KL of a sentinel
            # logprob): before the bounds they voided the whole step and were counted as trained.
            "completions[0].reward: 1e+39 is beyond": lambda i: _patched(_group(i, vocab), reward=1e39),
            "completions[0].logprobs: -1e+30 at 0 is below": lambda i: _patched(
                _group(i, vocab), logprob=-1e30
            ),
        }
        sent: list[str] = []
        k = 0
        for make in kinds.values():
            for _ in range(PER_KIND):
                assert buf.try_admit(owner="actor-0")
                sent.append(buf.put(make(k), "actor-0"))
                k += 1
        for make in codec.values():
            for _ in range(PER_KIND):
                assert buf.try_admit(owner="actor-0")
                sent.append(buf.put_raw(make(k)))
                k += 1
        good = [_group(10_000 + j, vocab) for j in range(cfg.buffer.groups_per_step)]
        for g in good:
            assert buf.try_admit(owner="actor-0")
            buf.put(g, "actor-0")

        batch = r0.gather("learner-0", 0, threading.Event(), world=1)

        assert batch is not None and [g.group_id for g in batch.groups] == [g.group_id for g in good]
        assert batch.dropped_invalid == PER_KIND * len(kinds)
        dead = buf.dead_letters(count=1000)
        assert sorted(d["original_id"] for d in dead) == sorted(sent)
        by_kind = Counter(next(p for p in [*kinds, *codec] if d["reason"].startswith(p)) for d in dead)
        assert by_kind == {p: PER_KIND for p in [*kinds, *codec]}
        assert all(d["size"] > 0 for d in dead)  # the record itself is kept for inspection
        s = buf.stats()
        n_bad = PER_KIND * (len(kinds) + len(codec))
        # admitted = credited (every poison record) + pending (the good ones, acknowledged at checkpoint)
        assert (s["admitted"], s["credits"], s["dead"], s["pending"], s["depth"]) == (
            n_bad + len(good), n_bad, n_bad, len(good), len(good),
        )  # fmt: skip
    finally:
        r0.heartbeat.close()  # before the run's keys go: it would write the learner status back
        buf.delete_run()
        r0.close()


def _nan_reward(g: Group) -> bytes:
    return _patched(g, reward=float("nan"))


def _patched(g: Group, reward: float | None = None, logprob: float | None = None) -> bytes:
    """``g``'s record with completion 0's reward or first logprob replaced, past the encoder's checks."""
    doc = msgpack.unpackb(encode(g), raw=False)
    c = doc["completions"][0]
    if reward is not None:
        c["reward"] = reward
    if logprob is not None:
        lp = np.frombuffer(c["logprobs"], dtype="<f4").copy()
        lp[0] = logprob
        c["logprobs"] = lp.tobytes()
    return msgpack.packb(doc, use_bin_type=True)
