"""Which hosts are this machine: decided by address, from the SSH config's HostName where it
gives one, the other names resolved at once against one deadline, each name once.

The resolver, the address check and the host name are injected (``Locality``): a resolver
that counts its calls and blocks until the test lets it go shows what is asked, how often,
and that nobody waits for one name after another."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest

from launcher.core.config import JobConfig, PlacementConfig, SshConfig
from launcher.run.planning import plan_job
from launcher.run.survey import survey_hosts
from launcher.transport.locality import Locality, is_address


def owns(address: str) -> bool:
    """This machine's addresses, for the tests: loopback and 10.9.9.9."""
    return address.startswith("127.") or address in ("::1", "10.9.9.9")


class CountingResolver:
    """Resolves ``names`` (name -> addresses) after ``gate`` lets it; counts every call."""

    def __init__(self, names: dict[str, list[str]], gate: threading.Event | None = None) -> None:
        self.names = names
        self.gate = gate
        self.calls: list[str] = []
        self.lock = threading.Lock()
        self.answered = 0

    def __call__(self, name: str) -> Sequence[str]:
        with self.lock:
            self.calls.append(name)
        if self.gate is not None:
            self.gate.wait()
        with self.lock:
            self.answered += 1
        if name not in self.names:
            raise OSError(f"{name}: no such host")
        return self.names[name]


def test_the_names_are_resolved_at_once_each_one_once() -> None:
    """Eight names whose lookups each wait until all eight are under way: asked one after
    another, the first would wait for the others forever (the barrier breaks, and every
    name is taken for another machine)."""
    names = {f"node{i}": ["127.0.1.1" if i < 4 else f"192.0.2.{i}"] for i in range(8)}
    barrier = threading.Barrier(len(names), timeout=30)

    def resolve(name: str) -> Sequence[str]:
        calls.append(name)
        barrier.wait()  # every lookup under way at once, or none answers
        return names[name]

    calls: list[str] = []
    locality = Locality(resolve=resolve, owns=owns, deadline_s=60, hostname=lambda: "here")
    asked = [*names, "node0", "node5"]  # (a name given twice is looked up once)
    assert locality.decide(asked) == {f"node{i}": i < 4 for i in range(8)}
    assert locality.decide(["node3", "node4"]) == {"node3": True, "node4": False}
    assert sorted(calls) == sorted(names)  # each name once, for both questions


def test_a_name_without_an_answer_costs_one_deadline_for_all_of_them() -> None:
    """Twenty names whose resolver never answers (a DNS that drops the queries): the answer
    comes while every lookup is still blocked (none waited for another: one deadline, not
    twenty), and they are other machines.  Once the lookups end, their answers are kept: a
    second question asks the resolver nothing."""
    gate = threading.Event()
    names = {f"far{i}": ["192.0.2.1"] for i in range(20)}
    resolver = CountingResolver({**names, "far3": ["127.0.0.1"]}, gate)
    locality = Locality(resolve=resolver, owns=owns, deadline_s=0.2, hostname=lambda: "here")
    try:
        assert locality.decide(names) == dict.fromkeys(names, False)
        assert resolver.answered == 0  # decided with every lookup still under way...
        assert sorted(resolver.calls) == sorted(names)  # ...all twenty of them
    finally:
        gate.set()
    for lookup in locality.lookups.values():
        assert lookup.done.wait(30)
    assert locality.decide(names) == {n: n == "far3" for n in names}  # the answers, kept
    assert len(resolver.calls) == len(names)  # nothing asked twice


def test_names_that_say_it_themselves_ask_no_resolver() -> None:
    resolver = CountingResolver({})
    locality = Locality(resolve=resolver, owns=owns, hostname=lambda: "this-box")
    asked = ["localhost", "127.0.0.1", "::1", "this-box", "10.9.9.9", "192.0.2.7", "::2"]
    assert locality.decide(asked) == {
        "localhost": True,
        "127.0.0.1": True,
        "::1": True,
        "this-box": True,
        "10.9.9.9": True,
        "192.0.2.7": False,
        "::2": False,
    }
    assert resolver.calls == []


def test_the_ssh_configs_hostname_decides_and_is_asked_only_when_needed() -> None:
    """An alias whose HostName is this machine's address (or its host name) is local, one
    whose HostName is another's is not, without a lookup of either; a name the config does
    not know is resolved.  A job on this machine alone never asks for the config."""
    resolver = CountingResolver({"plain": ["127.0.0.1"]})
    locality = Locality(resolve=resolver, owns=owns, hostname=lambda: "this-box")
    config = {"alias": "127.0.0.1", "alias6": "::1", "self": "this-box", "far": "192.0.2.9"}
    asked_config: list[list[str]] = []

    def host_names(names: Collection[str]) -> dict[str, str]:
        asked_config.append(sorted(names))
        return {n: config[n] for n in names if n in config}

    found = locality.decide([*config, "plain"], host_names)
    assert found == {"alias": True, "alias6": True, "self": True, "far": False, "plain": True}
    assert resolver.calls == ["plain"]
    assert asked_config == [sorted([*config, "plain"])]
    assert locality.decide(["localhost", "127.0.0.1"], host_names) == {
        "localhost": True,
        "127.0.0.1": True,
    }
    assert len(asked_config) == 1  # nothing left to ask about: the config is not read


@pytest.mark.parametrize(
    ("text", "address"),
    [("10.0.0.1", True), ("::1", True), ("fe80::1", True), ("node1", False), ("10.0.0", False)],
)
def test_an_address_is_told_from_a_name_without_a_lookup(text: str, address: bool) -> None:
    assert is_address(text) is address


def test_the_survey_takes_an_ssh_alias_of_this_machine_for_local_without_dns(
    tmp_path: Path,
) -> None:
    """A dry run's survey with an SSH config: the alias whose HostName is 127.0.0.1 is this
    machine, the one whose HostName is another machine's address is not, and neither name
    goes to the resolver (only the name the config does not know does)."""
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        "Host twin\n    HostName 127.0.0.1\n\nHost far\n    HostName 192.0.2.10\n    Port 2222\n"
    )
    resolver = CountingResolver({"plain": ["192.0.2.11"]})
    locality = Locality(resolve=resolver, hostname=lambda: "this-box")  # (the real bind test)
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(host_lists=("twin:1,far:1,plain:1",)),
        ssh=SshConfig(config_file=str(ssh_config)),
        dry_run=True,
    )
    environ = {"PATH": "/usr/bin:/bin"}
    plan = plan_job(config, environ)
    survey = survey_hosts(plan, config, environ, str(tmp_path), locality=locality)
    assert survey.site.local == {"twin": True, "far": False, "plain": False}
    assert resolver.calls == ["plain"]
