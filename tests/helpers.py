"""Small helpers shared by every test package."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, every: float = 0.02,
             what: str = "condition") -> None:
    """Poll `predicate` until it is true; AssertionError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(every)
