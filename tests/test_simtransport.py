"""The benchmarks' simulated transport drives the real job layer: every rank starts, prints,
and stops, also when one fails and the others must be stopped (correctness, not timing)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import scale_sim  # noqa: E402


def test_every_simulated_rank_starts_prints_and_exits(tmp_path: Path) -> None:
    found = scale_sim.run_job_once(6, tmp_path, fail=False)
    ranks = 6 * scale_sim.RANKS_PER_HOST
    assert found["exit_code"] == 0
    assert found["ranks"] == found["started"] == found["ended"] == ranks
    assert found["logged_lines"] == ranks * 10  # every line of every rank in the job directory


def test_a_failing_simulated_rank_stops_every_other(tmp_path: Path) -> None:
    from simtransport import SimHosts, SimTransport

    transport = SimTransport(SimHosts(run_s=None, fail_rank=3, fail_after_s=0.2))
    transport.expected = 4 * scale_sim.RANKS_PER_HOST
    outcome = scale_sim.run_simulated(transport, 4, tmp_path, {"PATH": "/usr/bin"})
    result = outcome.result  # type: ignore[union-attr]
    assert result.exit_code == 1
    assert result.failure is not None and result.failure.rank == 3
    assert transport.ended == transport.expected
    others = [p for r, p in transport.processes.items() if r != 3]
    assert all(p.signals[:1] == [signal.SIGTERM] and p.status == -signal.SIGTERM for p in others)
    assert transport.closed


def test_the_interpreter_keeps_pace_with_thousands_of_ranks_and_is_given_back(
    tmp_path: Path,
) -> None:
    """While a job starts its ranks, the collector is held off and threads switch more
    often (before, starting 8,000 ranks ran six full collections of a growing heap, and the
    job directory's writer waited up to 5 ms for the GIL after each of its file operations:
    the job's end waited seconds for it); once they run, what the job holds is out of the
    collector's reach.  After the job, the process's own settings are back."""
    import gc

    from simtransport import SimHosts, SimTransport

    seen: dict[str, list[object]] = {"collecting": [], "switch_s": [], "frozen": []}

    class Watching(SimTransport):
        def start(self, spec: Any) -> Any:
            seen["collecting"].append(gc.isenabled())
            seen["switch_s"].append(sys.getswitchinterval())
            return super().start(spec)

        def count_ended(self, rank: int, status: int) -> None:
            seen["frozen"].append(gc.get_freeze_count() > 0)
            super().count_ended(rank, status)

    switch_s = sys.getswitchinterval()
    transport = Watching(SimHosts())
    transport.expected = 2 * scale_sim.RANKS_PER_HOST
    assert gc.isenabled() and gc.get_freeze_count() == 0
    outcome = scale_sim.run_simulated(transport, 2, tmp_path, {"PATH": "/usr/bin"})
    assert outcome.result.exit_code == 0  # type: ignore[union-attr]
    assert seen["collecting"] == [False] * transport.expected
    assert all(during < switch_s for during in seen["switch_s"])  # type: ignore[operator]
    assert any(seen["frozen"])  # (ranks that ended before the start was over: not yet)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert sys.getswitchinterval() == switch_s


def test_the_simulators_scheduler_is_woken_only_by_an_earlier_event() -> None:
    """Thousands of starts each schedule an event after the first: the scheduler's thread
    is not woken for each (it took the GIL and its lock from the launcher's loop every
    time, a cost of the simulation counted as dtrain's); every event still fires, in
    order."""
    import functools
    import threading
    import time

    from simtransport import Scheduler

    scheduler = Scheduler()
    fired: list[int] = []
    done = threading.Event()
    soon = time.monotonic() + 0.2
    try:
        for i in range(100):  # each after the one before
            scheduler.at(soon + i * 0.001, functools.partial(fired.append, i))
        assert scheduler.wakes == 1
        scheduler.at(soon - 0.1, functools.partial(fired.append, -1))  # before them all
        scheduler.at(soon + 0.2, done.set)
        assert scheduler.wakes == 2
        assert done.wait(10)
        assert fired == [-1, *range(100)]
    finally:
        scheduler.stop()
