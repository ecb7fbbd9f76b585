"""Repeated warnings are rate-limited by a logging.Filter: the first few, then one line per window with
the count of the rest. A reward failing on every call printed ~320 warning lines a second (two per
dropped group) through the actor logs and `asyncrl run`'s console."""

from __future__ import annotations

import logging

from asyncrl.log_throttle import RepeatThrottle, throttle


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _logger(name: str, clock: _Clock) -> tuple[logging.Logger, list[str]]:
    out: list[str] = []
    logger = logging.getLogger(f"test.throttle.{name}")
    logger.propagate, logger.filters, logger.handlers = False, [], []
    handler = logging.Handler()
    handler.emit = lambda r: out.append(r.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    throttle(logger, burst=3, window_s=10.0, clock=clock)
    return logger, out


def test_a_flood_shows_the_first_few_then_one_counted_line_per_window() -> None:
    clock = _Clock()
    log, out = _logger("flood", clock)
    for i in range(100):  # 100 groups in 1 s, each its own group id, prompt and score
        clock.t += 0.01
        log.warning(
            "actor-0: group actor-0-%012x dropped: reward for verl-%d is %.1f", 0xABC123DEF000 + i, i, i / 7
        )
    assert len(out) == 3 and out[0].startswith(
        "actor-0: group actor-0-abc123def000 dropped: reward for verl-0"
    )
    clock.t += 9.5  # 10.5 s after the first: a new window
    log.warning("actor-0: group actor-0-%012x dropped: reward for verl-%d is %.1f", 0xABC123DEF999, 7, 1.0)
    assert len(out) == 4 and out[3] == (
        "actor-0: group actor-0-abc123def999 dropped: reward for verl-7 is 1.0 (97 more like this in the last 10 s)"
    )
    for _ in range(50):  # still flooding: nothing more in this window
        clock.t += 0.1
        log.warning("actor-0: group actor-0-abc123def998 dropped: reward for verl-3 is 0.0")
    assert len(out) == 4
    clock.t += 5.1
    log.warning("actor-0: group actor-0-abc123def997 dropped: reward for verl-3 is 0.0")
    assert len(out) == 5 and out[4].endswith("(50 more like this in the last 10 s)")


def test_other_reasons_and_quiet_keys_are_not_held_back() -> None:
    clock = _Clock()
    log, out = _logger("keys", clock)
    for _ in range(5):
        log.warning("group dropped: reward: ValueError: not a number")
        log.warning("group dropped: reward: timed out after 30 s")
        log.error("group dropped: reward: ValueError: not a number")  # another level: another key
    assert len(out) == 9  # 3 of each of the three
    clock.t += 30.0  # suppressed ones pending: the next line says how many
    log.warning("group dropped: reward: timed out after 30 s")
    assert out[-1] == "group dropped: reward: timed out after 30 s (2 more like this in the last 30 s)"
    clock.t += 11.0  # a whole window without one: a fresh burst, no count
    for _ in range(3):
        log.warning("group dropped: reward: timed out after 30 s")
    assert out[-3:] == ["group dropped: reward: timed out after 30 s"] * 3


def test_the_loggers_of_dropped_groups_are_throttled() -> None:
    import asyncrl.actors.group_worker  # noqa: F401
    import asyncrl.buffer.producer  # noqa: F401

    for name in ("asyncrl.actors.group_worker", "asyncrl.buffer.producer"):
        assert any(isinstance(f, RepeatThrottle) for f in logging.getLogger(name).filters), name
