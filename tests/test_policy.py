"""The policy, event by event, without processes."""

from __future__ import annotations

import signal

from launcher.policy import (
    Action,
    Continue,
    Event,
    Failure,
    Finish,
    GraceExpired,
    Interrupted,
    JobState,
    KillAll,
    RankExited,
    StopAll,
    decide,
    describe_status,
    exit_code_of,
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
