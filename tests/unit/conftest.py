"""Fixtures of the unit tests (beside the shared ones of tests/conftest.py).

Fixtures:
  ray_one_cpu  (function)  a local Ray of one CPU for the test (skips without ray): no dashboard, no
                           worker logs on the driver; shut down after the test, unless the test found
                           Ray already running (then it is that one, left as it was)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def ray_one_cpu() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
