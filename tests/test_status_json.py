"""status.json's rank records: the same JSON as json.dumps of the state, for every field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.core.outcome import RankState
from launcher.streams.recorder import state_json

STATES = [
    RankState(0, "node1", "worker", 4242, 1764201600.123456),
    RankState(7, 'n\u00f6de-"2"\\', "ps", 1, 1e-7, status=-9, ended=1764201601.0, restarts=3),
    RankState(3, "", "chief", 0, 12.5, status=0, ended=float("inf"), stopped=True),
]


@pytest.mark.parametrize("state", STATES)
def test_a_rank_record_is_json_dumps_of_its_state(state: RankState) -> None:
    assert state_json(state) == json.dumps(vars(state))


def test_every_field_of_a_rank_state_is_written() -> None:
    # A field added to RankState must be added to state_json too: this fails until it is.
    names = [field.name for field in dataclasses.fields(RankState)]
    assert list(json.loads(state_json(STATES[1]))) == names
