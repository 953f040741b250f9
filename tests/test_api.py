"""The Python API end to end: ``launcher.launch`` and ``launcher.start`` run real ranks through
``dtrain run``'s path; every rank's value comes back, a failing rank raises with its
traceback, Ctrl-C tears down, and nothing (process, thread, fd, signal handler) is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import launcher
from launcher.api.options import keyword_values
from launcher.api.payload import pack_call
from launcher.base.errors import UsageError
from launcher.cli.main import run as run_command
from launcher.core.results import ERROR, RESULT_MARK, TOKEN_VARIABLE, read_frames
from launcher.remote import fnrunner
from launcher.streams.jobdir import JobDir
from tests import apifuncs
from tests.conftest import JOBS, MARK, REPO, child_env, run_dtrain, wait_until_gone
from tests.slurmcluster import SlurmCluster

pytestmark = pytest.mark.timeout(120)


def here(mark: str, **options: Any) -> dict[str, Any]:
    """The options every test's job gets: its job directory root, its mark on the ranks."""
    return {"job_dir": str(JOBS), "env": {MARK: mark}, **options}


def test_launch_returns_every_ranks_value_and_shows_tagged_lines(
    mark: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = launcher.launch(apifuncs.rank_times, (10,), {"offset": 1}, np=4, **here(mark))
    assert result.values == (1, 11, 21, 31)
    assert result.rank(2) == 21
    assert (result.exit_code, result.state) == (0, "succeeded")
    out = capsys.readouterr().out.splitlines()
    assert sorted(line for line in out if "hello" in line) == [
        f"[{rank}] hello from rank {rank}" for rank in range(4)
    ]
    assert "[0-3] every rank says this" in out  # collapsed, as on a terminal
    assert not any("\x1e" in line for line in out)  # the result lines are not shown...
    job = JobDir(Path(result.job_dir))
    assert all(b"\x1e" not in job.log_path(r).read_bytes() for r in range(4))  # ...nor logged
    assert (job.path / "results" / "rank.3").read_bytes().startswith(RESULT_MARK)
    logs = run_dtrain("logs", result.job_id, "--job-dir", str(JOBS))
    assert "[2] hello from rank 2" in logs.stdout and "\x1e" not in logs.stdout
    listed = run_dtrain("jobs", "--job-dir", str(JOBS)).stdout
    assert f"{result.job_id}  succeeded" in listed and "tests.apifuncs.rank_times" in listed


def test_quiet_keeps_the_lines_in_the_job_directory_only(
    mark: str, capsys: pytest.CaptureFixture[str]
) -> None:
    result = launcher.launch(apifuncs.rank_times, (1,), np=2, quiet=True, **here(mark))
    assert result.values == (0, 1)
    assert "hello" not in capsys.readouterr().out
    logs = run_dtrain("logs", result.job_id, "--job-dir", str(JOBS)).stdout
    assert "[1] hello from rank 1" in logs


def test_options_reach_the_ranks_and_the_call_leaves_their_environment(mark: str) -> None:
    os.environ["API_TEST_VALUE"], os.environ[MARK] = "copied", mark
    try:
        result = launcher.launch(
            apifuncs.world,
            np=3,
            job_dir=str(JOBS),
            env=[MARK, "API_TEST_VALUE"],  # names: copied from here, as -x NAME
            max_restarts=1,
            tag_format="{rank}>",
        )
    finally:
        del os.environ["API_TEST_VALUE"], os.environ[MARK]
    assert [v["rank"] for v in result.values] == [0, 1, 2]
    assert {v["world_size"] for v in result.values} == {3}
    assert {v["marked"] for v in result.values} == {"copied"}
    assert {tuple(v["payload_left"]) for v in result.values} == {()}  # taken out: no child gets it


def test_a_failing_rank_raises_rank_failed_with_its_remote_traceback(mark: str) -> None:
    with pytest.raises(launcher.RankFailed) as caught:
        launcher.launch(apifuncs.fail_on, (2,), np=4, **here(mark))
    failed = caught.value
    assert (failed.rank, failed.host, failed.cause) == (2, "localhost", "exit code 1")
    assert (failed.exc_type, failed.exc_message) == ("ValueError", "rank 2 cannot go on")
    assert failed.message == "rank 2 on localhost raised ValueError: rank 2 cannot go on"
    assert failed.remote_traceback is not None
    assert 'apifuncs.py", line' in failed.remote_traceback
    assert 'raise ValueError(f"rank {rank} cannot go on")' in failed.remote_traceback
    assert "Remote traceback (rank 2 on localhost)" in str(failed)
    assert (failed.exit_code, failed.state) == (1, "failed")
    assert "dtrain: stopped the other 3 ranks" in failed.summary
    assert failed.summary[-1] == "dtrain: rank 2 on localhost failed (exit code 1); dtrain exits 1"


def test_a_rank_that_ends_without_returning_is_an_error(mark: str) -> None:
    with pytest.raises(launcher.JobFailed, match="rank 0 ended without sending back a result"):
        launcher.launch(apifuncs.exits_early, np=2, **here(mark))


def test_a_job_failed_without_a_rank_says_its_whole_last_line(mark: str) -> None:
    # (the summary's last line is broken to fit 80 columns: the message is all of it)
    with pytest.raises(launcher.JobFailed) as caught:
        launcher.launch(apifuncs.ready_then_sleep, np=2, timeout=1, **here(mark))
    assert caught.value.message == (
        "the job ran longer than --timeout 1 s (rank(s) 0-1 on localhost still running); "
        "dtrain exits 124"
    )
    assert caught.value.exit_code == 124


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_restart": 2}, "no such option max_restart= (did you mean max_restarts=?)"),
        ({"np": "x"}, "np='x': not a whole number (write e.g. np=4)"),
        ({"grace": -1}, "grace=-1: must be at least 0 seconds (give grace=0 or more)"),
        ({"np": 0}, "np=0: must be at least 1 (give np=1 or more)"),
        ({"quiet": "yes"}, "quiet='yes': a flag takes True or False (write quiet=True)"),
        ({"detach": True}, "detach= is not an option of launch() (use launcher.start("),
        ({"env": 5}, "env=5: not variables"),
        ({"env": {"A": None}}, "env={'A': None}: a variable's value is text"),
        ({"env": {"A": True}}, "env={'A': True}: a variable's value is text"),
        ({"env": {"1BAD": "x"}}, "-x '1BAD=x': '1BAD' is not a valid variable name"),
        ({"bind_to": "everything"}, "bind_to='everything': not one of none, core, socket"),
        ({"bind_to": "cores"}, "bind_to='cores': not one of none, core, socket (did you mean"),
        ({"hosts": []}, "-H: no hosts"),  # (as -H '': not this machine by default)
        ({"hosts": ()}, "-H: no hosts"),
        ({"hosts": ""}, "-H: no hosts"),
    ],
)
def test_a_bad_option_raises_the_command_lines_error_before_anything_starts(
    options: dict[str, Any], message: str
) -> None:
    before = set(JOBS.iterdir())
    with pytest.raises(UsageError) as caught:
        launcher.launch(apifuncs.rank_times, (1,), job_dir=str(JOBS), **options)
    assert str(caught.value).startswith(message)
    assert caught.value.exit_code == 2
    assert set(JOBS.iterdir()) == before  # no job directory: nothing started


