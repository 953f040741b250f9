"""Shared helpers for end-to-end tests: run the real dtrain, find what it left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.otheruser import other_user, shared_tmp  # noqa: F401 (fixtures)
from tests.slurmcluster import SlurmCluster, SlurmClusterError
from tests.slurmcluster import unavailable_reason as slurm_unavailable_reason
from tests.testhosts import TestHosts, unavailable_reason

REPO = Path(__file__).resolve().parent.parent
DTRAIN = [sys.executable, "-m", "launcher"]
MARK = "DTRAIN_TEST_MARK"
_INHERITED = os.environ.get("DTRAIN_JOB_DIR", "")  # (child_env's, in a test's rank or helper)
if os.path.basename(_INHERITED).startswith("dtrain-test-jobs-") and os.path.isdir(_INHERITED):
    JOBS = Path(_INHERITED)  # a process of a test that imports this module: its run's folder
    JOBS_OWNER = -1  # (not its to remove; it made none to leave behind)
else:
    # The job directories of this run: made by pytest_configure, so only by a pytest process
    # (a rank that imports a test module, as the API's function ranks do, makes none)
    JOBS = Path(tempfile.gettempdir()) / f"dtrain-test-jobs-{uuid.uuid4().hex}"
    JOBS_OWNER = os.getpid()  # the pytest process that made JOBS removes it at its end


def pytest_configure(config: pytest.Config) -> None:
    if os.getpid() == JOBS_OWNER:
        JOBS.mkdir(mode=0o700)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # Started in the background by a script (a job without job control: POSIX has it
        # ignore SIGINT, and every process it starts then too): the dtrain processes of the
        # tests get Ctrl-C as a terminal's job does (the tests of SIGINT send it).
        signal.signal(signal.SIGINT, signal.default_int_handler)


def child_env() -> dict[str, str]:
    """The test's environment with this interpreter's bin dir first, so ranks' `python` is ours."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("NO_COLOR", None)
    env["DTRAIN_JOB_DIR"] = str(JOBS)
    return env


def run_dtrain(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DTRAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or child_env(),
        cwd=cwd or REPO,
        errors="replace",
    )


