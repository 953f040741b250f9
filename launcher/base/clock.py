"""Time, and every wait of the supervisor's loop, behind one injectable object.

The supervisor never calls ``time`` or blocks on its inbox by itself: it asks
its clock.  ``SystemClock`` is the real one; tests pass a clock whose time
jumps forward instead of passing, so grace periods of a minute take no time.
"""

from __future__ import annotations

import queue
import time
from typing import Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds, for deadlines."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch, for records."""
        ...

    def take(self, inbox: queue.SimpleQueue[T], timeout: float | None) -> T | None:
        """The next item of ``inbox``, waiting at most ``timeout`` (None: forever); None if none."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def take(self, inbox: queue.SimpleQueue[T], timeout: float | None) -> T | None:
        try:
            return inbox.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return None
