"""Bad input at the edge (issue 25): one line, exit 2, nothing started.

Host names too long for a file name, a shell script without its bit, hosts split by a
space, options before the subcommand, a busy --master-port, a job root others can
write to, and what a dry run checks (and says it could not).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.cli.main import main
from launcher.core.command import is_python_script
from launcher.remote.probe import port_refusal
from launcher.run.preflight import explicit_script
from launcher.run.survey import hostfile_shorthand
from tests.conftest import JOBS, child_env, dtrain_in_process, run_dtrain, tagged
from tests.testhosts import TestHosts

LONG_NAME = "h" * 300  # over 255 bytes: too long for a file name (ENAMETOOLONG)


def one_error(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The one line of a refused command line (exit 2, no traceback, nothing on stdout)."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: "), lines
    return lines[0]


def jobs_now() -> set[str]:
    return {p.name for p in JOBS.iterdir()}


# -- a host name too long for a file name -------------------------------------------


def test_a_host_name_too_long_for_a_file_is_no_hostfile() -> None:
    assert hostfile_shorthand([LONG_NAME]) is None  # ENAMETOOLONG: not a file, no traceback


@pytest.mark.parametrize(
    "args",
    [
        ("run", "-H", LONG_NAME, "true"),
        ("hosts", "-H", LONG_NAME),
        ("run", "--ssh-config", LONG_NAME, "-H", "a", "true"),
        ("run", "--job-dir", LONG_NAME, "true"),
        ("logs", "--job-dir", LONG_NAME),
        ("run", "-np", "1", LONG_NAME),
        ("run", "-np", "1", "python", LONG_NAME),
    ],
    ids=["-H", "hosts -H", "--ssh-config", "run --job-dir", "logs --job-dir", "program", "script"],
)
def test_names_too_long_for_a_file_are_one_line(args: tuple[str, ...]) -> None:
    line = one_error(dtrain_in_process(*args), 2)  # (a missing --ssh-config too: a usage error)
    assert LONG_NAME[:50] in line


# -- a script that is neither executable nor Python --------------------------------


def test_a_file_without_a_python_shebang_is_no_python_script() -> None:
    assert not is_python_script("run.sh", b"echo hi\n")  # no shebang: a shell script, say
    assert not is_python_script("run", b"#!/bin/bash\necho hi\n")
    assert is_python_script("train", b"#!/usr/bin/env python3\nprint(1)\n")
    assert is_python_script("train.py", None)


def test_a_shell_script_without_its_bit_is_refused_with_the_ways_to_run_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "run.sh").write_text("echo hi $RANK\n")
    (tmp_path / "b.sh").write_text("#!/bin/bash\necho hi $RANK\n")
    before = jobs_now()
    line = one_error(dtrain_in_process("run", "-np", "2", "run.sh", cwd=tmp_path))
    assert line.startswith("dtrain: error: run.sh: not executable, and not Python by its name")
    assert "run bash run.sh," in line and "chmod +x run.sh" in line
    assert "shebang line" in line  # executable, but without one: exec format error
    line = one_error(dtrain_in_process("run", "./run.sh", cwd=tmp_path))
    assert "chmod +x ./run.sh" in line
    line = one_error(dtrain_in_process("run", "b.sh", cwd=tmp_path))
    assert "bash b.sh, or chmod +x b.sh and run ./b.sh)" in line
    assert jobs_now() == before  # nothing started
    # As the hint says: named with its interpreter, it runs.
    ran = run_dtrain("run", "-np", "2", "bash", "run.sh", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert sorted(tagged(ran.stdout, 0) + tagged(ran.stdout, 1)) == ["hi 0", "hi 1"]


def test_an_executable_file_here_that_is_not_on_path_gets_its_dot_slash(tmp_path: Path) -> None:
    script = tmp_path / "go.sh"
    script.write_text("#!/bin/sh\necho go\n")
    script.chmod(0o755)
    line = one_error(dtrain_in_process("run", "go.sh", cwd=tmp_path))
    assert "program 'go.sh' not found on PATH" in line and "write ./go.sh" in line


# -- -H h7:2 h8:2: a space for a comma ------------------------------------------------


def test_a_host_after_a_space_is_said_to_be_taken_as_the_program() -> None:
    line = one_error(dtrain_in_process("run", "-H", "h7:2", "h8:2", "true"))
    assert line == (
        "dtrain: error: -H h7:2 h8:2: h8:2 was taken as the program "
        "(hint: separate hosts with commas: -H h7:2,h8:2)"
    )  # (before any host is resolved: h7 does not resolve, and is not what is said)
    line = one_error(dtrain_in_process("run", "-H", "h7", "h8:2,h9", "python", "x.py"))
    assert "h8:2,h9 was taken as the program" in line and "-H h7,h8:2,h9" in line


def test_a_program_that_looks_like_a_host_but_is_on_path_runs(tmp_path: Path) -> None:
    program = tmp_path / "job:1"
    program.write_text("#!/bin/sh\necho ran\n")
    program.chmod(0o755)
    env = child_env()
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    result = run_dtrain("run", "-H", "localhost:1", "job:1", env=env)
    assert result.returncode == 0 and tagged(result.stdout, 0) == ["ran"], result.stderr


# -- options before the subcommand ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "meant"),
    [
        (["-np", "2", "python", "x.py"], "dtrain run -np 2 python x.py"),
        (["-H", "a,b", "-x", "A=b c", "train.py"], "dtrain run -H a,b -x 'A=b c' train.py"),
        (["--hostfile", "hf", "x.py"], "dtrain run --hostfile hf x.py"),
        (["--nproc-per-node", "2", "x.py"], "dtrain run --nproc-per-node 2 x.py"),
        (["-n", "4", "python", "x.py"], "dtrain run -n 4 python x.py"),
        (["--workers", "2", "--ps", "1"], "dtrain ps --workers 2 --ps 1"),
        (["--verbose", "run", "x.py"], "dtrain run --verbose x.py"),
        (["train.py", "--lr", "0.1"], "dtrain run train.py --lr 0.1"),
        (["python", "x.py"], "dtrain run python x.py"),
        (["-f", "logs", "JOB"], "dtrain logs -f JOB"),
        # A subcommand's name among the program's arguments stays where it is:
        (["-np", "2", "t.py", "--mode", "run"], "dtrain run -np 2 t.py --mode run"),
        (["--hostfile", "hf", "t.py", "check"], "dtrain run --hostfile hf t.py check"),
        (["-H", "h1:2", "t.py", "hosts"], "dtrain run -H h1:2 t.py hosts"),
    ],
)
def test_run_options_before_the_subcommand_say_the_line_meant(
    args: list[str], meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith(f"(hint: did you mean: {meant})"), err


@pytest.mark.parametrize(
    "args", [["--foo", "x"], ["lgos"], ["--json", "jobs"], ["-np", "2", "stop"]]
)
def test_other_mistakes_get_no_run_guess(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "did you mean: dtrain" not in err and "--help" in err


# -- --master-port in use -----------------------------------------------------------


@pytest.fixture
def listening() -> Iterator[int]:
    """A port some other program listens on (every address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("", 0))
        server.listen()
        yield server.getsockname()[1]


