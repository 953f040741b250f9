"""``dtrain check --network``: the network between the hosts of a job, measured for real.

Every host runs ``remote/netcheck.py`` over dtrain's own connection (a process here for a
local host).  Each opens a listener on an ephemeral port of the interface its ranks would
use (towards the first host, as the survey picks GLOO/NCCL_SOCKET_IFNAME, or
``--network-interface``), serving only connections that present the token handed to it on
its stdin; the hosts then measure each other in rounds of a ring shift (``core/netcheck``),
and finally, where torch is there, run a short allreduce over all of them, one rank each
(``remote/netreduce.py``, started with the measurements so that torch's import overlaps
them; NCCL where every host has a GPU, gloo otherwise).  However it ends (done, Ctrl-C, a
host lost), every program's stdin is closed, which closes its listener and ends it.
"""

from __future__ import annotations

import queue
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from launcher import remote
from launcher.base.errors import LauncherError, UsageError
from launcher.base.log import LOG
from launcher.base.parallel import run_parallel
from launcher.core.config import SshConfig
from launcher.core.hosts import Host
from launcher.core.netcheck import (
    MOST_ROUNDS,
    AllreduceOutcome,
    HostSeen,
    NetReport,
    PairFigure,
    better,
    judge,
    one_each_way,
    pair_from,
    ring_rounds,
)

if TYPE_CHECKING:
    from launcher.transport.lineprogram import Event, LineProgram
    from launcher.transport.ssh import SshConnection

PAIRS_SHARE = 0.4  # of --timeout: the point-to-point rounds (the allreduce has the rest)
LONGEST_BULK_S = 1.0  # a pair's transfer: long enough to leave TCP's slow start behind
SHORTEST_BULK_S = 0.1
PING_WAIT_S = 5.0  # per peer: connecting, the token, the round trips (netcheck's own waits)
ROUND_SLACK_S = 5.0  # past bulk_s: connecting, the token, the round trips (netcheck's own waits)
FEWEST_ALLREDUCE_S = 1.0  # less left than this: the allreduce is skipped, not started
ALLREDUCE_SLACK_S = 5.0  # past its budget: the process group's start and end
END_WAIT_S = 3.0  # how long the programs may take to close their listeners and end


@dataclass(frozen=True)
class NetcheckOptions:
    timeout_s: float
    floor_bytes_per_s: float | None = None  # --min-bandwidth
    interface: str | None = None  # --network-interface
    allreduce: bool = True


@dataclass
class HostState:
    """What one host's program has said so far."""

    ready: dict[str, Any] | None = None
    error: str | None = None
    gone: bool = False
    pings: dict[str, dict[str, Any]] | None = None  # peer: {"rtt_ms"} or {"error"}
    rounds: dict[int, dict[str, Any]] = field(default_factory=dict)
    torch: dict[str, Any] | None = None  # its allreduce rank: {"ready": ...} or {"skipped": ...}
    result: dict[str, Any] | None = None  # its allreduce rank: {"result": ...} or {"error": ...}
    refused: int | None = None


