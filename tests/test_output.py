"""Output never stalls the kill path or grows without bound: bounded per-rank queues,
writer threads per sink, back-pressure to the ranks, sinks that fail or go away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig, PlacementConfig
from launcher.core.hosts import Host
from launcher.core.outcome import JobResult, RankState, Stream
from launcher.loop.supervisor import Supervisor
from launcher.remote import agent
from launcher.run.attempt import Finished
from launcher.run.job import run_job
from launcher.streams.jobdir import JobDir
from launcher.streams.outlets import Fanout, Lines, Outlet, OutputQueue
from launcher.transport.agentlink import AgentProcess
from tests.conftest import DTRAIN, JOBS, REPO, child_env, marked_pids, rss_mib, wait_for_pids
from tests.fakes import FakeClock, FakeTransport, RecordingFrontend, RecordingSink
from tests.test_job import local_survey
from tests.test_output_end import FeedRecord, StubHost
from tests.testhosts import TestHosts


def spec(rank: int) -> LaunchSpec:
    return LaunchSpec(rank=rank, host=Host("h"), local_rank=rank, argv=("x",), env={})


def test_a_full_rank_is_held_back_while_other_ranks_pass() -> None:
    """Posting never waits: a rank whose share is full is told so (its reader stops reading
    it) and told again once the writer took half of it; another rank's share is its own."""
    queue = OutputQueue(limit_bytes=1000)
    assert queue.put_lines(spec(0), "stdout", [b"x" * 436])  # 500 bytes with its overhead
    assert queue.put_lines(spec(0), "stdout", [b"y" * 436])  # the share is full: still taken
    room = threading.Event()
    assert not queue.when_room((0, None), room.set)  # full: hold rank 0 back
    assert queue.when_room((1, None), lambda: None)  # rank 1's share is its own
    assert queue.put_lines(spec(1), "stdout", [b"z" * 200])
    item, dropped = queue.take()
    assert isinstance(item, Lines) and item.lines == [b"x" * 436] and dropped == 0
    assert room.is_set()  # half of rank 0's share is free: its reader goes on
    taken = [queue.take()[0] for _ in range(2)]
    assert [i.lines[0][:1] for i in taken if isinstance(i, Lines)] == [b"y", b"z"]


def test_a_lossy_queue_drops_and_counts_instead_of_waiting() -> None:
    queue = OutputQueue(limit_bytes=1000, lossy=True)
    queue.put_lines(spec(0), "stdout", [b"x" * 900])
    queue.put_lines(spec(0), "stdout", [b"a" * 200, b"b" * 200])  # returns at once
    item, dropped = queue.take()
    assert isinstance(item, Lines) and dropped == 2


def test_states_never_wait_and_abandon_frees_a_held_reader() -> None:
    queue = OutputQueue(limit_bytes=10)
    queue.put_lines(spec(0), "stdout", [b"x" * 10])
    room = threading.Event()
    assert not queue.when_room((0, None), room.set)
    queue.put_state(RankState(0, "h", "worker", 1, 0.0))  # the loop's post: no wait
    queue.abandon()
    assert room.is_set()
    assert queue.take() == (None, 0)


class BlockingSink(RecordingSink):
    """A terminal whose reader paused: every show waits until ``resume`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.resume = threading.Event()

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        self.resume.wait()
        super().show(spec, stream, lines)


def test_a_paused_view_does_not_stall_the_kill_path() -> None:
    clock = FakeClock()
    many = [b"line %d\n" % i * 1000 for i in range(50)]  # more than the view's queue holds
    transport = FakeTransport(
        {0: ({"stdout": many}, None, False), 1: ({"stderr": [b"boom\n"]}, 3, False)}, clock
    )
    view = BlockingSink()
    outlet = Outlet(view, limit_bytes=4096)
    supervisor = Supervisor(
        [spec(0), spec(1)],
        transport,
        outlet_fanout(outlet),
        grace_s=5,
        clock=clock,
        handle_signals=False,
    )
    results: list[JobResult] = []
    runner = threading.Thread(target=lambda: results.append(supervisor.run()))
    runner.start()
    deadline = time.monotonic() + 10
    while not transport.started.get(0) or not transport.started[0].signals:
        assert time.monotonic() < deadline, "rank 0 was never stopped while the view was paused"
        time.sleep(0.01)
    assert transport.started[0].signals == [signal.SIGTERM]
    assert runner.is_alive()  # what is left is the view's to show
    view.resume.set()
    runner.join(10)
    (result,) = results
    assert result.exit_code == 3
    assert outlet.finish(timeout_s=30)  # the view is the job's to finish, as the attempt does
    # Every line rank 0 wrote, in order, to the last: a paused view loses none at the end.
    shown = [line for rank, _, line in view.lines if rank == 0]
    assert shown == [b"line %d" % i for i in range(50) for _ in range(1000)]


class TimedRecordingSink(BlockingSink):
    """A sink that holds lines (as the collapsing view does): it records when each batch
    was posted, and the flush at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.posted: list[tuple[bytes, float]] = []
        self.flushed = False

    def show_at(self, spec: LaunchSpec, stream: Stream, lines: list[bytes], at: float) -> None:
        self.show(spec, stream, lines)
        self.posted.extend((line, at) for line in lines)

    def next_due(self) -> float | None:
        return None

    def tick(self, now: float | None = None) -> None:
        """Nothing is held here."""

    def flush(self) -> None:
        self.flushed = True