def test_a_call_that_cannot_travel_is_refused() -> None:
    with pytest.raises(UsageError, match="cannot be pickled"):
        launcher.launch(apifuncs.rank_times, (threading.Lock(),), job_dir=str(JOBS))
    with pytest.raises(UsageError, match=r"pickle to 2,\d+,\d+ bytes, over the 1,048,576"):
        launcher.launch(apifuncs.rank_times, (b"x" * 2_000_000,), job_dir=str(JOBS))
    with pytest.raises(UsageError, match="launch\\(\\) runs a function, not 3"):
        launcher.launch(3, job_dir=str(JOBS))  # type: ignore[arg-type]


def test_keywords_become_the_values_the_command_line_gives() -> None:
    given = {
        "np": 8,
        "hosts": ["a:4", "b:4"],
        "max_restarts": 2,
        "hang_timeout": 300,
        "env": {"NCCL_DEBUG": "INFO"},
        "collapse": False,
        "no_gpu_binding": True,
        "mca": {"btl": "self,tcp"},
        "oversubscribe": False,
        "hostfile": None,
    }
    values, fields = keyword_values(given)
    assert values == {
        "np": 8,
        "host_lists": ("a:4", "b:4"),
        "max_restarts": 2,
        "hang_timeout_s": 300.0,
        "exports": ("NCCL_DEBUG=INFO",),
        "collapse": False,
        "gpu_binding": False,
        "mca": (("btl", "self,tcp"),),
        "oversubscribe": False,
    }
    assert fields == set(values)
    assert keyword_values({"env": "HOME", "hosts": "a,b"})[0] == {
        "exports": ("HOME",),
        "host_lists": ("a,b",),
    }
    cli = run_command.make_context("run", ["-np", "8", "-H", "a:4", "-H", "b:4", "true"]).params
    assert {name: cli[name] for name in ("np", "host_lists")} == {
        "np": 8,
        "host_lists": ("a:4", "b:4"),
    }


