"""The one transport protocol (DESIGN.md rule 2): local and SSH fill it in.

``Process`` is what every started rank does; ``AttachableProcess`` and
``LateStartingProcess`` are what some also do, checked with ``isinstance``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from launcher.core.command import LaunchSpec
from launcher.core.outcome import Stream

__all__ = [
    "AttachableProcess",
    "LateStartingProcess",
    "Process",
    "RankFeed",
    "RoutedTransport",
    "Transport",
]


class RankFeed(Protocol):
    """Where a transport that reads its ranks' output itself (``attach``) hands it on."""

    def feed(self, stream: Stream, data: bytes, on_room: Callable[[], None] | None = None) -> bool:
        """A chunk of a stream; b"" once at its end.  False: the rank's share of the outlets
        is full: feed no more of it (stop reading it, withhold its credit) until ``on_room``
        is called, from another thread (back-pressure on that rank alone).  Without
        ``on_room`` it waits for room itself."""
        ...

    def cut_off(self, stream: Stream, cause: str) -> None:
        """The stream ended without its end (the host was lost): its output may be cut."""
        ...

    def began(self) -> None:
        """A remote rank's pid is known."""
        ...

    def exited(self, status: int) -> None:
        """The rank's status (as ``Process.wait`` returns it); never waits."""
        ...


class Process(Protocol):
    """A started rank: its streams, its exit, its process group."""

    spec: LaunchSpec

    @property
    def pid(self) -> int:
        """Its process group (the watchdog's pid), once known (a local rank's: it may wait
        for the agent's answer; a remote rank's: once its agent said it, see ``started``)."""
        ...

    @property
    def cause(self) -> str | None:
        """Why it ended, beyond its status, when the transport knows (a lost host)."""
        ...

    def read(self, stream: Stream, size: int) -> bytes:
        """Up to ``size`` bytes of a stream, as soon as any are there; b"" at EOF."""
        ...

    def wait(self) -> int:
        """Block until the rank exits: its code, or -N when signal N killed it."""
        ...

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the rank's whole process group (no-op once it exited)."""
        ...

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        """The program's Python stacks as py-spy dumps them (``{"pid", "threads"}``), or
        ``{"error": why}``; never longer than ``timeout``."""
        ...

    def take_stats(self, timeout: float) -> dict[str, Any]:
        """What the rank's processes use: ``cpu_s`` (CPU time so far), ``time`` (when, on its
        host's monotonic clock), ``rss`` (bytes), ``gpu_mib``, ``processes``; or ``error``."""
        ...

    def gone(self, timeout: float) -> bool:
        """Block until nothing of the rank runs (its watchdog ended what the program left
        and exited), at most ``timeout`` seconds; True when gone."""
        ...


# What a Process may also do, found with isinstance: only the one member each (an isinstance
# check of a protocol reads every member, and a local rank's ``pid`` waits for its agent).


@runtime_checkable
class AttachableProcess(Protocol):
    """A process whose transport reads its output and its exit on its own threads and hands
    them on (local ranks, agents' ranks), instead of a reader per stream and a waiter."""

    def attach(self, feed: RankFeed) -> None:
        """From now on, output and the exit go to ``feed`` (what came before first)."""
        ...


@runtime_checkable
class LateStartingProcess(Protocol):
    """A process whose start is known later than ``Transport.start`` returns (a remote rank:
    its agent says its pid)."""

    started: threading.Event  # set once its pid is known, or once it ended without one


class Transport(Protocol):
    def start(self, spec: LaunchSpec) -> Process: ...

    def close(self) -> None: ...


class RoutedTransport:
    """Local ranks to the local transport, the others to the remote one (same protocol)."""

    def __init__(self, local: Transport, remote: Transport | None, remote_hosts: set[str]) -> None:
        self.local = local
        self.remote = remote
        self.remote_hosts = remote_hosts

    def start(self, spec: LaunchSpec) -> Process:
        if spec.host.name in self.remote_hosts:
            assert self.remote is not None, "remote host without a remote transport"
            return self.remote.start(spec)
        return self.local.start(spec)

    def close(self) -> None:
        self.local.close()
        if self.remote is not None:
            self.remote.close()
