"""Every launcher variable that names a folder names one that exists when the rank starts:
DTRAIN_CHECKPOINT_DIR (the job's checkpoints/, or --checkpoint-dir) and the folder of
DTRAIN_METRICS_FILE, made 0700 on every host (locally, over SSH, under --mpi) before the
program runs; one that cannot be made fails the rank's start naming the variable."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from tests.conftest import JOBS, run_dtrain, tagged, wait_until_gone
from tests.testhosts import TestHosts

MPIRUN = Path(sys.executable).parent / "mpirun"
needs_mpi = pytest.mark.skipif(
    not MPIRUN.exists() or shutil.which("python") is None,
    reason="needs Open MPI in this environment (pip install 'dtrain[mpi]')",
)

# The rank's first action: list its checkpoint folder (a missing one raises), then say what
# it found: the folder, its mode, its host, and that the metrics file's folder is there too.
RANK = (
    "import os, socket\n"
    "folder = os.environ['DTRAIN_CHECKPOINT_DIR']\n"
    "os.listdir(folder)\n"
    "metrics = os.path.dirname(os.environ.get('DTRAIN_METRICS_FILE', ''))\n"
    "mode = oct(os.stat(folder).st_mode & 0o777)\n"
    "print(folder, mode, socket.gethostname(), os.path.isdir(metrics))\n"
)


def rank_args(tmp_path: Path, mark: str) -> list[str]:
    (tmp_path / "rank.py").write_text(RANK)
    return ["-x", f"DTRAIN_TEST_MARK={mark}", sys.executable, str(tmp_path / "rank.py")]


def job_of(stderr: str) -> Path:
    return JOBS / stderr.split("dtrain: job ", 1)[1].split()[0]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mpi", [False, pytest.param(True, marks=needs_mpi)], ids=["local", "mpi"])
def test_the_checkpoint_folder_exists_at_each_ranks_start(
    tmp_path: Path, mark: str, mpi: bool
) -> None:
    """The default folder (in the job directory) and one --checkpoint-dir names that does not
    exist yet, three levels down: each made 0700; the metrics file's folder too."""
    metrics = tmp_path / "metrics" / "deep" / "m.jsonl"
    common = ["run", *(["--mpi"] if mpi else []), "-np", "2"]
    default = run_dtrain(
        *common, "-x", f"DTRAIN_METRICS_FILE={metrics}", *rank_args(tmp_path, mark)
    )
    assert default.returncode == 0, default.stderr
    folder = job_of(default.stderr) / "checkpoints"
    for rank in range(2):
        assert tagged(default.stdout, rank) == [f"{folder} 0o700 {os.uname().nodename} True"]
    assert mode_of(folder) == mode_of(metrics.parent) == mode_of(metrics.parent.parent) == 0o700

    named = tmp_path / "not" / "yet" / "there"
    given = run_dtrain(*common, "--checkpoint-dir", str(named), *rank_args(tmp_path, mark))
    assert given.returncode == 0, given.stderr
    for rank in range(2):
        assert tagged(given.stdout, rank) == [f"{named} 0o700 {os.uname().nodename} False"]
    assert [mode_of(p) for p in (named, named.parent, named.parent.parent)] == [0o700] * 3
    assert wait_until_gone(mark) == []


def test_a_folder_named_that_exists_is_left_as_it_is(tmp_path: Path, mark: str) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)  # (whatever the umask)
    (shared / "kept").write_text("x")
    done = run_dtrain("run", "--checkpoint-dir", str(shared), *rank_args(tmp_path, mark))
    assert done.returncode == 0, done.stderr
    assert tagged(done.stdout, 0) == [f"{shared} 0o755 {os.uname().nodename} False"]
    assert mode_of(shared) == 0o755 and (shared / "kept").read_text() == "x"


