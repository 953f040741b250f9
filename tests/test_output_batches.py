"""The output path in batches (issue 28): the job directory's writer takes many items per
lock round trip, the loop hands a burst of rank states on at once, the recorder encodes
a rank's state once per status write, and a large job's logs are made while it starts."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.outcome import RankState
from launcher.loop.supervisor import Supervisor
from launcher.streams import recorder as recorder_module
from launcher.streams.jobdir import JobDir
from launcher.streams.logfiles import LogFiles
from launcher.streams.outlets import Fanout, Lines, Outlet, OutputQueue
from launcher.streams.recorder import JobRecorder
from tests.fakes import FakeClock, FakeTransport, RecordingSink


def spec(rank: int) -> LaunchSpec:
    return LaunchSpec(rank=rank, host=Host("h"), local_rank=rank, argv=("x",), env={})


def test_a_writer_takes_many_items_at_once_and_frees_a_held_rank() -> None:
    queue = OutputQueue(limit_bytes=1000)
    for i in range(3):
        queue.put_lines(spec(0), "stdout", [b"%d" % i + b"x" * 435])  # 500 bytes each
    queue.put_state(RankState(1, "h", "worker", 1, 0.0))
    room = threading.Event()
    assert not queue.when_room((0, None), room.set)  # rank 0's share is full
    taken, dropped = queue.take_batch()
    assert isinstance(taken, list) and dropped == 0
    assert [i.lines[0][:1] for i in taken if isinstance(i, Lines)] == [b"0", b"1", b"2"]
    assert isinstance(taken[-1], RankState)  # in the queue's order, states included
    assert room.is_set() and queue.pending[(0, None)] == 0
    queue.close()
    assert queue.take_batch() == (None, 0)


def test_a_batch_is_bounded_in_items() -> None:
    queue = OutputQueue()
    for i in range(10):
        queue.put_lines(spec(i), "stdout", [b"line"])
    taken, _ = queue.take_batch(limit=4)
    assert isinstance(taken, list) and len(taken) == 4
    assert [i.spec.rank for i in taken if isinstance(i, Lines)] == [0, 1, 2, 3]
    following = queue.take()[0]
    assert isinstance(following, Lines) and following.spec.rank == 4


class CountingFanout(Fanout):
    """Counts how often the loop handed states to the outlets."""

    def __init__(self, sink: RecordingSink) -> None:
        super().__init__([Outlet(sink)])
        self.handed = 0

    def post_state(self, state: RankState) -> None:
        self.handed += 1
        super().post_state(state)

    def post_states(self, states: Any) -> None:
        self.handed += 1
        super().post_states(states)


def test_a_burst_of_exits_reaches_the_outlets_in_a_few_batches() -> None:
    """200 ranks start and exit at once: 400 states, each one recorded, in a few hand-overs
    (each takes the queue's lock, which the writer and the readers contend for)."""
    ranks = 200
    clock = FakeClock()
    transport = FakeTransport(
        {r: ({"stdout": [b"r%d\n" % r]}, 0, False) for r in range(ranks)}, clock
    )
    sink = RecordingSink()
    output = CountingFanout(sink)
    specs = [spec(r) for r in range(ranks)]
    result = Supervisor(specs, transport, output, handle_signals=False, clock=clock).run()
    assert result.exit_code == 0
    assert len(sink.lines) == ranks  # every line
    last = {state.rank: state for state in sink.states}
    assert len(last) == ranks and all(s.status == 0 for s in last.values())
    assert output.handed < ranks // 4  # not one hand-over per state


def test_a_rank_state_is_encoded_once_per_status_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of ranks start, run and exit within one interval: only the state that is
    written is encoded, once."""
    job = JobDir.create(tmp_path, "20261126-000000-abcdef", {})
    recorder = JobRecorder(job, status_every_s=3600)
    recorder.write_status("running", None)  # the interval starts: the states below wait
    encoded: list[RankState] = []
    real = recorder_module.state_json

    def counting(state: RankState) -> str:
        encoded.append(state)
        return real(state)

    monkeypatch.setattr(recorder_module, "state_json", counting)
    for rank in range(50):
        for status in (None, None, 0):  # started, running, exited
            recorder.update(RankState(rank, "h", "worker", 100 + rank, 1.0, status=status))
    recorder.end_status("succeeded", 0)
    assert sorted(state.rank for state in encoded) == list(range(50))  # the last state, once
    assert all(state.status == 0 for state in encoded)
    status = job.status()
    assert status["state"] == "succeeded"
    assert {int(r): s["status"] for r, s in status["ranks"].items()} == dict.fromkeys(range(50), 0)


def test_a_large_job_has_every_rank_log_made_while_it_starts(tmp_path: Path) -> None:
    """Every rank's log exists, private, once the plan is written (a silent rank's empty),
    and every line still lands in its own rank's file."""
    job = JobDir.create(tmp_path, "20261126-000000-abcdef", {})
    recorder = JobRecorder(job)
    ranks = 300
    recorder.write_plan([{"rank": r, "host": "h", "local_rank": r} for r in range(ranks)])
    for r in range(0, ranks, 2):  # the odd ranks say nothing
        recorder.show(spec(r), "stdout", [b"hello from %d" % r])
    recorder.close_files()
    for r in range(ranks):
        path = job.log_path(r)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        logged = [line.split(b" ", 2)[2] for line in path.read_bytes().splitlines()]
        assert logged == ([b"hello from %d" % r] if r % 2 == 0 else [])


