"""``dtrain check --network``: the naming rule by tables, the listener's token for real, and
the check itself on this machine and on the SSH test hosts with one link shaped by tc."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from launcher import remote
from launcher.base.errors import UsageError
from launcher.cli.main import main
from launcher.core.netcheck import (
    AllreduceOutcome,
    HostSeen,
    NetReport,
    PairFigure,
    better,
    format_rate,
    judge,
    one_each_way,
    pair_from,
    parse_rate,
    ring_rounds,
)
from launcher.remote.netreduce import tensor_bytes
from launcher.run.netcheck import Conversation, run_allreduce
from launcher.transport.lineprogram import LineProgram, start_here
from launcher.view.netview import network_lines
from tests.conftest import run_dtrain, start_dtrain
from tests.testhosts import TestHosts

MB = 1e6
FAST, SLOW = 300 * MB, 6 * MB
THREE = [HostSeen("n1", "10.0.0.1", "eth0"), HostSeen("n2", "10.0.0.2", "eth0"), HostSeen("n3")]
RING = [("n1", "n2"), ("n2", "n3"), ("n3", "n1"), ("n1", "n3"), ("n2", "n1"), ("n3", "n2")]


def figures(
    slow: set[tuple[str, str]] | None = None, slow_host: str | None = None
) -> list[PairFigure]:
    """The six pairs of three hosts' two rounds, FAST except the ones said."""
    return [
        PairFigure(a, b, SLOW if (a, b) in (slow or set()) or slow_host in (a, b) else FAST, 0.1)
        for a, b in RING
    ]


def test_ring_rounds_send_and_receive_once_a_round() -> None:
    assert ring_rounds(2) == [[(0, 1), (1, 0)]]
    assert ring_rounds(3) == [[(0, 1), (1, 2), (2, 0)], [(0, 2), (1, 0), (2, 1)]]
    assert len(ring_rounds(50)) == 3
    for shift in ring_rounds(7):
        assert sorted(s for s, _ in shift) == sorted(r for _, r in shift) == list(range(7))


