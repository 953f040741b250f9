"""What dtrain itself prints about a job, as a person reads it at 80 columns: the failure
summary (a short excerpt, then the one line naming the rank, host, cause and exit code),
torch's error file in it, the job's first line, ``--json``'s first object, ``--verbose``,
the count of stopped ranks and ``--timestamp-output``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launcher.core.outcome import JobResult, RankReport
from launcher.view.reports import format_failure
from tests.conftest import JOBS, REPO, run_dtrain
from tests.testhosts import TestHosts

WIDTH = 80  # the columns every line of dtrain's own fits
EXCERPT_ROWS = 8  # at most, the failure summary's excerpt of the rank's last lines
JOB_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")
DIVE = """
import os, time
def dive(n):
    if n == 0:
        raise ValueError("bad batch")
    dive(n - 1)
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    dive(12)
time.sleep(60)
"""


def own_lines(text: str) -> list[str]:
    """The lines dtrain itself printed (not the ranks' tagged lines)."""
    return [line for line in text.splitlines() if not re.match(r"\[[^\]]*\]", line)]


def summary_of(err: str) -> list[str]:
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("dtrain: last std"))
    return lines[start:]


def test_the_failure_summary_is_a_short_excerpt_then_who_failed(mark: str, tmp_path: Path) -> None:
    """A deep traceback (30 lines and more, just shown tagged) comes back as at most 8 lines
    ending at the exception; the last line names rank, host, cause and exit code."""
    (tmp_path / "dive.py").write_text(DIVE)
    done = run_dtrain(
        "run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "python", str(tmp_path / "dive.py")
    )
    assert done.returncode == 1, done.stderr
    summary = summary_of(done.stderr)
    assert summary[0] == "dtrain: last stderr lines of rank 1:"
    excerpt = [line for line in summary[1:] if line.startswith("    ")]
    assert 1 <= len(excerpt) <= EXCERPT_ROWS
    assert excerpt[-1] == "    ValueError: bad batch"
    assert excerpt[-2].strip() == 'raise ValueError("bad batch")'
    assert summary[-2:] == [
        "dtrain: stopped the other 1 rank",
        "dtrain: rank 1 on localhost failed (exit code 1); dtrain exits 1",
    ]
    assert all(len(line) <= WIDTH for line in own_lines(done.stderr) if line.startswith("dtrain"))
    assert all(len(line) <= 2 * WIDTH for line in excerpt)  # a long path: two rows at most


def report(lines: list[str]) -> JobResult:
    """A job whose rank 3 failed with these last lines of stderr."""
    failure = RankReport(rank=3, host="node2", status=1, last_lines=tuple(lines), stream="stderr")
    return JobResult(exit_code=1, world_size=4, elapsed_s=1.0, failure=failure, stopped=3)


