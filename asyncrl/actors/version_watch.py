"""The rollout actor's weight side: find the newest verifiable version, swap it in, run periodic eval.

A mixin of :class:`asyncrl.actors.actor.RolloutActor` (it uses the actor's engine, buffer, counters and
heartbeat). Invariants: a manifest is served only after its path is confined to this run's weight
directories and its sha256 (or sizes) verified; a manifest that fails is refused once, remembered and
logged, and the actor keeps generating on the weights it has. Refusals are the
:class:`~asyncrl.buffer.WeightIntegrityError` s (the file's digest, or its header: names, shapes,
version tag, see :mod:`asyncrl.actors.weight_swaps`) and registry entries that do not parse (e.g. a
newer learner's schema); any other swap error is the engine's and goes to the actor's supervision. A
file that vanished after it was verified (``WeightFileGone``: pruned, recycled) is not remembered:
newer weights replaced it, and the actor moves on to the newest manifest. With ``learner.weight_transport=nccl``
the learner drives the swap (:mod:`asyncrl.actors.nccl_receiver`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from asyncrl.buffer import WeightIntegrityError, WeightManifest, verify
from asyncrl.buffer.paths import confine
from asyncrl.buffer.weights import WeightFileGone

__all__ = ["VersionWatching", "MANIFEST_POLL_S", "NCCL_POLL_S"]

log = logging.getLogger(__name__)

#: The ``_rejected`` key (with the version) of a registry entry that does not parse as a manifest.
UNREADABLE = "<unreadable manifest>"
MANIFEST_POLL_S = 0.2  # registry poll while waiting for the first version / between hints
NCCL_POLL_S = 0.005  # broadcast-round poll (learner.weight_transport=nccl)


class VersionWatching:
    """Weight versions of one rollout actor (mixin of RolloutActor; see the module doc)."""

    engine: Any
    buffer: Any
    counters: dict[str, Any]
    timeline: Any

    async def _newest_valid_manifest(
        self, defer: bool = False, skip: frozenset[tuple[int, str]] = frozenset()
    ) -> WeightManifest | None:
        """The newest published manifest newer than the served version whose weights verify.

        Manifests that fail verification (tampered, half-written) are refused once, logged and
        remembered; an older valid one is used instead only if it is still newer than what the
        engine serves (a restarted actor thus falls back to the newest good version). The registry
        reads and the verification run in one worker thread (one hop on the swap's path, not three).
        ``defer``: the newest candidate is returned confined but *unverified*: the caller verifies it
        inside the swap, beside the stage build (``swap_weights(verify=...)``), and refuses it there.
        """
        assert self.engine is not None
        current = -1 if self.engine.version is None else self.engine.version
        rejected = set(self._rejected) | skip
        found, refused = await asyncio.to_thread(self._scan_manifests, current, rejected, defer)
        for key, e in refused:  # counters and the refusal set belong to the loop thread
            self._refuse_key(key, e)
        return found

    def _refuse(self, m: WeightManifest, e: Exception) -> None:
        self._refuse_key((m.version, m.sha256), e)

    def _refuse_key(self, key: tuple[int, str], e: Exception) -> None:
        self._rejected.add(key)
        self.counters["weight_rejects"] += 1
        log.error("%s: refusing weights v%d: %s", self.actor_id, key[0], e)

    def _scan_manifests(
        self, current: int, rejected: set[tuple[int, str]], defer: bool = False
    ) -> tuple[WeightManifest | None, list[tuple[tuple[int, str], Exception]]]:
        """The newest manifest above ``current`` not in ``rejected`` that confines (and verifies unless
        ``defer``), and the refusals met on the way (keys of ``rejected``). A registry entry that does
        not parse is refused under the key ``(v, UNREADABLE)``, and skipped while it stays unreadable."""
        refused: list[tuple[tuple[int, str], Exception]] = []
        for v in sorted((v for v in self.buffer.manifest_versions() if v > current), reverse=True):
            try:
                m = self.buffer.manifest(v)
            except ValueError as e:  # e.g. {"schema": 2} of a newer learner: the older ones still serve
                if (v, UNREADABLE) not in rejected:
                    refused.append(((v, UNREADABLE), e))
                continue
            if m is None or (m.version, m.sha256) in rejected:
                continue
            try:
                confine(m.path, self.weight_roots)  # a manifest path from Redis: never outside the run
                if not defer:
                    verify(m)
            except WeightIntegrityError as e:
                refused.append(((m.version, m.sha256), e))
                continue
            return m, refused
        return None, refused

    def _hinted(self, m: WeightManifest) -> WeightManifest | None:
        """The manifest of the newest notification, if it is newer than the served version and not
        refused before; confined as the registry's are (and verified inside the swap, as they are). A
        path outside the run is ignored, not remembered as refused: the registry's entry of the same
        version and digest decides then."""
        current = -1 if self.engine.version is None else self.engine.version
        if m.version <= current or (m.version, m.sha256) in self._rejected:
            return None
        try:
            confine(m.path, self.weight_roots)
        except WeightIntegrityError as e:
            log.warning("%s: ignoring the notification of v%d: %s", self.actor_id, m.version, e)
            return None
        return m

    async def _maybe_swap(self, first: bool = False, hint: WeightManifest | None = None) -> bool:
        """Serve the newest valid manifest if it is newer than the served version; True if swapped.

        ``hint``: the manifest the newest version notification carried (the registry's entry when it
        was published). Tried first, without reading the registry: in a synchronous run that read (two
        round trips in a thread) sat between the learner's publish and the swap (demo sync step, from
        the actor's wake-up to the stage RPC: 1.4-1.6 -> 0.6 ms). Refused or stale, the registry decides
        as without it."""
        assert self.engine is not None
        mode = "in_flight" if first else self.swap_mode
        if self.receiver is not None:  # nccl: the learner drives; join its group / take part in its round
            res = await self.receiver.poll(mode)
            if res is None:
                return False
        else:
            gone: set[tuple[int, str]] = set()  # files that vanished: skipped in this call only
            while True:  # the newest candidate; refused (it did not verify): the next older one
                m = self._hinted(hint) if hint is not None else None
                hint = None  # the newest candidate only: after a refusal, the registry's next older one
                if m is not None and (m.version, m.sha256) in gone:
                    m = None
                if m is None:
                    m = await self._newest_valid_manifest(defer=True, skip=frozenset(gone))
                if m is None or not (first or self._swap_due(m.version)):
                    return False
                try:
                    res = await self.engine.swap_weights(
                        m.path, m.version, mode, verify=lambda m=m: asyncio.to_thread(verify, m)
                    )
                    break
                except WeightFileGone as e:  # pruned or recycled since: newer weights replaced it
                    gone.add((m.version, m.sha256))
                    self.counters["weight_rejects"] += 1
                    log.warning("%s: weights v%d vanished before the swap: %s", self.actor_id, m.version, e)
                except WeightIntegrityError as e:  # the old weights keep serving (nothing half-loaded)
                    self._refuse(m, e)
        t_end = time.time()  # the swap returned just now after pausing the engine for pause_s
        # Workers admitted for this version while it was prepared (group_worker._await_swap) submit
        # their groups before the bookkeeping below runs: the engine gets them all at once.
        await asyncio.sleep(0)
        self.counters["version"] = res.version
        if not first:
            self.counters["swaps"] += 1
            self.counters["swap_pause_s"].append(res.pause_s)
            self.counters["swap_pause_hist"].observe(res.pause_s)
            self.timeline.record(
                "swap", t_start=t_end - res.pause_s, pause_s=res.pause_s, version=res.version
            )
        waker = getattr(self, "_waker", None)
        if waker is not None:  # workers refused for stale weights (refuse_stale_weights) may start now
            waker.pulse()
        # INFO once per engine (its first version); every later swap at DEBUG: one line per published
        # version grew the actor's log with the steps (asyncrl.actors.engine_logs). The swaps are in
        # the actor's metrics (swaps, swap pause) and its timeline.
        (log.info if first else log.debug)("%s: serving v%d (%s, pause %.3fs, prepare %.3fs)", self.actor_id,
                                           res.version, res.mode, res.pause_s, res.prepare_s)  # fmt: skip
        await self._heartbeat_async()
        return True

    def _swap_due(self, newest: int) -> bool:
        """``actors.swap_min_lag``: swap once ``newest`` is that many versions ahead of the served one,
        or at once while a group worker waits on admission. Invariant: a worker refused for stale weights
        counts as waiting (``admission_blocked``) until it is admitted, so it is never left waiting for a
        swap that the lag alone would not trigger (no deadlock when the learner needs its group)."""
        lag = self.cfg.actors.swap_min_lag
        served = self.engine.version
        return lag <= 1 or served is None or newest - served >= lag or self.counters["admission_blocked"] > 0

    async def _watch_versions(self) -> None:
        """Swap on newer manifests (see :meth:`_swap_due`). Pub/sub wakes us early and hands over the
        manifest it registered (tried first); the registry is authoritative (the timed poll, a refused
        or stale hint). A group worker that starts waiting on admission wakes us too (``_swap_hint``)."""
        sub = await asyncio.to_thread(self.buffer.subscribe_versions)
        hint = asyncio.Event()  # never set at swap_min_lag 1: every new version is due anyway
        if self.cfg.actors.swap_min_lag > 1:
            self._swap_hint = hint
        poll: asyncio.Future | None = None
        try:
            while not self._stop_requested:
                await self._maybe_eval()  # before looking for newer weights: eval pins the version
                # nccl: the learner waits for every actor to start a round, so look often.
                if poll is None:
                    timeout = MANIFEST_POLL_S if self.receiver is None else NCCL_POLL_S
                    poll = asyncio.ensure_future(asyncio.to_thread(sub.latest_note, timeout))
                woke = asyncio.ensure_future(hint.wait())
                try:
                    await asyncio.wait((poll, woke), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woke.cancel()
                hint.clear()
                note = None
                if poll.done():  # else it keeps reading in its thread; the next turn waits on it again
                    poll, done = None, poll
                    note = done.result()
                await self._maybe_swap(hint=None if note is None else note["manifest"])
        finally:
            self._swap_hint = None
            if poll is None:
                sub.close()
            else:  # never close the subscription under the thread reading it
                poll.add_done_callback(lambda _: sub.close())

    async def _maybe_eval(self) -> None:
        """Periodic eval (actor 0, every eval.every versions) on the served weights; see asyncrl.evaluate."""
        ev, engine = self.evaluator, self.engine
        if ev is not None and engine is not None and ev.due(engine.version):
            await ev.run(engine.llm, self._tokenizer, engine.version)
            await self._heartbeat_async()  # the learner picks the result up from the heartbeat
