"""The supervisor loop against a scripted fake transport (no processes)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.outcome import JobResult, RankReport
from launcher.loop.rankrun import Signalled
from launcher.loop.settle import SETTLE_EXTRA_S
from launcher.loop.supervisor import Supervisor, TimeLimits
from tests.fakes import FakeClock, FakeProcess, FakeTransport, RecordingSink, Script


def specs(count: int) -> list[LaunchSpec]:
    return [
        LaunchSpec(rank=r, host=Host("h"), local_rank=r, argv=("x",), env={}) for r in range(count)
    ]


def supervise(
    plans: dict[int, Script], grace_s: float = 5.0, delays: dict[int, float] | None = None
) -> tuple[JobResult, FakeTransport, RecordingSink]:
    clock = FakeClock()
    transport, sink = FakeTransport(plans, clock, delays), RecordingSink()
    result = Supervisor(
        specs(len(plans)), transport, sink, grace_s=grace_s, handle_signals=False, clock=clock
    ).run()
    return result, transport, sink


def test_success_shows_every_line_and_exits_zero() -> None:
    result, transport, sink = supervise(
        {
            0: ({"stdout": [b"a\nb", b"c\n"], "stderr": [b"warn\n"]}, 0, False),
            1: ({"stdout": [b"d\n"]}, 0, False),
        }
    )
    assert result.exit_code == 0 and result.failure is None
    assert result.statuses == {0: 0, 1: 0}
    per_stream = {
        key: [line for rank, stream, line in sink.lines if (rank, stream) == key]
        for key in [(0, "stdout"), (0, "stderr"), (1, "stdout")]
    }
    assert per_stream == {
        (0, "stdout"): [b"a", b"bc"],
        (0, "stderr"): [b"warn"],
        (1, "stdout"): [b"d"],
    }
    assert transport.closed


def test_failure_stops_the_others_and_reports_the_first() -> None:
    result, transport, _ = supervise(
        {
            0: ({}, None, False),
            1: ({"stderr": [b"line 1\nTraceback\nValueError: bad\n"]}, 3, False),
            2: ({}, None, False),
        }
    )
    assert result.exit_code == 3
    assert result.failure == RankReport(
        rank=1,
        host="h",
        status=3,
        last_lines=("line 1", "Traceback", "ValueError: bad"),
        stream="stderr",
    )
    assert transport.started[0].signals == [signal.SIGTERM]
    assert transport.started[2].signals == [signal.SIGTERM]
    assert transport.started[1].signals == []


def test_rank_ignoring_sigterm_gets_sigkill_after_grace() -> None:
    result, transport, _ = supervise(
        {
            0: ({"stdout": [b"bye\n"]}, 1, False),
            1: ({}, None, True),
        },
        grace_s=30,
    )
    assert result.exit_code == 1
    assert transport.started[1].signals == [signal.SIGTERM, signal.SIGKILL]
    term_at, kill_at = transport.started[1].signal_times
    assert kill_at - term_at == 30  # exactly the grace period, in the loop's own time
    assert result.statuses[1] == -signal.SIGKILL
    assert result.failure is not None and result.failure.last_lines == ("bye",)


def test_rank_exiting_on_sigterm_is_not_killed() -> None:
    result, transport, _ = supervise({0: ({}, 2, False), 1: ({}, None, False)}, grace_s=30)
    assert transport.started[1].signals == [signal.SIGTERM]
    assert result.statuses == {0: 2, 1: -signal.SIGTERM} and result.exit_code == 2


def test_interrupt_stops_gracefully_then_second_kills() -> None:
    clock = FakeClock()
    transport = FakeTransport({0: ({}, None, True), 1: ({}, None, True)}, clock)
    supervisor = Supervisor(
        specs(2), transport, RecordingSink(), grace_s=60, handle_signals=False, clock=clock
    )
    supervisor.events.put(Signalled(signal.SIGINT))
    supervisor.events.put(Signalled(signal.SIGINT))
    result = supervisor.run()
    assert result.exit_code == 130 and result.interrupt == signal.SIGINT
    assert transport.started[0].signals == [signal.SIGTERM, signal.SIGKILL]
    term_at, kill_at = transport.started[0].signal_times
    assert kill_at == term_at  # the second Ctrl-C does not wait for the grace period
    assert result.statuses == {0: -signal.SIGKILL, 1: -signal.SIGKILL}


def test_interrupt_before_start_starts_nothing_more() -> None:
    transport, sink = FakeTransport({0: ({}, None, False), 1: ({}, None, False)}), RecordingSink()
    supervisor = Supervisor(specs(2), transport, sink, grace_s=5, handle_signals=False)
    supervisor.stop_requested = True
    supervisor.events.put(Signalled(signal.SIGTERM))
    result = supervisor.run()
    assert transport.started == {}
    assert result.exit_code == 143


def test_report_keeps_progress_bars_final_state_and_says_no_output() -> None:
    bar = [b"\rstep 1/3 ", b"\rstep 2/3 ", b"\rstep 3/3 \ndone\n"]
    result, _, _ = supervise({0: ({"stdout": bar}, 2, False)})
    assert result.failure is not None
    assert result.failure.last_lines == ("step 3/3 ", "done")
    assert result.failure.stream == "stdout"
    silent, _, _ = supervise({0: ({}, 1, False)})
    assert silent.failure is not None and silent.failure.last_lines == ()
    from launcher.view.reports import format_failure

    assert format_failure(silent)[0] == "dtrain: rank 0 wrote nothing (no output)"


def test_summary_counts_the_ranks_actually_stopped() -> None:
    from launcher.view.reports import format_failure

    # Ranks 0 and 2 had ended well before rank 1 failed: only rank 3 was stopped.
    result, _, _ = supervise(
        {0: ({}, 0, False), 1: ({}, 4, False), 2: ({}, 0, False), 3: ({}, None, False)},
        delays={1: 0.5},
    )
    assert result.stopped == 1 and result.sigkilled == 0
    assert format_failure(result)[-2:] == [
        "dtrain: stopped the 1 rank still running",
        "dtrain: rank 1 on h failed (exit code 4); dtrain exits 4",
    ]
    alone, _, _ = supervise({0: ({}, 0, False), 1: ({}, 4, False)}, delays={1: 0.5})
    assert "no other rank was running" in format_failure(alone)[-2]


class QuickToDie(FakeProcess):
    """Dies the moment it is signalled, and the launcher's thread runs again only later (a busy
    machine): the rank's exit is stamped before the signal call returns."""

    def signal(self, signum: int) -> None:
        super().signal(signum)
        time.sleep(0.2)  # the waiter stamps the exit now
        assert self.clock is not None
        self.clock.time += 1.0