class Conversation:
    """Every host's program and what they said (one queue, read by one thread: this one)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.states = {name: HostState() for name in names}
        self.programs: dict[str, LineProgram] = {}
        self.events: queue.Queue[Event] = queue.Queue()
        self.ending = False

    def take(self, host: str, message: Mapping[str, Any] | None) -> None:
        state = self.states[host]
        if message is None:
            state.gone = True
        elif "ended" in message:
            if not self.ending and state.error is None:
                state.error = f"its netcheck ended: {message['ended']}"
        elif "ready" in message:
            state.ready = dict(message["ready"])
        elif "error" in message:
            state.error = str(message["error"])
        elif "pings" in message:
            state.pings = dict(message["pings"])
        elif "round" in message:
            state.rounds[int(message["round"])] = dict(message)
        elif "allreduce" in message:
            said = dict(message["allreduce"])
            if "ready" in said or "skipped" in said:
                state.torch = said
            else:
                state.result = said
        elif "refused" in message:
            state.refused = int(message["refused"])

    def wait(self, done: Callable[[], bool], deadline: float) -> None:
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                host, message = self.events.get(timeout=left)
            except queue.Empty:
                return
            self.take(host, message)

    def wait_all(
        self, names: Sequence[str], said: Callable[[HostState], object], deadline: float
    ) -> None:
        """Until each of ``names`` has ``said`` something (or failed), or the deadline."""
        self.wait(lambda: all(said(self.states[n]) or self.failed(n) for n in names), deadline)

    def active(self) -> list[str]:
        return [n for n in self.names if self.states[n].ready is not None and not self.failed(n)]

    def failed(self, name: str) -> bool:
        state = self.states[name]
        return state.error is not None or state.gone

    def send(self, name: str, message: Mapping[str, Any]) -> None:
        program = self.programs.get(name)
        if program is None or not program.send(message):
            self.states[name].error = self.states[name].error or "its netcheck is gone"

    def finish(self) -> None:
        """Tell every program to end; wait (a little) until each has closed its listener."""
        self.ending = True
        for program in self.programs.values():
            program.send({"end": True})
            program.close()
        gone = [self.states[name] for name in self.programs]  # (failed ones too: their ends)
        self.wait(lambda: all(state.gone for state in gone), time.monotonic() + END_WAIT_S)

    def close(self) -> None:
        self.ending = True
        for program in self.programs.values():
            program.close()


def check_network(hosts: Sequence[Host], ssh: SshConfig, options: NetcheckOptions) -> NetReport:
    """Measure the network between ``hosts`` (at least two); the report names what is slow."""
    names = list(dict.fromkeys(host.name for host in hosts))
    if len(names) < 2:
        raise UsageError(
            "check --network measures between hosts: give at least two",
            "name them with -H a,b or --hostfile",
        )
    conversation = Conversation(names)
    connections: dict[str, SshConnection | None] = {}
    bulk_s = pick_bulk_s(options.timeout_s, len(names))
    try:
        connections, fanout = connect(hosts, ssh, conversation)
        start_programs(conversation, connections, ssh, options, fanout)
        started = time.monotonic()
        pairs = measure_pairs(conversation, bulk_s, options.floor_bytes_per_s)
        if options.allreduce:
            allreduce = run_allreduce(conversation, started + options.timeout_s, options.timeout_s)
        else:
            allreduce = AllreduceOutcome("skipped", "--no-allreduce")
        conversation.finish()
    finally:
        conversation.close()
        for connection in connections.values():
            if connection is not None:
                connection.close()
    verdict = judge(seen_hosts(conversation), pairs, options.floor_bytes_per_s)
    refused = {n: s.refused for n, s in conversation.states.items() if s.refused is not None}
    return NetReport(verdict, allreduce, bulk_s, refused)


def seen_hosts(conversation: Conversation) -> list[HostSeen]:
    return [
        HostSeen(
            name,
            (state.ready or {}).get("address"),
            (state.ready or {}).get("interface"),
            state.error,
        )
        for name, state in conversation.states.items()
    ]


def pick_bulk_s(timeout_s: float, count: int) -> float:
    """Each pair's transfer: a share of --timeout over the rounds (by time, not bytes: a slow
    link does not make the check slow)."""
    rounds = max(len(ring_rounds(count)), 1)
    return min(LONGEST_BULK_S, max(SHORTEST_BULK_S, timeout_s * PAIRS_SHARE / rounds))


def connect(
    hosts: Sequence[Host], ssh: SshConfig, conversation: Conversation
) -> tuple[dict[str, SshConnection | None], int]:
    """An SSH connection to every remote host (None: a local one), in parallel; a host that
    cannot be reached is a failure of the check, the others are measured."""
    from launcher.run.survey import ssh_settings
    from launcher.transport.local import is_local_address
    from launcher.transport.ssh import connect as connect_host
    from launcher.transport.sshconfig import load_ssh_config

    settings = ssh_settings(ssh)
    config = load_ssh_config(settings)
    by_name = {host.name: host for host in hosts}

    def reach(name: str) -> SshConnection | None:
        if is_local_address(name):
            return None
        return connect_host(by_name[name], settings, config)

    found = run_parallel(conversation.names, reach, settings.fanout)
    connections: dict[str, SshConnection | None] = {}
    for name, result in found.items():
        if isinstance(result, LauncherError):
            conversation.states[name].error = without_name(name, str(result))
        elif isinstance(result, BaseException):
            for connection in connections.values():
                if connection is not None:
                    connection.close()
            raise result
        else:
            connections[name] = result
    return connections, settings.fanout


def without_name(name: str, error: str) -> str:
    """A connection's error without the host's name it begins with (the report's line
    names the host: ``dtrain: node9: cannot resolve...``, not ``node9: node9: ...``)."""
    return error.removeprefix(f"{name}: ")


def first_address(names: Sequence[str], connections: Mapping[str, SshConnection | None]) -> str:
    """The address of the first host reached, as rank 0's host is MASTER_ADDR: every host's
    ranks use their interface towards it."""
    ours = next((c.local_address for c in connections.values() if c is not None), "")
    for name in names:
        if name in connections:
            connection = connections[name]
            return (connection.peer_address if connection else ours) or "127.0.0.1"
    return "127.0.0.1"


def start_programs(
    conversation: Conversation,
    connections: Mapping[str, SshConnection | None],
    ssh: SshConfig,
    options: NetcheckOptions,
    fanout: int,
) -> None:
    """The netcheck on every reached host, told its token and where to listen; waits until
    each says where it listens (or fails)."""
    from launcher.transport.lineprogram import start_here, start_over_ssh

    source = remote.source("netcheck")
    first = {
        "token": secrets.token_hex(16),
        "probe_source": remote.source("probe"),
        "route_to": first_address(conversation.names, connections),
        "interface": options.interface,
        # a last resort, should the launcher's end not reach it
        "lifetime_s": options.timeout_s * 2 + ssh.timeout_s * 2 + 30,
        "allreduce_source": remote.source("netreduce") if options.allreduce else None,
    }

    def start(name: str) -> LineProgram:
        connection = connections[name]
        if connection is None:
            return start_here(name, sys.executable, source, first, conversation.events)
        events = conversation.events
        return start_over_ssh(connection, sys.executable, source, first, events, ssh.timeout_s)

    started = run_parallel(list(connections), start, fanout)
    for name, program in started.items():
        if isinstance(program, LauncherError):
            conversation.states[name].error = without_name(name, str(program))
        elif isinstance(program, BaseException):
            raise program
        else:
            conversation.programs[name] = program
    states = conversation.states
    deadline = time.monotonic() + ssh.timeout_s
    conversation.wait_all(list(conversation.programs), lambda state: state.ready, deadline)
    for name in conversation.programs:
        if states[name].ready is None and states[name].error is None:
            states[name].error = f"its netcheck did not answer within {ssh.timeout_s:g} s"
    LOG.debug("netcheck listening: %s", {n: s.ready for n, s in states.items()})


def measure_pairs(
    conversation: Conversation, bulk_s: float, floor: float | None
) -> list[PairFigure]:
    """Round trips to every peer first, then transfers round by round: each host sends to
    its peer of the round and receives from another.  A transfer below the bar is made once
    more and the better one counts: one transfer slowed by something passing names nothing."""
    active = conversation.active()
    rounds = [[(active[i], active[j]) for i, j in shift] for shift in ring_rounds(len(active))]
    ping_peers(conversation, active, [receiver for shift in rounds for _, receiver in shift])
    pairs: dict[tuple[str, str], PairFigure] = {}
    for k, shift in enumerate(rounds, start=1):
        pairs.update(transfer_round(conversation, k, shift, bulk_s))
    bar = judge(seen_hosts(conversation), list(pairs.values()), floor).bar_bytes_per_s
    suspects = [key for key, pair in pairs.items() if bar and (pair.bytes_per_s or bar) < bar]
    for k, shift in enumerate(one_each_way(suspects)[:MOST_ROUNDS], start=len(rounds) + 1):
        for key, again in transfer_round(conversation, k, shift, bulk_s).items():
            pairs[key] = better(pairs[key], again)
    return list(pairs.values())


def ping_peers(conversation: Conversation, active: Sequence[str], peers: Sequence[str]) -> None:
    """Each host's round trips to its peers of the rounds (``peers``: every round's receivers,
    round after round), one peer after the other, before any transfer."""
    listening = {name: conversation.states[name].ready or {} for name in active}
    for i, name in enumerate(active):
        mine = peers[i :: len(active)]
        where = [[peer, listening[peer]["address"], listening[peer]["port"]] for peer in mine]
        conversation.send(name, {"pings": where})
    deadline = time.monotonic() + max(len(peers) // max(len(active), 1), 1) * PING_WAIT_S
    conversation.wait_all(active, lambda state: state.pings is not None, deadline)


def transfer_round(
    conversation: Conversation, k: int, shift: Sequence[tuple[str, str]], bulk_s: float
) -> dict[tuple[str, str], PairFigure]:
    """Round ``k``: each sender of ``shift`` sends to its receiver, all at once."""
    states = conversation.states
    peers = dict(shift)
    receivers = {receiver for _, receiver in shift}
    involved = list(dict.fromkeys([*peers, *receivers]))
    for name in involved:
        ready = states[peers[name]].ready if name in peers else None
        order = {"round": k, "name": name, "receive": name in receivers, "bulk_s": bulk_s}
        conversation.send(name, {**order, "send_to": ready and [ready["address"], ready["port"]]})
    deadline = time.monotonic() + bulk_s + ROUND_SLACK_S
    conversation.wait_all(involved, partial(answered, k), deadline)
    return {
        (sender, receiver): pair_from(
            sender,
            receiver,
            (states[sender].pings or {}).get(receiver),
            states[sender].rounds.get(k, {}).get("out"),
            states[receiver].rounds.get(k, {}).get("in"),
        )
        for sender, receiver in shift
    }


def answered(round_k: int, state: HostState) -> bool:
    return round_k in state.rounds


def run_allreduce(
    conversation: Conversation, deadline: float, timeout_s: float
) -> AllreduceOutcome:
    """One rank on every measured host, once torch has started on all of them."""
    active = conversation.active()
    states = conversation.states
    if len(active) < 2:  # (nothing to wait for: torch's start would only cost time)
        return AllreduceOutcome("skipped", f"{len(active)} host(s) measured: it takes 2")
    for name in active:  # (where torch's import has not been running beside the measurements)
        conversation.send(name, {"prepare_allreduce": True})
    conversation.wait_all(active, lambda state: state.torch, deadline)
    active = conversation.active()
    for name in active:
        torch = states[name].torch or {}
        if "skipped" in torch:
            return AllreduceOutcome("skipped", f"{name}: {torch['skipped']}")
    late = [n for n in active if states[n].torch is None]
    budget_s = deadline - time.monotonic()
    if len(active) < 2:  # (one failed while torch started)
        return AllreduceOutcome("skipped", f"{len(active)} host(s) left: it takes 2")
    if late or budget_s < FEWEST_ALLREDUCE_S:
        why = f"torch did not start on {late[0]} in time" if late else "no time left"
        return AllreduceOutcome("skipped", f"{why} (raise --timeout, now {timeout_s:g} s)")
    cuda = all(states[n].torch["ready"]["cuda"] for n in active)  # type: ignore[index]
    # one machine named twice (localhost,127.0.0.1) would put two NCCL ranks on its cuda:0
    machines = {(states[n].ready or {}).get("address") for n in active}
    cuda = cuda and len(machines) == len(active)
    master = states[active[0]].ready or {}
    for rank, name in enumerate(active):
        rendezvous = {
            "master_addr": master["address"],
            "master_port": master["spare_port"],
            "rank": rank,
            "world": len(active),
            "backend": "nccl" if cuda else "gloo",
            "interface": (states[name].ready or {})["interface"],
            "budget_s": budget_s,
        }
        conversation.send(name, {"allreduce": rendezvous})
    deadline = time.monotonic() + budget_s + ALLREDUCE_SLACK_S
    conversation.wait_all(active, lambda state: state.result, deadline)
    return allreduce_outcome(active, states)


def allreduce_outcome(active: Sequence[str], states: Mapping[str, HostState]) -> AllreduceOutcome:
    for name in active:
        said = states[name].result
        if said is None:
            return AllreduceOutcome("failed", f"{name}: no result in time")
        if "error" in said:
            return AllreduceOutcome("failed", f"{name}: {said['error']}")
    figures = (states[active[0]].result or {})["result"]
    return AllreduceOutcome(
        "done",
        backend=figures["backend"],
        hosts=int(figures["hosts"]),
        bytes=int(figures["bytes"]),
        seconds=float(figures["seconds"]),
        algbw_bytes_per_s=float(figures["algbw_bytes_per_s"]),
        busbw_bytes_per_s=float(figures["busbw_bytes_per_s"]),
    )
