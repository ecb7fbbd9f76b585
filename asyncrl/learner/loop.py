"""The learner process: read groups, train, publish, checkpoint, acknowledge; repeat.

``asyncrl learn`` calls :func:`learn`. It runs as one process (CPU: gloo) or as N data-parallel
ranks under torchrun / the DeepSpeed launcher (``python -m torch.distributed.run --nproc_per_node 2
-m asyncrl.learner --config run.yaml``).

Data parallelism: only rank 0 talks to Redis. It reads ``groups_per_step`` groups that survive the
filters (staleness, dynamic sampling; dropped groups are acknowledged and credited at once), then
broadcasts them to every rank (``broadcast_object_list`` of msgpack-encoded records, plus the step
version). Every rank derives the same plan and trains its share (asyncrl.learner.step). While rank
0 waits for data it broadcasts a keep-alive every ``feed.KEEPALIVE_S`` so the other ranks never hit the
collective timeout; a stop (SIGTERM / ``stop_event``) is broadcast the same way.

Delivery: entries are acknowledged only after the checkpoint that includes their effect is
committed. On resume the learner restores that checkpoint, re-acknowledges the entries it lists
(crash between commit and ack), and then its consumer gets its pending entries first: the groups
trained after the checkpoint are retrained exactly once relative to the restored weights. A group
delivered again although its effect is already in the weights (a Redis crash lost the acknowledgement
or the delivery) is found in the ledger of recently trained group ids, which the checkpoint carries,
and skipped. A checkpoint that does not load is passed over for the previous one
(asyncrl.learner.checkpoint); the groups only it contained were already acknowledged, so they are
lost: they are logged and their admission slots credited back.

Version on resume (decision): the learner restarts at the checkpoint's version V_c whenever that is
unambiguous, i.e. nothing newer than V_c was published (clean stop, crash right after a checkpoint,
Redis lost); it re-publishes the restored weights as V_c when v{V_c} is missing or corrupt, but only
if they are V_c's weights: a checkpoint taken steps after the last publication (the checkpoint's
``since_publish`` > 0: publish_every > 1, publish_policy=taken, a final save on stop) holds newer
weights, which are published as ``max(published, V_c) + 1`` instead (one number never names two
sets of weights; actors serving V_c would not even look at a re-published V_c). If
versions > V_c were published before a crash, those numbers already name weights of the discarded
lineage that actors may hold or have tagged tokens with; re-using them would give one version number
two meanings and make an in-flight completion's versions go backwards (records reject that). The
learner then publishes the restored weights as ``max published + 1`` (versions stay monotonic).
Groups sampled by the discarded lineage are ordinary off-policy data: their behaviour logprobs are
recorded, their staleness is counted against the new V, and the usual drop bound applies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.buffer import decode, encode
from asyncrl.learner import adaptive, tracking
from asyncrl.learner.checkpoint import LearnerState, Skipped, load_checkpoint, read_latest, save_checkpoint
from asyncrl.learner.engine import LearnerEngine, build_engine, init_distributed, pad_id
from asyncrl.learner.feed import Rank0, broadcast
from asyncrl.learner.logprobs import ReferenceModel
from asyncrl.learner.records import StepRecord
from asyncrl.learner.step import Trainer
from asyncrl.learner.step_record import step_record
from asyncrl.tinymodel import resolve_model_path

__all__ = ["learn", "COUNTERS"]

log = logging.getLogger(__name__)
#: Unix times of this learner process's start-up milestones (rank 0, written at its first step; read by
#: asyncrl bench's start-up breakdown): learn() entered (imports done), DeepSpeed engine built,
#: weights published or restored, first batch in hand, first step recorded.
STARTUP_FILE = "learner_startup.json"
#: Cumulative StepRecord fields carried in the checkpoint.
COUNTERS = ("groups_total", "tokens_total", "wait_s_total", "dropped_stale_total", "dropped_filtered_total",
            "skipped_nonfinite", "weights_delete_failures_total")  # fmt: skip


def _install_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM/SIGINT set ``stop`` (finish the step, checkpoint, exit); returns the restorer."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping after the current step", signum)
        stop.set()

    for s in old:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore


def _publish(le: LearnerEngine, r0: Rank0 | None, version: int) -> float:
    """Publish the current weights as ``version`` (collective: ZeRO-3 gathers on every rank)."""
    t0 = time.monotonic()
    if r0 is not None:
        device = r0.publisher.transport.weights_device  # host copies, or the GPU tensors (NCCL)
        r0.publisher.publish(version, lambda: le.named_weights(device))
    else:
        for _ in le.named_weights():
            pass
    return time.monotonic() - t0


def learn(
    cfg: Any,
    run_dir: str | Path,
    resume: bool = False,
    *,
    start_time: float | None = None,
    stop_event: threading.Event | None = None,
    on_step: Iterable[Callable[[StepRecord], None]] = (),
    on_wait: Iterable[Callable[[float], None]] = (),
) -> LearnerState:
    """Run the learner until ``run.max_steps`` (0 = forever) or a stop; returns the final state.

    ``start_time``: unix time the record ``time`` counts from (default: now). ``stop_event`` or
    SIGTERM/SIGINT: finish the current step, checkpoint, acknowledge, return. ``on_step``: callbacks
    called on rank 0 with every :class:`StepRecord` (after it is written to metrics.jsonl). ``on_wait``:
    called on rank 0 with the unix time the learner starts waiting for a batch, and with 0.0 once it
    has one (a live "blocked on data" signal: the step records only say how long a wait was after it).
    ``resume``: restore the last checkpoint (a fresh start when there is none); without it the run
    must have no published weights and no checkpoint.
    """
    start_time = time.time() if start_time is None else start_time
    marks = {"start_time": start_time, "learner_started": time.time()}  # start-up milestones (unix s)
    run_dir = Path(run_dir)
    stop = stop_event or threading.Event()
    callbacks = list(on_step)
    waiting = list(on_wait)
    rank, world = init_distributed()
    torch.manual_seed(cfg.run.seed + rank)
    np.random.seed(cfg.run.seed + rank)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        model_path = resolve_model_path(cfg, run_dir)  # builds the tiny model once
    if world > 1:
        dist.barrier()
    if rank != 0:
        model_path = resolve_model_path(cfg, run_dir)
    restore_signals = _install_signals(stop)
    r0: Rank0 | None = None
    try:
        le = build_engine(cfg, model_path)
        marks["deepspeed_ready"] = time.time()
        ref = ReferenceModel(model_path, le.dtype, le.device) if cfg.learner.loss.ref_kl_coef > 0 else None
        trainer = Trainer(cfg, le, ref, pad_id(le.module.config))
        r0 = Rank0(cfg, run_dir, model_path, le.dtype_name) if rank == 0 else None
        adapt: adaptive.AdaptiveBound | None = None  # rank 0's adaptive admission bound (installed below)

        if not resume and rank == 0 and (r0.published_max() >= 0 or read_latest(run_dir) is not None):
            raise RuntimeError(
                f"run {cfg.run.name!r} already has published weights or a checkpoint in {run_dir}; "
                "resume it (asyncrl learn --resume) or use a new run name and directory"
            )
        skipped: list[Skipped] = []
        restored = load_checkpoint(le, run_dir, skipped) if resume else None
        state = restored or LearnerState(consumer=cfg.learner.consumer, since_publish=0)
        if resume and rank == 0:  # `asyncrl learn --resume` says where it continues (console, learner.log)
            if restored is not None:
                log.info("resumed from step %d (v%d)", state.step, state.version)
            else:
                log.info("--resume: no checkpoint yet in %s: starting from step 0", run_dir)
        since = state.since_publish if state.since_publish >= 0 else state.step % cfg.learner.publish_every
        trainer.applied_steps = state.applied_steps
        counters = {k: float(state.counters.get(k, 0.0)) for k in COUNTERS}

        # Version at start (see the module docstring), decided on rank 0, executed by all ranks.
        action = None
        if r0 is not None:
            if state.entry_ids:
                r0.buffer.ack(state.entry_ids)  # committed but maybe not acknowledged before a crash
            r0.ledger.extend(state.trained_ids)
            if skipped:
                _credit_lost(r0, state.consumer, state.step, max(s.step for s in skipped))
            r0.writer.truncate_after(state.step)
            # The adaptive admission bound: set (or cleared) in Redis, moved after steps. Restored from the
            # checkpoint (after metrics.jsonl is truncated: it re-reads the checkpoint step's record).
            adapt = adaptive.install(cfg, r0.buffer, run_dir, state.adaptive, state.step)
            callbacks += [adapt] if adapt is not None else []
            pub = r0.published_max()
            if pub < state.version or (pub == state.version and not r0.publisher.usable(state.version)):
                # The restored weights are V_c's only if no step followed its publication.
                action = state.version if since == 0 else max(pub, state.version) + 1
                if since:
                    log.warning("v%d is missing and the checkpoint is %d step(s) past it: publishing the "
                                "restored weights as v%d", state.version, since, action)  # fmt: skip
            elif pub > state.version:
                action = pub + 1
                log.warning("versions up to %d were published after checkpoint v%d: forking to v%d",
                            pub, state.version, action)  # fmt: skip
            else:
                r0.buffer.set_version(state.version)
            # Before the fork's version is published: the window must not widen by the jump meanwhile.
            # Set on every start (not only on a fork): the total is the checkpoint's, so a debit made by
            # a fork whose lineage was discarded again is undone.
            jump = 0 if action is None else action - state.version
            gpv = cfg.buffer.groups_per_step * cfg.learner.publish_every
            r0.buffer.set_version_skew(state.version_skew + jump, gpv)
        action = broadcast(action, world)
        if action is not None:
            state.version_skew += action - state.version
            _publish(le, r0, action)
            state.version = action
        marks["weights_published"] = time.time()
        # Learner steps since the weights were last published (they are past V by that much when
        # publish_every > 1 or under publish_policy=taken); the objective places pi_prox on the version
        # axis with it, and the taken policy counts publish_max_steps from it. Checkpointed.
        since_publish = 0 if action is not None else since

        # Failed removals of stored weights counted so far (the transport's total; records carry the delta).
        deletes_failed = _delete_failures(r0)
        pending_ids: list[str] = []  # consumed since the last checkpoint, acknowledged after the next
        pending_groups: list[str] = []
        max_steps = cfg.run.max_steps
        while not (max_steps and state.step >= max_steps):
            t_step = time.monotonic()
            if r0 is not None:
                # The storage of the versions the last publish unregistered, freed while the actors
                # generate (not in the next publish, which a synchronous run's actors wait for).
                r0.publisher.free_unregistered()
                # The state and since when (unix s), written once as it begins: asyncrl status tells a
                # learner waiting for data from one stuck in a step (a frozen one).
                now = time.time()
                r0.buffer.set_learner_status({"step": state.step, "version": state.version, "time": now - start_time,
                                              "state": "waiting", "since": now})  # fmt: skip
                for cb in waiting:
                    cb(now)
                batch = r0.gather(state.consumer, state.version, stop, world)
                for cb in waiting:
                    cb(0.0)
                if batch is not None:
                    r0.buffer.set_learner_status({"state": "training", "since": time.time()})
                # Other ranks get the groups encoded; a single rank trains on its own (encoding the
                # step's groups cost ~0.5 ms between a synchronous run's batch and its step).
                groups_out = [encode(g) for g in batch.groups] if batch is not None and world > 1 else []
                msg = {"kind": "stop"} if batch is None else {
                    "kind": "batch", "version": state.version, "groups": groups_out}  # fmt: skip
            else:
                msg = None
            while True:
                msg = broadcast(msg, world)
                if msg["kind"] != "wait":
                    break
                msg = None
            if msg["kind"] == "stop":
                break
            groups = batch.groups if r0 is not None else [decode(d) for d in msg["groups"]]
            version = int(msg["version"])
            marks.setdefault("first_batch", time.time())

            t_train = time.monotonic()
            res = trainer.train(groups, version, since_publish)
            train_s = time.monotonic() - t_train
            state.step += 1
            state.applied_steps = trainer.applied_steps
            published = _publish_due(cfg, r0, state.step, state.version, since_publish + 1, world)
            publish_s = 0.0
            since_publish = 0 if published else since_publish + 1
            if not published and cfg.learner.publish_policy == "taken":
                # The window must still advance by this step's groups (asyncrl.buffer.admission, "Steps
                # without a publication"); the skew travels in the checkpoint like a fork's.
                state.version_skew -= 1
                if r0 is not None:
                    r0.buffer.set_version_skew(state.version_skew, cfg.buffer.groups_per_step)
            if published:
                state.version += 1
                publish_s = _publish(le, r0, state.version)
            if r0 is not None:
                pending_ids += batch.entry_ids + batch.duplicate_entry_ids
                pending_groups += [g.group_id for g in groups]
                r0.ledger.extend([g.group_id for g in groups])
                r0.writer.ledger(state.step, state.version, [g.group_id for g in groups], batch.entry_ids)
                counters["groups_total"] += len(groups)
                counters["tokens_total"] += res.tokens
                counters["wait_s_total"] += batch.wait_s
                counters["dropped_stale_total"] += batch.dropped_stale
                counters["dropped_filtered_total"] += batch.dropped_filtered
            counters["skipped_nonfinite"] += res.skipped
            delete_failures = _delete_failures(r0) - deletes_failed  # this step's (the free, the publish)
            deletes_failed += delete_failures
            counters["weights_delete_failures_total"] += delete_failures
            due = state.step % cfg.learner.checkpoint_every == 0 or (max_steps and state.step >= max_steps)
            if due:
                state.since_publish = since_publish
                _checkpoint(le, r0, run_dir, state, counters, pending_ids, pending_groups, adapt)
            if r0 is not None:
                rec = step_record(cfg, state, res, groups, batch, counters, start_time, t_step, train_s,
                                  publish_s, published, bool(due), trainer.lr_now(), delete_failures)  # fmt: skip
                if cfg.eval.every > 0:  # the newest periodic eval of actor 0 (a Redis read per step)
                    tracking.attach_eval(rec, r0.buffer)
                r0.writer.write(rec)
                if "first_step" not in marks:
                    marks["first_step"] = time.time()
                    (run_dir / STARTUP_FILE).write_text(json.dumps(marks, indent=1) + "\n")
                r0.buffer.set_learner_status({"step": rec.step, "version": rec.version, "time": rec.time,
                                              "state": "stepped", "since": rec.step_time})  # fmt: skip
                log.info("step %d v%d reward %.3f loss %.4f ratio %.4f mismatch_kl %.2e staleness %.2f/%d "
                         "dropped %d grad_norm %.3g skipped %d wait %.2fs train %.2fs",
                         rec.step, rec.version, rec.reward_mean, rec.loss, rec.ratio_mean, rec.mismatch_kl,
                         rec.staleness_mean, rec.staleness_max, rec.dropped_stale + rec.dropped_filtered,
                         rec.grad_norm, rec.skipped, rec.wait_s, rec.train_s)  # fmt: skip
                for cb in callbacks:
                    cb(rec)
        if world > 1:
            # Ranks other than 0 do not know about trained-but-unacked entries; agree on a final save.
            need = broadcast(bool(pending_ids) if r0 is not None else None, world)
        else:
            need = bool(pending_ids)
        if need:
            state.since_publish = since_publish
            _checkpoint(le, r0, run_dir, state, counters, pending_ids, pending_groups, adapt)
        if r0 is not None:
            r0.buffer.set_learner_status({"step": state.step, "version": state.version, "time": time.time() - start_time,
                                          "state": "stopped", "since": time.time()})  # fmt: skip
        return state
    finally:
        restore_signals()
        if r0 is not None:
            r0.close()  # shm transport: frees the weights in /dev/shm (a restart re-publishes)


def _delete_failures(r0: Rank0 | None) -> int:
    """Failed attempts of rank 0's weight transport to remove stored weights (0: none, or no counter)."""
    return int(getattr(r0.publisher.transport, "delete_failures", 0)) if r0 is not None else 0