def test_a_rank_that_dies_at_once_on_the_signal_counts_as_stopped() -> None:
    """The README's failure sample said "stopped the 2 ranks still running" on a busy CI
    machine: the signal time was taken after the signal, later than the exit it caused."""
    from launcher.view.reports import format_failure

    clock = FakeClock()
    plans: dict[int, Script] = {0: ({}, None, False), 1: ({}, 4, False), 2: ({}, None, False)}
    transport = FakeTransport(plans, clock, delays={1: 0.5})
    transport.start = lambda spec: transport.started.setdefault(  # type: ignore[method-assign]
        spec.rank, (QuickToDie if spec.rank != 1 else FakeProcess)(
            spec, plans[spec.rank], clock, 0.5 if spec.rank == 1 else 0)
    )  # fmt: skip
    result = Supervisor(
        specs(3), transport, RecordingSink(), handle_signals=False, clock=clock
    ).run()
    assert result.stopped == 2
    assert format_failure(result)[-2] == "dtrain: stopped the other 2 ranks"


def test_a_second_interrupt_says_it_killed_at_once() -> None:
    from launcher.view.reports import format_failure

    clock = FakeClock()
    transport = FakeTransport({0: ({}, None, True), 1: ({}, None, True)}, clock)
    supervisor = Supervisor(
        specs(2), transport, RecordingSink(), grace_s=60, handle_signals=False, clock=clock
    )
    supervisor.events.put(Signalled(signal.SIGINT))
    supervisor.events.put(Signalled(signal.SIGINT))
    result = supervisor.run()
    assert format_failure(result) == [
        "dtrain: stopped 2 ranks (2 with SIGKILL at the second signal)",
        "dtrain: interrupted by SIGINT; dtrain exits 130",
    ]


