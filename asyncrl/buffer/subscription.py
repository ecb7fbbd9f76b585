"""Weight-version notifications: a small wrapper over a Redis pub/sub subscription.

The learner publishes ``{schema, version, path, sha256, manifest}`` (msgpack; ``manifest``: the
registered manifest's bytes) on the run's versions channel each time it publishes weights, after the
registry transaction. Pub/sub is fire-and-forget: a subscriber that is disconnected misses messages,
so a notification is only a hint that wakes the actor early; its manifest is the registry's entry at
publish time (what a registry read right then returns), and actors fall back to the authoritative
registry whenever no notification came (their periodic poll) or its manifest is refused.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import redis

from asyncrl.buffer.weights import WeightManifest

__all__ = ["NOTIFICATION_SCHEMA", "VersionSubscription"]

log = logging.getLogger(__name__)

NOTIFICATION_SCHEMA = 1


class VersionSubscription:
    """Subscription to one run's version channel. Not thread-safe: one reader per instance."""

    def __init__(self, client: redis.Redis, channel: str, confirm_timeout: float = 5.0) -> None:
        self.channel = channel
        self._pubsub = client.pubsub()
        self._pubsub.subscribe(channel)
        # Wait for the server's confirmation: only then is a later PUBLISH (sent on another
        # connection) guaranteed to reach us.
        deadline = time.monotonic() + confirm_timeout
        while True:
            msg = self._pubsub.get_message(timeout=max(deadline - time.monotonic(), 0.0))
            if msg is not None and msg["type"] == "subscribe":
                break
            if time.monotonic() >= deadline:
                self._pubsub.close()
                raise TimeoutError(f"no confirmation of SUBSCRIBE {channel} within {confirm_timeout}s")

    def get_notification(self, timeout: float | None = 0.0) -> dict[str, Any] | None:
        """Next ``{version, path, sha256, manifest}`` notification (``manifest``: a WeightManifest, or
        None where the publisher sent none or an unreadable one), waiting up to ``timeout`` seconds
        (None: forever). Malformed notifications (no valid version) are logged and skipped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            msg = self._pubsub.get_message(timeout=remaining if remaining is not None else 3600.0)
            if msg is not None and msg["type"] == "message":
                note = _parse(msg["data"])
                if note is not None:
                    return note
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def get(self, timeout: float | None = 0.0) -> int | None:
        """The next published version, or None if none arrived within ``timeout`` seconds."""
        note = self.get_notification(timeout)
        return None if note is None else note["version"]

    def latest(self, timeout: float | None = 0.0) -> int | None:
        """Wait up to ``timeout`` for a notification, then drain queued ones; newest version."""
        note = self.latest_note(timeout)
        return None if note is None else note["version"]

    def latest_note(self, timeout: float | None = 0.0) -> dict[str, Any] | None:
        """Wait up to ``timeout`` for a notification, then drain queued ones; the newest version's."""
        newest = self.get_notification(timeout)
        while newest is not None:
            nxt = self.get_notification(0.0)
            if nxt is None:
                break
            if nxt["version"] >= newest["version"]:
                newest = nxt
        return newest

    def close(self) -> None:
        self._pubsub.close()

    def __enter__(self) -> VersionSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(data: Any) -> dict[str, Any] | None:
    try:
        note = msgpack.unpackb(data, raw=False)
        version = note["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"bad version {version!r}")
    except Exception as exc:
        log.warning("ignoring malformed version notification: %s", exc)
        return None
    return {"version": version, "path": str(note.get("path", "")), "sha256": str(note.get("sha256", "")),
            "manifest": _manifest(note.get("manifest"), version)}  # fmt: skip


def _manifest(data: Any, version: int) -> WeightManifest | None:
    """The note's manifest, or None (none sent, or unreadable: the note still wakes the subscriber, which
    then reads the registry, e.g. beside a publisher whose manifest format is newer)."""
    if data is None:
        return None
    try:
        manifest = WeightManifest.from_bytes(data)
        if manifest.version != version:
            raise ValueError(f"a manifest of v{manifest.version}")
    except Exception as exc:
        log.warning("version notification of v%d: its manifest is not used (%s)", version, exc)
        return None
    return manifest