def test_a_second_launch_leaves_no_thread_fd_or_signal_handler(mark: str) -> None:
    def ours(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGINT, ours)
    terminate = signal.getsignal(signal.SIGTERM)
    try:
        threads, fds = set(threading.enumerate()), sorted(os.listdir("/proc/self/fd"))
        for scale in (1, 2):
            values = launcher.launch(apifuncs.rank_times, (scale,), np=2, **here(mark)).values
            assert values == (0, scale)
            for thread in set(threading.enumerate()) - threads:
                thread.join(5.0)  # (a thread that ends as the job does may still be ending)
            assert set(threading.enumerate()) == threads
            assert sorted(os.listdir("/proc/self/fd")) == fds
            assert signal.getsignal(signal.SIGINT) is ours
            assert signal.getsignal(signal.SIGTERM) == terminate
    finally:
        signal.signal(signal.SIGINT, previous)


def test_launch_in_a_thread_installs_no_signal_handler(mark: str) -> None:
    found: list[Any] = []
    handler = signal.getsignal(signal.SIGINT)

    def work() -> None:
        found.append(launcher.launch(apifuncs.rank_times, (5,), np=2, **here(mark)).values)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert found == [(0, 5)]
    assert signal.getsignal(signal.SIGINT) is handler


def interrupted_script(jobs: Path) -> str:
    """A script whose function is defined in __main__ (it travels by value): Ctrl-C stops
    the first launch; a second one works."""
    return textwrap.dedent(
        f"""
        import sys, time
        from launcher import launch

        def wait():
            print("ready", flush=True)
            time.sleep(120)

        def double(x):
            return 2 * x

        try:
            launch(wait, np=4, job_dir={str(jobs)!r}, env={{{MARK!r}: sys.argv[1]}},
                   collapse=False)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.stdin.readline()  # the test looks for leftovers, then says go on
        again = launch(double, (21,), np=2, job_dir={str(jobs)!r}, env={{{MARK!r}: sys.argv[2]}})
        print("second", again.values, flush=True)
        """
    )