def test_a_master_port_in_use_here_is_refused_before_ranks_start(listening: int) -> None:
    before = jobs_now()
    line = one_error(dtrain_in_process("run", "--master-port", str(listening), "-np", "2", "true"))
    assert line == (
        f"dtrain: error: --master-port {listening} is in use on localhost (by another process) "
        "(hint: pick another, or leave it out for a free one)"
    )
    assert jobs_now() == before
    dry = dtrain_in_process("run", "--dry-run", "--master-port", str(listening), "-np", "1", "true")
    assert dry.returncode == 2 and "is in use on localhost" in dry.stderr


def time_wait_port() -> int:
    """A port with nothing listening, whose last connection waits in TIME_WAIT (the server's
    side closed first, as a finished rendezvous leaves it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port: int = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server's side first: it is the one left in TIME_WAIT
            client.recv(1)  # its FIN has arrived
    return port


def test_a_port_in_time_wait_is_free_as_torch_binds_it() -> None:
    port = time_wait_port()
    assert port_refusal(port) is None
    result = run_dtrain(
        "run", "--master-port", str(port), "-np", "1", "sh", "-c", "echo $MASTER_PORT"
    )
    assert result.returncode == 0, result.stderr
    assert tagged(result.stdout, 0) == [str(port)]


def test_a_port_bound_on_one_address_is_in_use_for_all() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert port_refusal(server.getsockname()[1]) == "in use"


# -- a job root another user could write to --------------------------------------------


def planted_job(root: Path, victim_pid: int) -> None:
    """What another user could leave in a root they can write to: a running job whose
    launcher pid is a process of the victim's."""
    job = root / "20260101-000000-abcdef"
    job.mkdir(parents=True)
    (job / "meta.json").write_text(json.dumps({"id": job.name, "command": ["x"]}))
    status = {"state": "running", "launcher_pid": victim_pid}
    (job / "status.json").write_text(json.dumps(status))


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of ours that a planted job names as its launcher."""
    process = subprocess.Popen(["sleep", "300"])
    yield process
    process.kill()
    process.wait()


def test_a_root_others_can_write_is_refused_and_nothing_is_signalled(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    root = tmp_path / "shared"
    planted_job(root, bystander.pid)
    root.chmod(0o777)
    line = one_error(dtrain_in_process("stop", "--job-dir", str(root)))
    assert line == (
        f"dtrain: error: --job-dir {root}: writable by group or others (mode 0777): another "
        f"user could plant a job there (hint: chmod go-w {root}, or pass another --job-dir)"
    )
    assert bystander.poll() is None  # not signalled
    given = ["--job-dir", str(root)]
    for command in (["jobs", *given], ["logs", *given], ["run", *given, "-np", "1", "true"]):
        assert "writable by group or others" in one_error(dtrain_in_process(*command))
    env = {**child_env(), "DTRAIN_JOB_DIR": str(root)}
    assert one_error(dtrain_in_process("jobs", env=env)).startswith(
        f"dtrain: error: DTRAIN_JOB_DIR {root}:"
    )
    root.chmod(0o755)  # as chmod go-w leaves it: trusted again
    assert dtrain_in_process("jobs", "--job-dir", str(root)).returncode == 0


def test_a_sticky_shared_root_gets_a_folder_inside_it(tmp_path: Path) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp
    line = one_error(dtrain_in_process("jobs", "--job-dir", str(shared)))
    assert f"--job-dir {shared / 'dtrain-jobs'})" in line
    inside = shared / "dtrain-jobs"  # what the hint says: made by dtrain, 0700, trusted
    result = run_dtrain("run", "--job-dir", str(inside), "-np", "1", "true")
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(inside.stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_root_owned_by_another_user_is_refused(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    root = tmp_path / "theirs"
    planted_job(root, bystander.pid)
    root.chmod(0o700)
    os.chown(root, 65534, 65534)
    line = one_error(dtrain_in_process("stop", "--job-dir", str(root)))
    assert f"--job-dir {root}: owned by " in line and "not by you" in line
    assert bystander.poll() is None


def test_a_root_in_a_folder_others_can_write_is_refused(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    """Its folder's other users could rename the private root and plant their own in its
    place: the folders above are checked as OpenSSH checks those above ``~/.ssh``."""
    loose = tmp_path / "loose"
    root = loose / "jobs"
    planted_job(root, bystander.pid)
    root.chmod(0o700)
    loose.chmod(0o777)
    line = one_error(dtrain_in_process("stop", "--job-dir", str(root)))
    assert line == (
        f"dtrain: error: --job-dir {root}: its folder {loose} is writable by group or others "
        "(mode 0777): another user could swap the jobs for their own (hint: chmod go-w "
        f"{loose}, or pass a --job-dir in a folder of yours)"
    )
    assert bystander.poll() is None  # not signalled
    assert "its folder" in one_error(dtrain_in_process("jobs", "--job-dir", str(loose / "new")))
    loose.chmod(0o1777)  # sticky, as /tmp: nobody may rename what is not theirs
    assert dtrain_in_process("jobs", "--job-dir", str(root)).returncode == 0
    if os.geteuid() == 0:
        loose.chmod(0o755)
        os.chown(loose, 65534, 65534)
        assert "its folder" in one_error(dtrain_in_process("jobs", "--job-dir", str(root)))


def test_a_root_dtrain_makes_is_private(tmp_path: Path) -> None:
    root = tmp_path / "new" / "jobs"
    result = run_dtrain("run", "--job-dir", str(root), "-np", "1", "true")
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(root.parent.stat().st_mode) == 0o700


# -- what a dry run checks, and says it could not ---------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--workdir", "/nonexistent", "true"), "--workdir /nonexistent: no such directory"),
        (("nosuchprogram",), "program 'nosuchprogram' not found on PATH on localhost"),
        (("nothere.py",), "script nothere.py not found in"),
        (("python", "trian.py"), "python trian.py: script trian.py not found in"),
    ],
)
def test_a_dry_run_refuses_what_a_real_run_refuses_here(args: tuple[str, ...], said: str) -> None:
    assert said in one_error(dtrain_in_process("run", "--dry-run", "-np", "1", *args))
    assert said in one_error(dtrain_in_process("run", "-np", "1", *args))


def test_a_dry_run_says_which_hosts_it_did_not_check() -> None:
    result = dtrain_in_process(
        "run", "--dry-run", "--json", "-H", "a,b", "--workdir", "/x", "nothere"
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == 2  # the plan, still on stdout alone
    assert result.stderr.splitlines() == [
        "dtrain: note: not checked on a, b: the program and --workdir are looked up when the "
        "job starts"
    ]
    many = dtrain_in_process(
        "run", "--dry-run", "-H", "a,b,c,d,e,f,g", "--master-port", "1234", "true"
    )
    assert (
        "not checked on a, b, c, d, e and 2 more: the program and --workdir are looked up, "
        "and --master-port tried, when the job starts"
    ) in many.stderr
    here = dtrain_in_process("run", "--dry-run", "-np", "1", "true")
    assert here.returncode == 0 and "not checked" not in here.stderr


@pytest.mark.parametrize(
    ("command", "script"),
    [
        (["python", "trian.py"], "trian.py"),
        (["python3", "-u", "trian.py", "--lr", "1"], "trian.py"),
        ([sys.executable, "-W", "ignore", "-X", "dev", "t.py"], "t.py"),
        (["/usr/bin/python3.11", "-uWignore", "t.py"], "t.py"),
        (["python", "-uW", "ignore", "t.py"], "t.py"),
        (["python", "-c", "print(1)"], None),
        (["python", "-m", "mod", "x.py"], None),
        (["python", "-um", "mod"], None),
        (["python", "-"], None),
        (["python", "--version"], None),
        (["python"], None),
        (["pythonic", "x.py"], None),
        (["sh", "x.py"], None),
    ],
)
def test_the_script_of_an_explicit_python(command: list[str], script: str | None) -> None:
    assert explicit_script(command) == script


def test_an_explicit_pythons_script_runs_when_it_is_there(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import os; print('rank', os.environ['RANK'])\n")
    result = run_dtrain("run", "-np", "1", sys.executable, "-u", "train.py", cwd=tmp_path)
    assert result.returncode == 0 and tagged(result.stdout, 0) == ["rank 0"], result.stderr
    ran = run_dtrain("run", "-np", "1", "python", "-c", "print('c')", cwd=tmp_path)
    assert ran.returncode == 0 and tagged(ran.stdout, 0) == ["c"], ran.stderr


# -- on the SSH test hosts: the same checks where the ranks run ---------------------------


def test_remote_hosts_check_an_explicit_pythons_script_and_the_master_port(
    ssh_hosts: TestHosts, tmp_path: Path
) -> None:
    ssh = ["--ssh-config", str(ssh_hosts.ssh_config)]
    missing = run_dtrain("run", *ssh, "-H", "node1", "python3", "trian.py", cwd=tmp_path)
    assert missing.returncode == 1
    assert f"node1: script trian.py not found there in {tmp_path}" in missing.stderr
    listener = subprocess.Popen(  # a port taken on node1 (it ends when its stdin closes)
        [*ssh_hosts.ssh_command, "node1", "exec python3 -c " + LISTEN_UNTIL_EOF],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None
        port = int(listener.stdout.readline())
        taken = run_dtrain("run", *ssh, "-H", "node1,node2", "--master-port", str(port), "true")
        line = one_error(taken)
        assert f"--master-port {port} is in use on node1 (by another process)" in line
        # Only rank 0's host matters: on node2 first, the port is free there.
        free = run_dtrain("run", *ssh, "-H", "node2,node1", "--master-port", str(port), "true")
        assert free.returncode == 0, free.stderr
    finally:
        assert listener.stdin is not None
        listener.stdin.close()
        try:
            listener.wait(timeout=30)
        except subprocess.TimeoutExpired:
            listener.send_signal(signal.SIGKILL)
            listener.wait()


LISTEN_UNTIL_EOF = (
    '\'import socket, sys; s = socket.socket(); s.bind(("", 0)); s.listen(); '
    "print(s.getsockname()[1], flush=True); sys.stdin.read()'"
)