def _publish_due(cfg: Any, r0: Rank0 | None, step: int, version: int, steps_since: int, world: int) -> bool:
    """Whether the step just trained (``step``; ``steps_since`` steps since the last publication, this
    one included) publishes its weights as ``version + 1``: ``learner.publish_policy``.

    steps: every ``publish_every`` steps. taken: once no live actor still lags behind ``version`` (a
    version nobody has loaded yet is not followed by another that would only queue behind it), or after
    ``publish_max_steps`` steps without one; at ``max_staleness = 0`` always (the actors sampled this
    step's data with ``version``, so they hold it; a heartbeat still in flight must not turn a
    synchronous run into one that trains a step on data one step behind). Decided on rank 0 (it alone
    reads Redis), the same on every rank."""
    lc = cfg.learner
    if lc.publish_policy == "steps":
        return step % lc.publish_every == 0
    if cfg.buffer.max_staleness == 0:
        return True
    due = None
    if r0 is not None:
        due = steps_since >= lc.publish_max_steps or not r0.buffer.lagging_actors(
            version, cfg.actors.heartbeat_timeout_s
        )
    return bool(broadcast(due, world))


def _credit_lost(r0: Rank0, consumer: str, restored: int, newest: int) -> None:
    """Credit back the groups trained in steps (restored, newest] that are lost with the checkpoint of
    step ``newest``, which turned out not to load.

    Lost are only those whose entries were acknowledged (the ack follows the commit). A crash between
    the commit and the ack leaves them pending to this consumer: its next read returns them and they
    are trained again in the new lineage, so their slots are still in use. Crediting those too would
    count them twice (seen in the chaos test: a SIGSTOP right after the commit of step 6 left steps 5-6
    pending, and the admission ledger came out 8 slots over). The credit's request id names the lost
    entries, so a crash and second fall-back before the ledger is truncated does not repeat it.
    """
    rows = r0.writer.ledger_entries(restored, newest)
    pending = r0.buffer.pending_of(consumer, [e for _, e in rows])
    lost = sorted(g for g, e in rows if e not in pending)
    log.warning("fell back to the checkpoint of step %d: of the %d groups trained in steps %d-%d, %d are lost "
                "with the checkpoint that did not load (already acknowledged; their admission slots are "
                "credited back) and %d were never acknowledged (they are trained again)",
                restored, len(rows), restored + 1, newest, len(lost), len(rows) - len(lost))  # fmt: skip
    if lost:
        digest = hashlib.sha256("\n".join(lost).encode()).hexdigest()[:24]
        r0.buffer.credit(len(lost), request_id=f"lost:{digest}")


def _checkpoint(
    le: LearnerEngine,
    r0: Rank0 | None,
    run_dir: Path,
    state: LearnerState,
    counters: dict[str, float],
    pending_ids: list[str],
    pending_groups: list[str],
    adapt: adaptive.AdaptiveBound | None,
) -> None:
    """Commit a checkpoint (collective), then acknowledge what it includes (rank 0)."""
    state.adaptive = adapt.state() if adapt is not None else None
    state.entry_ids = list(pending_ids)
    state.group_ids = list(pending_groups)
    state.trained_ids = r0.ledger.ids() if r0 is not None else []
    state.counters = dict(counters)
    save_checkpoint(le, run_dir, state)
    if r0 is not None and pending_ids:
        r0.buffer.ack(pending_ids)
    pending_ids.clear()
    pending_groups.clear()
