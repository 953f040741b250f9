"""Failure injection over three real SSH test hosts: every way a job can end badly.

Each cell starts 6 ranks on node1..node3 (2 each), injects one failure, and
checks what a user relies on: dtrain's exit code, its summary line, how long
until every process of the job was gone on every host, and that nothing (no
rank, watchdog, agent or Open MPI daemon) is left anywhere.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import marked_pids, start_dtrain, wait_for_pids
from tests.test_ssh import watchdogs_on
from tests.testhosts import VETH_PREFIX, TestHosts, processes_in

pytestmark = [pytest.mark.sshhosts, pytest.mark.slow]

GRACE_S = 2
HOST_TIMEOUT_S = 5
VICTIM = 3  # rank 3 runs on node2
HOSTS = "node1:2,node2:2,node3:2"


def dtrain_processes(hosts: TestHosts) -> list[int]:
    """Agents, watchdogs and Open MPI daemons on the test hosts."""
    return watchdogs_on(hosts, (b"dtrain-remote", b"prted"))


def wait_clean(hosts: TestHosts, mark: str, timeout_s: float) -> float:
    """Seconds until no process of the job is left on any host (fails after ``timeout_s``)."""
    started = time.monotonic()
    while marked_pids(mark) or dtrain_processes(hosts):
        if time.monotonic() - started > timeout_s:
            raise AssertionError(
                f"left after {timeout_s} s: ranks {marked_pids(mark)}, "
                f"dtrain/MPI processes {dtrain_processes(hosts)}"
            )
        time.sleep(0.05)
    return time.monotonic() - started


def wait_for_sleepers(mark: str, count: int, timeout_s: float = 30) -> None:
    """Wait until ``count`` processes of the job run ``sleep 300``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = 0
        for pid in marked_pids(mark):
            try:
                found += Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00300\x00"
            except OSError:
                continue
        if found >= count:
            return
        assert time.monotonic() < deadline, f"{found} of {count} ranks reached their sleep"
        time.sleep(0.05)


def set_link(name: str, up: bool) -> None:
    """Plug or unplug host ``name``'s network cable (its veth on the test bridge)."""
    state = "up" if up else "down"
    subprocess.run(["ip", "link", "set", "dev", f"{VETH_PREFIX}{name}", state], check=True)


@dataclass(frozen=True)
class Cell:
    script: str  # every rank runs sh -c SCRIPT
    inject: Callable[[subprocess.Popen[str], TestHosts, str], None]
    code: int
    summary: str
    clean_s: float  # from the injection until nothing is left
    options: tuple[str, ...] = ()
    restarts_hosts: bool = False  # the cell kills a host: start fresh hosts afterwards


def nothing(proc: subprocess.Popen[str], hosts: TestHosts, mark: str) -> None:
    """The failure is in the script itself."""


def send(*signums: int) -> Callable[[subprocess.Popen[str], TestHosts, str], None]:
    def inject(proc: subprocess.Popen[str], hosts: TestHosts, mark: str) -> None:
        for signum in signums:
            proc.send_signal(signum)
            time.sleep(0.3)

    return inject