def test_a_timed_sink_gets_each_batch_with_the_time_it_was_posted() -> None:
    posted_at = iter(range(100, 200))
    sink = TimedRecordingSink()
    outlet = Outlet(sink, clock=lambda: float(next(posted_at)))
    for i in range(3):  # the writer waits on the sink meanwhile: taken later, stamped now
        outlet.post_lines(spec(i), "stdout", [b"line %d" % i])
    sink.resume.set()
    assert outlet.finish(timeout_s=10)
    assert sink.posted == [(b"line 0", 100.0), (b"line 1", 101.0), (b"line 2", 102.0)]
    assert sink.flushed


def outlet_fanout(outlet: Outlet) -> Fanout:
    return Fanout([outlet])


class RaisingFrontend(RecordingFrontend):
    def __init__(self) -> None:
        super().__init__()

        def broken(spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
            raise RuntimeError("the view has a bug")

        self.sink.show = broken  # type: ignore[method-assign]


def test_a_view_that_raises_does_not_end_the_job(tmp_path: Path) -> None:
    clock = FakeClock()
    transport = FakeTransport(
        {0: ({"stdout": [b"a\n", b"b\n"]}, 0, False), 1: ({"stdout": [b"c\n"]}, 0, False)}, clock
    )
    frontend = RaisingFrontend()
    config = JobConfig(command=("true",), placement=PlacementConfig(np=2), job_dir=str(tmp_path))
    outcome = run_job(
        config,
        {"PATH": os.environ["PATH"]},
        frontend,
        survey=local_survey,
        transports=lambda survey, config, environ: transport,
        clock=clock,
    )
    assert isinstance(outcome, Finished) and outcome.result.exit_code == 0
    assert transport.started[0].signals == []  # nobody was stopped for it
    assert any(
        "the terminal view failed" in n and "the view has a bug" in n for n in frontend.notices
    )
    (job,) = tmp_path.iterdir()
    assert JobDir(job).status()["state"] == "succeeded"
    assert JobDir(job).log_path(0).read_bytes().count(b" o ") == 2  # every line recorded


CHATTY = "if [ $RANK = 1 ]; then sleep 2; exit 3; fi; yes 'a line of output' "


@pytest.mark.timeout(120)
def test_paused_reader_during_a_failure(
    mark: str, start_unread: Callable[..., subprocess.Popen[bytes]]
) -> None:
    before = set(JOBS.iterdir())
    proc = start_unread(
        "run", "--plain", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", CHATTY
    )
    wait_for_pids(mark, 2)
    peak = 0.0
    deadline = time.monotonic() + 30
    while marked_pids(mark):  # rank 1 fails after 2 s; rank 0 must be stopped, unread or not
        assert time.monotonic() < deadline, "the ranks outlived a failure behind a paused reader"
        peak = max(peak, rss_mib(proc.pid))
        time.sleep(0.05)
    assert proc.poll() is None  # still showing what rank 0 wrote, to a reader that waits
    assert peak < 200, f"dtrain grew to {peak:.0f} MiB behind a paused reader"
    out, err = proc.communicate(timeout=60)  # the reader resumes
    assert proc.returncode == 3, err
    assert b"dtrain: rank 1 on localhost failed (exit code 3)" in err
    (job,) = set(JOBS.iterdir()) - before
    assert JobDir(job).status()["state"] == "failed"
    shown = out.count(b"[0] a line of output\n")
    assert shown > 0 and shown == JobDir(job).log_path(0).read_bytes().count(b" o a line")


@pytest.mark.timeout(120)
def test_sigterm_while_output_is_blocked(
    mark: str, start_unread: Callable[..., subprocess.Popen[bytes]]
) -> None:
    proc = start_unread(
        "run", "--plain", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "yes"
    )
    wait_for_pids(mark, 2 * 2)
    time.sleep(0.5)  # the pipe and the queues fill
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while marked_pids(mark) or proc.poll() is None:  # nobody ever reads: dtrain still ends
        assert time.monotonic() < deadline, "SIGTERM did not end the job behind a paused reader"
        time.sleep(0.05)
    assert proc.returncode == 128 + signal.SIGTERM


def test_json_into_head_ends_the_view_not_the_job(mark: str) -> None:
    before = set(JOBS.iterdir())
    script = "for i in $(seq 300); do echo line $i; done; sleep 0.5; echo done"
    command = (
        " ".join(DTRAIN)
        + f" run --json -np 2 -x DTRAIN_TEST_MARK={mark} sh -c '{script}' | head -2;"
        + " echo status=${PIPESTATUS[0]} >&2"
    )
    result = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=60,
    )
    # The job's object, then a line's.
    assert result.stdout.count("\n") == 2 and '"text": "line 1"' in result.stdout
    assert "status=0" in result.stderr
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr
    (job,) = set(JOBS.iterdir()) - before
    assert JobDir(job).status()["state"] == "succeeded"
    assert JobDir(job).log_path(1).read_bytes().count(b" o ") == 301