def test_an_excerpt_ends_at_the_exception_and_keeps_to_its_rows() -> None:
    """After the exception, a rank's last lines may be noise (a destructor's warning): the
    excerpt ends at the exception line; a long line is cut, so the excerpt stays 8 rows."""
    lines = [
        "Traceback (most recent call last):",
        '  File "train.py", line 9, in <module>',
        "    step(" + "x" * 300 + ")",
        "RuntimeError: NCCL error",
        "[W socket.cpp:207] destructor called after the process group was destroyed",
    ]
    shown = format_failure(report(lines))
    assert shown[0] == "dtrain: last stderr lines of rank 3:"
    assert shown[-3] == "    RuntimeError: NCCL error"
    assert shown[-1] == "dtrain: rank 3 on node2 failed (exit code 1); dtrain exits 1"
    rows = sum(-(-len(line) // WIDTH) for line in shown[1:-2])
    assert rows <= EXCERPT_ROWS and all(len(line) <= 2 * WIDTH for line in shown)
    many = format_failure(report([f"line {i}" for i in range(20)]))
    assert [line.strip() for line in many[1:-2]] == [f"line {i}" for i in range(12, 20)]


def test_long_summary_lines_break_between_words_never_inside_an_id() -> None:
    host = "gpu-node-0017.training-cluster.example.com"
    failure = RankReport(3, host, -9, ("Killed",), "stderr")
    result = JobResult(
        exit_code=137, world_size=64, elapsed_s=1.0, failure=failure, stopped=63, sigkilled=2,
        kill_cause="after the 5 s grace",
    )  # fmt: skip
    shown = format_failure(result)
    assert all(len(line) <= WIDTH for line in shown)
    text = " ".join(line.strip() for line in shown)
    assert f"rank 3 on {host} failed" in text and text.endswith("dtrain exits 137")
    assert shown[-1].startswith("    ")  # the one line, broken between words


@pytest.mark.slow  # a real torch program
def test_torch_error_file_names_the_exception_and_where_it_was_raised(
    mark: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, time\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "print(os.environ['TORCHELASTIC_ERROR_FILE'], flush=True)\n"
        "def load(shard):\n"
        "    raise KeyError(f'shard {shard} is missing')\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        load(7)\n"
        "    time.sleep(60)\n"
        "main()\n"
    )
    done = run_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "python", str(script))
    assert done.returncode == 1, done.stderr
    job_id = JOB_ID.search(done.stderr)
    assert job_id is not None
    files = {line.split("] ", 1)[0]: line.split("] ", 1)[1] for line in done.stdout.splitlines()}
    assert files == {
        f"[{rank}": str(JOBS / job_id[0] / "errors" / f"rank.{rank}.json") for rank in (0, 1)
    }
    summary = summary_of(done.stderr)
    assert f"dtrain: rank 1 raised KeyError: 'shard 7 is missing' at {script}:5 in load" in (
        " ".join(line.strip() if line.startswith("    ") else "\n" + line for line in summary)
    )
    assert summary[-1] == "dtrain: rank 1 on localhost failed (exit code 1); dtrain exits 1"


def test_the_first_line_fits_80_columns_and_the_logs_command_stands_alone() -> None:
    done = run_dtrain("run", "-np", "2", "true")
    assert done.returncode == 0, done.stderr
    first, second = done.stderr.splitlines()[:2]
    job_id = JOB_ID.search(first)
    assert job_id is not None and first == f"dtrain: job {job_id[0]} (2 ranks); its logs:"
    assert second == f"    dtrain logs {job_id[0]}"


def test_json_names_the_job_first(mark: str) -> None:
    done = run_dtrain("run", "--json", "-np", "2", "echo", "hi")
    assert done.returncode == 0, done.stderr
    objects = [json.loads(line) for line in done.stdout.splitlines()]
    assert set(objects[0]) == {"time", "job", "world_size", "attempt"}
    assert (objects[0]["world_size"], objects[0]["attempt"]) == (2, 0)
    assert (JOBS / objects[0]["job"] / "status.json").exists()
    assert sorted(o["rank"] for o in objects[1:]) == [0, 1]


def test_a_rank_that_failed_by_itself_while_stopping_is_not_counted_stopped(mark: str) -> None:
    """Rank 0 fails; rank 1 ignores SIGTERM and fails on its own a moment later; rank 2 is
    stopped by dtrain: one rank stopped, not two."""
    script = (
        'case $RANK in 0) sleep 0.5; exit 3;; 1) trap "" TERM; sleep 1.5; exit 5;; esac; '
        "sleep 60 & wait"
    )
    done = run_dtrain("run", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script)
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        "dtrain: stopped the 1 rank still running",
        "dtrain: rank 0 on localhost failed (exit code 3); dtrain exits 3",
    ]
    job_id = JOB_ID.search(done.stderr)
    assert job_id is not None
    status = json.loads((JOBS / job_id[0] / "status.json").read_text())
    assert status["result"]["stopped"] == 1


def test_timestamp_output_puts_the_time_in_each_tag() -> None:
    done = run_dtrain("run", "--timestamp-output", "-np", "2", "echo", "hi")
    assert done.returncode == 0, done.stderr
    lines = sorted(done.stdout.splitlines())
    assert len(lines) == 2
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d \[[01]\] hi", line) for line in lines), lines


def test_the_readme_failure_sample_fits_80_columns() -> None:
    text = (REPO / "README.md").read_text()
    sample = text.split("<!-- failure -->")[1].split("<!-- /failure -->")[0]
    ours = [line[4:] for line in sample.splitlines() if line.startswith("    dtrain")]
    assert ours and all(len(line) <= WIDTH for line in ours)