def test_log_files_made_ahead_are_waited_for_not_made_twice(tmp_path: Path) -> None:
    """A line whose file the creating thread is about to make waits for it; one far
    ahead of it, or not in its list, is made by the writer; closing stops the thread."""
    logs = LogFiles(tmp_path, limit=4)
    names = [f"rank.{r}.log" for r in range(2000)]
    logs.create_ahead(names)
    for r in (0, 1, 2, 1999):
        logs.append(f"rank.{r}.log", b"line %d\n" % r)
    logs.append("mpirun.log", b"mpirun's own\n")
    assert len(logs.fds) == 4  # the least recently used closed past the limit
    logs.close()
    assert logs.creating is not None and not logs.creating.is_alive()
    for r in (0, 1, 2, 1999):
        assert (tmp_path / f"rank.{r}.log").read_bytes() == b"line %d\n" % r
    assert (tmp_path / "mpirun.log").read_bytes() == b"mpirun's own\n"
    logs.append("rank.5.log", b"late\n")  # after the end: opened, written, closed
    assert (tmp_path / "rank.5.log").read_bytes() == b"late\n" and not logs.fds
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in tmp_path.iterdir())


def test_a_late_line_and_the_job_end_never_share_a_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line after the drain's cut comes on its reader's thread while the main thread
    closes the logs at the job's end: the close waits for the write in progress, so no line
    goes to a closed descriptor (or to the file that took its number, status.json)."""
    import launcher.streams.logfiles as logfiles

    logs = LogFiles(tmp_path)
    logs.append("rank.0.log", b"first\n")
    write = logfiles.append_all
    closer = threading.Thread(target=logs.close)
    still_open: list[bool] = []

    def append_all(fd: int, data: bytes) -> None:
        if not closer.is_alive() and not still_open:  # the job ends mid-write
            closer.start()
            closer.join(timeout=0.5)  # (it may close at once: before the fix, it did)
            still_open.append(closer.is_alive())
        write(fd, data)

    monkeypatch.setattr(logfiles, "append_all", append_all)
    logs.append("rank.0.log", b"late\n")  # (an OSError here: written to a closed fd)
    closer.join()
    assert still_open == [True]
    assert (tmp_path / "rank.0.log").read_bytes() == b"first\nlate\n"
    assert logs.closed and not logs.fds
