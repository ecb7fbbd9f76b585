"""Event-driven admission retries: a refused group worker wakes on a credit or a publish, not a timer.

A refused admission can only succeed after the bound rose: a credit (dropped, aborted, abandoned or
reclaimed group), a new policy version, or a looser adaptive bound. Each of those publishes a hint on
the run's admission channel or its versions channel (asyncrl.buffer.admission). :class:`AdmissionWaker`
holds one subscription to both in a daemon thread and turns every hint into a pulse on the actor's
event loop: the current :attr:`event` is set and replaced by a fresh one.

Invariant (no lost wake-up): a worker captures :attr:`event` *before* its admission attempt and waits
on that object; a hint that arrives while the attempt is in flight sets it, so the wait returns at once.
The actor pulses it too, right after its engine swapped (a refusal for stale weights ends there).
The actor still retries every ``actors.admission_poll_s`` (hints are fire-and-forget: a subscription
that is reconnecting misses them); after a reconnect the waker pulses once, since it may have missed one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

__all__ = ["AdmissionWaker"]

log = logging.getLogger(__name__)

_WAIT_S = 0.5  # longest single blocking read: bounds how long stop() waits for the thread


class AdmissionWaker:
    """One actor's admission-hint subscription, pulsing :attr:`event` on ``loop``."""

    def __init__(self, buffer: Any, loop: asyncio.AbstractEventLoop, name: str = "") -> None:
        self.buffer = buffer
        self.event = asyncio.Event()
        self.hints = 0  # pulses delivered (metrics, tests)
        self._loop = loop
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"admission-wake-{name}", daemon=True)

    def start(self, timeout: float = 10.0) -> AdmissionWaker:
        """Start the thread; returns once subscribed (or after ``timeout``: the poll still works)."""
        self._thread.start()
        self._ready.wait(timeout)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(_WAIT_S * 4)

    def _pulse(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.pulse)

    def pulse(self) -> None:
        """Wake the waiting workers now (loop thread only). Also called by the actor itself after its
        engine swapped: a worker refused for stale weights can only be admitted after that, and no
        Redis hint announces it (waiting for the next poll cost ~half of ``actors.admission_poll_s``
        per synchronous step)."""
        # On the loop thread: wake every worker waiting on the current event, and give later attempts a
        # fresh one (a set event would make them spin).
        ev, self.event = self.event, asyncio.Event()
        self.hints += 1
        ev.set()

    def _run(self) -> None:
        sub = None
        failures = 0
        while not self._stop.is_set():
            try:
                if sub is None:
                    sub = self.buffer.subscribe_admission()
                    self._ready.set()
                    if failures:
                        self._pulse()  # hints sent while we were away are lost: retry once now
                    failures = 0
                if sub.wait(_WAIT_S):
                    self._pulse()
            except Exception as e:  # Redis away: the actor's poll carries on; resubscribe with backoff
                failures += 1
                if failures == 1:
                    log.warning("admission hints unavailable (%s: %s); retrying", type(e).__name__, e)
                if sub is not None:
                    try:
                        sub.close()
                    except Exception:
                        pass
                    sub = None
                self._stop.wait(min(0.2 * 2**failures, 5.0))
        if sub is not None:
            try:
                sub.close()
            except Exception as e:
                log.debug("closing the admission subscription: %s", e)
