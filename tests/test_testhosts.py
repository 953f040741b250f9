"""The SSH test hosts themselves (tests/testhosts.py), netns mode.

Needs root, OpenSSH server/client and iproute2 (scripts/install-test-deps.sh);
skipped otherwise.  Run alone with ``pytest -m sshhosts tests/test_testhosts.py``.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.testhosts import (
    BRIDGE,
    NETNS_PREFIX,
    SUBNET,
    TestHosts,
    cleanup_leftovers,
    netns_name,
    pid_alive,
    processes_in,
    unavailable_reason,
)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "SSH test hosts need root (network namespaces, sshd on port 22)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found; run scripts/install-test-deps.sh"
    return unavailable_reason()


_REASON = _skip_reason()
pytestmark = [
    pytest.mark.sshhosts,
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]

COUNT = 3


@pytest.fixture
def hosts(ssh_hosts: TestHosts) -> TestHosts:
    """The session's hosts (tests/conftest.py), restarted if a teardown test stopped them."""
    assert len(ssh_hosts.names) == COUNT
    return ssh_hosts


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{NETNS_PREFIX}node")]


def _bridge_exists() -> bool:
    return (
        subprocess.run(["ip", "link", "show", "dev", BRIDGE], capture_output=True).returncode == 0
    )


def test_layout(hosts: TestHosts) -> None:
    assert hosts.netns
    assert hosts.names == ["node1", "node2", "node3"]
    assert hosts.addresses == {f"node{k}": f"{SUBNET}.{10 + k}" for k in (1, 2, 3)}
    for path in (hosts.ssh_config, hosts.identity, hosts.known_hosts):
        assert path.is_file()
    assert sorted(_namespaces()) == [netns_name(n) for n in hosts.names]
    assert _bridge_exists()


@pytest.mark.parametrize("name", [f"node{k}" for k in range(1, COUNT + 1)])
def test_hostname(hosts: TestHosts, name: str) -> None:
    proc = hosts.run(name, "hostname")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == name
    assert proc.stderr == ""  # no host key prompts or warnings


def test_plain_ssh_by_alias_and_address(hosts: TestHosts) -> None:
    for target in ("node2", hosts.addresses["node2"]):
        proc = subprocess.run(
            ["ssh", "-F", str(hosts.ssh_config), target, "hostname"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        assert (proc.returncode, proc.stdout.strip()) == (0, "node2"), proc.stderr


def test_each_node_has_its_own_address(hosts: TestHosts) -> None:
    for name in hosts.names:
        proc = hosts.run(name, "ip -4 -o addr show dev eth0")
        assert proc.returncode == 0, proc.stderr
        assert f"inet {hosts.addresses[name]}/24" in proc.stdout


def test_node_reaches_other_node(hosts: TestHosts) -> None:
    target = hosts.addresses["node2"]
    probe = f'import socket; socket.create_connection(("{target}", 22), 2).close(); print("ok")'
    proc = hosts.run("node1", ["python3", "-c", probe])
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok"), proc.stderr


def test_node_sshes_to_other_node(hosts: TestHosts) -> None:
    proc = hosts.run("node1", [*hosts.ssh_command, "node3", "hostname"])
    assert (proc.returncode, proc.stdout.strip()) == (0, "node3"), proc.stderr


def test_many_parallel_sessions(hosts: TestHosts) -> None:
    jobs = [(name, i) for name in hosts.names for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: hosts.run(job[0], f"echo {job[1]}; hostname"), jobs))
    for (name, i), proc in zip(jobs, results, strict=True):
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [str(i), name]


def test_processes_in_sees_remote_processes(hosts: TestHosts) -> None:
    before = set(processes_in("node2"))
    assert hosts.pids["node2"] in before
    proc = hosts.run("node2", "setsid sleep 120 </dev/null >/dev/null 2>&1 & echo $!")
    assert proc.returncode == 0, proc.stderr
    # $! is the pid as seen in node2's pid namespace, which is the root one
    sleeper = int(proc.stdout.strip())
    assert sleeper in processes_in("node2")
    assert sleeper not in processes_in("node1")
    assert hosts.processes("node2") == processes_in("node2")


def test_stop_leaves_nothing(hosts: TestHosts) -> None:
    # a detached process per node must not survive teardown
    for name in hosts.names:
        proc = hosts.run(name, "setsid sleep 300 </dev/null >/dev/null 2>&1 &")
        assert proc.returncode == 0, proc.stderr
    state_dir = hosts.state_dir
    pids = {pid for name in hosts.names for pid in processes_in(name)}
    assert set(hosts.pids.values()) <= pids and len(pids) > len(hosts.names)

    hosts.stop()
    hosts.stop()  # idempotent

    assert _namespaces() == []
    assert not _bridge_exists()
    assert [pid for pid in pids if pid_alive(pid)] == []
    assert all(processes_in(name) == [] for name in hosts.names)
    assert not state_dir.exists()


def test_cleanup_after_crashed_run(ssh_hosts_session: TestHosts, tmp_path: Path) -> None:
    ssh_hosts_session.stop()  # only one set of netns hosts can exist at a time
    crashed = TestHosts(2, tmp_path / "state")
    crashed.start()
    sshd_pids = list(crashed.pids.values())
    crashed.detach()  # as if the process had died: everything left running
    assert sorted(_namespaces()) == [netns_name("node1"), netns_name("node2")]

    # a new run starts cleanly on top of the leftovers ...
    with TestHosts(1) as fresh:
        assert fresh.run("node1", "hostname").stdout.strip() == "node1"
        assert not any(pid_alive(pid) for pid in sshd_pids)
    # ... and cleanup_leftovers() alone also removes everything
    crashed = TestHosts(2, tmp_path / "state2")
    crashed.start()
    sshd_pids = list(crashed.pids.values())
    crashed.detach()
    cleanup_leftovers()
    assert _namespaces() == []
    assert not _bridge_exists()
    assert not any(pid_alive(pid) for pid in sshd_pids)
    TestHosts.attach(tmp_path / "state2").stop()  # removes its state dir
    assert not (tmp_path / "state2").exists()