def dtrain_in_process(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """``dtrain ARGS`` through the CLI's ``main`` in this process, read as ``run_dtrain``'s
    result: the same arguments, environment (``child_env``'s, or exactly ``env``) and
    folder.  For a test whose subject is what dtrain says or decides (a refusal, a dry run,
    help, a plan), not a process: no interpreter to start and nothing to import again, a
    tenth of a subprocess's time.  Signals, teardown, terminals and real jobs keep
    ``run_dtrain``."""
    import click
    from click.testing import CliRunner

    from launcher.cli.main import main

    wanted = env if env is not None else child_env()
    overrides: dict[str, str | None] = {k: None for k in os.environ if k not in wanted}
    overrides.update(wanted)
    for name, value in (("COLUMNS", "80"), ("LINES", "24")):  # (a subprocess's pipes: no tty)
        if name not in wanted:
            overrides[name] = value
    here = os.getcwd()
    os.chdir(cwd or REPO)
    try:
        with CliRunner().isolation(input=stdin, env=overrides) as (out, err, _):
            click.formatting.FORCED_WIDTH = None  # (the runner's 80: help as COLUMNS says)
            try:
                code = main(list(args))
            except SystemExit as exc:  # (what click's own code may raise past main)
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            return subprocess.CompletedProcess(
                [*DTRAIN, *args],
                code,
                out.getvalue().decode(errors="replace"),
                err.getvalue().decode(errors="replace"),
            )
    finally:
        os.chdir(here)


def start_dtrain(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*DTRAIN, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or child_env(),
        cwd=REPO,
        errors="replace",
    )


def marked_pids(mark: str) -> list[int]:
    """Processes whose environment carries ``DTRAIN_TEST_MARK=mark`` (ranks, grandchildren...)."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state != b"Z" and needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def wait_until_gone(mark: str, timeout: float = 5.0) -> list[int]:
    """Wait for every marked process to end; returns the survivors (empty: none)."""
    deadline = time.monotonic() + timeout
    while True:
        left = marked_pids(mark)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def wait_for_pids(mark: str, count: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = marked_pids(mark)
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"expected {count} processes marked {mark}, saw {marked_pids(mark)}")


@pytest.fixture
def mark() -> Iterator[str]:
    """A unique marker for one job; the test fails if any marked process outlives it."""
    value = uuid.uuid4().hex
    yield value
    survivors = wait_until_gone(value, timeout=10)
    described = [describe_process(pid) for pid in survivors]  # (before they are killed)
    for pid in survivors:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    assert not survivors, f"processes of the job survived: {described}"


def describe_process(pid: int) -> str:
    """A process as a failure message names it: pid, parent, state and command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return f"{pid} (parent {int(fields[1])}, {fields[0].decode()}): {argv[:200]}"
    except OSError:
        return f"{pid} (gone)"


def tagged(output: str, rank: int) -> list[str]:
    prefix = f"[{rank}] "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def py(code: str) -> Sequence[str]:
    """argv running ``code`` with this interpreter."""
    return [sys.executable, "-c", code]


SSH_HOSTS = 3


@pytest.fixture(scope="session")
def ssh_hosts_session() -> Iterator[TestHosts]:
    """Real sshd test hosts node1..node3 (one set per test session, see tests/testhosts.py)."""
    reason = unavailable_reason() if os.geteuid() == 0 else "SSH test hosts need root"
    if reason:
        pytest.skip(reason)
    hosts = TestHosts(SSH_HOSTS)
    try:
        yield hosts
    finally:
        hosts.stop()


@pytest.fixture
def ssh_hosts(ssh_hosts_session: TestHosts) -> TestHosts:
    """The session's test hosts, (re)started if a teardown test stopped them."""
    if not ssh_hosts_session.started:
        ssh_hosts_session.start()
    return ssh_hosts_session


WIDE_HOSTS = 32


@pytest.fixture
def ssh_hosts_wide(ssh_hosts_session: TestHosts) -> Iterator[TestHosts]:
    """32 test hosts node1..node32 for one test. Only one set of test hosts runs at a time
    (one lock per machine, held by the set that runs), so the session's 3 are stopped first
    (``ssh_hosts`` starts them again for the next test that wants them): the lock is never
    waited for while this process holds it (which would wait forever)."""
    if ssh_hosts_session.started:
        ssh_hosts_session.stop()
    hosts = TestHosts(WIDE_HOSTS)
    try:
        hosts.start()
        yield hosts
    finally:
        hosts.stop()


@pytest.fixture
def start_unread() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts dtrain with a stdout pipe nobody reads (a paused terminal, `| less`); a dtrain
    still there when the test ends is killed."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [*DTRAIN, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            cwd=REPO,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def rss_mib(pid: int) -> float:
    """A process's resident memory."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(scope="session")
def slurm_cluster_session(request: pytest.FixtureRequest) -> Iterator[SlurmCluster]:
    """The session's Slurm cluster (tests/slurmcluster.py) on the SSH test hosts; skips where
    it cannot run (not root, Slurm or munge not installed)."""
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(request.getfixturevalue("ssh_hosts_session"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm_cluster(slurm_cluster_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """A real Slurm cluster: slurmctld and munged here, a slurmd on each test host node1..node3
    (``env()`` for salloc/srun/sbatch).  (Re)started when the hosts were restarted by an
    earlier test; afterwards no job, step or job process may be left (the test fails)."""
    cluster = slurm_cluster_session
    if not cluster.healthy():
        cluster.stop()
        if not cluster.hosts.started:
            cluster.hosts.start()
        cluster.start()
    yield cluster
    if cluster.healthy():
        try:
            cluster.wait_idle(timeout=30)
        except SlurmClusterError:
            cluster.stop()  # the next test starts a clean one
            raise


# Fixtures that need machinery beyond this machine's processes, and the marker a test that
# uses one gets: the fast lane (./scripts/test --fast) deselects these markers.
HOST_FIXTURES = {"ssh_hosts", "ssh_hosts_session", "ssh_hosts_wide"}
CLUSTER_FIXTURES = {"slurm_cluster", "slurm_cluster_session"}
SLURM_FIXTURES = {*CLUSTER_FIXTURES, "slurm"}  # "slurm": tests/test_slurm.py's one-node Slurm
NEEDS = {  # marker: what its tests need, said when -m leaves them out
    "sshhosts": "needing the SSH test hosts (root, sshd, network namespaces)",
    "slurm": "needing Slurm (root, slurmctld, slurmd, munge; the cluster also the test hosts)",
    "slow": "slow (real torch, TensorFlow and MPI programs end to end)",
}
LEFT_OUT: dict[str, int] = dict.fromkeys(NEEDS, 0)
MACHINE_WIDE = "slurm"  # the xdist group of the tests on Slurm (one Slurm per machine)


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist reads the groups off the items)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that use the SSH test hosts are marked ``sshhosts``, those that use Slurm
    ``slurm`` (``-m "not sshhosts and not slurm"`` leaves them out). Tests that use the Slurm
    cluster run last: its slurmds live in the test hosts' namespaces until the session ends,
    which the tests that tear the hosts down and check that nothing is left must not see.
    Under pytest-xdist each worker has test hosts of its own (tests/testhosts.py's lanes),
    and the tests on Slurm share one worker (one Slurm per machine), where they run last."""
    uses = {id(item): set(getattr(item, "fixturenames", ())) for item in items}
    grouped = config.pluginmanager.hasplugin("xdist")  # (-p no:xdist: no group to join)
    for item in items:
        if uses[id(item)] & HOST_FIXTURES:
            item.add_marker(pytest.mark.sshhosts)
        if uses[id(item)] & SLURM_FIXTURES:
            item.add_marker(pytest.mark.slurm)
        if grouped and item.get_closest_marker("slurm"):
            # One Slurm per machine: its tests share one pytest-xdist worker (--dist
            # loadgroup), which starts it once.  (By the marker: one marked by hand too.)
            item.add_marker(pytest.mark.xdist_group(MACHINE_WIDE))
    items.sort(key=lambda item: bool(uses[id(item)] & CLUSTER_FIXTURES))  # stable sort


def pytest_deselected(items: Sequence[pytest.Item]) -> None:
    """Counts what ``-m`` left out, by the first marker of NEEDS a test has: not what ``-k``
    left out (pytest calls this hook for both; ``-k plan`` leaves out no test by what it
    needs)."""
    for item in items:
        marker = next((name for name in NEEDS if item.get_closest_marker(name)), None)
        if marker and left_out_by_marker(item):
            LEFT_OUT[marker] += 1


def left_out_by_marker(item: pytest.Item) -> bool:
    """Whether ``-m`` leaves ``item`` out, and ``-k`` (if given) would have kept it."""
    from _pytest.mark import KeywordMatcher, MarkMatcher
    from _pytest.mark.expression import Expression

    marks, keywords = item.config.option.markexpr, item.config.option.keyword.lstrip()
    if not marks or Expression.compile(marks).evaluate(
        MarkMatcher.from_markers(item.iter_markers())
    ):
        return False
    return not keywords or Expression.compile(keywords).evaluate(KeywordMatcher.from_item(item))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The run's job directories go with it (a pytest process left one in /tmp each).  A
    pytest-xdist worker hands what -m left out to the controller, which says it."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["left_out"] = dict(LEFT_OUT)
    if os.getpid() == JOBS_OWNER:  # (not a process that imported this module to use it)
        import shutil

        shutil.rmtree(JOBS, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: -p no:xdist runs without it)
def pytest_testnodedown(node: Any, error: object) -> None:
    """(pytest-xdist's controller) What a worker's -m left out: every worker collects the
    whole run, so one worker's count is the run's."""
    said = getattr(node, "workeroutput", {}).get("left_out")
    if said:
        LEFT_OUT.update(said)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line saying which tests were left out and what they need (the fast lane's)."""
    parts = [f"{count} {NEEDS[marker]}" for marker, count in LEFT_OUT.items() if count]
    if parts:
        total = sum(LEFT_OUT.values())
        terminalreporter.write_line(
            f"left out {total} test{'s' * (total != 1)}: {'; '.join(parts)}"
            " (./scripts/test runs them all)"
        )
