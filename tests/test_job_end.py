"""The end of a job at any size (issue 28): once the ranks have exited, what is left to do
does not grow with the number of ranks times the number of messages, and nothing waits on
one rank (or one host) after another.  Counted, not timed."""

from __future__ import annotations

import gc
import queue
import signal
import sys
import weakref
from typing import Any

from launcher.base.clock import SystemClock
from launcher.base.interpreter import START_SWITCH_S, Interpreter
from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.outcome import JobResult
from launcher.loop import drain
from launcher.loop.supervisor import Supervisor
from launcher.streams.recorder import result_record
from tests.fakes import FakeClock, RecordingSink


class Looks:
    """How often the drain looked at the runs' streams."""

    count = 0


class EndingRun:
    """A rank that has exited and whose two streams end when their ends are handled; every
    look at whether its streams are open is counted."""

    def __init__(self, rank: int, looks: Looks) -> None:
        self.spec = LaunchSpec(rank=rank, host=Host(f"h{rank}"), local_rank=0, argv=("x",), env={})
        self.looks = looks
        self.streams = 2
        self.holds = 0
        self.last_data = 0.0

    @property
    def open_streams(self) -> int:
        self.looks.count += 1
        return self.streams


def test_the_drain_looks_at_each_rank_a_few_times_not_once_per_message() -> None:
    """2,000 ranks whose 4,000 stream ends are already in the inbox when the drain starts:
    it looked at every open rank again after each message (4,000 x 2,000 looks, seconds at
    the end of a job of thousands of ranks); now once per batch of what came."""
    looks = Looks()
    runs: list[Any] = [EndingRun(rank, looks) for rank in range(2000)]
    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    for run in runs:
        events.put(run)
        events.put(run)

    def handle(run: Any) -> None:
        run.streams -= 1

    cut = drain.drain_streams(SystemClock(), events, handle, lambda: runs, quiet_s=60.0)
    assert cut is None
    assert all(run.streams == 0 for run in runs)
    assert looks.count <= 3 * len(runs)


class CountedStatuses(dict[int, int | None]):
    """Every rank's status, counting how often it was gone through."""

    walks = 0

    def items(self) -> Any:
        CountedStatuses.walks += 1
        return super().items()


def test_the_jobs_end_record_does_not_copy_every_ranks_status() -> None:
    """status.json's result leaves the statuses out: they were deep-copied first (asdict),
    a tenth of a second at the end of a job of 8,000 ranks."""
    statuses = CountedStatuses({rank: 0 for rank in range(8000)})
    result = JobResult(exit_code=0, world_size=8000, elapsed_s=1.0, statuses=statuses)
    record = result_record(result)
    assert "statuses" not in record and record["world_size"] == 8000
    assert CountedStatuses.walks == 0


def test_the_interpreters_settings_are_counted_and_given_back() -> None:
    """Two jobs at once (a sweep's): the first start sets the pace, the last start's end
    gives back the switch interval and the collector as they were (off, where the user had
    turned it off); what a job froze goes back to the collector when the last job ends."""
    interpreter = Interpreter()
    switch_s = sys.getswitchinterval()
    gc.disable()  # (the user's choice: kept)
    try:
        with interpreter.running_job():
            with interpreter.running_job():
                with interpreter.starting_ranks():
                    with interpreter.starting_ranks():
                        assert sys.getswitchinterval() == START_SWITCH_S
                    assert sys.getswitchinterval() == START_SWITCH_S
                assert sys.getswitchinterval() == switch_s and not gc.isenabled()
                interpreter.freeze()
            assert gc.get_freeze_count() > 0  # the other job still runs
        assert gc.get_freeze_count() == 0
        interpreter.freeze()  # no job: nothing frozen
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
    with interpreter.starting_ranks():
        assert not gc.isenabled()
    assert gc.isenabled()


class QuickProcess:
    """A rank that reports its end at once (an attached process: no thread of its own):
    rank 0 fails as it starts, the others exit as soon as they are signalled."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.pid = 100 + spec.rank
        self.cause: str | None = None
        self.feed: Any = None
        self.signals: list[int] = []
        self.status: int | None = None

    def attach(self, feed: Any) -> None:
        self.feed = feed
        if self.spec.rank == 0:
            self.end(1)

    def end(self, status: int) -> None:
        self.status = status
        self.feed.exited(status)
        self.feed.feed("stdout", b"")
        self.feed.feed("stderr", b"")

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        if self.status is None:
            self.end(-signum)

    def gone(self, timeout: float) -> bool:
        return self.status is not None

    def read(self, stream: Any, size: int) -> bytes:
        return b""

    def wait(self) -> int:
        raise AssertionError("an attached process is not waited for")

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        return {}

    def take_stats(self, timeout: float) -> dict[str, Any]:
        return {}


class QuickTransport:
    def __init__(self) -> None:
        self.started: dict[int, QuickProcess] = {}

    def start(self, spec: LaunchSpec) -> QuickProcess:
        self.started[spec.rank] = QuickProcess(spec)
        return self.started[spec.rank]

    def close(self) -> None:
        pass


class BusyLoopClock(FakeClock):
    """A loop busy with thousands of ranks: each message it takes costs it ``STEP_S``."""

    STEP_S = 0.5

    def take(self, inbox: queue.SimpleQueue[Any], timeout: float | None) -> Any:
        item = super().take(inbox, timeout)
        if item is not None:
            self.time += self.STEP_S
        return item


def test_exits_that_came_before_the_grace_ran_out_are_not_killed() -> None:
    """Rank 0 fails, the 7 others exit at once on SIGTERM, but the loop takes 0.5 s for
    each message and the grace is 1 s: their exits wait in the inbox when the grace runs
    out.  They are exits, not ranks to SIGKILL (before: SIGKILL sent to every rank whose
    exit was still queued, thousands at 1,000 simulated hosts when the loop fell behind,
    and counted in the summary as killed after the grace)."""
    transport = QuickTransport()
    specs = [
        LaunchSpec(rank=r, host=Host("h"), local_rank=r, argv=("x",), env={}) for r in range(8)
    ]
    supervisor = Supervisor(
        specs,
        transport,
        RecordingSink(),
        grace_s=1.0,
        clock=BusyLoopClock(),
        handle_signals=False,
    )
    result = supervisor.run()
    assert result.exit_code == 1 and result.failure is not None and result.failure.rank == 0
    others = [transport.started[r] for r in range(1, 8)]
    assert [p.signals for p in others] == [[signal.SIGTERM]] * 7
    assert result.stopped == 7 and result.sigkilled == 0 and result.kill_cause is None


class Cycle:
    """Garbage only the cyclic collector frees."""

    def __init__(self) -> None:
        self.me = self


def test_a_restarts_freeze_frees_what_the_attempt_before_left() -> None:
    """A restart freezes its ranks' objects again: the attempt before's, dead since, are
    collected then, not kept until the job's end (a job restarted a hundred times)."""
    interpreter = Interpreter()
    with interpreter.running_job():
        left = Cycle()
        gone = weakref.ref(left)
        interpreter.freeze()  # the first attempt started
        del left  # its end: garbage now
        gc.collect()
        assert gone() is not None  # frozen: out of the collector's reach
        interpreter.freeze()  # the restart started
        assert gone() is None
    assert gc.get_freeze_count() == 0
