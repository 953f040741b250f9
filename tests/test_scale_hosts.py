"""Scale on one machine: a 32-host job on the SSH test hosts (ranks start, one fails,
nothing is left on any host), and what keeps the launcher's cost per host flat as hosts
are added (each host's ssh config entry and known_hosts keys read once per launch)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.core.hosts import Host
from launcher.transport import ssh, sshconfig
from launcher.transport.sshlib import paramiko
from tests.conftest import JOBS, run_dtrain, wait_until_gone
from tests.testhosts import TestHosts


@pytest.mark.timeout(120)
def test_a_32_host_job_starts_every_rank_and_leaves_nothing_after_a_failure(
    ssh_hosts_wide: TestHosts, mark: str, tmp_path: Path
) -> None:
    hosts = ssh_hosts_wide
    count = len(hosts.names)
    started = tmp_path / "started"  # the test hosts share this machine's file system
    started.mkdir()
    # Every rank says it runs; rank 17 fails once all 32 have, the others wait to be stopped.
    script = (
        f'touch {started}/$RANK; echo up; if [ "$RANK" = 17 ]; then '
        f"while [ $(ls {started} | wc -l) -lt {count} ]; do sleep 0.1; done; exit 5; fi; "
        "sleep 300 & wait"
    )
    result = run_dtrain(
        "run",
        "--ssh-config",
        str(hosts.ssh_config),
        "--ssh-timeout",
        "60",  # 32 agents start at once on the 2 cores the hosts share with the suite
        "-H",
        ",".join(hosts.names),
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        "sh",
        "-c",
        script,
    )
    assert result.returncode == 5, result.stderr[-2000:]
    # (the prefix names the host too: [RANK@HOST])
    assert sorted(result.stdout.splitlines()) == sorted(
        f"[{rank}@{name}] up" for rank, name in enumerate(hosts.names)
    )
    assert result.stderr.splitlines()[-2:] == [
        f"dtrain: stopped the other {count - 1} ranks",
        "dtrain: rank 17 on node18 failed (exit code 5); dtrain exits 5",
    ]
    assert wait_until_gone(mark, timeout=10) == []
    deadline = time.monotonic() + 10
    while hosts.leftovers() and time.monotonic() < deadline:  # sshd sessions closing
        time.sleep(0.1)
    assert hosts.leftovers() == []  # nothing but each host's sshd
    job_id = result.stderr.split("dtrain: job ", 1)[1].split()[0]
    ranks = json.loads((JOBS / job_id / "status.json").read_text())["ranks"]
    assert [ranks[str(r)]["host"] for r in range(count)] == hosts.names


class CountingConfig(paramiko.SSHConfig):
    """An SSH config that counts its lookups."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.parse(text.splitlines())
        self.asked: list[str] = []

    def lookup(self, hostname: str) -> Any:
        self.asked.append(hostname)
        return super().lookup(hostname)


def test_each_hosts_ssh_config_entry_is_looked_up_once() -> None:
    """The survey (locality) and the connection resolve the same names: paramiko walks
    every Host block for each lookup, so a 64-host config was read 2 x 64 times."""
    config = CountingConfig("Host a\n  HostName 10.0.0.1\n  IdentityFile ~/k\nHost *\n  User u\n")
    settings = sshconfig.SshSettings()
    host = Host("a")
    first = sshconfig.resolve_target(host, settings, config)
    again = sshconfig.resolve_target(host, settings, config)
    assert config.asked == ["a"]
    assert again == first
    assert (again.hostname, again.user) == ("10.0.0.1", "u")
    other = sshconfig.resolve_target(Host("b"), settings, config)
    assert (other.hostname, config.asked) == ("b", ["a", "b"])
    # another config (the file read again) is looked up afresh
    fresh = CountingConfig("Host a\n  HostName 10.0.0.2\n")
    assert sshconfig.resolve_target(host, settings, fresh).hostname == "10.0.0.2"


def ed25519_line(names: str, directory: Path, stem: str) -> str:
    key = directory / stem
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    kind, blob = key.with_suffix(".pub").read_text().split()[:2]
    return f"{names} {kind} {blob}\n"


def test_known_hosts_are_read_once_per_file_and_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection took its host's keys from a fresh read of the whole file (paramiko's
    load compares every line with those before it): 64 hosts, 64 x 64 lines."""
    loads: list[str] = []
    original = paramiko.HostKeys.load

    def counting(self: Any, filename: str) -> None:
        loads.append(filename)
        original(self, filename)

    monkeypatch.setattr(paramiko.HostKeys, "load", counting)
    known = tmp_path / "known_hosts"
    known.write_text(
        ed25519_line("a,10.0.0.1", tmp_path, "a") + ed25519_line("[b]:2222", tmp_path, "b")
    )
    cache = ssh.KnownHosts()
    a = cache.keys_of(str(known), "10.0.0.1")
    assert list(a) == ["ssh-ed25519"]
    assert cache.keys_of(str(known), "a") == a
    assert list(cache.keys_of(str(known), "[b]:2222")) == ["ssh-ed25519"]
    assert cache.keys_of(str(known), "c") == {}
    assert loads == [str(known)]
    with known.open("a") as f:  # trust on first use appends: the file is read again
        f.write(ed25519_line("c", tmp_path, "c"))
    assert list(cache.keys_of(str(known), "c")) == ["ssh-ed25519"]
    assert loads == [str(known)] * 2
    assert cache.keys_of(str(tmp_path / "missing"), "a") == {}


def test_the_first_known_hosts_file_with_a_key_of_a_type_wins(tmp_path: Path) -> None:
    """As when paramiko loads the system's and the user's files into one table."""
    system, user = tmp_path / "system", tmp_path / "user"
    system.write_text(ed25519_line("10.0.0.1", tmp_path, "s"))
    user.write_text(ed25519_line("10.0.0.1", tmp_path, "u"))
    target = sshconfig.SshTarget(
        "a", "10.0.0.1", 22, "u", known_hosts=(str(user),), global_known_hosts=(str(system),)
    )
    client = paramiko.SSHClient()
    ssh.trust_known_keys(client, target)
    expected = paramiko.HostKeys(str(system)).lookup("10.0.0.1")
    assert expected is not None
    found = client.get_host_keys().lookup("10.0.0.1")
    assert found is not None and found["ssh-ed25519"] == expected["ssh-ed25519"]
    on_port = sshconfig.SshTarget("a", "10.0.0.1", 2222, "u", known_hosts=(str(user),))
    other = paramiko.SSHClient()
    ssh.trust_known_keys(other, on_port)
    assert other.get_host_keys().lookup("[10.0.0.1]:2222") is None  # port 22's keys only