def test_verbose_says_each_step_once_and_remote_ranks_pids(ssh_hosts: TestHosts, mark: str) -> None:
    done = run_dtrain(
        "run", "--verbose", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2",
        "-x", f"DTRAIN_TEST_MARK={mark}", "true",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("connecting to 2 host(s) over ssh") == 1, done.stderr
    connected = re.findall(r"connected to (node\d.*) as ", done.stderr)
    assert len(connected) == 2 and all(re.fullmatch(r"node\d \([\d.]+\)", c) for c in connected)
    started = re.findall(r"rank (\d) started on (node\d) \(pid (\d+)\)", done.stderr)
    assert sorted((rank, host) for rank, host, _ in started) == [("0", "node1"), ("1", "node2")]
    assert all(int(pid) > 0 for _, _, pid in started), done.stderr


def test_at_80_columns_no_line_of_dtrains_own_is_wider(mark: str, tmp_path: Path) -> None:
    """A failing job and ``dtrain jobs`` on a terminal of 80 columns: the first lines, the
    summary and every row of the jobs table fit, ids whole."""
    from tests.test_terminal import on_terminal

    (tmp_path / "dive.py").write_text(DIVE)
    argv = ["python", str(tmp_path / "dive.py"), "--a-long-argument", "x" * 40]
    code, screen = on_terminal(
        ["run", "--plain", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", *argv], columns=80
    )
    assert code == 1, screen[-2000:]
    lines = screen.replace("\r\n", "\n").splitlines()
    ours = [line for line in lines if line.startswith(("dtrain", "    dtrain"))]
    assert len(ours) >= 5 and all(len(line) <= WIDTH for line in ours), ours
    code, table = on_terminal(["jobs"], columns=80)
    rows = table.replace("\r\n", "\n").splitlines()
    assert code == 0 and rows[0].split()[:3] == ["job", "state", "exit"], rows
    assert len(rows) > 2 and all(len(row) <= WIDTH for row in rows), rows
    assert all(JOB_ID.match(row) for row in rows[1:]), rows


def test_a_standing_clusters_view_counts_the_tasks_dtrain_runs(tmp_path: Path) -> None:
    """``dtrain ps`` without a program: the chief is the user's coordinator, not started
    here, so the view (its status line, its collapsing) counts the workers and ps only."""
    from launcher.core.config import JobConfig, PsConfig
    from launcher.run.job import run_job
    from tests.fakes import FakeClock, FakeTransport, RecordingFrontend
    from tests.test_job import local_survey

    config = JobConfig(
        command=(), ps=PsConfig(workers=2, ps_tasks=1), job_dir=str(tmp_path), grace_s=1
    )
    clock = FakeClock()
    transport = FakeTransport({r: ({}, 0 if r == 3 else None, False) for r in range(4)}, clock)
    frontend = RecordingFrontend()
    run_job(
        config, {"PATH": "/usr/bin"}, frontend, survey=local_survey,
        transports=lambda survey, config, environ: transport, clock=clock,
    )  # fmt: skip
    assert sorted(transport.started) == [1, 2, 3]  # the chief, rank 0, is the coordinator
    assert [size for _, size in frontend.views] == [3]


@pytest.mark.parametrize("columns", [80, 200])
def test_a_clock_that_did_not_answer_in_time_is_unknown(
    columns: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dtrain check` where no `date` exchange with a host came back in time (a busy host):
    its clock offset is unknown, null in --json and "-" on the terminal, not NaN (which is
    no JSON, and was shown as "clock +nan ms")."""
    import io

    from launcher.run.survey import summarize_host
    from launcher.view.reports import print_check_report

    report = {"hostname": "node1", "python": "/usr/bin/python3", "python_version": "3.11.7",
              "versions": {}, "gpus": [], "ports": [40000]}  # fmt: skip
    row = summarize_host("node1", report, 0.004, None)
    assert json.loads(json.dumps(row, allow_nan=False))["clock_offset_ms"] is None
    monkeypatch.setenv("COLUMNS", str(columns))
    out = io.StringIO()
    print_check_report([row], out)
    assert "nan" not in out.getvalue() and "1 of 1 hosts ok" in out.getvalue()
    assert ("clock -  free port 40000" in out.getvalue()) == (columns == 80), out.getvalue()
    measured = summarize_host("node1", report, 0.004, -0.0123)
    assert measured["clock_offset_ms"] == -12.3
