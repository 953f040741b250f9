"""Time, and every wait of the loop, the restart loop and the survey, behind one object.

The supervisor, the restart loop and the survey never call ``time`` or block on an
inbox or an event by themselves: they ask their clock.  ``SystemClock`` is the real
one; tests pass a clock whose time jumps forward instead of passing, so grace periods,
restart delays and cooldowns of minutes take no time.
"""

from __future__ import annotations

import queue
import threading
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

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        """Wait until ``event`` is set, at most ``timeout`` (None: forever); True once set."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass (between two looks at something nobody announces)."""
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

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        return event.wait(None if timeout is None else max(0.0, timeout))

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))
