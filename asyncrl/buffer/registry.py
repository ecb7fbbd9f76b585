"""Run registry: weight manifests, version notifications, actor heartbeats, learner status.

A mixin of :class:`asyncrl.buffer.replay.ReplayBuffer` (it uses ``self._client`` and
``self.keys``), kept apart because it is control-plane state, not the data path.
All values are msgpack; the version key is shared with admission (layout.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import msgpack
import redis

from asyncrl.buffer.layout import Keys
from asyncrl.buffer.subscription import NOTIFICATION_SCHEMA, VersionSubscription
from asyncrl.buffer.weights import WeightManifest

__all__ = [
    "RunRegistry",
    "PUBLISH_WEIGHTS_LUA",
    "LearnerHeartbeat",
    "LEARNER_HEARTBEAT_S",
    "LEARNER_SILENT_S",
]

log = logging.getLogger(__name__)

#: A live learner stamps ``alive`` into its status this often, from a thread: the loop itself writes
#: only as a state begins (waiting, training), and a wait or a step can last minutes.
LEARNER_HEARTBEAT_S = 5.0
#: ``asyncrl status`` calls a learner silent this long (and not stopped) gone or frozen.
LEARNER_SILENT_S = 3 * LEARNER_HEARTBEAT_S

# KEYS: weights, version. ARGV: version (decimal), manifest bytes, versions channel, notification, keep.
# Stores the manifest, sets V, deletes the manifests of all but the newest `keep` versions (keep 0:
# none), then notifies, in that order, in one call; returns {receivers, dropped version, ...}. Only
# decimal keys are versions (what publishers write); any other key of the hash is left alone.
PUBLISH_WEIGHTS_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
local keep = tonumber(ARGV[5]) or 0
local out = {0}
if keep > 0 then
  local held = {}
  for _, key in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.match(key, '^%d+$') then table.insert(held, {tonumber(key), key}) end
  end
  table.sort(held, function(a, b) return a[1] < b[1] end)
  for i = 1, #held - keep do
    redis.call('HDEL', KEYS[1], held[i][2])
    table.insert(out, held[i][2])
  end
end
out[1] = redis.call('PUBLISH', ARGV[3], ARGV[4])
return out
"""


