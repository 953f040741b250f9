"""Remote hosts for real: dtrain over SSH to sshd test hosts in their own network namespaces."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    JOBS,
    child_env,
    marked_pids,
    py,
    rss_mib,
    run_dtrain,
    start_dtrain,
    wait_for_pids,
    wait_until_gone,
)
from tests.testhosts import SUBNET, TestHosts, netns_name, processes_in

pytestmark = pytest.mark.sshhosts


def ssh(hosts: TestHosts) -> list[str]:
    return ["--ssh-config", str(hosts.ssh_config)]


def watchdogs_on(hosts: TestHosts, names: tuple[bytes, ...] = (b"dtrain-remote",)) -> list[int]:
    """dtrain agents and watchdogs left on the test hosts (BOOTSTRAP in their command line),
    or other processes whose command line has one of ``names``."""
    return [pid for pids in hosts.running(names).values() for pid in pids]


def assert_nothing_left(hosts: TestHosts, mark: str) -> None:
    assert wait_until_gone(mark, timeout=5) == []
    deadline = time.monotonic() + 5
    while watchdogs_on(hosts) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watchdogs_on(hosts) == []


def without_identity(hosts: TestHosts, directory: Path, known_hosts: Path | None = None) -> Path:
    """A copy of the hosts' ssh config without IdentityFile (and another known_hosts)."""
    lines = []
    for line in hosts.ssh_config.read_text().splitlines():
        key = line.strip().split(" ")[0].lower()
        if key == "identityfile":
            continue
        if known_hosts is not None and key == "userknownhostsfile":
            line = f"  UserKnownHostsFile {known_hosts}"
        lines.append(line)
    config = directory / "ssh_config"
    config.write_text("\n".join(lines) + "\n")
    return config


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("host_list", "hostnames"),
    [
        ("node1:2,node2:2,node3:2", ["node1", "node1", "node2", "node2", "node3", "node3"]),
        ("localhost:1,node2:1", [os.uname().nodename, "node2"]),
    ],
)
@pytest.mark.slow
def test_torch_allreduce_across_hosts(
    ssh_hosts: TestHosts, mark: str, host_list: str, hostnames: list[str]
) -> None:
    pytest.importorskip("torch")
    result = run_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        host_list,
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "examples/torch_allreduce.py",
        timeout=230,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    world = len(hostnames)
    total = world * (world + 1) // 2
    for rank, hostname in enumerate(hostnames):
        lines = [line for line in result.stdout.splitlines() if "all_reduce sum" in line]
        assert any(
            f" on {hostname}: all_reduce sum = {total} ok" in line and line.startswith(f"[{rank}@")
            for line in lines
        ), lines
    assert f"weights identical on all {world} ranks" in result.stdout


def test_failure_on_one_host_tears_down_every_host(ssh_hosts: TestHosts, mark: str) -> None:
    script = "if [ $RANK = 3 ]; then sleep 1; echo 'bad shard' >&2; exit 7; fi; sleep 300 & wait"
    result = run_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        "node1:2,node2:2,node3:2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        script,
    )
    assert result.returncode == 7
    assert result.stderr.splitlines()[-2:] == [
        "dtrain: stopped the other 5 ranks",
        "dtrain: rank 3 on node2 failed (exit code 7); dtrain exits 7",
    ]
    assert "    bad shard" in result.stderr.splitlines()
    assert_nothing_left(ssh_hosts, mark)
    job_id = result.stderr.split("dtrain: job ", 1)[1].split()[0]
    ranks = json.loads((JOBS / job_id / "status.json").read_text())["ranks"]
    # Remote ranks are recorded with their process group (the watchdog's pid there), not 0.
    assert [ranks[str(r)]["host"] for r in range(6)] == ["node1"] * 2 + ["node2"] * 2 + [
        "node3"
    ] * 2
    assert all(ranks[str(r)]["pid"] > 0 for r in range(6))


def test_remote_signal_death_and_exit_codes(ssh_hosts: TestHosts, mark: str) -> None:
    result = run_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        "node1,node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then kill -SEGV $$; fi; sleep 300",
    )
    assert result.returncode == 128 + signal.SIGSEGV
    assert "rank 1 on node2 failed (killed by SIGSEGV)" in result.stderr
    ok = run_dtrain("run", *ssh(ssh_hosts), "-H", "node3", "sh", "-c", "exit 0")
    assert ok.returncode == 0