@pytest.mark.timeout(120)
def test_a_failed_job_behind_a_paused_reader_is_recorded_and_ends_on_sigterm(
    mark: str, start_unread: Callable[..., subprocess.Popen[bytes]]
) -> None:
    before = set(JOBS.iterdir())
    proc = start_unread(
        "run", "--plain", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", CHATTY
    )
    wait_for_pids(mark, 2)
    deadline = time.monotonic() + 30
    while marked_pids(mark):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (job,) = set(JOBS.iterdir()) - before
    while JobDir(job).status().get("state") == "running":  # recorded before the view is done
        assert time.monotonic() < deadline, "the job stayed 'running' behind a paused reader"
        time.sleep(0.05)
    assert JobDir(job).status()["state"] == "failed"
    assert proc.poll() is None  # still showing rank 0's lines to a reader that waits
    proc.send_signal(signal.SIGTERM)  # the user gives up on the view
    proc.wait(timeout=15)
    assert proc.returncode == 3  # the job's own exit code, not the signal's


def test_a_reader_held_back_by_a_full_view_goes_on_once_the_ranks_ended() -> None:
    """Behind a paused terminal a rank's share of the view's queue is full and its reader
    holds it back; once every rank has exited the view may hold more, so what is still in
    flight reaches the job directory now instead of waiting for (or being lost to) the
    terminal."""
    queue = OutputQueue(limit_bytes=100)
    assert queue.put_lines(spec(0), "stdout", [b"x" * 80])
    room = threading.Event()
    assert not queue.when_room((0, None), room.set)  # no room: the reader stops reading it
    queue.let_lag()
    assert room.is_set()
    assert queue.put_lines(spec(0), "stdout", [b"y" * 80])
    assert len(queue.items) == 2  # both batches kept for the view


# -- back-pressure holds back one rank, never the reader of all, never a "hang" ----------

BUSY = "import time\nwhile True: print('step', time.time(), 'x' * 2000, flush=True)"
FLOOD_AND_TICK = """
import os, sys, time
if os.environ["RANK"] == "0":
    while True:
        print("flood", "x" * 2000, flush=True)
for i in range(40):
    print("tick", i, flush=True)
    time.sleep(0.1)
"""


def logged(job: Path, rank: int) -> list[bytes]:
    """A rank's stdout lines in the job directory, so far."""
    path = JobDir(job).log_path(rank)
    if not path.exists():
        return []
    return [
        line.split(b" ", 2)[2]
        for line in path.read_bytes().splitlines()
        if line.count(b" ") >= 2 and line.split(b" ", 2)[1] == b"o"
    ]


def wait_held_back(job: Path, rank: int, timeout_s: float = 30) -> None:
    """Wait until the rank's log stops growing: the paused reader holds it back."""
    deadline = time.monotonic() + timeout_s
    size = -1
    while True:
        path = JobDir(job).log_path(rank)
        now = path.stat().st_size if path.exists() else 0
        if now == size and now > 0:
            return
        assert time.monotonic() < deadline, "the rank was never held back"
        size = now
        time.sleep(1.0)


def new_job(before: set[Path], timeout_s: float = 30) -> Path:
    deadline = time.monotonic() + timeout_s
    while not (set(JOBS.iterdir()) - before):
        assert time.monotonic() < deadline, "no job directory"
        time.sleep(0.05)
    (job,) = set(JOBS.iterdir()) - before
    return job