def kill_host(proc: subprocess.Popen[str], hosts: TestHosts, mark: str) -> None:
    """node2 dies: its sshd and every process on it (again, until none is left: a process
    forked while the first round ran must die too, as it would with its machine).  A machine
    dies at once: every process is stopped before any is killed, so none (a watchdog, the
    agent) lives on for a moment to report another's death, which a dead machine never
    does (killed one by one, a rank's SIGKILL was now and then reported before the loss)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        running = [pid for pid in processes_in("node2") if not stopped(pid)]
        if not running:
            break
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
    while processes_in("node2") and time.monotonic() < deadline:
        for pid in processes_in("node2"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def stopped(pid: int) -> bool:
    """Is ``pid`` stopped (or gone)?"""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"T"
    except (OSError, IndexError):
        return True


def unplug(seconds: float) -> Callable[[subprocess.Popen[str], TestHosts, str], None]:
    def inject(proc: subprocess.Popen[str], hosts: TestHosts, mark: str) -> None:
        set_link("node2", up=False)
        try:
            time.sleep(seconds)
        finally:
            set_link("node2", up=True)

    return inject


def unplug_until_clean(proc: subprocess.Popen[str], hosts: TestHosts, mark: str) -> None:
    """A long outage: node2 stays cut off until everything is gone, node2 included (its agent
    must clean up by itself, dtrain cannot reach it)."""
    set_link("node2", up=False)
    try:
        proc.wait(timeout=60)
        wait_clean(hosts, mark, timeout_s=HOST_TIMEOUT_S + GRACE_S + 15)
    finally:
        set_link("node2", up=True)


def kill_watchdog(proc: subprocess.Popen[str], hosts: TestHosts, mark: str) -> None:
    on_node2 = set(processes_in("node2"))
    rank = next(p for p in marked_pids(mark) if p in on_node2)
    parent = int(Path(f"/proc/{rank}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
    os.kill(parent, signal.SIGKILL)


STOPPED_5 = "stopped the other 5 ranks"
# The victim fails once the test says so: after every rank has started, however slow.
AWAIT_TRIGGER = 'while [ ! -e "$DTRAIN_TEST_TRIGGER" ]; do sleep 0.05; done'
RUN_ON = "sleep 300 & wait"
IGNORE_TERM = "trap '' TERM; sleep 300 & while :; do sleep 0.1; done"
CELLS = {
    "rank exits 1": Cell(
        f"if [ $RANK = {VICTIM} ]; then {AWAIT_TRIGGER}; exit 1; fi; {RUN_ON}",
        nothing,
        1,
        f"{STOPPED_5} dtrain: rank 3 on node2 failed (exit code 1); dtrain exits 1",
        5,
    ),
    "rank SIGKILLed": Cell(
        f"if [ $RANK = {VICTIM} ]; then {AWAIT_TRIGGER}; kill -KILL $$; fi; {RUN_ON}",
        nothing,
        128 + signal.SIGKILL,
        "rank 3 on node2 failed (killed by SIGKILL",
        5,
    ),
    "rank segfaults": Cell(
        f"if [ $RANK = {VICTIM} ]; then {AWAIT_TRIGGER}; kill -SEGV $$; fi; {RUN_ON}",
        nothing,
        128 + signal.SIGSEGV,
        f"{STOPPED_5} dtrain: rank 3 on node2 failed (killed by SIGSEGV); dtrain exits 139",
        5,
    ),
    "rank ignores SIGTERM": Cell(
        f"if [ $RANK = {VICTIM} ]; then {AWAIT_TRIGGER}; exit 1; fi; {IGNORE_TERM}",
        nothing,
        1,
        f"{STOPPED_5} (5 with SIGKILL after the 2 s grace) dtrain: rank 3 on node2 failed (exit "
        "code 1)",
        GRACE_S + 5,
    ),
    "Ctrl-C": Cell(
        RUN_ON, send(signal.SIGINT), 130, "stopped 6 ranks dtrain: interrupted by SIGINT;", 5
    ),
    "Ctrl-C twice": Cell(
        IGNORE_TERM,
        send(signal.SIGINT, signal.SIGINT),
        130,
        "stopped 6 ranks (6 with SIGKILL at the second signal) dtrain: interrupted by SIGINT;",
        5,
    ),
    "SIGTERM": Cell(
        RUN_ON, send(signal.SIGTERM), 143, "stopped 6 ranks dtrain: interrupted by SIGTERM;", 5
    ),
    "dtrain SIGKILLed": Cell(RUN_ON, send(signal.SIGKILL), -signal.SIGKILL, "", GRACE_S + 5),
    "watchdog killed alone": Cell(
        RUN_ON,
        kill_watchdog,
        128 + signal.SIGKILL,
        "on node2 failed (killed by SIGKILL: out of memory? see dmesg on node2); dtrain exits 137",
        5,
    ),
    "host killed": Cell(
        RUN_ON,
        kill_host,
        255,
        "on node2 failed (the connection to node2 was lost); dtrain exits 255",
        HOST_TIMEOUT_S + 5,
        restarts_hosts=True,
    ),
    "link down (long)": Cell(
        RUN_ON,
        unplug_until_clean,
        255,
        "on node2 failed (no word from the agent on node2 for 5 s: the host is frozen or cut off)",
        HOST_TIMEOUT_S + GRACE_S + 15,
    ),
    "link blip (3 s)": Cell(
        "sleep 6; echo survived",
        unplug(3),
        0,
        "",
        10,
        options=("--host-timeout", "10"),
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CELLS))
def test_failure_cell(name: str, ssh_hosts: TestHosts, mark: str, tmp_path: Path) -> None:
    cell, hosts = CELLS[name], ssh_hosts
    trigger = tmp_path / "fail-now"  # the test hosts share this file system
    proc = start_dtrain(
        "run",
        "--ssh-config",
        str(hosts.ssh_config),
        "--grace",
        str(GRACE_S),
        "--host-timeout",
        str(HOST_TIMEOUT_S),
        *cell.options,
        "-H",
        HOSTS,
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "-x",
        f"DTRAIN_TEST_TRIGGER={trigger}",
        "sh",
        "-c",
        cell.script,
    )
    try:
        wait_for_pids(mark, 6)
        # Every rank is in its script, past any trap: its `sleep 300` runs (a victim waits
        # for its trigger instead).
        sleepers = cell.script.count("sleep 300") and 6 - ("TRIGGER" in cell.script)
        wait_for_sleepers(mark, sleepers)
        injected = time.monotonic()
        trigger.touch()
        cell.inject(proc, hosts, mark)
        _, err = proc.communicate(timeout=90)
        wait_clean(hosts, mark, timeout_s=cell.clean_s + 10)
        clean_s = time.monotonic() - injected
        assert proc.returncode == cell.code, err
        if cell.summary:  # (lines broken to fit 80 columns are joined again)
            assert cell.summary in " ".join(err.split()), err
        elif cell.code == 0:
            assert "failed" not in err and "interrupted" not in err, err
        assert clean_s < cell.clean_s, f"{clean_s:.1f} s until nothing was left"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if cell.restarts_hosts:
            hosts.stop()  # node2 was killed: the next test gets fresh hosts


MPI_CELLS = {
    "rank exits 1": (
        f"if [ $OMPI_COMM_WORLD_RANK = 1 ]; then {AWAIT_TRIGGER}; exit 1; fi; {RUN_ON}",
        None,
    ),
    "Ctrl-C": (RUN_ON, signal.SIGINT),
    "dtrain SIGKILLed": (RUN_ON, signal.SIGKILL),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(MPI_CELLS))
def test_mpi_failure_cell(name: str, ssh_hosts: TestHosts, mark: str, tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    script, signum = MPI_CELLS[name]
    trigger = tmp_path / "fail-now"
    proc = start_dtrain(
        "run",
        "--mpi",
        "--ssh-config",
        str(ssh_hosts.ssh_config),
        "--grace",
        str(GRACE_S),
        "-H",
        "node1,node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "-x",
        f"DTRAIN_TEST_TRIGGER={trigger}",
        "sh",
        "-c",
        script,
    )
    try:
        wait_for_pids(mark, 2)
        trigger.touch()
        if signum is not None:
            time.sleep(0.5)
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=90)
        wait_clean(ssh_hosts, mark, timeout_s=GRACE_S + 15)  # no rank, no prted left
        expected = {None: 1, signal.SIGINT: 130, signal.SIGKILL: -signal.SIGKILL}[signum]
        assert proc.returncode == expected, err
        if signum == signal.SIGINT:
            assert "dtrain: stopped 2 ranks" in err, err
            assert "dtrain: interrupted by SIGINT; dtrain exits 130" in err, err
        elif signum is None:
            assert "rank 1 on node2 failed (exit code 1)" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