def test_ctrl_c_tears_down_like_dtrain_run_and_a_second_launch_works(
    mark: str, tmp_path: Path
) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(interrupted_script(JOBS))
    second = f"{mark}-second"
    proc = subprocess.Popen(
        [sys.executable, str(script), mark, second],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=child_env(),
        start_new_session=True,  # a terminal of its own: Ctrl-C goes to its process group
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        ready = [proc.stdout.readline() for _ in range(4)]
        assert sorted(ready) == [f"[{rank}] ready\n" for rank in range(4)], ready
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.stdout.readline() == "interrupted\n"
        assert wait_until_gone(mark, timeout=10) == []
        out, err = proc.communicate("go on\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "second (42, 42)" in out
    assert "interrupted by SIGINT" in err
    assert wait_until_gone(second) == []


def test_start_returns_a_handle_to_a_job_like_any_other(mark: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    job = launcher.start(apifuncs.wait_for_file, (str(go),), np=2, **here(mark))
    assert job.status in ("starting", "running")
    assert job.wait(timeout=0.01) is None
    running = run_dtrain("jobs", "--running", "--job-dir", str(JOBS)).stdout
    assert job.job_id in running
    go.touch()
    result = job.result(timeout=60)
    assert result.values == (0, 1) and result.job_id == job.job_id
    assert job.status == "succeeded" and job.wait() == 0
    assert sorted(job.logs().splitlines()) == ["[0] waiting", "[1] waiting"]  # type: ignore[union-attr]
    logs = run_dtrain("logs", job.job_id, "--job-dir", str(JOBS)).stdout
    assert "[1] waiting" in logs


def wait_for_ready(job: launcher.Job, count: int) -> None:
    deadline = time.monotonic() + 60
    while (job.logs() or "").count("ready") < count:
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.05)


def test_stop_and_dtrain_stop_end_a_started_job(mark: str) -> None:
    job = launcher.start(apifuncs.ready_then_sleep, np=2, **here(mark))
    wait_for_ready(job, 2)
    job.stop()
    assert job.status == "stopped"
    with pytest.raises(launcher.JobFailed) as caught:
        job.result()
    assert (caught.value.state, caught.value.exit_code) == ("stopped", 143)
    assert wait_until_gone(mark) == []
    other = launcher.start(apifuncs.ready_then_sleep, np=2, **here(mark))
    wait_for_ready(other, 2)
    stopped = run_dtrain("stop", other.job_id, "--job-dir", str(JOBS))
    assert stopped.returncode == 0, stopped.stderr
    assert other.wait(timeout=30) == 143 and other.status == "stopped"


def test_a_started_job_ends_when_its_caller_does(mark: str, tmp_path: Path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            import launcher
            from tests import apifuncs

            job = launcher.start(apifuncs.ready_then_sleep, np=2, job_dir={str(JOBS)!r},
                                 env={{{MARK!r}: sys.argv[1]}})
            while (job.logs() or "").count("ready") < 2:
                time.sleep(0.05)
            print(job.job_id)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script), mark],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**child_env(), "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    job = JobDir(JOBS / done.stdout.strip())
    assert wait_until_gone(mark, timeout=30) == []
    deadline = time.monotonic() + 30
    while job.state() in ("starting", "running"):  # its launcher records the end, then exits
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert job.state() == "interrupted"


def test_import_launcher_stays_light_and_dtrain_loads_no_cloudpickle() -> None:
    code = (
        "import sys, launcher; "
        "print(sorted(m for m in ('click', 'rich', 'paramiko', 'torch', 'cloudpickle', "
        "'launcher.api') if m in sys.modules))"
    )
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert light.stdout.strip() == "[]", light.stderr
    helped = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from launcher.cli.main import main; main(['--help']); "
            "main(['run', '--help']); print('cloudpickle' in sys.modules)",
        ],
        capture_output=True,
        text=True,
    )
    assert helped.stdout.splitlines()[-1] == "False"
    assert launcher.UsageError is UsageError
    assert {"launch", "start", "RankFailed", "UsageError"} <= set(dir(launcher)) | set(
        launcher.__all__
    )