@pytest.mark.timeout(120)
def test_a_rank_held_back_by_a_paused_terminal_is_not_a_hang(
    mark: str, start_unread: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """A rank that prints all the time at a paused terminal waits on dtrain's back-pressure:
    that is not silence, and --hang-timeout does not fire (it fired after the timeout, with
    exit 124, while the rank printed all the time)."""
    before = set(JOBS.iterdir())
    proc = start_unread(
        "run", "--plain", "-np", "1", "--hang-timeout", "1", "-x", f"DTRAIN_TEST_MARK={mark}",
        "--", sys.executable, "-c", BUSY,
    )  # fmt: skip
    job = new_job(before)
    wait_held_back(job, 0)
    time.sleep(4)  # four hang timeouts of a rank held back all the while
    assert marked_pids(mark), "the rank was stopped as hung"
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert b"--hang-timeout" not in err, err
    assert proc.returncode == 128 + signal.SIGTERM


def check_ticks_pass_a_flood(proc: subprocess.Popen[bytes], job: Path, mark: str) -> None:
    """Rank 0 floods a terminal nobody reads, rank 1 ticks: every tick reaches the job
    directory meanwhile, and the terminal once it is read."""
    deadline = time.monotonic() + 60
    ticks = [b"tick %d" % i for i in range(40)]
    while logged(job, 1) != ticks:
        assert time.monotonic() < deadline, f"rank 1's ticks so far: {logged(job, 1)!r}"
        assert proc.poll() is None
        time.sleep(0.2)
    assert marked_pids(mark)  # rank 0 is still flooding, held back
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)  # the terminal is read again
    shown = [line.split(b"] ", 1)[1] for line in out.splitlines() if line.startswith(b"[1")]
    assert shown == ticks
    assert proc.returncode == 128 + signal.SIGTERM


@pytest.mark.timeout(120)
def test_one_rank_at_a_paused_terminal_does_not_stall_the_others(
    mark: str, start_unread: Callable[..., subprocess.Popen[bytes]]
) -> None:
    """One thread reads every local rank: a rank whose share is full is skipped (its pipe
    is not read until there is room), never waited on (the job directory held 1 of 40
    ticks)."""
    before = set(JOBS.iterdir())
    proc = start_unread(
        "run", "--plain", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}",
        "--", sys.executable, "-c", FLOOD_AND_TICK,
    )  # fmt: skip
    check_ticks_pass_a_flood(proc, new_job(before), mark)


@pytest.mark.timeout(180)
def test_one_remote_rank_at_a_paused_terminal_does_not_stall_the_others(
    mark: str, start_unread: Callable[..., subprocess.Popen[bytes]], ssh_hosts: TestHosts
) -> None:
    """Over SSH one thread feeds every remote rank: a rank whose share is full gets no
    credit back (its agent stops reading it), and the others' chunks and credit go on."""
    before = set(JOBS.iterdir())
    proc = start_unread(
        "run", "--plain", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:1,node2:1",
        "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "-x", "PATH",
        "--", sys.executable, "-c", FLOOD_AND_TICK,
    )  # fmt: skip
    check_ticks_pass_a_flood(proc, new_job(before), mark)


def test_a_remote_rank_with_full_outlets_gets_no_credit_until_there_is_room() -> None:
    """The pump that feeds every remote rank never waits on one: a rank whose outlets are
    full gets no credit back (its agent stops reading it at the end of its window) until
    they have room; then all of it."""
    host = StubHost()
    rank = LaunchSpec(0, Host("h7"), 0, argv=("x",), env={})
    process = AgentProcess(rank, host, 1)  # type: ignore[arg-type]
    feed = FeedRecord()
    feed.full = True
    process.attach(feed)
    quarter = agent.WINDOW_BYTES // 4
    process.receive(agent.STDOUT, b"x" * quarter)
    process.receive(agent.STDOUT, b"y" * quarter)
    host.pump.close()
    assert host.pump.thread is not None
    host.pump.thread.join(10)
    assert [e[2][:1] for e in feed.events] == [b"x", b"y"]  # fed on, not waited on
    assert not [s for s in host.sent if s[1] == agent.CREDIT]
    for on_room in feed.on_room:
        on_room()
    assert [s for s in host.sent if s[1] == agent.CREDIT] == [
        (1, agent.CREDIT, str(2 * quarter).encode())
    ]


def test_a_view_holds_at_most_a_bound_per_rank_once_every_rank_ended() -> None:
    """After the ranks' end nothing holds a reader back, and a paused terminal's view keeps
    at most ENDED_VIEW_BYTES of a rank that goes on writing (an escaped process): the rest
    is dropped and counted, never memory without bound (it grew to 436 MB before)."""
    from launcher.streams.outlets import ENDED_VIEW_BYTES

    queue = OutputQueue(limit_bytes=1 << 20)
    spec = LaunchSpec(rank=0, host=Host("h"), local_rank=0, argv=("x",), env={})
    queue.let_lag()
    line = b"x" * 1000
    for _ in range(20_000):  # 20 MB of lines into a view nobody reads
        assert queue.put_lines(spec, "stdout", [line])
        assert queue.when_room((0, None), lambda: None)  # no reader is held back
    assert sum(queue.pending.values()) <= ENDED_VIEW_BYTES + 2000
    assert queue.dropped > 10_000
