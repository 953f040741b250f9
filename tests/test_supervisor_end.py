"""The end of a job in the supervisor: what it costs per rank (counted, not timed).

At the end of a job of thousands of ranks their exits come by the thousand; each one goes
through the loop and the policy, and the result is built from all of them once the last
has ended.  Done naively, that was a tenth of a second per 8,000 ranks in each of three
places between the last exit and ``run_job``'s return (issue 28 §3)."""

from __future__ import annotations

import dataclasses
import signal
from collections import Counter
from typing import Any

import pytest

from launcher.core import policy
from launcher.loop import supervisor
from launcher.loop.supervisor import Supervisor
from tests.fakes import FakeClock, FakeTransport, RecordingSink, Script
from tests.test_supervisor import specs


def test_exits_are_handled_without_rebuilding_states_and_the_result_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every exit (and start) changes the rank's state and the job's: copied with
    ``policy.evolve``, never ``dataclasses.replace`` (five times the cost: a new
    ``__init__`` for each of 8,000 exits); the result asks once per rank whether dtrain
    stopped it (it asked three times: the failed-host rule, and twice for the counts)."""
    replaced: Counter[str] = Counter()
    real_replace = dataclasses.replace

    def counting(module: str) -> Any:
        def replace(value: Any, /, **changes: Any) -> Any:
            replaced[module] += 1
            return real_replace(value, **changes)

        return replace

    monkeypatch.setattr(policy, "replace", counting("policy"))
    monkeypatch.setattr(supervisor, "replace", counting("supervisor"))
    asked: list[int] = []
    real_ended_by_us = Supervisor.ended_by_us

    def ended_by_us(self: Supervisor, rank: int, status: int | None, ended: Any = None) -> bool:
        if ended is None:  # (the result's question; an exit's is asked with its time)
            asked.append(rank)
        return real_ended_by_us(self, rank, status, ended)

    monkeypatch.setattr(Supervisor, "ended_by_us", ended_by_us)
    plans: dict[int, Script] = {r: ({"stdout": [b"up\n"]}, None, False) for r in range(6)}
    plans[2] = ({"stderr": [b"boom\n"]}, 3, False)
    clock = FakeClock()
    transport, sink = FakeTransport(plans, clock), RecordingSink()
    result = Supervisor(
        specs(6), transport, sink, grace_s=5.0, handle_signals=False, clock=clock
    ).run()
    assert result.exit_code == 3 and result.failure is not None and result.failure.rank == 2
    assert result.stopped == 5 and result.sigkilled == 0 and result.failed_hosts == frozenset()
    assert all(transport.started[r].signals == [signal.SIGTERM] for r in range(6) if r != 2)
    assert replaced == {}  # (before: one per start, one per exit in each module)
    assert sorted(asked) == [r for r in range(6) if r != 2]  # (before: 16 questions)


def test_evolve_copies_a_frozen_state_with_its_changes_and_checks_their_names() -> None:
    state = policy.start_state({0, 1, 2})
    failure = policy.Failure(1, 3, 2.0)
    changed = policy.evolve(state, running=1, failure=failure)
    assert changed == dataclasses.replace(state, running=1, failure=failure)
    assert state.running == 3 and state.failure is None  # (the original is left as it was)
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.running = 0  # type: ignore[misc]
    with pytest.raises(TypeError, match="no field"):
        policy.evolve(state, runing=1)
