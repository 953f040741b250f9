"""status.json while a job runs: rank states in bursts (at most one write per interval), and
the job's end at once, never overwritten by a write that was pending."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from launcher.core.outcome import JobResult, RankState
from launcher.streams.jobdir import JobDir
from launcher.streams.recorder import JobRecorder

RANKS = 300
EVERY_S = 0.5


class CountingRecorder(JobRecorder):
    def __init__(self, job: JobDir) -> None:
        super().__init__(job, status_every_s=EVERY_S)
        self.writes: list[str] = []

    def write_status(self, state: str, exit_code: int | None) -> None:
        self.writes.append(state)
        super().write_status(state, exit_code)


def wait_for(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_burst_of_states_is_one_write_and_the_end_is_final(tmp_path: Path) -> None:
    job = JobDir.create(tmp_path, "20261125-000000-abcdef", {})
    recorder = CountingRecorder(job)
    recorder.write_status("running", None)  # as the job layer does before the first rank
    began = time.monotonic()
    states = [RankState(r, "localhost", "worker", 1000 + r, time.time()) for r in range(RANKS)]
    for state in states:
        recorder.update(state)
    burst_s = time.monotonic() - began
    # One write per interval the burst spanned, and the one that ends it: not one per state.
    assert len(recorder.writes) <= 2 + int(burst_s / EVERY_S)
    # The burst's last states are written without another update coming.
    assert wait_for(lambda: len(job.status().get("ranks", {})) == RANKS)
    assert job.status()["ranks"][str(RANKS - 1)]["pid"] == 1000 + RANKS - 1
    for state in states:
        recorder.update(replace(state, status=0, ended=time.time()))
    recorder.finish(JobResult(exit_code=0, world_size=RANKS, elapsed_s=1.0), stopped=False)
    final = job.status()
    assert final["state"] == "succeeded"
    assert all(final["ranks"][str(r)]["status"] == 0 for r in range(RANKS))
    writes = len(recorder.writes)
    time.sleep(EVERY_S * 2)  # a pending write, were it not cancelled, would come by now
    assert job.status()["state"] == "succeeded"
    assert len(recorder.writes) == writes


def test_a_single_state_after_a_quiet_spell_is_written_at_once(tmp_path: Path) -> None:
    job = JobDir.create(tmp_path, "20261125-000000-abcdef", {})
    recorder = CountingRecorder(job)
    recorder.update(RankState(0, "localhost", "worker", 42, time.time()))
    assert recorder.writes == ["running"]  # nothing was written before: no wait
    assert job.status()["ranks"]["0"]["pid"] == 42


def test_lines_after_the_journal_finished_still_reach_the_job_directory(tmp_path: Path) -> None:
    """A rank's reader can outlive the job's end (it waited on a paused view): its last lines
    go to the job directory after everything queued before them."""
    from launcher.core.command import LaunchSpec
    from launcher.core.hosts import Host
    from launcher.streams.outlets import Fanout, Outlet

    job = JobDir.create(tmp_path, "20261125-000000-abcdef", {})
    recorder = JobRecorder(job)
    journal = Outlet(recorder, name="job directory")
    fanout = Fanout([journal])
    spec = LaunchSpec(0, Host("localhost"), 0, argv=("true",), env={})
    fanout.post_lines(spec, "stdout", [b"line %d" % i for i in range(1000)])
    fanout.finish_journals()
    recorder.finish(JobResult(exit_code=0, world_size=1, elapsed_s=1.0), stopped=False)
    fanout.post_lines(spec, "stdout", [b"late %d" % i for i in range(3)])  # after the end
    logged = [line.split(b" ", 2)[2] for line in job.log_path(0).read_bytes().splitlines()]
    assert logged == [b"line %d" % i for i in range(1000)] + [b"late 0", b"late 1", b"late 2"]
    assert job.status()["state"] == "succeeded"


def test_thousands_of_ranks_keep_a_bounded_number_of_log_files_open(tmp_path: Path) -> None:
    from launcher.core.command import LaunchSpec
    from launcher.core.hosts import Host
    from launcher.streams.logfiles import MAX_OPEN_LOGS

    job = JobDir.create(tmp_path, "20261125-000000-abcdef", {})
    recorder = JobRecorder(job)
    specs = [LaunchSpec(r, Host("h"), 0, argv=("true",), env={}) for r in range(MAX_OPEN_LOGS * 3)]
    for round_ in range(3):  # every rank's file is closed and reopened between rounds
        for spec in specs:
            recorder.show(spec, "stdout", [b"round %d rank %d" % (round_, spec.rank)])
            assert len(recorder.logs.fds) <= MAX_OPEN_LOGS
    recorder.close_files()
    for spec in specs:
        logged = [
            line.split(b" ", 2)[2] for line in job.log_path(spec.rank).read_bytes().splitlines()
        ]
        assert logged == [b"round %d rank %d" % (r, spec.rank) for r in range(3)]
