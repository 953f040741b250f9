"""base/pids.process_alive: one answer for every kind of pid, zombies included."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from launcher.base.pids import process_alive

SETTLE_S = 10.0  # how long a child may take to become a zombie on a busy machine


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def live_pid(children: list[subprocess.Popen[bytes]]) -> int:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    children.append(child)
    return child.pid


def dead_pid(children: list[subprocess.Popen[bytes]]) -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    return child.pid


def zombie_pid(children: list[subprocess.Popen[bytes]]) -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    children.append(child)  # not reaped before the check: it stays a zombie
    deadline = time.monotonic() + SETTLE_S
    while state_of(child.pid) != "Z":
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.01)
    return child.pid


CASES: list[tuple[str, Callable[[list[subprocess.Popen[bytes]]], int], bool]] = [
    ("this process", lambda _: os.getpid(), True),
    ("a running child", live_pid, True),
    ("pid 1 (init: another user's, unless we are root)", lambda _: 1, True),
    ("a child that ended and was reaped", dead_pid, False),
    ("a zombie child (ended, not reaped)", zombie_pid, False),
    ("pid 0 (a process group, not a process)", lambda _: 0, False),
    ("pid -1", lambda _: -1, False),
]


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for child in started:
        child.kill()
        child.wait()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="zombies are read from /proc")
@pytest.mark.parametrize(("what", "make_pid", "alive"), CASES, ids=[c[0] for c in CASES])
def test_process_alive(
    what: str,
    make_pid: Callable[[list[subprocess.Popen[bytes]]], int],
    alive: bool,
    children: list[subprocess.Popen[bytes]],
) -> None:
    assert process_alive(make_pid(children)) is alive, what