def test_arguments_and_a_large_environment_arrive_intact(
    ssh_hosts: TestHosts, mark: str, tmp_path: Path
) -> None:
    weird = ["a b", "it's", '"quoted"', "$HOME", "`id`", "new\nline", "semi;colon", "*"]
    env_file = tmp_path / "big.env"  # 4 x 100 KB: more than one ssh command line could carry
    env_file.write_text("".join(f"BIG{i}={chr(97 + i) * 100_000}\n" for i in range(4)))
    code = (
        "import json, os, socket, sys; print(json.dumps([socket.gethostname(), sys.argv[1:], "
        "[os.environ[f'BIG{i}'] == chr(97 + i) * 100_000 for i in range(4)], os.getcwd()]))"
    )
    result = run_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        "node2",
        "--env-file",
        str(env_file),
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        *py(code),
        *weird,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.splitlines()[0].split("] ", 1)[1]
    assert json.loads(line) == ["node2", weird, [True] * 4, os.getcwd()]


def test_ctrl_c_stops_remote_ranks(ssh_hosts: TestHosts, mark: str) -> None:
    proc = start_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        "node1,node2,node3",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "sleep 300 & wait",
    )
    wait_for_pids(mark, 6)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert_nothing_left(ssh_hosts, mark)


def test_killed_launcher_leaves_nothing_on_any_host(ssh_hosts: TestHosts, mark: str) -> None:
    proc = start_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        "node1:2,node2,node3",
        "--grace",
        "1",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "trap '' TERM; sleep 300 & sleep 300",
    )
    wait_for_pids(mark, 8)
    assert watchdogs_on(ssh_hosts)
    proc.kill()
    proc.communicate(timeout=10)
    started = time.monotonic()
    assert_nothing_left(ssh_hosts, mark)
    assert time.monotonic() - started < 5


def test_unreachable_host_fails_within_the_timeout(ssh_hosts: TestHosts) -> None:
    started = time.monotonic()
    result = run_dtrain(
        "run", *ssh(ssh_hosts), "--ssh-timeout", "2", "-H", f"node1,{SUBNET}.99", "true"
    )
    assert time.monotonic() - started < 15
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"dtrain: error: {SUBNET}.99: no answer on port 22 within 2s (hint: check that the host "
        "is up and reachable, or raise --ssh-timeout)"
    ]


def test_a_host_with_no_route_is_unreachable_not_refused(ssh_hosts: TestHosts) -> None:
    """An address on the hosts' network where nothing answers (a host that is down): the
    kernel finds no route (ARP gets no answer) before --ssh-timeout, and dtrain says so
    (it said "connection refused", which sends the user to check sshd)."""
    result = run_dtrain("run", *ssh(ssh_hosts), "--ssh-timeout", "30", "-H", f"{SUBNET}.98", "true")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"dtrain: error: {SUBNET}.98: unreachable: no route to it (nothing answers at its "
        "address) (hint: check that the host is up and its address, or the network between)"
    ]


def test_refused_connection_names_the_host(ssh_hosts: TestHosts) -> None:
    result = run_dtrain("run", *ssh(ssh_hosts), "--ssh-port", "2222", "-H", "node1", "true")
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"dtrain: error: node1 ({SUBNET}.11): connection refused on port 2222"
    )


def test_refused_key(ssh_hosts: TestHosts, tmp_path: Path) -> None:
    key = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    config = without_identity(ssh_hosts, tmp_path)
    result = run_dtrain(
        "run", "--ssh-config", str(config), "--ssh-identity", str(key), "-H", "node2", "true"
    )
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"dtrain: error: node2 ({SUBNET}.12): authentication failed for user root"
    )


