"""Staleness admission: the one function that bounds how far actors may run ahead.

Invariant (DESIGN.md, "Staleness control"): an actor may start a new group only while

    admitted < (V + max_staleness + 1) * groups_per_step + credits

where V is the learner's current policy version. The check and the increment of
``admitted`` happen in one Lua script, so concurrent actors can never overshoot the bound:
Redis runs scripts atomically, and V is read inside the script rather than passed in, so a
stale V cached by an actor cannot widen the bound either.

Every group the learner drops (too stale, filtered, malformed) must return one credit;
otherwise dropped groups would permanently use up admission and the pipeline would
deadlock waiting for groups that will never arrive. With ``max_staleness = 0`` the bound
is ``(V + 1) * groups_per_step`` (+ credits): actors produce exactly one step's worth of
groups per version, i.e. synchronous on-policy training.

Retry safety (connection.py retries commands through Redis outages): a retried admission or
credit whose first execution succeeded but whose reply was lost must not count twice. Each call
carries a request id; the script records it in a dedup key (``Keys.request``, expiring after
:data:`DEDUP_TTL_S`, far longer than any retry budget) in the same atomic step as its effect, and a
repeat of the same request returns the recorded outcome without touching the counters.

A write that failed after the retry budget may still run later (a frozen server executes what an
abandoned connection had sent). Such a request is remembered as *uncertain* and settled before the
next admission, credit or reclaim of this client (:meth:`Admission.settle`): its dedup key is set to a
tombstone if the write has not run (so it never will), and an admission that did run is given back
(the caller never used that slot). Without this a late admission would hold a slot nobody uses and a
late credit could repeat one that a reclaim already made.

Forks (a learner resumed from an older checkpoint while newer versions were published): it
publishes the restored weights as ``max published + 1`` (asyncrl.learner.loop), so V jumps ahead of
the steps the slots count by J = that version - the checkpoint's. The groups of the discarded steps
are either trained again (still pending) or credited as lost, so the slot count is that of the
checkpoint's step: without a correction the window would stay J * groups_per_step slots too wide for
the rest of the run (measured in the chaos test: a fork of 3 versions, 4 groups dropped as stale every
second step from then on, 396 in 200 steps). The learner therefore sets the run's total skew (the sum
of its forks, carried in its checkpoints) and :meth:`Admission.set_version_skew` debits the credits
by the change times the groups per version, in one script: the bound and :func:`slot_version` then
count on the new version axis, and the admission ledger reads
``admitted = credits + skew * groups_per_version + in flight + in the stream + trained``. Setting an
absolute total (not adding a delta) makes it idempotent: a learner that crashes again and forks from
the same checkpoint sets its own total, and a debit made by a discarded fork is undone.

Steps without a publication (``learner.publish_policy=taken``: the learner publishes only once the
actors serve the previous version): the learner still consumes ``groups_per_step`` groups per step, so
a window counted in versions would stop moving while the learner drains it, and the learner would
starve waiting for data that admission no longer lets anyone start. Each such step lowers the skew by
one (negative skew: steps ahead of versions), which returns ``groups_per_step`` credits: the window
advances per learner step. :func:`slot_version` then counts in steps and over-estimates the version
that will train a slot (versions advance at most once per step), which can only refuse more, and the
current weights V still always pass; staleness at train time stays exact, in versions.

Wake-ups (no fixed poll): everything that can raise the bound — a credit, a reclaim, a settled
admission given back, a dropped or dead-lettered group, a new version, a new adaptive bound — also
PUBLISHes a hint on the run's admission channel (inside the same script where it is one, after the
write otherwise). A refused actor waits on :class:`AdmissionEvents` (that channel plus the weight
versions channel) and retries at once; it still retries every ``actors.admission_poll_s`` because
pub/sub is fire-and-forget (a subscriber that is reconnecting misses hints). The channel name carries
the run's hash tag, and PUBLISH reaches every node of a Redis Cluster.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import msgpack
import redis

# The scripts live in admission_lua.py; the names other modules import from here stay importable here.
from asyncrl.buffer.admission_lua import (
    ADMIT_LUA,
    CREDIT_LUA,
    RECLAIM_LUA,
    SETTLE_LUA,
    SKEW_LUA,
    TAKE_SLOT_LUA,
    WAKE_SCHEMA,
    wake_lua,
)
from asyncrl.buffer.layout import Keys

__all__ = [
    "ADMIT_LUA",
    "TAKE_SLOT_LUA",
    "DEDUP_TTL_S",
    "WAKE_SCHEMA",
    "admission_bound_formula",
    "slot_version",
    "check_admission_args",
    "Admission",
    "AdmissionEvents",
    "wake_lua",
]

#: Lifetime of a request-id dedup key (seconds): far above any retry budget, short enough to not pile up.
DEDUP_TTL_S = 3600


def wake_message(event: str) -> bytes:
    return msgpack.packb({"schema": WAKE_SCHEMA, "event": event}, use_bin_type=True)


def check_admission_args(max_staleness: int, groups_per_step: int) -> None:
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
    if isinstance(groups_per_step, bool) or not isinstance(groups_per_step, int) or groups_per_step < 1:
        raise ValueError(f"groups_per_step must be an int >= 1, got {groups_per_step!r}")


def admission_bound_formula(version: int, max_staleness: int, groups_per_step: int, credits: int) -> int:
    """The bound the Lua script enforces, in Python (for stats and tests)."""
    return (version + max_staleness + 1) * groups_per_step + credits


def slot_version(slot: int, groups_per_step: int, credits: int) -> int:
    """The learner version expected to train the ``slot``-th admitted group (1-based), as the script computes it.

    The learner trains ``groups_per_step`` groups per version in arrival order, and every dropped group
    returned a credit, so slot k is trained at version ceil((k - credits) / groups_per_step) - 1. The
    window of a version V runs to slot (V + eta + 1) * groups_per_step + credits, so its last
    ``groups_per_step`` slots are trained at V + eta: a group started there on weights v < V would be
    V + eta - v > eta versions stale, i.e. dropped. Measured on the demo at max_staleness 1 before this
    check: about a third of all generated groups (194-200 of ~600 per 100 steps) were such groups, each
    publish opening the last slots to workers still on the previous weights. With ``sampler_version`` the
    script refuses them (the worker swaps first; V is published, so it always can), which at
    max_staleness 0 is exactly the old rule. It is a prediction (arrival order can differ from admission
    order): the drop at train time stays the guarantee.
    """
    return -(-(slot - credits) // groups_per_step) - 1


_TRANSIENT = (redis.ConnectionError, redis.TimeoutError)


class Admission:
    """Redis-side admission for one run. Thread-safe (the scripts, plus a locked list of uncertain
    requests to settle)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._keys = keys
        # redis-py's Script uses EVALSHA and reloads on NOSCRIPT, so a Redis restart
        # (which empties the script cache) is handled transparently.
        self._script = client.register_script(ADMIT_LUA)
        self._reclaim = client.register_script(RECLAIM_LUA)
        self._credit = client.register_script(CREDIT_LUA)
        self._settle = client.register_script(SETTLE_LUA)
        self._skew = client.register_script(SKEW_LUA)
        self._uncertain: list[tuple[str, str | bytes, str]] = []  # (kind, dedup key, owner)
        self._uncertain_lock = threading.Lock()
        # try_admit runs once per group: its keys are encoded once here (redis-py encodes every str
        # argument on every call, ~8 us of a ~70 us round trip for these six).
        enc = str.encode
        self._admit_keys = tuple(map(enc, (keys.admitted, keys.credits, keys.version, keys.inflight)))
        self._bound_key = enc(keys.staleness_bound)
        self._request_prefix = enc(keys.request(""))  # + the request id = keys.request(id)

    def uncertain(self, kind: str, dedup_key: str | bytes, owner: str | None) -> None:
        """Remember a write whose reply never came (settled by :meth:`settle`)."""
        with self._uncertain_lock:
            self._uncertain.append((kind, dedup_key, owner or ""))

    def settle(self) -> int:
        """Settle the uncertain requests (see the module doc); returns the slots given back."""
        with self._uncertain_lock:
            todo, self._uncertain = self._uncertain, []
        k, given = self._keys, 0
        try:
            while todo:
                kind, key, owner = todo[0]
                given += int(
                    self._settle(
                        keys=[key, k.credits, k.inflight],
                        args=[owner, DEDUP_TTL_S, kind, k.admission_channel],
                    )
                )
                todo.pop(0)
        finally:
            if todo:
                with self._uncertain_lock:
                    self._uncertain[:0] = todo
        return given

    def try_admit(
        self,
        max_staleness: int,
        groups_per_step: int,
        sampler_version: int | None = None,
        owner: str | None = None,
    ) -> bool:
        """Atomically admit one group if under the bound; True if the caller may start it.

        ``sampler_version``: the policy version the caller would sample with. When given, a caller
        whose weights are already more than ``max_staleness`` behind V, or would be at the version
        expected to train the slot it would take (:func:`slot_version`), is refused (without using a
        slot): its group would be dropped at train time anyway, and with ``max_staleness = 0`` this
        is what makes the pipeline exactly synchronous (no group starts on superseded weights).
        ``owner``: an actor id; the slot is then also counted in the owner's in-flight tally, so a
        crashed owner's slots can be turned back into credits by :meth:`reclaim` when it restarts.
        """
        check_admission_args(max_staleness, groups_per_step)
        if self._uncertain:  # an unlocked look: one appended meanwhile is settled by the next call
            self.settle()
        sv = -1 if sampler_version is None else int(sampler_version)
        # One request id per call (a uuid4's 128 random bits): redis-py's retries resend the same
        # arguments, so a lost reply re-runs into the dedup key instead of a second INCR (see the
        # module docstring).
        dedup = self._request_prefix + os.urandom(16).hex().encode()
        try:
            ok, _admitted, _bound = self._script(
                keys=[*self._admit_keys, dedup, self._bound_key],
                args=[max_staleness, groups_per_step, sv, owner or "", DEDUP_TTL_S],
            )
        except _TRANSIENT:
            self.uncertain("admit", dedup, owner)
            raise
        return ok == 1

    def reclaim(self, owner: str) -> int:
        """Credit back every slot ``owner`` was admitted for and never wrote nor credited (it died)."""
        self.settle()
        k = self._keys
        return int(self._reclaim(keys=[k.inflight, k.credits], args=[owner, k.admission_channel]))

    def credit(self, n: int = 1, owner: str | None = None, request_id: str | None = None) -> int:
        """Return ``n`` admission slots (one per dropped group). Returns total credits.

        ``owner``: the actor giving back slots it was admitted for (aborted groups): its in-flight
        tally drops by ``n`` in the same transaction. ``request_id``: makes the credit idempotent
        across calls too (e.g. the group id of the group given up); default: unique per call, which
        still makes redis-py's retries of this call safe.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"credit count must be an int >= 0, got {n!r}")
        if n == 0:
            return int(self._client.get(self._keys.credits) or 0)
        self.settle()
        k = self._keys
        dedup = k.request(f"credit:{request_id}" if request_id else uuid.uuid4().hex)
        try:
            return int(
                self._credit(
                    keys=[k.credits, k.inflight, dedup],
                    args=[n, owner or "", DEDUP_TTL_S, k.admission_channel],
                )
            )
        except _TRANSIENT:
            self.uncertain("credit", dedup, owner)
            raise

    def counters(self) -> tuple[int, int, int]:
        """(version, admitted, credits), read in one round trip (MGET is atomic)."""
        k = self._keys
        version, admitted, credits = self._client.mget([k.version, k.admitted, k.credits])
        return int(version or 0), int(admitted or 0), int(credits or 0)

    def bound(self, max_staleness: int, groups_per_step: int) -> int:
        """Current admission bound for these settings (with the adaptive bound when one is set)."""
        check_admission_args(max_staleness, groups_per_step)
        version, _admitted, credits = self.counters()
        return admission_bound_formula(version, self.staleness_bound(max_staleness), groups_per_step, credits)

    def set_staleness_bound(self, bound: int | None) -> None:
        """Set the adaptive staleness bound the admission script reads (None removes it).

        It can only tighten: the script uses ``min(max_staleness, bound)``, so a bound above
        ``max_staleness`` changes nothing and the hard drop bound at train time is never exceeded.
        """
        if bound is None:
            self._client.delete(self._keys.staleness_bound)
        elif isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ValueError(f"staleness bound must be an int >= 0 or None, got {bound!r}")
        else:
            self._client.set(self._keys.staleness_bound, bound)
        self.wake("bound")  # it may have loosened

    def set_version_skew(self, skew: int, groups_per_version: int) -> int:
        """Set the run's version skew (versions minus learner steps: the versions its learner's forks
        skipped, minus its steps that published nothing under ``learner.publish_policy=taken``) and move
        the credits by the change times ``groups_per_version`` (module doc, "Forks" and "Steps without a
        publication"); returns the change. Idempotent: the same total twice changes nothing the second time."""
        if isinstance(skew, bool) or not isinstance(skew, int):
            raise ValueError(f"version skew must be an int, got {skew!r}")
        if (
            isinstance(groups_per_version, bool)
            or not isinstance(groups_per_version, int)
            or groups_per_version < 1
        ):
            raise ValueError(f"groups per version must be an int >= 1, got {groups_per_version!r}")
        k = self._keys
        return int(
            self._skew(keys=[k.credits, k.version_skew], args=[skew, groups_per_version, k.admission_channel])
        )

    def version_skew(self) -> int:
        return int(self._client.get(self._keys.version_skew) or 0)

    def wake(self, event: str) -> int:
        """Publish an admission hint (after a write that may raise the bound); returns the receivers."""
        return int(self._client.publish(self._keys.admission_channel, wake_message(event)))

    def staleness_bound(self, max_staleness: int) -> int:
        """The staleness bound admission applies now: ``max_staleness``, or the adaptive one if lower."""
        v = self._client.get(self._keys.staleness_bound)
        return max_staleness if v is None else min(max_staleness, int(v))


class AdmissionEvents:
    """What a refused actor waits on: the run's admission channel and its weight-versions channel (a
    publish bumps V). Messages are hints, never parsed for content: the admission script decides.
    Thread-safe for one waiting thread (the actor's watcher)."""

    def __init__(self, client: redis.Redis, keys: Keys, confirm_timeout: float = 5.0) -> None:
        self._pubsub = client.pubsub()
        channels = [keys.admission_channel, keys.versions_channel]
        self._pubsub.subscribe(*channels)
        # Only once the server confirmed both subscriptions is a later PUBLISH guaranteed to reach us.
        deadline = time.monotonic() + confirm_timeout
        confirmed = 0
        while confirmed < len(channels):
            msg = self._pubsub.get_message(timeout=max(deadline - time.monotonic(), 0.0))
            if msg is not None and msg["type"] == "subscribe":
                confirmed += 1
            elif time.monotonic() >= deadline:
                self._pubsub.close()
                raise TimeoutError(f"no confirmation of SUBSCRIBE {channels} within {confirm_timeout}s")

    def wait(self, timeout: float) -> bool:
        """True as soon as a hint arrives (then drains any queued ones), False after ``timeout`` s."""
        msg = self._pubsub.get_message(timeout=timeout)
        if msg is None or msg["type"] != "message":
            return False
        while (more := self._pubsub.get_message(timeout=0.0)) is not None and more["type"] == "message":
            pass
        return True

    def close(self) -> None:
        self._pubsub.close()