@pytest.mark.parametrize("mpi", [False, pytest.param(True, marks=needs_mpi)], ids=["local", "mpi"])
def test_a_folder_that_cannot_be_made_fails_the_start_naming_it(
    tmp_path: Path, mark: str, mpi: bool
) -> None:
    """A file where the folder should be: the rank does not start (its program never runs),
    and the job's failure says which variable and path, not a traceback of the program's."""
    in_the_way = tmp_path / "ckpt"
    in_the_way.write_text("a file")
    done = run_dtrain(
        "run", *(["--mpi"] if mpi else []), "--checkpoint-dir", str(in_the_way),
        *rank_args(tmp_path, mark),
    )  # fmt: skip
    assert done.returncode != 0
    assert f"dtrain: cannot create DTRAIN_CHECKPOINT_DIR {in_the_way}: a file is in the way" in (
        done.stdout + done.stderr
    )
    assert "Traceback" not in done.stdout + done.stderr
    assert "0o" not in done.stdout  # the program did not run
    assert "rank -1" not in done.stderr  # (under --mpi: mpirun's lines, no rank's)
    beneath = tmp_path / "file" / "ckpt"
    (tmp_path / "file").write_text("a file")
    done = run_dtrain("run", "--checkpoint-dir", str(beneath), *rank_args(tmp_path, mark))
    assert done.returncode != 0
    assert f"dtrain: cannot create DTRAIN_CHECKPOINT_DIR {beneath}: Not a directory" in (
        done.stdout + done.stderr
    )
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_the_checkpoint_folder_exists_at_each_ranks_start_on_every_ssh_host(
    ssh_hosts: TestHosts, tmp_path: Path, mark: str
) -> None:
    """No rank here: the job directory's checkpoints/ is made by each remote host's watchdog
    (these test hosts share this machine's file system, so each host also checks its mode)."""
    from tests.test_ssh import assert_nothing_left

    done = run_dtrain(
        "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2,node3",
        *rank_args(tmp_path, mark),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    folder = job_of(done.stderr) / "checkpoints"
    seen = sorted(line.split(" ", 1)[1] for line in done.stdout.splitlines())
    assert seen == [f"{folder} 0o700 node{n} False" for n in (1, 2, 3)], done.stdout
    for name in ssh_hosts.names:
        shown = ssh_hosts.run(name, f"stat -c %a {folder}")
        assert shown.stdout.strip() == "700", (name, shown.stderr)
    assert_nothing_left(ssh_hosts, mark)


WATCHDOG = Path(__file__).resolve().parents[1] / "launcher" / "remote" / "watchdog.py"


@pytest.mark.parametrize("under", ["watchdog", "mpi shim"])
@pytest.mark.parametrize(
    ("folder", "starts"),
    [
        ("/proc/nope/job-1/checkpoints", True),  # dtrain's default: a path of the launcher's
        ("/proc/nope/mine", False),  # --checkpoint-dir: the user's own, so it must be there
    ],
)
def test_only_a_folder_the_user_named_fails_the_start(
    under: str, folder: str, starts: bool
) -> None:
    """The default checkpoint folder is the launcher's job directory, a path that may mean
    nothing on a remote host (another home, another OS): a rank that never saves there must
    not fail for it.  A --checkpoint-dir that cannot be made fails the start."""
    import subprocess

    from launcher.core.mpi import RANK_SHIM

    program = [sys.executable, "-c", "print('the program ran')"]
    env = {**os.environ, "DTRAIN_JOB_ID": "job-1", "DTRAIN_CHECKPOINT_DIR": folder}
    if under == "watchdog":
        argv = [sys.executable, str(WATCHDOG), "1", "-1", "--", *program]
    else:
        env |= {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
        env |= {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
        argv = ["sh", "-c", RANK_SHIM, "sh", *program]
    with subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:  # stdin: the watchdog's lifeline from the launcher, open until the rank ends
        code = proc.wait(timeout=30)
        done = subprocess.CompletedProcess(argv, code, proc.stdout.read(), proc.stderr.read())  # type: ignore[union-attr]
    said = done.stderr.strip().splitlines()
    if starts:
        assert (done.returncode, done.stdout) == (0, "the program ran\n"), done.stderr
        assert said[-1].startswith(
            f"dtrain: warning: cannot create DTRAIN_CHECKPOINT_DIR {folder}: "
        )
    else:
        assert (done.returncode, done.stdout) == (126, ""), done.stderr
        assert said[-1].startswith(f"dtrain: cannot create DTRAIN_CHECKPOINT_DIR {folder}: ")


# -- torch's error file (TORCHELASTIC_ERROR_FILE) --------------------------------------

RECORDED = (
    "import os\n"
    "from torch.distributed.elastic.multiprocessing.errors import record\n"
    "@record\n"
    "def main():\n"
    "    if os.environ['RANK'] == '1':\n"
    "        raise ValueError('bad batch')\n"
    "main()\n"
)


@pytest.mark.slow  # a real torch program
def test_torchs_error_file_is_0600_in_a_0700_folder(tmp_path: Path, mark: str) -> None:
    """torch's ``@record`` writes the error file with open(path, 'w') under the umask (0644
    before): the watchdog makes it first, empty and 0600, and it keeps that mode."""
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(RECORDED)
    done = run_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "python", str(script))
    assert done.returncode == 1, done.stderr
    assert "rank 1 raised ValueError: bad batch" in " ".join(done.stderr.split())
    errors = job_of(done.stderr) / "errors"
    assert mode_of(errors) == 0o700 and mode_of(errors.parent) == 0o700
    assert json.loads((errors / "rank.1.json").read_text())["message"]
    assert (errors / "rank.0.json").read_bytes() == b""  # (rank 0 raised nothing)
    assert {mode_of(errors / f"rank.{r}.json") for r in (0, 1)} == {0o600}


def test_an_empty_error_file_is_none_written(tmp_path: Path, mark: str) -> None:
    """A rank that fails without ``@record`` leaves its error file as the watchdog made it
    (empty, 0600): the summary names the exit code, no exception."""
    done = run_dtrain(
        "run", "-np", "1", "-x", f"DTRAIN_TEST_MARK={mark}", sys.executable, "-c", "exit(3)"
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    error_file = job_of(done.stderr) / "errors" / "rank.0.json"
    assert error_file.read_bytes() == b"" and mode_of(error_file) == 0o600
    assert "raised" not in done.stderr
    assert "rank 0 on localhost failed (exit code 3); dtrain exits 3" in done.stderr