def test_unknown_host_key_is_refused_then_trusted_on_request(
    ssh_hosts: TestHosts, tmp_path: Path
) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    lines = ssh_hosts.ssh_config.read_text()
    config = tmp_path / "ssh_config"
    config.write_text(
        "\n".join(
            f"  UserKnownHostsFile {known_hosts}"
            if line.strip().lower().startswith("userknownhostsfile")
            else line
            for line in lines.splitlines()
        )
    )
    refused = run_dtrain("run", "--ssh-config", str(config), "-H", "node3", "true")
    assert refused.returncode == 1
    assert f"node3 ({SUBNET}.13): host key unknown" in refused.stderr
    assert f"ssh-keyscan -p 22 {SUBNET}.13 >> {known_hosts}'" in refused.stderr
    trusted = run_dtrain(
        "run", "--ssh-config", str(config), "--accept-new-host-keys", "-H", "node3", "true"
    )
    assert trusted.returncode == 0, trusted.stderr
    assert known_hosts.read_text().startswith(f"{SUBNET}.13 ssh-ed25519 ")
    again = run_dtrain("run", "--ssh-config", str(config), "-H", "node3", "true")
    assert again.returncode == 0, again.stderr


def test_changed_host_key_is_refused(ssh_hosts: TestHosts, tmp_path: Path) -> None:
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(
        f"{SUBNET}.11 " + " ".join(other.with_suffix(".pub").read_text().split()[:2]) + "\n"
    )
    config = tmp_path / "ssh_config"
    config.write_text(
        "\n".join(
            f"  UserKnownHostsFile {known_hosts}"
            if line.strip().lower().startswith("userknownhostsfile")
            else line
            for line in ssh_hosts.ssh_config.read_text().splitlines()
        )
    )
    result = run_dtrain("run", "--ssh-config", str(config), "-H", "node1", "true")
    assert result.returncode == 1
    assert f"node1 ({SUBNET}.11): host key CHANGED: it does not match {known_hosts}" in (
        result.stderr
    )
    assert f"ssh-keygen -f {known_hosts} -R {SUBNET}.11" in result.stderr


def test_system_wide_known_hosts_are_trusted(ssh_hosts: TestHosts, tmp_path: Path) -> None:
    """Clusters distribute host keys in /etc/ssh/ssh_known_hosts (GlobalKnownHostsFile)."""
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    lines = []
    for line in ssh_hosts.ssh_config.read_text().splitlines():
        if line.strip().lower().startswith("userknownhostsfile"):
            system = line.split(None, 1)[1]
            line = f"  UserKnownHostsFile {empty}\n  GlobalKnownHostsFile {system}"
        lines.append(line)
    config = tmp_path / "ssh_config"
    config.write_text("\n".join(lines) + "\n")
    result = run_dtrain("run", "--ssh-config", str(config), "-H", "node1", "true")
    assert result.returncode == 0, result.stderr
    assert empty.read_text() == ""  # nothing recorded: the key was known system-wide


def test_missing_directory_or_program_on_a_host(ssh_hosts: TestHosts) -> None:
    result = run_dtrain(
        "run", *ssh(ssh_hosts), "-H", "node1", "--workdir", "/nonexistent-dtrain-dir", "true"
    )
    assert result.returncode == 1
    assert result.stderr.startswith(
        "dtrain: error: node1: working directory /nonexistent-dtrain-dir does not exist there"
    )
    missing = run_dtrain("run", *ssh(ssh_hosts), "-H", "node2", "no-such-program-xyz")
    assert missing.returncode == 1
    assert "node2: program 'no-such-program-xyz' not found there" in missing.stderr


def test_marked_processes_are_visible_on_remote_hosts(ssh_hosts: TestHosts, mark: str) -> None:
    """The no-orphan checks can fail: they do see remote ranks while they run."""
    proc = start_dtrain(
        "run", *ssh(ssh_hosts), "-H", "node3", "-x", f"DTRAIN_TEST_MARK={mark}", "sleep", "30"
    )
    pids = wait_for_pids(mark, 1)
    assert set(pids) <= set(processes_in("node3"))
    # While it runs, the job directory records the remote rank's pid (its process group).
    job = max(JOBS.iterdir(), key=lambda p: p.name)
    deadline = time.monotonic() + 10
    while json.loads((job / "status.json").read_text())["ranks"].get("0", {}).get("pid", 0) <= 0:
        assert time.monotonic() < deadline, "the remote pid was never recorded"
        time.sleep(0.05)
    recorded = json.loads((job / "status.json").read_text())["ranks"]["0"]["pid"]
    assert recorded in processes_in("node3")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert_nothing_left(ssh_hosts, mark)


