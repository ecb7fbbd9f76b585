"""Rank 0's side of the learner: the Redis replay buffer, the weight publisher, the records.

Only rank 0 talks to Redis. It gathers the groups of a step (:meth:`Rank0.gather`), drops the
too-stale ones and (with dynamic sampling) the zero-variance ones, acknowledging and crediting every
drop at once, and the loop broadcasts the kept groups to the other ranks with :func:`broadcast`.
While it waits it broadcasts ``{"kind": "wait"}`` keep-alives every ``KEEPALIVE_S``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from asyncrl.buffer import ReplayBuffer, encode
from asyncrl.buffer.registry import LearnerHeartbeat
from asyncrl.learner.checkpoint import TrainedLedger
from asyncrl.learner.publisher import Publisher, checkpoint_tensor_names, is_local_url, make_transport
from asyncrl.learner.records import MetricsWriter
from asyncrl.learner.validate import RunSpec, check_group

__all__ = ["Batch", "Rank0", "batch_order_key", "broadcast", "KEEPALIVE_S", "SATURATED_S"]

log = logging.getLogger(__name__)

KEEPALIVE_S = 30.0
#: fill_window: an unchanged unread count for this long under saturated admission ends the wait.
SATURATED_S = 1.0


@dataclass
class Batch:
    """What rank 0 gathered for one step."""

    entry_ids: list[str] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    wait_s: float = 0.0
    dropped_stale: int = 0
    dropped_filtered: int = 0
    #: Groups that do not fit the run (asyncrl.learner.validate): dead-lettered with the reason, credited.
    dropped_invalid: int = 0
    #: Redelivered groups already in the weights (ledger hit): not trained, acknowledged with the next
    #: checkpoint (never credited: their admission slot is accounted for by the trained copy).
    duplicate_entry_ids: list[str] = field(default_factory=list)


def batch_order_key(group: Any) -> tuple[int, int, str]:
    """Where a group goes in a step's batch: by actor, then by its prompt's position in that actor's
    stream (``meta.prompt_seq``, see asyncrl.actors.seeding), then by id. A batch of the same groups
    is then trained in the same order however they arrived, so a ``max_staleness=0`` run and the
    synchronous reference loop (asyncrl.reference) do the same float operations in the same order.
    Only groups that passed ``check_group`` are sorted: it guarantees both keys are integers or absent."""
    meta = group.meta or {}
    return (int(meta.get("actor_index", -1)), int(meta.get("prompt_seq", -1)), str(group.group_id))


def broadcast(obj: Any, world: int) -> Any:
    """Rank 0's ``obj`` on every rank (pickled by torch between our own ranks; group records inside
    are msgpack bytes, decoded and validated by the receiver)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Rank0:
    """Rank 0's side: Redis, publisher, records."""

    def __init__(self, cfg: Any, run_dir: Path, model_path: Path, dtype: str) -> None:
        self.cfg = cfg
        # Redis options (AUTH, ACL user, TLS, retry budget) from the config; the socket timeout must
        # exceed one blocking read.
        self.buffer = ReplayBuffer.from_config(
            cfg, max_deliveries=cfg.learner.max_deliveries,
            socket_timeout=max(cfg.redis.socket_timeout_s, cfg.learner.read_block_ms / 1000.0 + 10.0),
        )  # fmt: skip
        vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
        self.spec = RunSpec.from_config(cfg, vocab_size)
        transport = make_transport(
            cfg.learner.weight_transport, run_dir, cfg.run.name, checkpoint_tensor_names(model_path),
            local=is_local_url(cfg.redis.url), cfg=cfg, redis_client=self.buffer.client,
        )  # fmt: skip
        self.publisher = Publisher(self.buffer, transport, cfg.learner.keep_versions, dtype)
        self.writer = MetricsWriter(run_dir, uuid.uuid4().hex[:12])
        self.ledger = TrainedLedger(cfg.learner.ledger_size)  # restored from the checkpoint by the loop
        self.heartbeat = LearnerHeartbeat(self.buffer)

    def close(self) -> None:
        """Heartbeat first (it uses the client), then the transport (shm: frees /dev/shm), then Redis."""
        self.heartbeat.close()
        self.publisher.close()
        self.buffer.close()

    def published_max(self) -> int:
        """Highest version ever published in this run (-1: none)."""
        latest = self.buffer.latest_manifest()
        v = self.buffer.version()
        if latest is None and v == 0:
            return -1
        return max(v, latest.version if latest else -1)

    def gather(self, consumer: str, version: int, stop: threading.Event, world: int) -> Batch | None:
        """Read until ``groups_per_step`` groups survive the filters; None when told to stop."""
        cfg, buf = self.cfg, self.buffer
        want, eta = cfg.buffer.groups_per_step, cfg.buffer.max_staleness
        b = Batch()
        last_keepalive = time.monotonic()
        if cfg.learner.fill_window:
            t0 = time.monotonic()
            if not self.fill_window(stop, world):
                return None
            b.wait_s += time.monotonic() - t0
        while len(b.groups) < want:
            if stop.is_set():
                return None
            t0 = time.monotonic()
            entries = buf.read(consumer, want - len(b.groups), block_ms=cfg.learner.read_block_ms)
            b.wait_s += time.monotonic() - t0
            drop: list[str] = []
            for e in entries:
                g = e.group
                reason = check_group(g, self.spec, version)
                if reason is not None:
                    # Poison for this run: never trained; dead letter with the reason, slot credited.
                    buf.dead_letter([(e.entry_id, reason, encode(g))])
                    b.dropped_invalid += 1
                elif g.group_id in self.ledger:
                    log.warning("group %s (entry %s) was already trained: delivered again, skipped",
                                g.group_id, e.entry_id)  # fmt: skip
                    b.duplicate_entry_ids.append(e.entry_id)
                elif g.staleness(version) > eta:
                    b.dropped_stale += 1
                    drop.append(e.entry_id)
                elif cfg.learner.dynamic_sampling and len({float(c.reward) for c in g.completions}) <= 1:
                    b.dropped_filtered += 1
                    drop.append(e.entry_id)
                else:
                    b.entry_ids.append(e.entry_id)
                    b.groups.append(g)
            if drop:
                # A drop is final and has no effect on the weights: acknowledge now, give the credit back
                # (one script, crediting exactly what it acknowledged: safe to retry).
                buf.drop(drop)
            if world > 1 and len(b.groups) < want and time.monotonic() - last_keepalive > KEEPALIVE_S:
                broadcast({"kind": "wait"}, world)
                last_keepalive = time.monotonic()
        # Arrival order is timing; the trained order must not be (float sums and micro-batches follow it).
        if b.groups:
            pairs = sorted(zip(b.groups, b.entry_ids, strict=True), key=lambda p: batch_order_key(p[0]))
            b.groups, b.entry_ids = [p[0] for p in pairs], [p[1] for p in pairs]
        return b

    def fill_window(self, stop: threading.Event, world: int) -> bool:
        """Experiment knob ``learner.fill_window``: wait for a full admission window of unread groups.

        Done when ``(max_staleness + 1) * groups_per_step`` groups wait unread, or when admission is
        saturated (admitted >= bound) and the unread count stopped growing for ``SATURATED_S``:
        nothing more can arrive before the learner consumes (e.g. publish_every > 1 shrinks the
        window). False when told to stop.
        """
        cfg = self.cfg
        per_version = (
            cfg.buffer.groups_per_step * cfg.learner.publish_every
        )  # admission's unit (replay.from_config)
        window = (cfg.buffer.max_staleness + 1) * per_version
        last, since, last_keepalive = -1, time.monotonic(), time.monotonic()
        while not stop.is_set():
            st = self.buffer.stats()
            unread = st["depth"] - st["pending"]
            if st.get("staleness_bound") is not None:  # the adaptive bound, when it tightened admission
                window = (st["staleness_bound"] + 1) * per_version
            if unread >= window:
                return True
            if unread != last:
                last, since = unread, time.monotonic()
            elif (
                st["bound"] is not None
                and st["admitted"] >= st["bound"]
                and time.monotonic() - since > SATURATED_S
            ):
                return True
            if world > 1 and time.monotonic() - last_keepalive > KEEPALIVE_S:
                broadcast({"kind": "wait"}, world)
                last_keepalive = time.monotonic()
            time.sleep(0.05)
        return False
