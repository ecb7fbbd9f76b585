"""Repeated warnings, rate-limited: the first few, then one line per window with a count of the rest.

Why: a per-group warning (a group dead-lettered because its reward failed, its prompt was refused)
repeats at the rate groups finish. A reward failing on every call printed ~320 warning lines a second
(two per group: the actor's and the buffer's), through the actor logs and ``asyncrl run``'s console,
burying everything else. :class:`RepeatThrottle` is a :class:`logging.Filter`, added to the loggers
that log per group (:func:`throttle`), so every handler (the actor's log file, the console tailing it,
a ``-v`` terminal) sees the same reduced stream.

What counts as "the same" warning: the rendered message with its numbers and hex ids masked
(:func:`repeat_key`): ``group actor-0-59065c3b96e6 dropped: ... reward for verl-12 is ...`` and the same
line for another group and prompt are one warning; another reason is another.

Per key and window (``window_s``, default 10 s): the first ``burst`` records pass; the rest are
counted, not emitted. The first record of a later window passes with ``(N more like this in the last
T s)`` appended, and while the flood goes on only that one line passes per window; a key quiet for a
whole window starts again with a burst. A count still pending when the flood stops is not emitted on
its own (no timer thread): the dead-letter stream and the counters keep the exact numbers.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RepeatThrottle", "repeat_key", "throttle"]

#: Numbers (``12``, ``0.0``) and hex ids of 8+ characters (a group id's ``59065c3b96e6``).
_VARYING = re.compile(r"[0-9a-f]{8,}|\d+")


def repeat_key(record: logging.LogRecord) -> tuple[str, int, str]:
    """What makes two records "the same warning": logger, level, message with numbers and ids masked."""
    return record.name, record.levelno, _VARYING.sub("#", record.getMessage())


class _Seen:
    __slots__ = ("start", "passed", "suppressed")

    def __init__(self, start: float) -> None:
        self.start, self.passed, self.suppressed = start, 0, 0


class RepeatThrottle(logging.Filter):
    """Rate-limits repeated records (see the module doc). Thread-safe; remembers at most ``max_keys``
    keys (the least recently seen is forgotten first)."""

    def __init__(self, burst: int = 5, window_s: float = 10.0, max_keys: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        super().__init__()
        self.burst, self.window_s, self.max_keys, self.clock = burst, window_s, max_keys, clock
        self._seen: OrderedDict[tuple[str, int, str], _Seen] = OrderedDict()
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget every key (tests)."""
        with self._lock:
            self._seen.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        key = repeat_key(record)
        now = self.clock()
        with self._lock:
            s = self._seen.get(key)
            if s is None:
                s = self._seen[key] = _Seen(now)
                while len(self._seen) > self.max_keys:
                    self._seen.popitem(last=False)
            self._seen.move_to_end(key)
            if now - s.start >= self.window_s:  # a new window
                n, elapsed = s.suppressed, now - s.start
                s.start, s.suppressed = now, 0
                # Still flooding: this line carries the count, and is the window's only one.
                s.passed = self.burst if n else 1
                if n:
                    # Rendered here: the record is this call's own (a logger's filter runs before any
                    # handler), so every handler prints the same annotated line.
                    record.msg = f"{record.getMessage()} ({n} more like this in the last {elapsed:.0f} s)"
                    record.args = None
                return True
            if s.passed < self.burst:
                s.passed += 1
                return True
            s.suppressed += 1
            return False


def throttle(logger: logging.Logger, **kwargs: float) -> logging.Logger:
    """``logger`` with a :class:`RepeatThrottle` (``kwargs``: its parameters); returns it."""
    logger.addFilter(RepeatThrottle(**kwargs))  # type: ignore[arg-type]
    return logger