def test_an_agent_that_cannot_start_is_one_error_and_leaves_nothing(
    ssh_hosts: TestHosts,
) -> None:
    from launcher.base.errors import HostConnectionError
    from launcher.core.hosts import Host
    from launcher.transport.agentlink import HostAgent
    from launcher.transport.ssh import connect
    from launcher.transport.sshconfig import SshSettings, load_ssh_config

    settings = SshSettings(config_file=str(ssh_hosts.ssh_config), timeout_s=5)
    connection = connect(Host("node1"), settings, load_ssh_config(settings))
    try:
        # An "interpreter" that exits at once: the agent never starts.
        with pytest.raises(HostConnectionError) as caught:
            HostAgent.open(connection, "/bin/false", {"ports": 1}, 5)
        assert caught.value.message.startswith("node1: cannot run Python there")
    finally:
        connection.close()
    deadline = time.monotonic() + 5
    while watchdogs_on(ssh_hosts) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watchdogs_on(ssh_hosts) == []


def test_check_reports_every_host(ssh_hosts: TestHosts) -> None:
    result = run_dtrain(
        "check",
        *ssh(ssh_hosts),
        "--ssh-timeout",
        "2",
        "-H",
        f"localhost,node1,node2,node3,{SUBNET}.99",
        "--json",
    )
    assert result.returncode == 1, result.stdout  # one host is unreachable
    rows = {row["host"]: row for row in json.loads(result.stdout)}
    assert rows[f"{SUBNET}.99"]["ok"] is False
    assert "no answer on port 22" in rows[f"{SUBNET}.99"]["error"]
    for name in ("node1", "node2", "node3"):
        row = rows[name]
        assert row["ok"] and row["hostname"] == name, row
        assert row["python_version"].count(".") == 2 and row["python"]
        assert row["versions"]["dtrain"] is not None
        assert row["rtt_ms"] is not None and row["rtt_ms"] >= 0
        assert abs(row["clock_offset_ms"]) < 500  # one clock: the estimate must be close to 0
        assert 1024 <= row["free_port"] <= 65535
        assert row["gpus"] == 0
    assert rows["localhost"]["ok"] and rows["localhost"]["rtt_ms"] is None
    table = run_dtrain("check", *ssh(ssh_hosts), "-H", "node1,node2")
    assert table.returncode == 0
    assert "2 of 2 hosts ok" in table.stdout
    for columns in (80, 200):  # host by host on a narrow terminal, a table on a wide one
        env = {**child_env(), "COLUMNS": str(columns)}
        shown = run_dtrain("check", *ssh(ssh_hosts), "-H", f"node1,{SUBNET}.99", env=env).stdout
        assert all(len(line) <= columns for line in shown.splitlines()), shown
        assert ("┃" in shown) == (columns == 200)  # the table's header
        assert "FAILED" in shown and "1 of 2 hosts ok" in shown


@pytest.mark.slow
def test_mpi_across_two_hosts(ssh_hosts: TestHosts, mark: str) -> None:
    pytest.importorskip("mpi4py")
    hello = run_dtrain(
        "run",
        "--mpi",
        *ssh(ssh_hosts),
        "-H",
        "node1:2,node2:2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "-m",
        "mpi4py.bench",
        "helloworld",
    )
    assert hello.returncode == 0, hello.stderr[-2000:]
    lines = sorted(hello.stdout.splitlines())
    assert lines == [
        f"[{r}@node{r // 2 + 1}] Hello, World! I am process {r} of 4 on node{r // 2 + 1}."
        for r in range(4)
    ]
    ring = run_dtrain(
        "run",
        "--mpi",
        *ssh(ssh_hosts),
        "-H",
        "node1,node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "python",
        "-m",
        "mpi4py.bench",
        "ringtest",
        "-n",
        "4096",
        "-l",
        "20",
    )
    assert ring.returncode == 0, ring.stderr[-2000:]
    assert "time for 20 loops" in ring.stdout


