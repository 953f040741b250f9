"""The end of a job's output (loop layer): every line the ranks wrote, or why not.

A job ends only when every rank's streams have reached their end (a local pipe's EOF, the
end its agent relays over SSH) and what they carried was handed to the outlets: when the
ranks exit, a busy machine may still hold much of their output in pipes, in agents and on
SSH channels.  Streams still delivering are never cut, short of a generous cap; a stream
silent for longer than a watchdog takes to end what a rank left (the grace, and
``QUIET_S`` more) is given up on, and so is everything at a signal to dtrain.  Whatever
was not waited for, or was cut by a lost host, is said: those ranks' output may be
incomplete, and the job did not succeed.
"""

from __future__ import annotations

import queue
import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.base.clock import Clock
from launcher.core.config import rank_set
from launcher.loop.rankrun import RankRun, Signalled

QUIET_S = 10.0  # beyond the grace: an open stream silent this long after the end is given up
CAP_S = 120.0  # after the loop ended, at most this long for output still arriving
# After a signal to dtrain (Ctrl-C, SIGTERM, SIGHUP, dtrain stop) the user asked to stop:
# what is in flight gets a short bound, never the full wait (the kill path never waits on
# output).  Silent this long, or this long in all, and it is given up, and said.
STOPPED_QUIET_S = 2.0
STOPPED_CAP_S = 5.0


@dataclass(frozen=True)
class DrainCut:
    """Streams still open when the drain stopped waiting: whose, and why it stopped
    (``signum``: a signal to dtrain during the drain, which the job's end must report)."""

    ranks: tuple[int, ...]
    why: str
    signum: int | None = None


def drain_streams(
    clock: Clock,
    events: queue.SimpleQueue[Any],
    handle: Callable[[Any], object],
    runs: Callable[[], Sequence[RankRun]],
    quiet_s: float,
    cap_s: float = CAP_S,
) -> DrainCut | None:
    """Handle the inbox's messages until every stream of ``runs`` has ended (None), or
    until its streams have been silent for ``quiet_s``, ``cap_s`` passed, or dtrain got a
    signal (the cut).  A rank that dtrain holds back (a full outlet) is not silent.

    The runs still open are looked at once per batch of messages (what came while one was
    awaited), not once per message: at the end of a job of thousands of ranks, their
    streams' ends come in bursts of thousands."""
    start = clock.now()
    cut: str | None = None
    signum: int | None = None
    open_runs = [run for run in runs() if run.open_streams]
    while open_runs:
        now = clock.now()
        heard = max([start, *(now if run.holds else run.last_data for run in open_runs)])
        if now >= start + cap_s:
            cut = f"it was still arriving {cap_s:g} s after the ranks' end"
        elif now - heard >= quiet_s:
            cut = f"its streams were open but silent for {quiet_s:g} s after the ranks' end"
        if cut is not None:
            break
        message = clock.take(events, min(start + cap_s, heard + quiet_s) - now)
        if message is not None and not isinstance(message, Signalled):
            handle(message)
            message = handle_queued(events, handle)
        if isinstance(message, Signalled):
            signum = message.signum
            cut = f"dtrain got {signal.Signals(signum).name} while it was still arriving"
            break
        open_runs = [run for run in open_runs if run.open_streams]
    handle_queued(events, handle, stop_at_signal=False)  # exits of ranks given up on, ends
    if cut is None:
        return None
    left = sorted({run.spec.rank for run in runs() if run.open_streams})
    return DrainCut(tuple(left), cut, signum) if left or signum else None


def handle_queued(
    events: queue.SimpleQueue[Any], handle: Callable[[Any], object], stop_at_signal: bool = True
) -> Signalled | None:
    """Handle every message queued now, without waiting; a signal to dtrain among them stops
    it there and is returned (unless ``stop_at_signal`` is False: it is handled too)."""
    while True:
        try:
            message = events.get_nowait()
        except queue.Empty:
            return None
        if stop_at_signal and isinstance(message, Signalled):
            return message
        handle(message)


def bounds(grace_s: float, stopped: bool) -> tuple[float, float]:
    """The drain's (silence, total) bounds: the full wait for a job that ended by itself, a
    short one for a job dtrain was asked to stop."""
    return (STOPPED_QUIET_S, STOPPED_CAP_S) if stopped else (grace_s + QUIET_S, CAP_S)


def judge_output(
    runs: Iterable[RankRun], cut: DrainCut | None, exit_code: int
) -> tuple[str | None, int]:
    """Whose output may be incomplete and why (None: every stream ended), and the job's
    exit code: a job whose every rank exited 0 did not succeed if lines may be missing
    (255 when a lost host cut them, as for a lost host; else 1)."""
    causes: dict[str, list[int]] = {}
    for run in runs:
        if not run.cut:  # (most runs: thousands at a job's end)
            continue
        for cause in sorted(set(run.cut.values())):
            why = f"their host was lost before it ended ({cause})"
            causes.setdefault(why, []).append(run.spec.rank)
    lost = bool(causes)
    if cut is not None:
        causes.setdefault(cut.why, []).extend(cut.ranks)
    if not causes:
        return None, exit_code
    text = "; ".join(
        f"the output of rank(s) {rank_set(ranks)} may be incomplete: {why}"
        for why, ranks in causes.items()
    )
    return text, exit_code if exit_code != 0 else 255 if lost else 1
