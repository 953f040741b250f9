"""The policy, event by event, without processes."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from launcher.core.policy import (
    Action,
    AttemptEnd,
    Continue,
    Event,
    Failure,
    Finish,
    GraceExpired,
    Interrupted,
    JobState,
    KillAll,
    RankEnd,
    RankExited,
    Restart,
    RestartAfter,
    StopAll,
    TimedOut,
    decide,
    decide_restart,
    describe_status,
    discovery_change,
    exit_code_of,
    failed_hosts,
    hosts_left_out,
    start_state,
)


def play(ranks: int, events: list[Event]) -> tuple[JobState, list[Action]]:
    state = start_state(frozenset(range(ranks)))
    actions = []
    for event in events:
        state, action = decide(state, event)
        actions.append(action)
    return state, actions


def test_all_succeed() -> None:
    state, actions = play(3, [RankExited(1, 0), RankExited(0, 0), RankExited(2, 0)])
    assert actions == [Continue(), Continue(), Finish(0)]
    assert state.exit_code == 0


def test_first_failure_stops_the_rest_and_sets_the_code() -> None:
    state, actions = play(3, [RankExited(2, 3), RankExited(0, -signal.SIGTERM), RankExited(1, 1)])
    assert actions == [StopAll(), Continue(), Finish(3)]
    assert state.failure == Failure(2, 3)


def test_signal_death_is_128_plus_signal() -> None:
    _, actions = play(2, [RankExited(0, -signal.SIGKILL), RankExited(1, -signal.SIGTERM)])
    assert actions == [StopAll(), Finish(137)]
    assert exit_code_of(-signal.SIGSEGV) == 139
    assert describe_status(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_status(4) == "exit code 4"


def test_grace_expiry_kills() -> None:
    _, actions = play(2, [RankExited(0, 1), GraceExpired(), GraceExpired(), RankExited(1, -9)])
    assert actions == [StopAll(), KillAll(), Continue(), Finish(1)]


def test_ctrl_c_then_second_ctrl_c() -> None:
    state, actions = play(
        2,
        [
            Interrupted(signal.SIGINT),
            Interrupted(signal.SIGINT),
            RankExited(0, -9),
            RankExited(1, -9),
        ],
    )
    assert actions == [StopAll(), KillAll(), Continue(), Finish(130)]
    assert state.failure is None


def test_sigterm_to_dtrain() -> None:
    _, actions = play(1, [Interrupted(signal.SIGTERM), RankExited(0, -signal.SIGTERM)])
    assert actions == [StopAll(), Finish(143)]


def test_failure_code_wins_over_later_interrupt() -> None:
    _, actions = play(2, [RankExited(0, 7), Interrupted(signal.SIGINT), RankExited(1, -9)])
    assert actions == [StopAll(), KillAll(), Finish(7)]


def test_last_rank_failing_finishes_at_once() -> None:
    _, actions = play(2, [RankExited(0, 0), RankExited(1, 2)])
    assert actions == [Continue(), Finish(2)]


ROLES = {0: "chief", 1: "worker", 2: "worker", 3: "ps"}


def play_ps(events: list[Event], restarts: int = 0) -> tuple[JobState, list[Action]]:
    state = start_state(frozenset(ROLES), ROLES, restarts)
    actions = []
    for event in events:
        state, action = decide(state, event)
        actions.append(action)
    return state, actions


def test_chief_exit_ends_a_ps_job_with_its_code() -> None:
    state, actions = play_ps(
        [RankExited(0, 0), RankExited(1, -15), RankExited(2, -15), RankExited(3, -15)]
    )
    assert actions == [StopAll(), Continue(), Continue(), Finish(0)]
    assert state.failure is None and state.exit_code == 0
    _, failed = play_ps(
        [RankExited(0, 3), RankExited(1, -15), RankExited(2, -15), RankExited(3, -15)]
    )
    assert failed[0] == StopAll() and failed[-1] == Finish(3)


def test_ps_dying_fails_the_job_whatever_its_code() -> None:
    state, actions = play_ps([RankExited(3, 0)])
    assert actions == [StopAll()]
    assert state.failure == Failure(3, 1) and state.exit_code == 1


def test_failed_worker_is_restarted_while_the_budget_lasts() -> None:
    state, actions = play_ps(
        [RankExited(1, -9), RankExited(1, 1), RankExited(1, 1), RankExited(0, 0)], restarts=2
    )
    assert actions == [Restart(1), Restart(1), Continue(), StopAll()]
    assert state.restarts_left[1] == 0 and state.exit_code == 0


def test_without_restarts_the_chief_carries_on() -> None:
    state, actions = play_ps([RankExited(2, 1), RankExited(1, 0)])
    assert actions == [Continue(), Continue()]
    assert state.failure is None and not state.stopping


def test_the_first_failure_is_the_earliest_not_the_first_reported() -> None:
    state, actions = play(
        3, [RankExited(2, 3, time=10.5), RankExited(0, 7, time=10.2), RankExited(1, -15, 11.0)]
    )
    assert state.failure == Failure(0, 7, 10.2) and state.exit_code == 7
    assert actions[0] == StopAll()
    # A rank stopped for the failure dies after it: it never takes the blame.
    state, _ = play(2, [RankExited(0, 3, time=5.0), RankExited(1, -15, time=5.1)])
    assert state.failure == Failure(0, 3, 5.0)


@pytest.mark.parametrize(
    ("end", "attempt", "max_restarts", "delay", "expected"),
    [
        (AttemptEnd(0, False), 0, 3, None, None),  # success: done
        (AttemptEnd(1, False, 2), 0, 3, None, RestartAfter(1, 1.0)),
        (AttemptEnd(137, False, 0), 1, 3, None, RestartAfter(2, 2.0)),
        (AttemptEnd(1, False, 0), 2, 3, None, RestartAfter(3, 4.0)),
        (AttemptEnd(1, False, 0), 3, 3, None, None),  # budget spent: the last attempt's code
        (AttemptEnd(1, False, 0), 0, 0, None, None),  # no restarts asked for
        (AttemptEnd(130, True), 0, 3, None, None),  # Ctrl-C never restarts
        (AttemptEnd(143, True, 1), 0, 3, None, None),  # nor SIGTERM, even after a failure
        (AttemptEnd(1, False, 0), 0, 3, 0.25, RestartAfter(1, 0.25)),  # --restart-delay
        (AttemptEnd(1, False, 0), 9, 20, None, RestartAfter(10, 30.0)),  # backoff capped
        (AttemptEnd(1, False, 0), 1024, 2000, None, RestartAfter(1025, 30.0)),  # 2**1024: no float
        (AttemptEnd(124, False, None), 0, 3, 0, RestartAfter(1, 0)),  # a hang restarts...
        (AttemptEnd(124, False, None, out_of_time=True), 0, 3, 0, None),  # --timeout not
        (AttemptEnd(1, False, 0, out_of_time=True), 0, 3, 0, None),  # (nor after it)
    ],
)
def test_restart_decisions(
    end: AttemptEnd,
    attempt: int,
    max_restarts: int,
    delay: float | None,
    expected: RestartAfter | None,
) -> None:
    assert decide_restart(end, attempt, max_restarts, delay) == expected


def end(host: str, status: int | None, lost: bool = False, stopped: bool = False) -> RankEnd:
    return RankEnd(host, status, lost, stopped)


@pytest.mark.parametrize(
    ("ends", "expected"),
    [
        ([end("a", 1), end("a", -15, stopped=True), end("b", -15, stopped=True)], set()),
        ([end("a", 0), end("b", 255, lost=True), end("b", 255, lost=True)], {"b"}),
        ([end("a", -15, stopped=True), end("b", -9), end("b", -9)], {"b"}),  # OOM killer
        ([end("a", -15, stopped=True), end("b", -9), end("b", -15, stopped=True)], set()),
        ([end("a", -11)], set()),  # its only rank: a crash of the program, not the machine's
        ([end("a", None), end("a", -9)], set()),  # one never reported: not known to be dead
    ],
)
def test_failed_hosts(ends: list[RankEnd], expected: set[str]) -> None:
    assert failed_hosts(ends) == expected


def test_failed_hosts_come_back_after_the_cooldown() -> None:
    failed = {"a": 100.0, "b": 150.0}
    assert hosts_left_out(failed, 160.0, None) == {"a", "b"}
    assert hosts_left_out(failed, 160.0, 30.0) == {"b"}
    assert hosts_left_out(failed, 200.0, 30.0) == set()


def test_a_time_limit_stops_the_job_with_124() -> None:
    state = start_state(frozenset({0, 1}))
    state, action = decide(state, TimedOut("no output for 5 s"))
    assert action == StopAll() and state.exit_code == 124 and state.timeout == "no output for 5 s"
    state, action = decide(state, TimedOut("again"))  # already stopping: nothing more
    assert action == Continue() and state.timeout == "no output for 5 s"
    state, _ = decide(state, RankExited(0, -15))  # stopped ranks do not make it a failure
    state, action = decide(state, RankExited(1, -15))
    assert action == Finish(124)


def test_a_failure_before_the_time_limit_keeps_its_code() -> None:
    state, _ = decide(start_state(frozenset({0, 1})), RankExited(0, 3))
    state, action = decide(state, TimedOut("late"))
    assert action == Continue() and state.exit_code == 3


def test_a_signal_while_stopping_for_a_failure_is_remembered() -> None:
    """Ctrl-C just after a rank failed: the job is already stopping, but no restart may follow."""
    state, _ = decide(start_state(frozenset({0, 1})), RankExited(0, 3))
    state, action = decide(state, Interrupted(signal.SIGINT))
    assert action == KillAll() and state.interrupt == signal.SIGINT
    assert state.exit_code == 3  # the failure's code still


SCRIPT = "the --host-discovery-script"


@pytest.mark.parametrize(
    ("discovered", "excluded", "grow_to", "expected"),
    [
        ({"a": 2, "b": 2}, (), 4, None),  # as it runs
        ({"a": 2}, (), 4, "b left the --host-discovery-script's hosts"),
        (
            {"a": 2, "b": 1},
            (),
            4,
            "the --host-discovery-script gives fewer slots on b (1 for 2 ranks)",
        ),
        (
            {"a": 2, "b": 2, "c": 2},
            (),
            6,
            "the --host-discovery-script gives more slots (c): 6 ranks fit, 4 run",
        ),
        (
            {"a": 2, "b": 2, "c": 2},
            (),
            5,
            "the --host-discovery-script gives more slots (c): 5 ranks fit, 4 run",
        ),
        ({"a": 2, "b": 2, "c": 2}, (), 4, None),  # already at --max-np
        ({"a": 2, "b": 2, "c": 2}, ("c",), 6, None),  # c failed: not back before its cooldown
        ({"a": 4, "b": 2}, (), None, None),  # not elastic: never grows
    ],
)
def test_what_the_discovery_script_changes(
    discovered: dict[str, int], excluded: tuple[str, ...], grow_to: int | None, expected: str | None
) -> None:
    assert discovery_change({"a": 2, "b": 2}, discovered, excluded, 4, grow_to) == expected


def test_a_host_change_restarts_at_once_and_is_not_counted() -> None:
    end = AttemptEnd(1, False, None, hosts_changed=True)
    assert decide_restart(end, 3, 3) == RestartAfter(3, 0.0)  # even with the budget spent
    assert decide_restart(replace(end, interrupted=True), 0, 3) is None