def _s(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


class RunRegistry:
    """Weights registry and liveness records of one run (mixin; see module docstring)."""

    _client: redis.Redis
    keys: Keys
    _publish_weights_script: Any  # PUBLISH_WEIGHTS_LUA, registered by ReplayBuffer

    # ------------------------------------------------------------------ weights registry

    def publish_weights(self, manifest: WeightManifest) -> int:
        """Store the manifest, set V = manifest.version, then notify: one script call.

        A script runs whole, so a subscriber woken by the notification always finds the new version in
        the registry; one call, where a MULTI and a PUBLISH after it (a Redis Cluster refuses PUBLISH
        inside a MULTI, not inside a script on the run's slot) were two round trips between the
        learner's write and the actors' swap. A retried call writes the same values and notifies again
        (a subscriber sees that version twice; the actor's watcher then has nothing to do). The
        notification carries the manifest's bytes as registered, so a subscriber acting on it at once
        needs no registry read (the actor's swap path: two round trips and a thread hop less).

        Returns the number of subscribers that received the notification. Subscribers can
        miss notifications while disconnected, so they should also poll :meth:`version`.
        """
        return self.publish_weights_pruned(manifest, 0)[0]

    def publish_weights_pruned(self, manifest: WeightManifest, keep_versions: int) -> tuple[int, list[int]]:
        """:meth:`publish_weights` that also deletes the manifests of all but the newest
        ``keep_versions`` versions (0: none) before it notifies, in the same script call.

        Returns ``(receivers, dropped versions ascending)``; the caller frees the dropped versions'
        storage. One round trip: the learner's publish made three (register, HKEYS, HDEL), the last two
        after the notification had woken the actors, whose swap then shared the cores with them. A
        retried call drops nothing more and so returns no version the first call dropped.
        """
        if keep_versions < 0:
            raise ValueError("keep_versions must be >= 0")
        k = self.keys
        data = manifest.to_bytes()
        note = {
            "schema": NOTIFICATION_SCHEMA,
            "version": manifest.version,
            "path": manifest.path,
            "sha256": manifest.sha256,
            "manifest": data,  # the registered bytes
        }
        args = [str(manifest.version), data, k.versions_channel, msgpack.packb(note, use_bin_type=True),
                str(int(keep_versions))]  # fmt: skip
        out = self._publish_weights_script(keys=[k.weights, k.version], args=args)
        return int(out[0]), [int(v) for v in out[1:]]

    def manifest(self, version: int) -> WeightManifest | None:
        data = self._client.hget(self.keys.weights, str(version))
        return None if data is None else WeightManifest.from_bytes(data)

    def manifest_versions(self) -> list[int]:
        """The registered versions, ascending. A key that is not a decimal version (written by
        something else than a publisher) is skipped: it must not stop readers of the valid ones."""
        versions = []
        for key in self._client.hkeys(self.keys.weights):
            try:
                versions.append(int(key))
            except ValueError:
                continue
        return sorted(versions)

    def latest_manifest(self) -> WeightManifest | None:
        """The manifest with the highest version, or None if none was published."""
        versions = self.manifest_versions()
        return self.manifest(versions[-1]) if versions else None

    def prune_manifests(self, keep_versions: int | Iterable[int]) -> list[int]:
        """Delete manifests: an int keeps the newest N, an iterable keeps exactly those.

        Returns the deleted versions (so the caller can free them in its transport).
        """
        versions = self.manifest_versions()
        if isinstance(keep_versions, int):
            if keep_versions < 0:
                raise ValueError("keep_versions must be >= 0")
            drop = versions[: max(len(versions) - keep_versions, 0)]
        else:
            keep = {int(v) for v in keep_versions}
            drop = [v for v in versions if v not in keep]
        if drop:
            self._client.hdel(self.keys.weights, *[str(v) for v in drop])
        return drop

    def subscribe_versions(self, confirm_timeout: float = 5.0) -> VersionSubscription:
        """Subscribe to version notifications; returns once the subscription is active."""
        return VersionSubscription(self._client, self.keys.versions_channel, confirm_timeout)

    # ------------------------------------------------------------------ the run's prompt order

    def claim_prompt_seq(self) -> int:
        """The next position of the run's one prompt order (0, 1, ...), claimed atomically: every actor
        of every pool takes its prompts from it, so no two groups share a position (nor, seeded by it,
        their samples) whatever the number of actors and pools, and a restart or a changed
        ``actors.num_actors`` continues where the run was. A position whose reply was lost is skipped
        (a retried INCR), and one claimed by an actor killed before it wrote its group is not redone."""
        return int(self._client.incr(self.keys.prompt_seq)) - 1

    def prompts_claimed(self) -> int:
        """Positions of the prompt order claimed so far."""
        return int(self._client.get(self.keys.prompt_seq) or 0)

    def mark_poison_prompt(self, prompt_id: str, max_model_len: int, reason: str) -> bool:
        """Remember for the run that the engine refused ``prompt_id`` (the request itself is bad: longer
        than ``model.max_model_len``, ...) at that limit; True for the first such record of the prompt at
        that limit (its dead letter is written then), False when one exists (another actor or pool was
        first). One HSETNX: a retried call finds its own record and says False, its dead letter unwritten."""
        field = f"{int(max_model_len)}:{prompt_id}"
        return bool(self._client.hsetnx(self.keys.poison_prompts, field, reason))

    def poison_prompts(self, max_model_len: int) -> dict[str, str]:
        """Prompt id -> reason of the prompts refused at a ``model.max_model_len`` of ``max_model_len`` or
        more: refused now too (a resume with the limit raised asks the engine again). Actors skip them."""
        out: dict[str, str] = {}
        for field, reason in self._client.hgetall(self.keys.poison_prompts).items():
            limit, _, prompt_id = _s(field).partition(":")
            try:
                if int(limit) >= max_model_len:
                    out[prompt_id] = _s(reason)
            except ValueError:  # a field not written by mark_poison_prompt: not ours to read
                continue
        return out

    # ------------------------------------------------------------------ heartbeats and status

    def heartbeat(self, actor_id: str, info: Mapping[str, Any]) -> None:
        """Record ``info`` (msgpack-able) for ``actor_id``; ``time`` defaults to now."""
        payload = {"time": time.time(), **info}
        self._client.hset(self.keys.actors, actor_id, msgpack.packb(payload, use_bin_type=True))

    def actors(self) -> dict[str, dict[str, Any]]:
        """actor_id -> last heartbeat info. Unreadable entries are reported, not raised."""
        out: dict[str, dict[str, Any]] = {}
        for actor_id, data in self._client.hgetall(self.keys.actors).items():
            try:
                out[_s(actor_id)] = dict(msgpack.unpackb(data, raw=False))
            except Exception as exc:
                out[_s(actor_id)] = {"error": f"unreadable heartbeat: {exc}"}
        return out

    def lagging_actors(self, version: int, timeout_s: float, now: float | None = None) -> list[str]:
        """Live actors that do not serve ``version`` yet (``learner.publish_policy=taken``).

        An actor writes a heartbeat right after every swap, so its ``version`` is current within a
        Redis round trip. Not counted: actors whose last heartbeat is older than ``timeout_s`` (dead or
        frozen: waiting for them would stall publishing until the step cap), actors stopping or stopped,
        and actors that serve no version yet (they load the newest one when they come up)."""
        now = time.time() if now is None else now
        lagging = []
        for actor_id, info in self.actors().items():
            if "error" in info or now - float(info.get("time", 0.0)) > timeout_s:
                continue
            if info.get("state") in ("stopping", "stopped") or int(info.get("version", -1)) < 0:
                continue
            if int(info["version"]) < version:
                lagging.append(actor_id)
        return sorted(lagging)

    def remove_actor(self, actor_id: str) -> None:
        self._client.hdel(self.keys.actors, actor_id)

    def set_learner_status(self, status: Mapping[str, Any]) -> None:
        """Update (merge) learner status fields; values are msgpack-encoded. Every write also stamps
        ``updated`` (unix seconds): the learner's own ``time`` field counts from its start."""
        if status:
            mapping = {str(k): msgpack.packb(v, use_bin_type=True) for k, v in status.items()}
            mapping["updated"] = msgpack.packb(time.time(), use_bin_type=True)
            self._client.hset(self.keys.learner, mapping=mapping)

    def beat_learner(self) -> None:
        """Stamp ``alive`` (unix s) into the learner status; its state and ``updated`` stay as written."""
        self._client.hset(self.keys.learner, "alive", msgpack.packb(time.time(), use_bin_type=True))

    def learner_status(self) -> dict[str, Any]:
        raw = self._client.hgetall(self.keys.learner)
        return {_s(k): msgpack.unpackb(v, raw=False) for k, v in raw.items()}


class LearnerHeartbeat:
    """Rank 0's liveness stamp, every ``interval_s`` from a daemon thread (first one at once).

    It dies with the process (kill -9) and stops with it (SIGSTOP), which is what ``asyncrl status``
    reads: a learner killed while it waited for data otherwise kept reading "waiting for data for Ns".
    Redis errors are logged and the beat goes on (this thread is its own supervision boundary: the
    loop's own Redis calls decide whether the learner survives an outage)."""

    def __init__(self, registry: RunRegistry, interval_s: float = LEARNER_HEARTBEAT_S) -> None:
        self._registry = registry
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.failures = 0  # beats that did not reach Redis
        self._thread = threading.Thread(target=self._run, name="learner-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._registry.beat_learner()
            except redis.RedisError as e:
                self.failures += 1
                log.warning("learner heartbeat not written (%d so far): %s", self.failures, e)
            if self._stop.wait(self._interval_s):
                return

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop beating (before the client closes); a beat stuck in a Redis retry is left behind."""
        self._stop.set()
        self._thread.join(timeout_s)
