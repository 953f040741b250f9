"""One way to fan work out to threads and wait for it against one deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def run_parallel(
    keys: Sequence[K],
    call: Callable[[K], T],
    fanout: int | None = None,
    timeout_s: float | None = None,
) -> dict[K, T | BaseException]:
    """``call(key)`` for every key, at most ``fanout`` at once (None: all at once); each
    result, or the error it raised, or a ``TimeoutError`` for a key not done ``timeout_s``
    after the start (one deadline for all, not one per key).  The threads are daemons: a
    call stuck past the deadline, or a connection stuck until its own timeout, never holds
    up dtrain's exit after a signal (a thread pool's workers are joined at exit)."""
    results: dict[K, T | BaseException] = {}
    todo = list(reversed(keys))
    done = threading.Condition()

    def work() -> None:
        while True:
            with done:
                if not todo:
                    return
                key = todo.pop()
            try:
                found: T | BaseException = call(key)
            except BaseException as exc:
                found = exc
            with done:
                results[key] = found
                done.notify_all()

    workers = len(keys) if fanout is None else max(1, min(fanout, len(keys)))
    for _ in range(workers):
        threading.Thread(target=work, name="dtrain-fanout", daemon=True).start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with done:
        while len(results) < len(keys):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            done.wait(left)
        late = TimeoutError(f"no answer within {timeout_s} s")
        return {key: results.get(key, late) for key in keys}
