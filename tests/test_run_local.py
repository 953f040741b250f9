"""End to end on this machine: the real dtrain, real processes, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    JOBS,
    REPO,
    child_env,
    dtrain_in_process,
    marked_pids,
    py,
    run_dtrain,
    start_dtrain,
    tagged,
    wait_for_pids,
    wait_until_gone,
)


def test_every_rank_runs_with_its_environment(mark: str) -> None:
    code = (
        "import os; print(' '.join(os.environ[k] for k in "
        "('RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','NODE_RANK','MASTER_ADDR',"
        "'DTRAIN_JOB_ID','PYTHONUNBUFFERED','OMP_NUM_THREADS')))"
    )
    result = run_dtrain("run", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code))
    assert result.returncode == 0, result.stderr
    rows = {r: tagged(result.stdout, r) for r in range(3)}
    job_ids = set()
    for rank, lines in rows.items():
        assert len(lines) == 1
        fields = lines[0].split()
        assert fields[:5] == [str(rank), "3", str(rank), "3", "0"]
        assert fields[5] == "127.0.0.1"
        assert fields[7:] == ["1", "1"]
        job_ids.add(fields[6])
    assert len(job_ids) == 1


def test_stderr_lines_are_marked_and_kept_apart(mark: str) -> None:
    result = run_dtrain(
        "run",
        "-np",
        "2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "echo out $RANK; echo err $RANK >&2",
    )
    assert result.returncode == 0
    assert sorted(result.stdout.splitlines()) == ["[0] out 0", "[1] out 1"]
    assert sorted(ln for ln in result.stderr.splitlines() if ln.startswith("[")) == [
        "[0]<stderr> err 0",
        "[1]<stderr> err 1",
    ]


def test_failing_rank_stops_the_others_and_sets_the_exit_code(mark: str) -> None:
    script = "if [ $RANK = 2 ]; then echo first >&2; echo dying now >&2; exit 3; fi; exec sleep 60"
    started = time.monotonic()
    result = run_dtrain("run", "-np", "4", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script)
    assert result.returncode == 3
    assert time.monotonic() - started < 30
    summary = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("dtrain:") and not line.startswith("dtrain: job ")
    ]
    # (Under heavy load a rank may still be starting when SIGTERM comes, and need SIGKILL
    # after the grace: the summary then says so after "stopped the other 3 ranks".)
    assert summary[-2].startswith("dtrain: stopped the other 3 ranks")
    assert summary[-1] == "dtrain: rank 2 on localhost failed (exit code 3); dtrain exits 3"
    assert "    dying now" in result.stderr.splitlines()
    assert wait_until_gone(mark) == []


def test_rank_killed_by_a_signal_exits_128_plus_signal(mark: str) -> None:
    script = "if [ $RANK = 0 ]; then kill -KILL $$; fi; exec sleep 60"
    result = run_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script)
    assert result.returncode == 128 + signal.SIGKILL
    assert (  # (the line is broken between words to fit 80 columns)
        "rank 0 on localhost failed (killed by SIGKILL: out of memory? see dmesg on localhost)"
        in " ".join(result.stderr.split())
    )


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(mark: str, tmp_path: Path) -> None:
    # Rank 0 fails once rank 1 ignores SIGTERM (it says so by a file, not a fixed wait).
    ready = tmp_path / "ready"
    script = (
        f"if [ $RANK = 0 ]; then while [ ! -e {ready} ]; do sleep 0.02; done; exit 1; fi; "
        f"trap '' TERM; touch {ready}; echo ready; while :; do sleep 0.1; done"
    )
    result = run_dtrain(
        "run",
        "-np",
        "2",
        "--grace",
        "3",
        "--tag-format",
        "[{rank} {time}]",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        script,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-2:] == [
        "dtrain: stopped the other 1 rank (1 with SIGKILL after the 3 s grace)",
        "dtrain: rank 0 on localhost failed (exit code 1); dtrain exits 1",
    ]
    job_id = re.search(r"dtrain: job (\S+)", result.stderr)
    assert job_id is not None
    ranks = json.loads((JOBS / job_id[1] / "status.json").read_text())["ranks"]
    assert ranks["1"]["status"] == -signal.SIGKILL  # it ignored SIGTERM...
    # ...and lived on for the grace period after rank 0 failed, not less, not much more
    assert 2.9 <= ranks["1"]["ended"] - ranks["0"]["ended"] < 10


@pytest.mark.parametrize(
    "script",
    [
        "sleep 300 & sleep 300 & echo started; exit 0",  # children left in the group
        "setsid sleep 300 & echo started; exit 0",  # a child in a session of its own
        "exec timeout 300 sleep 299",  # timeout(1) moves itself to its own group
        "sh -c 'setsid sleep 300 &' ; sleep 300",  # an orphaned grandchild in its own session
    ],
)
def test_grandchildren_are_ended_with_their_rank(mark: str, script: str) -> None:
    if not script.startswith("sleep 300 &"):
        # Stop these from a failing peer: the rank is killed, not exiting by itself.
        script = f"if [ $RANK = 1 ]; then sleep 1; exit 5; fi; {script}"
    result = run_dtrain(
        "run", "-np", "2", "--grace", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script
    )
    # The rank that exits by itself ends the job with 0; the others are stopped for rank 1.
    assert result.returncode == (0 if script.startswith("sleep 300 &") else 5), result.stderr
    assert wait_until_gone(mark) == []


def test_ranks_get_default_sigpipe(mark: str) -> None:
    result = run_dtrain(
        "run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "yes | head -n 2"
    )
    assert result.returncode == 0, result.stderr
    assert tagged(result.stdout, 0) == ["y", "y"]
    assert "Broken pipe" not in result.stderr


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_dtrain_stops_everything(mark: str, signum: int, code: int) -> None:
    proc = start_dtrain(
        "run", "-np", "3", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "sleep 300 & echo up; wait"
    )
    wait_for_pids(mark, 3 * 3)  # per rank: watchdog, sh, sleep
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code
    assert f"interrupted by {signal.Signals(signum).name}" in err
    assert wait_until_gone(mark) == []


def test_second_ctrl_c_kills_at_once(mark: str) -> None:
    proc = start_dtrain(
        "run",
        "-np",
        "2",
        "--grace",
        "60",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "trap '' TERM INT; while :; do sleep 0.1; done",
    )
    wait_for_pids(mark, 4)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # still in the 60 s grace period
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert proc.returncode == 130


def test_killed_launcher_leaves_nothing_behind(mark: str) -> None:
    proc = start_dtrain(
        "run",
        "-np",
        "3",
        "--grace",
        "1",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "sleep 300 & sleep 300",
    )
    wait_for_pids(mark, 3 * 3)
    proc.kill()
    proc.communicate(timeout=10)
    assert wait_until_gone(mark, timeout=5) == []


def test_program_not_found_exits_on_launch_failure(mark: str) -> None:
    result = run_dtrain("run", "-np", "2", "no-such-program-xyz")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "dtrain: error: program 'no-such-program-xyz' not found on PATH on localhost "
        "(hint: check the spelling, install it, or give its full path)"
    ]


def test_arguments_arrive_intact(mark: str) -> None:
    weird = ["a b", "it's", '"quoted"', "$HOME", "tab\there", "new\nline", "--np", "-x"]
    code = "import json, sys; print(json.dumps(sys.argv[1:]))"
    result = run_dtrain("run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code), *weird)
    assert result.returncode == 0, result.stderr
    assert json.loads(tagged(result.stdout, 0)[0]) == weird


def test_exported_variables_and_env_files(mark: str, tmp_path: Path) -> None:
    env_file = tmp_path / "job.env"
    env_file.write_text("# settings\nFROM_FILE='a b # c'\nexport OVERRIDDEN=file\n")
    env = child_env()
    env["COPIED"] = "from launcher"
    code = (
        "import os; print(os.environ['FROM_FILE'], os.environ['OVERRIDDEN'], os.environ['COPIED'])"
    )
    result = run_dtrain(
        "run",
        "-np",
        "1",
        "--env-file",
        str(env_file),
        "-x",
        "OVERRIDDEN=cli",
        "-x",
        "COPIED",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        *py(code),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert tagged(result.stdout, 0) == ["a b # c cli from launcher"]


def test_odd_output_survives(mark: str, tmp_path: Path) -> None:
    code = (
        "import sys; w = sys.stdout.buffer.write\n"
        "w(b'bar 1\\rbar 2\\rbar done\\n')\n"
        "w(b'bad \\xff\\xfe utf8\\n')\n"
        "w(b'x' * 1500000 + b'\\n')\n"
        "w(b'no newline at end')\n"
    )
    out_dir = tmp_path / "out"
    result = run_dtrain(
        "run", "-np", "1", "--output-dir", str(out_dir), "-x", f"DTRAIN_TEST_MARK={mark}", *py(code)
    )
    assert result.returncode == 0, result.stderr
    assert tagged(result.stdout, 0) == [
        "bar 1",  # piped: bar states at most once a second ('bar 2' came too soon)
        "bar done",
        "bad \ufffd\ufffd utf8",
        "x" * 1500000,
        "no newline at end",
    ]
    raw = (out_dir / "rank.0" / "stdout").read_bytes()
    assert raw.startswith(b"bar 1\rbar 2\rbar done\nbad \xff\xfe utf8\n")
    assert raw.endswith(b"no newline at end")
    assert (out_dir / "rank.0" / "stderr").read_bytes() == b""


def test_tag_format_with_host_and_time(mark: str) -> None:
    result = run_dtrain(
        "run",
        "-np",
        "2",
        "--tag-format",
        "[{rank}@{host} {time}]",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "echo",
        "hi",
    )
    assert result.returncode == 0, result.stderr
    seen = []  # every line must be a tagged "hi": none missing, none else
    for line in result.stdout.splitlines():
        tagged = re.fullmatch(r"\[(\d+)@(\S+) (\d\d:\d\d:\d\d)\] (.*)", line)
        assert tagged, line
        time.strptime(tagged[3], "%H:%M:%S")  # a time of day
        seen.append((tagged[1], tagged[2], tagged[4]))
    assert sorted(seen) == [("0", "localhost", "hi"), ("1", "localhost", "hi")], result.stdout


def test_many_lines_from_many_ranks_arrive_whole_and_in_order(mark: str) -> None:
    ranks, lines = 8, 100_000
    code = (
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        f"sys.stdout.write(''.join(f'rank {{r}} line {{i}} ' + 'y' * (i % 50) + '\\n' "
        f"for i in range({lines})))\n"
    )
    result = run_dtrain(
        "run", "-np", str(ranks), "-x", f"DTRAIN_TEST_MARK={mark}", *py(code), timeout=240
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for rank in range(ranks):
        got = tagged(result.stdout, rank)
        assert len(got) == lines, f"rank {rank}: {len(got)} lines"
        assert got == [f"rank {rank} line {i} " + "y" * (i % 50) for i in range(lines)]
    assert len(result.stdout.splitlines()) == ranks * lines


def test_concurrent_jobs_get_different_master_ports(mark: str) -> None:
    code = "import os, time; print(os.environ['MASTER_PORT']); time.sleep(1)"
    jobs = [
        start_dtrain("run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code))
        for _ in range(3)
    ]
    ports = set()
    for job in jobs:
        out, _ = job.communicate(timeout=60)
        ports.add(out.split()[-1])
    assert len(ports) == 3


def test_master_port_override_and_workdir(mark: str, tmp_path: Path) -> None:
    code = "import os; print(os.environ['MASTER_PORT'], os.getcwd())"
    result = run_dtrain(
        "run",
        "-np",
        "1",
        "--master-port",
        "23456",
        "--workdir",
        str(tmp_path),
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        *py(code),
    )
    assert tagged(result.stdout, 0) == [f"23456 {tmp_path}"]


def test_python_dash_m_launcher_is_dtrain() -> None:
    result = run_dtrain("--help")
    assert result.returncode == 0
    assert "dtrain run" in result.stdout


def test_no_heavy_imports_for_help_or_local_launch() -> None:
    code = (
        "import sys, io, contextlib\n"
        "from launcher.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    codes = [main(['--help']), main(['run', '--help'])]\n"
        "    codes.append(main(['run', '-np', '2', 'true']))\n"
        "assert codes == [0, 0, 0], codes\n"
        "assert 'launcher.loop.supervisor' in sys.modules\n"
        "heavy = ('paramiko', 'torch', 'tensorflow', 'mpi4py')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_torch_gloo_allreduce_on_four_ranks(mark: str) -> None:
    pytest.importorskip("torch")
    result = run_dtrain(
        "run",
        "-np",
        "4",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "examples/torch_allreduce.py",
        timeout=170,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(4):
        assert (
            f"rank {rank}/4 (local {rank}) on {socket.gethostname()}: all_reduce sum = 10 ok"
            in tagged(result.stdout, rank)
        )
    assert "final loss" in result.stdout and "weights identical on all 4 ranks" in result.stdout


def test_marked_pids_sees_a_live_job(mark: str) -> None:
    """The no-orphan checks above can fail: they do see a running job's processes."""
    proc = start_dtrain("run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "30")
    pids = wait_for_pids(mark, 2)
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert marked_pids(mark) == [] or wait_until_gone(mark) == []


def test_a_watchdog_killed_alone_fails_its_rank_and_leaves_nothing(mark: str) -> None:
    proc = start_dtrain(
        "run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "sleep 300 & wait"
    )
    pids = wait_for_pids(mark, 1 + 2 * 3)  # the local agent; per rank: watchdog, sh, sleep
    shell = next(p for p in pids if Path(f"/proc/{p}/comm").read_text().strip() == "sh")
    watchdog = int(Path(f"/proc/{shell}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    assert b"watchdog.serve()" in Path(f"/proc/{watchdog}/cmdline").read_bytes()
    # The local agent started before the ranks were planned: its watchdogs carry the job.
    assert re.search(
        rb"\0DTRAIN_JOB_ID=\d{8}-\d{6}-\w{6}\0", Path(f"/proc/{watchdog}/environ").read_bytes()
    )
    os.kill(watchdog, signal.SIGKILL)  # as the OOM killer would
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert re.search(  # (the line is broken between words to fit 80 columns)
        r"rank \d on localhost failed \(killed by SIGKILL: out of memory\? see dmesg on "
        r"localhost\)",
        " ".join(err.split()),
    ), err


TRAIN = "import os, sys; print(os.environ['RANK'], sys.executable)\n"


@pytest.mark.parametrize(
    ("name", "text", "mode"),
    [
        ("train.py", TRAIN, 0o644),  # torchrun's and deepspeed's way: no "python" needed
        ("train", "#!/usr/bin/env python3\n" + TRAIN, 0o644),  # a Python shebang
    ],
)
def test_a_python_script_runs_with_dtrains_interpreter(
    tmp_path: Path, mark: str, name: str, text: str, mode: int
) -> None:
    script = tmp_path / name
    script.write_text(text)
    script.chmod(mode)
    result = run_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", name, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(tagged(result.stdout, r)[0] for r in range(2)) == [
        f"{r} {sys.executable}" for r in range(2)
    ]


def test_python_options_and_scripts_that_run_as_they_are(tmp_path: Path, mark: str) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    other = run_dtrain("run", "--python", "/usr/bin/python3", "train.py", cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert tagged(other.stdout, 0) == ["0 /usr/bin/python3"]
    shell = tmp_path / "run.sh"  # executable, with its own shebang: run as it is
    shell.write_text("#!/bin/sh\necho shell $RANK\n")
    shell.chmod(0o755)
    assert tagged(run_dtrain("run", "./run.sh", cwd=tmp_path).stdout, 0) == ["shell 0"]
    refused = run_dtrain("run", "--no-python", "train.py", cwd=tmp_path)
    assert refused.returncode == 2
    assert "program 'train.py' not found on PATH on localhost" in refused.stderr
    missing = run_dtrain("run", "nothere.py", cwd=tmp_path)
    assert missing.returncode == 2
    assert f"script nothere.py not found in {tmp_path}" in missing.stderr
    plan = json.loads(
        dtrain_in_process("run", "--dry-run", "--json", "train.py", cwd=tmp_path).stdout
    )
    assert plan[0]["argv"] == [sys.executable, "train.py"]
    both = run_dtrain("run", "--python", "x", "--no-python", "train.py", cwd=tmp_path)
    assert both.returncode == 2 and "--python and --no-python both given" in both.stderr


def test_the_headline_usage(tmp_path: Path, mark: str) -> None:
    """dtrain run -np 8 -H hosts train.py: a hostfile here, a script without python."""
    (tmp_path / "hosts").write_text("localhost slots=8\n")
    (tmp_path / "train.py").write_text(TRAIN)
    result = run_dtrain(
        "run",
        "-np",
        "8",
        "-H",
        "hosts",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "train.py",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(int(line.split()[1]) for line in result.stdout.splitlines()) == list(range(8))


def test_progress_bars_are_thinned_when_piped(mark: str) -> None:
    code = (
        "import sys, time\n"
        "for i in range(200):\n"
        "    sys.stdout.write(f'\\rtraining {i}%'); sys.stdout.flush(); time.sleep(0.01)\n"
        "print('\\rtraining done')\n"
    )
    result = run_dtrain("run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code))
    assert result.returncode == 0, result.stderr
    lines = tagged(result.stdout, 0)
    assert lines[-1] == "training done" and lines[0] == "training 0%"
    assert 2 <= len(lines) <= 5  # about 2 s of states: one a second, not 200
    job = result.stderr.split("dtrain: job ", 1)[1].split()[0]
    logged = dtrain_in_process("logs", job).stdout.splitlines()
    assert logged == ["[0] training done"]  # the job directory keeps the final state only