def limited(
    plans: dict[int, Script], limits: TimeLimits
) -> tuple[JobResult, FakeTransport, FakeClock]:
    clock = FakeClock()
    transport = FakeTransport(plans, clock)
    result = Supervisor(
        specs(len(plans)), transport, RecordingSink(), grace_s=5, handle_signals=False,
        clock=clock, limits=limits,
    ).run()  # fmt: skip
    return result, transport, clock


def test_a_wall_clock_limit_stops_the_job_with_124() -> None:
    result, transport, _ = limited(
        {0: ({}, None, False), 1: ({}, None, False)}, TimeLimits(total_s=60)
    )
    assert result.exit_code == 124 and result.failure is None
    assert result.timeout == (
        "the job ran longer than --timeout 60 s (rank(s) 0-1 on h still running)"
    )
    assert transport.started[0].signal_times == [1060.0]  # exactly at the limit
    assert result.stopped == 2


def test_a_hang_takes_the_stacks_then_fails() -> None:
    seen: list[dict[int, object]] = []

    def on_hang(dumps: dict[int, tuple[str, dict[str, object]]]) -> str:
        seen.append(dict(dumps))
        return ": ranks 0-1 somewhere"

    plans: dict[int, Script] = {0: ({"stdout": [b"step 1\n"]}, None, False), 1: ({}, None, False)}
    result, transport, _ = limited(plans, TimeLimits(hang_s=300, on_hang=on_hang))
    assert result.exit_code == 124
    assert (
        result.timeout == "no output from any rank for 300 s (--hang-timeout): ranks 0-1 somewhere"
    )
    assert list(seen[0]) == [0, 1]  # every rank's stack, before anything was stopped
    assert transport.started[0].signals == [signal.SIGTERM]


def test_on_hang_dump_goes_on_and_dumps_again_after_another_silence() -> None:
    calls: list[float] = []
    plans: dict[int, Script] = {0: ({}, 0, False)}
    clock = FakeClock()

    def on_hang(dumps: object) -> str:
        calls.append(clock.now())
        return ""

    transport = FakeTransport(plans, clock, delays={0: 1.0})  # exits after 1 s of real time
    result = Supervisor(
        specs(1), transport, RecordingSink(), handle_signals=False, clock=clock,
        limits=TimeLimits(hang_s=10, fail_on_hang=False, on_hang=on_hang),
    ).run()  # fmt: skip
    assert result.exit_code == 0 and result.timeout is None
    assert len(calls) >= 2 and calls[1] - calls[0] == 10  # once per silence, not once per wake


class LateProcess(FakeProcess):
    """A remote rank whose agent has not said it started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started = threading.Event()


def test_a_rank_that_never_started_is_named_after_the_start_timeout() -> None:
    clock = FakeClock()
    transport = FakeTransport({0: ({}, None, False), 1: ({}, None, False)}, clock)
    transport.start = lambda spec: (  # type: ignore[method-assign]
        transport.started.setdefault(spec.rank, (LateProcess if spec.rank else FakeProcess)(
            spec, transport.scripts[spec.rank], clock))
    )  # fmt: skip
    result = Supervisor(
        specs(2), transport, RecordingSink(), handle_signals=False, clock=clock,
        limits=TimeLimits(start_s=30),
    ).run()  # fmt: skip
    assert result.exit_code == 124
    assert result.timeout == "rank(s) 1 on h had not started after 30 s (--start-timeout)"


def test_stuck_watchdogs_are_killed_together_within_one_budget() -> None:
    """Eight ranks whose watchdogs never exit: settling SIGKILLs them all at once and waits
    once, on the loop's clock (one after another, it took 19 s for a 3 s budget)."""
    clock = FakeClock()
    plans: dict[int, Script] = {r: ({}, 0, False) for r in range(8)}
    transport = FakeTransport(plans, clock, stuck=frozenset(plans))
    supervisor = Supervisor(
        specs(8), transport, RecordingSink(), grace_s=1, handle_signals=False, clock=clock
    )
    began, real_began = clock.now(), time.monotonic()
    result = supervisor.run()
    assert time.monotonic() - real_began < 1 + SETTLE_EXTRA_S  # the grace and the extra
    assert result.exit_code == 0
    assert supervisor.unsettled == set(range(8))
    assert all(transport.started[r].signals == [signal.SIGKILL] for r in range(8))
    # On the loop's clock: the grace and the extra for them to go, then the extra once more.
    assert clock.now() - began <= 1 + 2 * SETTLE_EXTRA_S + FakeClock.SETTLE_S
