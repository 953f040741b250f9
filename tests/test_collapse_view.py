"""The collapsing view in the job's output path: with --ranks/--local-ranks, behind a writer
that lags, before the live region, and under ``dtrain logs --collapse``."""

from __future__ import annotations

import io
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from launcher.core.command import LaunchSpec
from launcher.core.config import ViewConfig
from launcher.core.hosts import Host
from launcher.streams.collapse import HOLD_S, Collapser
from launcher.streams.joblogs import LogLine
from launcher.streams.outlets import Outlet
from launcher.view.frontend import make_view
from launcher.view.lineviews import DEFAULT_TAG, CollapsingView, JsonLinesView, LineView
from launcher.view.liveview import LiveView
from launcher.view.logview import LogView
from tests.conftest import child_env, py, run_dtrain


def spec_of(rank: int, local_rank: int | None = None) -> LaunchSpec:
    local = rank if local_rank is None else local_rank
    return LaunchSpec(rank, Host("localhost"), local, ("true",), {})


def wait_for(out: io.StringIO, text: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while text not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    return text in out.getvalue()


def filtered_view(out: io.StringIO, world_size: int, **view: Any) -> Outlet:
    config = ViewConfig(collapse=True, collapse_window_s=60, **view)
    extra: dict[str, Any] = {}
    if config.local_ranks is not None:
        extra["local_rank_of"] = {rank: rank % 4 for rank in range(world_size)}  # hosts of 4
    sink, _ = make_view(config, "job", world_size, DEFAULT_TAG, out, out, **extra)
    return Outlet(sink)


def test_ranks_shown_with_collapsing_lose_no_line() -> None:
    out = io.StringIO()
    outlet = filtered_view(out, 4, ranks="0,1,9")  # 9: no such rank, not waited for
    for rank in range(4):
        outlet.post_lines(spec_of(rank), "stdout", [b"same", b"only %d" % rank])
    # Both ranks shown said it: out at once, not after the window (60 s).
    assert wait_for(out, "[0-1] same\n")
    assert outlet.finish(timeout_s=10)  # the end lets out what is still held
    assert out.getvalue() == "[0-1] same\n[0] only 0\n[1] only 1\n"


def test_local_ranks_shown_count_as_every_rank() -> None:
    out = io.StringIO()
    outlet = filtered_view(out, 8, local_ranks="0,1,2")  # 2 hosts of 4: ranks 0-2 and 4-6
    for rank in range(8):
        outlet.post_lines(spec_of(rank, rank % 4), "stdout", [b"same"])
    assert wait_for(out, "[0-2,4-6] same\n")
    outlet.post_lines(spec_of(5, 1), "stdout", [b"r 5"])
    assert wait_for(out, "[5] r 5\n", timeout_s=0.5) is False  # held for the window
    assert outlet.finish(timeout_s=10)
    assert out.getvalue() == "[0-2,4-6] same\n[5] r 5\n"


def test_dtrain_run_with_local_ranks_and_collapse_shows_every_line() -> None:
    code = "import os; print('same'); print('r', os.environ['RANK'])"
    job = run_dtrain("run", "-np", "4", "--collapse", "--local-ranks", "0,1,2", *py(code))
    assert job.returncode == 0, job.stderr
    lines = job.stdout.splitlines()
    assert sorted(ln for ln in lines if " r " in ln) == ["[0] r 0", "[1] r 1", "[2] r 2"]
    assert [ln for ln in lines if ln.endswith("same")] == ["[0-2] same"]


def test_dtrain_run_mpi_with_collapse_shows_every_line() -> None:
    """mpirun's output is split by rank in front of the collapsing view: its timing passes
    through, so no held line is lost at the end."""
    code = "import os; print('same'); print('r', os.environ['OMPI_COMM_WORLD_RANK'])"
    job = run_dtrain("run", "--mpi", "-np", "2", "--collapse", *py(code))
    assert job.returncode == 0, job.stderr
    lines = job.stdout.splitlines()
    assert sorted(ln for ln in lines if " r " in ln) == ["[0] r 0", "[1] r 1"]
    assert [ln for ln in lines if ln.endswith("same")] == ["[0-1] same"]


class SlowFile(io.StringIO):
    """A terminal that lags: each write takes a while."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def write(self, text: str) -> int:
        time.sleep(self.delay_s)
        return super().write(text)


def test_copies_that_came_together_collapse_while_the_writer_lags() -> None:
    out = SlowFile(0.8)
    outlet = Outlet(CollapsingView(LineView(out, out), 3, 0.5))
    mpirun = replace(spec_of(0), label="mpirun")
    # All posted within milliseconds; the writer takes 0.8 s over mpirun's line (shown as it
    # comes), and gets to rank 2's and rank 1's lines after rank 0's window would have
    # closed by its own clock: by when they came, rank 1's copy is in time.
    outlet.post_lines(spec_of(0), "stderr", [b"UserWarning: slow"])
    outlet.post_lines(mpirun, "stderr", [b"mpirun says"])
    outlet.post_lines(spec_of(2), "stdout", [b"rank 2 alone"])
    outlet.post_lines(spec_of(1), "stderr", [b"UserWarning: slow"])
    assert outlet.finish(timeout_s=20)
    assert out.getvalue().splitlines() == [
        "[mpirun]<stderr> mpirun says",
        "[0-1]<stderr> UserWarning: slow",
        "[2] rank 2 alone",
    ]


def test_a_held_line_still_comes_out_by_the_writers_clock_when_nothing_else_comes() -> None:
    out = io.StringIO()
    outlet = Outlet(CollapsingView(LineView(out, out), 3, 0.3))
    posted = time.monotonic()
    outlet.post_lines(spec_of(1), "stdout", [b"alone"])
    assert wait_for(out, "[1] alone\n")
    assert 0.3 <= time.monotonic() - posted < 5
    assert outlet.finish(timeout_s=10)


def test_the_writer_holds_a_line_some_ranks_said_for_the_others_up_to_the_bound() -> None:
    out = io.StringIO()
    outlet = Outlet(CollapsingView(LineView(out, out), 3, 0.2))
    posted = time.monotonic()
    outlet.post_lines(spec_of(0), "stdout", [b"UserWarning: slow"])
    outlet.post_lines(spec_of(1), "stdout", [b"UserWarning: slow"])
    # Rank 2 has printed nothing yet: it is expected to say it too (before: out after 0.2 s).
    assert wait_for(out, "UserWarning", timeout_s=1.0) is False
    assert wait_for(out, "[0-1] UserWarning: slow\n")  # the writer's ticks alone let it out
    assert time.monotonic() - posted >= HOLD_S
    assert outlet.finish(timeout_s=10)


def test_dtrain_run_collapses_a_warning_of_ranks_that_print_it_apart(
    mark: str, tmp_path: Path
) -> None:
    """8 ranks print the same warning 0.1 s apart (0.7 s from the first to the last, more
    than the window): one line for all, and times that never go back."""
    code = (
        "import os, sys, time, warnings\n"
        "room = sys.argv[1]; rank = int(os.environ['RANK'])\n"
        "open(os.path.join(room, str(rank)), 'w').close()\n"
        "while len(os.listdir(room)) < 8: time.sleep(0.01)\n"
        "time.sleep(rank * 0.1)\n"
        "warnings.warn('TypedStorage is deprecated', UserWarning)\n"
        "print('rank', rank, 'done', flush=True)\n"
    )
    env = {**child_env(), "DTRAIN_JOB_DIR": str(tmp_path / "jobs")}  # this job's alone
    room = tmp_path / "room"
    room.mkdir()
    argv = ("run", "-np", "8", "--json", "--collapse", "-x", f"DTRAIN_TEST_MARK={mark}")
    job = run_dtrain(*argv, *py(code), str(room), env=env)
    assert job.returncode == 0, job.stderr
    records = [json.loads(line) for line in job.stdout.splitlines()]
    lines = [r for r in records if "text" in r]
    warned = [r for r in lines if "TypedStorage" in r["text"]]
    assert [r["ranks"] for r in warned] == [list(range(8))]
    assert sorted(r["text"] for r in lines if "done" in r["text"]) == [
        f"rank {rank} done" for rank in range(8)
    ]
    times = [r["time"] for r in lines]
    assert times == sorted(times)
    [job_id] = [path.name for path in (tmp_path / "jobs").iterdir()]
    shown = run_dtrain("logs", job_id, "--collapse", env=env)
    assert shown.returncode == 0, shown.stderr
    assert [ln for ln in shown.stdout.splitlines() if "TypedStorage" in ln] == [
        "[0-7]<stderr> <string>:6: UserWarning: TypedStorage is deprecated"
    ]


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_json_time_of_a_collapsed_line_is_when_it_was_written() -> None:
    out = io.StringIO()
    clock = Clock(10.0)  # the outlet's clock; wall time is 1000 s ahead of it
    view = CollapsingView(
        JsonLinesView(out, clock=lambda: 5.0), 3, 0.5, clock, wall=lambda: clock.now + 1000
    )
    view.show_at(spec_of(0), "stdout", [b"hi"], at=10.0)
    view.show_at(spec_of(1), "stdout", [b"hi"], at=10.1)
    clock.now = 13.0  # emitted well after
    view.tick()
    [record] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert (record["ranks"], record["time"]) == ([0, 1], 1010.0)


def test_json_times_never_go_back_when_the_wall_clock_is_set_back() -> None:
    out = io.StringIO()
    clock, wall = Clock(10.0), Clock(1010.0)
    view = CollapsingView(JsonLinesView(out, clock=lambda: 5.0), 2, 0.5, clock, wall=wall)
    view.show_at(spec_of(0), "stdout", [b"first"], at=10.0)
    clock.now, wall.now = 10.6, 1010.6
    view.tick()
    view.show_at(spec_of(1), "stdout", [b"second"], at=10.7)
    clock.now, wall.now = 11.3, 1001.3  # the wall clock was set back 10 s meanwhile
    view.tick()
    times = [json.loads(line)["time"] for line in out.getvalue().splitlines()]
    assert times == [1010.0, 1010.0]


# Before the live region: what rich would print, on stdout.


def test_before_the_live_region_a_stderr_line_goes_where_rich_would_print_it() -> None:
    out, err = io.StringIO(), io.StringIO()
    line_view = LineView(out, err, color=True, color_system="standard")
    live = LiveView(out, line_view, "job", 2)  # not entered: the live region has not started
    live.show(spec_of(1), "stderr", [b"early stderr 1", b"second"])
    live.show_group([spec_of(0), spec_of(1)], "stdout", [b"both"])
    assert err.getvalue() == ""
    block = (
        "\x1b[35m[1]\x1b[0m\x1b[31m<stderr>\x1b[0m early stderr 1\n"
        "\x1b[35m[1]\x1b[0m\x1b[31m<stderr>\x1b[0m second\n"
        "\x1b[97m[0-1]\x1b[0m both\n"
    )
    assert out.getvalue() == block
    # The live path hands the same text to rich: printed, it is the same bytes.
    printed = io.StringIO()
    console = Console(file=printed, force_terminal=True, color_system="standard", width=200)
    for text in block.splitlines(keepends=True):
        rich_text = Text.from_ansi(text)
        rich_text.rstrip()
        console.print(rich_text, highlight=False, soft_wrap=True)
    assert printed.getvalue() == block


# dtrain logs --collapse


def test_logs_hand_the_collapser_each_recorded_batch_whole() -> None:
    out = io.StringIO()
    specs = {rank: spec_of(rank) for rank in range(2)}
    view = LogView(specs, out, collapse_window_s=0.5)
    lines = [b"line %d" % i for i in range(1000)]
    for rank in range(2):  # each rank's batch was recorded with one time
        for text in lines:
            view.show_line(LogLine(1.0 + rank * 0.01, rank, "stdout", text))
        if rank == 0:
            assert view.collapser is not None
            view.show_line(LogLine(1.0, 0, "stderr", b"other stream"))  # ends the batch
            assert len(view.collapser.pending) == 1  # one block, not a block per line
    view.show_line(LogLine(1.5, 1, "stdout", b"later, alone"))
    view.finish()
    shown = out.getvalue().splitlines()
    assert shown == [
        *(f"[0-1] line {i}" for i in range(1000)),
        "[0]<stderr> other stream",
        "[1] later, alone",
    ]


def test_moving_many_free_blocks_in_front_of_a_shared_line_is_not_quadratic() -> None:
    c = Collapser(world_size=3, window_s=60)
    c.add(0, "stdout", b"shared", now=0)
    count = 20_000
    started = time.process_time()
    for i in range(count):  # a line per add (a rank that flushes after every line)
        c.add(1, "stdout", b"rank 1 line %d" % i, now=0.001)
        c.add(2, "stdout", b"rank 2 line %d" % i, now=0.001)
    setup_s = time.process_time() - started
    started = time.process_time()
    c.add(1, "stdout", b"shared", now=0.002)  # rank 1's 20,000 blocks move in front of it
    join_s = time.process_time() - started
    # Before: a scan of the 40,000 held blocks per block moved, several times the setup.
    assert join_s < setup_s / 2, (join_s, setup_s)
    out = c.flush()
    at = next(i for i, item in enumerate(out) if item.lines == (b"shared",))
    assert out[at].ranks == (0, 1)
    before = [line for item in out[:at] for line in item.lines]
    assert before == [b"rank 1 line %d" % i for i in range(count)]  # in order, in front