def test_transfers_made_again_are_one_each_way_and_the_better_counts() -> None:
    shaped = [("n1", "n2"), ("n2", "n3"), ("n2", "n1"), ("n3", "n2")]
    assert one_each_way(shaped) == [[("n1", "n2"), ("n2", "n3")], [("n2", "n1"), ("n3", "n2")]]
    assert one_each_way([("a", "b"), ("c", "d"), ("a", "d")]) == [
        [("a", "b"), ("c", "d")],
        [("a", "d")],
    ]
    slow, fast = PairFigure("a", "b", SLOW, 0.1), PairFigure("a", "b", FAST, 0.3)
    assert better(slow, fast) == PairFigure("a", "b", FAST, 0.1)  # (its round trip kept)
    assert better(fast, slow) == fast
    assert better(slow, PairFigure("a", "b", error="refused")) == slow


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("1Gbit", 125e6),
        ("500mbit/s", 62.5e6),
        ("10Gbps", 1.25e9),
        ("100MB", 100e6),
        ("1.5GB/s", 1.5e9),
        ("800MiB", 800 * 2**20),
        (" 64 kB ", 64e3),
    ],
)
def test_parse_rate_takes_bits_or_bytes(text: str, bytes_per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("100Mb", "'Mb' is not a unit of rate"),  # bits or bytes? refused, not guessed
        ("100", "not a rate"),
        ("fast", "not a rate"),
        ("1Xbit", "'Xbit' is not a unit"),
        ("0MB", "must be more than 0"),
    ],
)
def test_parse_rate_refuses_what_is_not_a_rate(text: str, said: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_rate(text)
    assert said in caught.value.message and "1Gbit" in (caught.value.hint or "")


def test_format_rate() -> None:
    assert [format_rate(v) for v in (512, 6.1e6, 412.34e6, 1.25e9, 12.5e9)] == [
        "512 B/s",
        "6.10 MB/s",
        "412.3 MB/s",
        "1.25 GB/s",
        "12.5 GB/s",
    ]


def test_a_slow_host_is_named_alone_its_pairs_explained_by_it() -> None:
    verdict = judge(THREE, figures(slow_host="n2"))
    assert [(h.name, h.out_bytes_per_s, h.in_bytes_per_s, h.slow) for h in verdict.hosts] == [
        ("n1", FAST, FAST, ()),
        ("n2", SLOW, SLOW, ("in", "out")),
        ("n3", FAST, FAST, ()),
    ]
    assert verdict.median_bytes_per_s == FAST and verdict.bar_bytes_per_s == FAST / 2
    assert verdict.named == (
        "dtrain: n2 is slow: 6.00 MB/s in, 6.00 MB/s out, median 300.0 MB/s "
        "(below half the median)",
    )
    assert verdict.slow_pairs == () and not verdict.ok


def test_a_slow_pair_is_named_as_a_pair() -> None:
    verdict = judge(THREE, figures(slow={("n1", "n3")}))
    assert [h.slow for h in verdict.hosts] == [(), (), ()]
    assert verdict.named == (
        "dtrain: n1 -> n3 is slow: 6.00 MB/s, median 300.0 MB/s (below half the median)",
    )


def test_uniform_figures_name_nothing() -> None:
    verdict = judge(THREE, figures())
    assert verdict.named == () and verdict.failures == () and verdict.ok


def test_fewer_than_three_hosts_are_only_named_against_a_floor() -> None:
    two = [HostSeen("a"), HostSeen("b")]
    pairs = [PairFigure("a", "b", SLOW, 0.2), PairFigure("b", "a", FAST, 0.2)]
    verdict = judge(two, pairs)
    assert verdict.bar_bytes_per_s is None and verdict.named == () and verdict.ok
    assert verdict.bar == "nothing named: a median needs 3 hosts measured"
    floored = judge(two, pairs, floor=parse_rate("1Gbit"))
    assert floored.named == (
        "dtrain: a is slow: 300.0 MB/s in, 6.00 MB/s out, median 153.0 MB/s "
        "(below --min-bandwidth 125.0 MB/s)",
        "dtrain: b is slow: 6.00 MB/s in, 300.0 MB/s out, median 153.0 MB/s "
        "(below --min-bandwidth 125.0 MB/s)",
    )
    assert [h.slow for h in floored.hosts] == [("out",), ("in",)]


def test_a_failed_host_is_a_failure_and_its_pairs_are_not_blamed_on_others() -> None:
    hosts = [*THREE[:2], HostSeen("n3", error="its netcheck ended: Killed")]
    pairs = [
        p if "n3" not in (p.sender, p.receiver) else PairFigure(p.sender, p.receiver, error="x")
        for p in figures()
    ]
    pairs[0] = PairFigure("n1", "n2", error="cannot send to 10.0.0.2:4000: refused")
    verdict = judge(hosts, pairs)
    assert verdict.failures == (
        "dtrain: n3: its netcheck ended: Killed",
        "dtrain: n1 -> n2: cannot send to 10.0.0.2:4000: refused",
    )
    assert verdict.named == () and not verdict.ok


def test_pair_from_reads_what_both_ends_said() -> None:
    trip, sent = {"rtt_ms": 0.08}, {"sent": 1 << 20}
    assert pair_from("a", "b", trip, sent, {"bytes": 3_000_000, "seconds": 0.5}) == PairFigure(
        "a", "b", 6e6, 0.08
    )
    assert pair_from("a", "b", trip, None, None).error == "no answer about its transfer in time"
    refused = pair_from("a", "b", trip, {"error": "refused"}, {"bytes": 0, "seconds": 0.0})
    assert refused.error == "refused" and refused.rtt_ms == 0.08
    assert pair_from("a", "b", trip, sent, {"bytes": 0, "seconds": 0.0}).error == (
        "too little arrived to measure"
    )


def test_the_report_is_a_table_then_the_named_lines() -> None:
    done = AllreduceOutcome(
        "done", None, "gloo", 3, 16 << 20, 0.1, 167.8e6, 223.7e6
    )  # (bytes, s, algbw, busbw)
    lines = network_lines(NetReport(judge(THREE, figures(slow_host="n2")), done, 0.5))
    assert lines == [  # (dtrain's own lines within 80 columns, as its other reports)
        "host  address          out         in          rtt ms  verdict",
        "n1    10.0.0.1 (eth0)  300.0 MB/s  300.0 MB/s  0.100   ok",
        "n2    10.0.0.2 (eth0)  6.00 MB/s   6.00 MB/s   0.100   SLOW in and out",
        "n3    -                300.0 MB/s  300.0 MB/s  0.100   ok",
        "allreduce (gloo, 3 hosts, 16 MiB): busbw 223.7 MB/s (algbw 167.8 MB/s)",
        "dtrain: n2 is slow: 6.00 MB/s in, 6.00 MB/s out, median 300.0 MB/s (below half",
        "    the median)",
        "3 of 3 hosts measured, median 300.0 MB/s; below half the median (150.0 MB/s): n2",
    ]
    floored = network_lines(NetReport(judge(THREE, figures(), parse_rate("10Gbit")), done, 0.5))
    assert floored[-2:] == [  # (the floor's rate said once)
        "3 of 3 hosts measured, median 300.0 MB/s; below --min-bandwidth 1.25 GB/s: n1,",
        "    n2, n3",
    ]
    assert max(len(line) for line in floored) <= 80


def fake_conversation(
    torches: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
    addresses: Sequence[str] = ("10.0.0.1", "10.0.0.2", "10.0.0.3"),
) -> tuple[Conversation, dict[str, list[dict[str, Any]]]]:
    """Three hosts whose programs say ``torches`` (their torch child's start) and ``results``;
    what each is told is kept."""
    names = ["a", "b", "c"]
    conversation = Conversation(names)
    told: dict[str, list[dict[str, Any]]] = {name: [] for name in names}

    def keep(name: str) -> Callable[[bytes], None]:
        return lambda data: told[name].append(json.loads(data))

    for i, name in enumerate(names):
        conversation.programs[name] = LineProgram(name, keep(name), lambda: None)
        ready = {"address": addresses[i], "port": 4000, "interface": "eth0"}
        conversation.states[name].ready = {**ready, "spare_port": 29500}
        conversation.events.put((name, {"allreduce": dict(torches[i])}))
        if results:
            conversation.events.put((name, {"allreduce": dict(results[i])}))
    return conversation, told


def test_the_allreduce_is_nccl_only_where_every_host_has_a_gpu() -> None:
    figures = {"backend": "x", "hosts": 3, "bytes": 1 << 20, "seconds": 0.01}
    figures |= {"algbw_bytes_per_s": 1e8, "busbw_bytes_per_s": 1.333e8}
    one_machine_twice = ("10.0.0.1", "10.0.0.2", "10.0.0.1")
    for cudas, backend, addresses in [
        ((True, True, True), "nccl", ("10.0.0.1", "10.0.0.2", "10.0.0.3")),
        ((True, False, True), "gloo", ("10.0.0.1", "10.0.0.2", "10.0.0.3")),
        ((True, True, True), "gloo", one_machine_twice),  # two NCCL ranks on one cuda:0: no
    ]:
        torches = [{"ready": {"torch": "2.13", "cuda": c}} for c in cudas]
        conversation, told = fake_conversation(torches, [{"result": figures}] * 3, addresses)
        outcome = run_allreduce(conversation, time.monotonic() + 30, 30)
        assert (outcome.state, outcome.busbw_bytes_per_s) == ("done", 1.333e8)
        rendezvous = [m["allreduce"] for name in "abc" for m in told[name] if "allreduce" in m]
        assert [r["backend"] for r in rendezvous] == [backend] * 3
        assert [(r["rank"], r["world"], r["master_addr"]) for r in rendezvous] == [
            (0, 3, "10.0.0.1"),
            (1, 3, "10.0.0.1"),
            (2, 3, "10.0.0.1"),
        ]


def test_the_allreduce_is_skipped_where_torch_is_not_there_and_failed_where_it_fails() -> None:
    missing = {"skipped": "torch is not importable there (ModuleNotFoundError: ...)"}
    ready = {"ready": {"torch": "2.13", "cuda": False}}
    conversation, told = fake_conversation([ready, missing, ready], [])
    outcome = run_allreduce(conversation, time.monotonic() + 30, 30)
    assert outcome == AllreduceOutcome("skipped", f"b: {missing['skipped']}")
    assert not any("allreduce" in m for said in told.values() for m in said)  # none started
    failing: list[dict[str, Any]] = [
        {"result": {}},
        {"error": "RuntimeError: refused"},
        {"result": {}},
    ]
    conversation, _ = fake_conversation([ready] * 3, failing)
    outcome = run_allreduce(conversation, time.monotonic() + 30, 30)
    assert outcome == AllreduceOutcome("failed", "b: RuntimeError: refused")


def test_the_allreduce_rank_says_skipped_without_torch() -> None:
    python = "/usr/bin/python3"
    found = subprocess.run([python, "-c", "import torch"], capture_output=True, check=False)
    if found.returncode == 0 or not Path(python).exists():
        pytest.skip(f"needs a Python without torch ({python})")
    said = subprocess.run(
        [python, "-I", "-c", remote.source("netreduce")],
        input="",
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert json.loads(said.stdout) == {
        "skipped": "torch is not importable there (ModuleNotFoundError: No module named 'torch')"
    }


@pytest.mark.parametrize(
    ("warmup_s", "budget_s", "size"),
    [(0.001, 10, 64 << 20), (0.01, 10, 16 << 20), (0.01, 0.5, 4 << 20), (0.5, 10, 1 << 20)],
)
def test_the_allreduce_tensor_fits_the_time_left(
    warmup_s: float, budget_s: float, size: int
) -> None:
    assert tensor_bytes(warmup_s, budget_s) == size


# The program on a host, for real (here: a local process, as for a local host of the list).


def netcheck_children() -> list[int]:
    """This process's netcheck programs (their command line holds netcheck's source)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                not entry.name.isdigit()
                or b"dtrain-netcheck" not in (entry / "cmdline").read_bytes()
            ):
                continue
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == os.getpid():
            found.append(int(entry.name))
    return found


def closed_without_answer(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


Events = queue.Queue[tuple[str, dict[str, object] | None]]


def start_listener(token: str, lifetime_s: float) -> tuple[LineProgram, Events, str, int]:
    """A netcheck program here, listening on loopback: it, what it says, its address and port."""
    events: Events = queue.Queue()
    first = {
        "token": token,
        "probe_source": remote.source("probe"),
        "route_to": "127.0.0.1",
        "lifetime_s": lifetime_s,
    }
    program = start_here("here", sys.executable, remote.source("netcheck"), first, events)
    try:
        _, said = events.get(timeout=20)
        assert said is not None and "ready" in said, said
        ready: dict[str, object] = said["ready"]  # type: ignore[assignment]
        assert (ready["address"], ready["interface"]) == ("127.0.0.1", "lo")
        return program, events, str(ready["address"]), int(ready["port"])  # type: ignore[call-overload]
    except BaseException:
        program.close()
        raise


def test_the_listener_serves_only_the_token_and_is_gone_after_the_check() -> None:
    token = os.urandom(16).hex()
    program, events, address, port = start_listener(token, 30)
    try:
        (pid,) = netcheck_children()
        for secret_free in ("cmdline", "environ"):  # the token came on stdin only
            assert token.encode() not in Path(f"/proc/{pid}/{secret_free}").read_bytes()
        ping = b'{"ping": true}\n' + b"p"
        with socket.create_connection((address, port), timeout=10) as wrong:
            wrong.sendall(b"0" * len(token) + ping)
            assert closed_without_answer(wrong)
        with socket.create_connection((address, port), timeout=10) as right:
            right.sendall(token.encode() + ping)
            assert right.recv(1) == b"p"  # a round trip answered
        program.send({"end": True})
        said_last = [events.get(timeout=10) for _ in range(3)]
        assert said_last[0] == ("here", {"refused": 1})
        assert said_last[-1] == ("here", None)  # its stdout ended: it has exited
    finally:
        program.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((address, port), timeout=10).close()
    assert netcheck_children() == []


def test_the_listener_bounds_peers_without_the_token() -> None:
    """Anyone on the network may connect: a crowd of silent peers gets at most
    UNAUTHENTICATED_MAX threads, a peer dripping a byte at a time is cut at the handshake's
    deadline (not kept alive by each byte), and the check's own peers are served after."""
    from launcher.remote.netcheck import HANDSHAKE_S, UNAUTHENTICATED_MAX

    token = os.urandom(16).hex()
    program, events, address, port = start_listener(token, 60)
    crowd: list[socket.socket] = []
    try:
        (pid,) = netcheck_children()
        crowd = [socket.create_connection((address, port), timeout=10) for _ in range(150)]
        time.sleep(0.5)  # (accepted: each has a thread, or was closed at once)
        threads = len(os.listdir(f"/proc/{pid}/task"))
        # (the program's own few threads besides: 150 silent peers made 84 before the cap)
        assert threads <= UNAUTHENTICATED_MAX + 8, threads
        closed_at_once = sum(1 for conn in crowd if closed_soon(conn))
        assert closed_at_once >= 150 - UNAUTHENTICATED_MAX - 2
        for conn in crowd:
            conn.close()
        with socket.create_connection((address, port), timeout=10) as drip:
            started = time.monotonic()
            for byte in token.encode()[:-1]:  # (one byte short: never the whole token)
                try:
                    drip.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.25)
                if closed_soon(drip):
                    break
            cut_after = time.monotonic() - started
        assert cut_after < HANDSHAKE_S + 2, cut_after  # 31 bytes: 7.75 s if each byte counted
        time.sleep(HANDSHAKE_S + 0.5)  # (the crowd's slots given back)
        with socket.create_connection((address, port), timeout=10) as right:
            right.sendall(token.encode() + b'{"ping": true}\n' + b"p")
            assert right.recv(1) == b"p"
        program.send({"end": True})
        while (said_last := events.get(timeout=10))[1] is not None:
            if "refused" in (said_last[1] or {}):  # the crowd and the drip
                assert int(said_last[1]["refused"]) >= 150  # type: ignore[call-overload]
    finally:
        for conn in crowd:
            conn.close()
        program.close()
    assert netcheck_children() == []


def closed_soon(conn: socket.socket) -> bool:
    """Whether the peer has closed ``conn`` (looked at without waiting)."""
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        conn.setblocking(True)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--timeout", "5"], "dtrain: error: --timeout is an option of check --network"),
        (["--no-allreduce"], "dtrain: error: --no-allreduce is an option of check --network"),
        (["--min-bandwidth", "1Gbit"], "dtrain: error: --min-bandwidth is an option of check"),
        (["--network", "--min-bandwidth", "100Mb"], "dtrain: error: --min-bandwidth '100Mb'"),
        (
            ["--network", "--timeout", "0"],
            "dtrain: error: --timeout 0: must be at least 0.5 seconds",
        ),
        (["--network", "-H", "localhost"], "dtrain: error: check --network measures between"),
        (["--network", "--network-interface", ""], "dtrain: error: --network-interface '': "),
        (["--network", "--network-interface", "a/b"], "dtrain: error: --network-interface 'a/b'"),
        (["--network", "--network-interface", "ib0,ib1"], "dtrain: error: --network-interface"),
    ],
)
def test_check_network_refuses_bad_input_before_starting_anything(
    capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    hosts = [] if "-H" in args else ["-H", "localhost,127.0.0.1"]
    assert main(["check", *args, *hosts]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(said) and "(hint: " in err, err
    assert len(err.splitlines()) == 1 and out == ""
    assert netcheck_children() == []


def test_ssh_options_stay_the_checks_own(capsys: pytest.CaptureFixture[str]) -> None:
    """--ssh-timeout fills the same config field name as a --timeout could: it is not one."""
    assert main(["check", "--ssh-timeout", "2", "-H", "localhost", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["ok"]


def test_check_network_on_this_machine_and_against_a_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["check", "--network", "-H", "localhost,127.0.0.1", "--no-allreduce"]
    assert main([*args, "--timeout", "1", "--network-interface", "lo", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(h["name"], h["address"], h["interface"]) for h in report["hosts"]] == [
        ("localhost", "127.0.0.1", "lo"),
        ("127.0.0.1", "127.0.0.1", "lo"),
    ]
    assert all(h["out_bytes_per_s"] > 0 and h["rtt_ms"] > 0 for h in report["hosts"])
    assert report["named"] == [] and report["bar_bytes_per_s"] is None  # two hosts: no median
    assert report["allreduce"]["state"] == "skipped"
    assert main([*args, "--timeout", "1", "--min-bandwidth", "100Tbit"]) == 1
    shown = capsys.readouterr().out
    named = [line for line in shown.replace("\n    ", " ").splitlines() if "dtrain: " in line]
    assert [line.split(" is slow: ")[0] for line in named] == [
        "dtrain: localhost",
        "dtrain: 127.0.0.1",
    ]
    assert all(line.endswith("(below --min-bandwidth 12500.0 GB/s)") for line in named)
    assert main([*args, "--network-interface", "nosuch0"]) == 1
    shown = capsys.readouterr().out
    assert "dtrain: localhost: no IPv4 address on interface 'nosuch0' here" in shown
    # a host not reached: named once in its line; the allreduce skipped at once, saying why
    unknown = ["check", "--network", "-H", "localhost,nosuch.invalid", "--timeout", "1"]
    assert main(unknown) == 1
    shown = capsys.readouterr().out
    assert "dtrain: nosuch.invalid: cannot resolve" in shown and "invalid: nosuch" not in shown
    assert "allreduce: skipped (1 host(s) measured: it takes 2)" in shown
    assert max(len(line) for line in shown.splitlines()) <= 80
    assert netcheck_children() == []


# On the SSH test hosts, node2's link slowed by tc tbf (tests/testhosts.py's shaped).


def netchecks_on(hosts: TestHosts) -> dict[str, list[int]]:
    """The netcheck programs and their torch children left on each test host."""
    return hosts.running((b"dtrain-netcheck", b"dtrain-netreduce"))


def wait_for_netchecks(
    hosts: TestHosts, names: list[str], timeout_s: float = 30
) -> dict[str, list[int]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = netchecks_on(hosts)
        if all(found.get(n) for n in names):
            return found
        time.sleep(0.02)
    raise AssertionError(f"no netcheck on {names} within {timeout_s} s: {netchecks_on(hosts)}")


def nothing_left_on(hosts: TestHosts) -> dict[str, list[int]]:
    deadline = time.monotonic() + 5
    while netchecks_on(hosts) and time.monotonic() < deadline:
        time.sleep(0.05)
    return netchecks_on(hosts)


def ssh_args(hosts: TestHosts) -> list[str]:
    return ["--ssh-config", str(hosts.ssh_config), "-H", ",".join(hosts.names[:3])]


def test_network_check_names_exactly_the_shaped_host(
    ssh_hosts: TestHosts, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["check", "--network", *ssh_args(ssh_hosts), "--no-allreduce", "--timeout", "2"]
    code = main([*args, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["named"] == [] and report["failures"] == []
    assert [(h["name"], h["interface"]) for h in report["hosts"]] == [
        ("node1", "eth0"),
        ("node2", "eth0"),
        ("node3", "eth0"),
    ]
    assert report["refused_connections"] == {"node1": 0, "node2": 0, "node3": 0}
    assert netchecks_on(ssh_hosts) == {}  # the check waits until every listener is closed
    with ssh_hosts.shaped("node2", rate="50mbit"):
        code = main(args)
    shown = capsys.readouterr().out
    assert code == 1, shown
    named = [line for line in shown.splitlines() if line.startswith("dtrain: ")]
    assert len(named) == 1 and named[0].startswith("dtrain: node2 is slow: "), shown
    assert "SLOW in and out" in shown
    assert netchecks_on(ssh_hosts) == {}


def test_network_check_leaves_nothing_on_ctrl_c_or_a_lost_host(ssh_hosts: TestHosts) -> None:
    args = ["check", "--network", *ssh_args(ssh_hosts), "--no-allreduce", "--timeout"]
    lost = start_dtrain(*args, "3")  # (its rounds take over a second: time to lose a host)
    found = wait_for_netchecks(ssh_hosts, ["node1", "node2", "node3"])
    os.kill(found["node3"][0], signal.SIGKILL)
    out, _ = lost.communicate(timeout=60)
    assert lost.returncode == 1, out
    assert "dtrain: node3: its netcheck ended" in out
    assert nothing_left_on(ssh_hosts) == {}
    interrupted = start_dtrain(*args, "30")  # (it would take seconds more)
    wait_for_netchecks(ssh_hosts, ["node1", "node2", "node3"])
    interrupted.send_signal(signal.SIGINT)
    shown, _ = interrupted.communicate(timeout=30)
    assert interrupted.returncode == 130, shown
    assert nothing_left_on(ssh_hosts) == {}


@pytest.mark.slow
def test_network_check_runs_an_allreduce_over_the_hosts(ssh_hosts: TestHosts) -> None:
    pytest.importorskip("torch")
    args = ["check", "--network", *ssh_args(ssh_hosts), "--timeout", "60", "--json"]
    result = run_dtrain(*args, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    allreduce = json.loads(result.stdout)["allreduce"]
    assert (allreduce["state"], allreduce["backend"], allreduce["hosts"]) == ("done", "gloo", 3)
    assert allreduce["busbw_bytes_per_s"] == pytest.approx(allreduce["algbw_bytes_per_s"] * 4 / 3)
    assert nothing_left_on(ssh_hosts) == {}
