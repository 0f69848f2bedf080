"""Waiting in tests for a condition rather than for a fixed time: on a loaded CI machine (two busy
cores shared by several jobs) any fixed sleep is too short some day, and a long one wastes time on
every other day."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout_s: float = 10.0, every_s: float = 0.01, what: str = "") -> T:
    """Call ``pred`` until it returns something truthy, and return that; AssertionError (naming
    ``what``) if it has not after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, f"{what or 'condition'} not reached in {timeout_s}s"
        time.sleep(every_s)
    return got