def test_the_ranks_result_lines_round_trip() -> None:
    data = bytes(range(256)) * 40  # several lines' worth
    lines = [line.rstrip(b"\n") for line in fnrunner.frame_lines("t0k3n", "value", data)]
    assert len(lines) > 1 and all(len(line) < 4096 for line in lines)
    sent = read_frames([b"other output", *lines], "t0k3n")
    assert sent is not None and (sent.kind, sent.data) == ("value", data)
    assert read_frames(lines, "another") is None  # another job's token
    assert read_frames(lines[:-1], "t0k3n") is None  # a piece missing
    assert fnrunner.MARK == RESULT_MARK and fnrunner.TOKEN == TOKEN_VARIABLE


def run_runner(variables: tuple[str, ...], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    env = {**child_env(), **dict(v.split("=", 1) for v in variables)}
    return subprocess.run(
        [sys.executable, "-m", "launcher.remote.fnrunner", "test"],
        capture_output=True,
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO)},
        timeout=60,
    )


def test_the_runner_bounds_the_return_value_and_says_what_it_cannot_load(
    tmp_path: Path,
) -> None:
    packed = pack_call(apifuncs.make_bytes, (5000,), None)
    variables = tuple(
        "DTRAIN_FN_RESULT_LIMIT=1000" if v.startswith("DTRAIN_FN_RESULT_LIMIT=") else v
        for v in packed.variables
    )
    done = run_runner(variables, REPO)
    assert done.returncode == 1
    sent = read_frames(done.stdout.splitlines(), packed.token)
    assert sent is not None and sent.kind == ERROR
    assert b"over the limit of 1000" in sent.data
    assert b"dtrain: its return value pickles to" in done.stderr
    # A function by reference whose module the rank cannot import: why, and what to do.
    (tmp_path / "gone_module.py").write_text("def f():\n    return 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import gone_module  # type: ignore[import-not-found]

        packed = pack_call(gone_module.f, (), None)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gone_module", None)
    elsewhere = [v for v in packed.variables if not v.startswith("DTRAIN_FN_PATH=")]
    done = run_runner(tuple(elsewhere), REPO)
    assert done.returncode == 1
    assert b"cannot load the function: No module named 'gone_module'" in done.stderr
    assert b"install it on this host" in done.stderr


@pytest.mark.slurm
def test_launch_inside_a_slurm_allocation_starts_the_ranks_through_srun(
    slurm_cluster: SlurmCluster, mark: str, tmp_path: Path
) -> None:
    script = tmp_path / "in_allocation.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, socket, sys
            from launcher import launch

            def where():
                return os.environ["RANK"], socket.gethostname(), "SLURM_STEP_ID" in os.environ

            result = launch(where, job_dir={str(JOBS)!r}, env={{{MARK!r}: sys.argv[1]}})
            print("values", result.values)
            """
        )
    )
    done = subprocess.run(
        ["salloc", "-N2", "-n2", sys.executable, str(script), mark],
        capture_output=True,
        text=True,
        env=slurm_cluster.env(child_env()),
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ": 2 task(s) on node1:1,node2:1; ranks start through srun" in done.stderr
    assert "values (('0', 'node1', True), ('1', 'node2', True))" in done.stdout
    assert slurm_cluster.steps() == []


def test_ranks_whose_python_has_no_dtrain_say_how_to_fix_it(mark: str, tmp_path: Path) -> None:
    bare = str(Path(sys.base_prefix) / "bin" / "python3")  # (outside this virtual environment)
    found = subprocess.run([bare, "-c", "import launcher"], capture_output=True, cwd=tmp_path)
    if found.returncode == 0:
        pytest.skip(f"{bare} has dtrain")
    with pytest.raises(launcher.RankFailed) as caught:
        launcher.launch(
            apifuncs.rank_times, (1,), np=1, python=bare, workdir=str(tmp_path), **here(mark)
        )
    assert caught.value.cause == "exit code 1" and caught.value.remote_traceback is None
    assert "install dtrain for the hosts' python" in str(caught.value)