@pytest.mark.slow
def test_mpi_failure_across_hosts_leaves_nothing(ssh_hosts: TestHosts, mark: str) -> None:
    script = "if [ $OMPI_COMM_WORLD_RANK = 3 ]; then sleep 1; exit 6; fi; sleep 300"
    result = run_dtrain(
        "run",
        "--mpi",
        *ssh(ssh_hosts),
        "-H",
        "node1:2,node2:2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        script,
    )
    assert result.returncode == 6
    assert "dtrain: rank 3 on node2 failed (exit code 6)" in result.stderr
    assert_nothing_left(ssh_hosts, mark)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_tf_parameter_servers_across_hosts(ssh_hosts: TestHosts, mark: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorflow", reason="needs tensorflow-cpu")
    result = run_dtrain(
        "ps",
        *ssh(ssh_hosts),
        "--workers",
        "2",
        "--ps",
        "1",
        "-H",
        "node1:1,node2:1,node3:1",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "-x",  # TensorFlow's autograph compiles its files there (and leaves their .pyc)
        f"TMPDIR={tmp_path}",
        "python",
        "examples/tf_ps_train.py",
        "--epochs",
        "3",
        "--checkpoint-dir",
        str(tmp_path),
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(
        next(ln for ln in result.stdout.splitlines() if "test accuracy" in ln).split()[-1]
    )
    assert accuracy >= 0.85
    servers = [ln for ln in result.stdout.splitlines() if "serving at" in ln]
    assert any(ln.startswith("[3@node2] ps 0 serving") or "ps 0" in ln for ln in servers)
    assert_nothing_left(ssh_hosts, mark)


def test_proxy_jump_from_the_ssh_config(ssh_hosts: TestHosts, mark: str, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host hidden-node2\n  HostName {SUBNET}.12\n  ProxyJump node1\n\n"
        + ssh_hosts.ssh_config.read_text()
    )
    result = run_dtrain(
        "run",
        "--ssh-config",
        str(config),
        "-H",
        "hidden-node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        'echo "$(hostname) from ${SSH_CONNECTION%% *}"',
    )
    assert result.returncode == 0, result.stderr
    # node2's sshd saw the connection come from node1: it went through the jump host.
    assert result.stdout.splitlines() == [f"[0@hidden-node2] node2 from {SUBNET}.11"]


def test_proxy_jump_over_two_hosts(ssh_hosts: TestHosts, mark: str, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host far-node3\n  HostName {SUBNET}.13\n  ProxyJump node1,node2\n\n"
        + ssh_hosts.ssh_config.read_text()
    )
    result = run_dtrain(
        "run",
        "--ssh-config",
        str(config),
        "-H",
        "far-node3",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        'echo "$(hostname) from ${SSH_CONNECTION%% *}"',
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"[0@far-node3] node3 from {SUBNET}.12"
    ]  # node1, then node2
    broken = config.read_text().replace("ProxyJump node1,node2", "ProxyJump node1,nosuchhost")
    config.write_text(broken)
    failed = run_dtrain("run", "--ssh-config", str(config), "-H", "far-node3", "true")
    assert failed.returncode == 1
    assert failed.stderr.startswith(
        "dtrain: error: nosuchhost: the jump host node1 cannot reach nosuchhost:22"
    )


def watchdog_of(pid: int) -> int:
    """The nearest watchdog above ``pid`` (agents and watchdogs run dtrain's bootstrap)."""
    for _ in range(3):
        pid = int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        if b"dtrain-remote" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no watchdog above {pid}")


def test_a_watchdog_killed_alone_fails_its_rank_and_leaves_nothing(
    ssh_hosts: TestHosts, mark: str
) -> None:
    proc = start_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        "node1,node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "sleep 300 & wait",
    )
    wait_for_pids(mark, 4)
    on_node2 = set(processes_in("node2"))
    sleeper = next(p for p in marked_pids(mark) if p in on_node2)
    os.kill(watchdog_of(sleeper), signal.SIGKILL)  # as the OOM killer would
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert (
        "rank 1 on node2 failed (killed by SIGKILL: out of memory? see dmesg on node2)"
        in " ".join(err.split())
    )
    assert_nothing_left(ssh_hosts, mark)


@pytest.fixture
def chatty_login_shell(ssh_hosts: TestHosts) -> Iterator[None]:
    """The test hosts' user's ~/.bashrc prints a banner, as many clusters' do (restored after);
    on this lane's hosts only (the ssh session's server address is in its subnet): the other
    pytest-xdist workers' hosts, in other lanes, read the same ~/.bashrc meanwhile."""
    rc = Path(pwd.getpwuid(os.geteuid()).pw_dir) / ".bashrc"
    saved = rc.read_bytes() if rc.exists() else None
    welcome = 'echo "Welcome to $(hostname)! Your quota is fine."'
    banner = f'case "$SSH_CONNECTION" in *" {SUBNET}."*) {welcome};; esac\n'
    rc.write_bytes(banner.encode() + (saved or b""))
    try:
        yield
    finally:
        if saved is None:
            rc.unlink()
        else:
            rc.write_bytes(saved)


def test_a_login_shell_that_prints_does_not_break_the_agent(
    ssh_hosts: TestHosts, chatty_login_shell: None
) -> None:
    banner = subprocess.run(
        ["ssh", "-F", str(ssh_hosts.ssh_config), "node1", "true"], capture_output=True, text=True
    )
    assert "Welcome to node1" in banner.stdout  # the shell really prints on a command channel
    result = run_dtrain("run", *ssh(ssh_hosts), "-H", "node1,node2", "sh", "-c", "echo ok $RANK")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[0@node1] ok 0", "[1@node2] ok 1"]


def test_a_frozen_host_is_lost_within_the_host_timeout(ssh_hosts: TestHosts, mark: str) -> None:
    proc = start_dtrain(
        "run",
        *ssh(ssh_hosts),
        "--host-timeout",
        "3",
        "-H",
        "node1,node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "sleep 300 & wait",
    )
    wait_for_pids(mark, 4)
    frozen = processes_in("node2")  # sshd, the agent, the watchdog, the rank: all of them
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        _, err = proc.communicate(timeout=60)
        noticed_s = time.monotonic() - started
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert proc.returncode == 255, err
    assert (  # (the last line, broken between words to fit 80 columns)
        "stopped the other 1 rank dtrain: rank 1 on node2 failed (no word from the agent on "
        "node2 for 3 s: the host is frozen or cut off)" in " ".join(err.split())
    ), err
    assert noticed_s < 20, noticed_s  # 3 s of silence, not TCP's 15 minutes
    assert_nothing_left(ssh_hosts, mark)  # thawed, node2's agent finds its launcher gone


@pytest.mark.timeout(120)
def test_paused_reader_does_not_stall_remote_teardown(
    ssh_hosts: TestHosts, mark: str, start_unread: Callable[..., subprocess.Popen[bytes]]
) -> None:
    proc = start_unread(
        "run",
        *ssh(ssh_hosts),
        "--plain",
        "-H",
        "node1,node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then sleep 3; exit 3; fi; yes 'a line of output'",
    )
    wait_for_pids(mark, 2)
    peak = 0.0
    deadline = time.monotonic() + 30
    while marked_pids(mark):  # node2's rank fails; node1's, blocked on output, must go too
        assert time.monotonic() < deadline, "remote ranks outlived a failure behind a paused reader"
        peak = max(peak, rss_mib(proc.pid))
        time.sleep(0.05)
    assert peak < 200, f"dtrain grew to {peak:.0f} MiB behind a paused reader"
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert b"rank 1 on node2 failed (exit code 3)" in err
    assert out.count(b"[0@node1] a line of output\n") > 0
    assert_nothing_left(ssh_hosts, mark)


def test_a_python_script_runs_on_remote_hosts(
    ssh_hosts: TestHosts, mark: str, tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text(
        "import os, sys; print(os.environ['RANK'], sys.executable)\n"
    )
    result = run_dtrain(
        "run",
        *ssh(ssh_hosts),
        "-H",
        "node1,node2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "train.py",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    # The same interpreter path exists on the test hosts: the ranks run with it.
    assert sorted(result.stdout.splitlines()) == [
        f"[0@node1] 0 {sys.executable}",
        f"[1@node2] 1 {sys.executable}",
    ]
    missing = run_dtrain("run", *ssh(ssh_hosts), "-H", "node1", "nothere.py", cwd=tmp_path)
    assert missing.returncode == 1
    assert f"node1: script nothere.py not found there in {tmp_path}" in missing.stderr


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_torch_rpc_parameter_server_across_hosts(ssh_hosts: TestHosts, mark: str) -> None:
    """TensorPipe binds 127.0.0.1 where host names do not resolve: TP_SOCKET_IFNAME fixes it."""
    pytest.importorskip("torch")
    result = run_dtrain(
        "ps", *ssh(ssh_hosts), "--framework", "torch", "--workers", "2", "--ps", "1",
        "-H", "node1:1,node2:2", "-x", f"DTRAIN_TEST_MARK={mark}",
        "python", "examples/torch_rpc_ps.py", "--epochs", "3",
        timeout=270,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = float(
        next(ln for ln in result.stdout.splitlines() if "test accuracy" in ln).split()[-1]
    )
    assert accuracy >= 0.9
    assert any(ln.startswith("[worker1@node2]") for ln in result.stdout.splitlines())
    assert_nothing_left(ssh_hosts, mark)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torch_ddp_under_mpi_across_two_hosts(ssh_hosts: TestHosts, mark: str) -> None:
    """MPI-launched ranks get RANK, MASTER_ADDR... too: a torch.distributed script runs as is."""
    pytest.importorskip("torch")
    result = run_dtrain(
        "run", "--mpi", *ssh(ssh_hosts), "-H", "node1:1,node2:1", "-x", f"DTRAIN_TEST_MARK={mark}",
        "examples/torch_allreduce.py", timeout=230,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[1@node2] rank 1/2 (local 0) on node2: all_reduce sum = 3 ok" in result.stdout
    assert "weights identical on all 2 ranks" in result.stdout
    assert_nothing_left(ssh_hosts, mark)


def test_a_raw_library_message_gets_the_host_and_a_hint(ssh_hosts: TestHosts) -> None:
    """Something that is not sshd answers on the port: paramiko's 'Error reading SSH protocol
    banner' comes with the host, what it means and what to try."""
    server = (
        "import socket, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('{SUBNET}.13', 2299)); s.listen(5); print('up', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept(); c.sendall(b'HTTP 400\\r\\n'); time.sleep(3); c.close()\n"
    )
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns_name("node3"), sys.executable, "-c", server],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        result = run_dtrain(
            "run", *ssh(ssh_hosts), "-H", "node3", "--ssh-port", "2299", "--ssh-timeout", "2",
            "true",
        )  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
    assert result.returncode != 0
    (line,) = result.stderr.splitlines()
    # paramiko says 'Error reading SSH protocol banner' or 'No existing session' here
    assert re.match(
        rf"dtrain: error: node3 \({SUBNET}.13\): (no SSH greeting from the server|the SSH session "
        r"ended before login).* \(paramiko: (Error reading SSH protocol banner|No existing "
        r"session)\) \(hint: check the port \(--ssh-port\)",
        line,
    ), line


DROPPING_PROXY = f"""
import socket, sys, threading
drops = int(sys.argv[1])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{SUBNET}.13", 2300)); s.listen(50); print("up", flush=True)
def pipe(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for c in (a, b):
        try:
            c.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
while True:
    c, _ = s.accept()
    if drops:  # as sshd past MaxStartups: accepted, closed before any greeting
        drops -= 1
        print("dropped", flush=True)
        c.close()
        continue
    up = socket.create_connection(("{SUBNET}.13", 22))
    threading.Thread(target=pipe, args=(c, up), daemon=True).start()
    threading.Thread(target=pipe, args=(up, c), daemon=True).start()
"""


def test_a_connection_dropped_before_the_greeting_is_tried_again(
    ssh_hosts: TestHosts, tmp_path: Path
) -> None:
    """sshd past its MaxStartups (many launches at once through one bastion) closes new
    connections before greeting them: dtrain tries again, with backoff, within --ssh-timeout."""
    key = (ssh_hosts.host_dir("node3") / "ssh_host_ed25519_key.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(
        ssh_hosts.known_hosts.read_text() + f"[node3]:2300,[{SUBNET}.13]:2300 {key[0]} {key[1]}\n"
    )
    config = tmp_path / "ssh_config"
    config.write_text(
        "\n".join(
            f"    UserKnownHostsFile {known}"
            if line.strip().lower().startswith("userknownhostsfile")
            else line
            for line in ssh_hosts.ssh_config.read_text().splitlines()
        )
        + "\n"
    )
    proxy = subprocess.Popen(
        ["ip", "netns", "exec", netns_name("node3"), sys.executable, "-c", DROPPING_PROXY, "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None and proxy.stdout.readline() == "up\n"
        result = run_dtrain(
            "run", "--ssh-config", str(config), "-H", "node3", "--ssh-port", "2300",
            "--ssh-timeout", "10", "echo", "greeted",
        )  # fmt: skip
    finally:
        proxy.kill()
        out, _ = proxy.communicate()
    assert result.returncode == 0, result.stderr
    assert "greeted" in result.stdout
    assert out.count("dropped") == 3
