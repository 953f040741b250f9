"""The one transport protocol (DESIGN.md rule 2): local and SSH fill it in."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from launcher.command import LaunchSpec
from launcher.outcome import Stream
from launcher.remote import watchdog

__all__ = ["Process", "RoutedTransport", "StatusFilter", "Stream", "Transport"]


class Process(Protocol):
    """A started rank: its streams, its exit, its process group."""

    spec: LaunchSpec
    pid: int

    def read(self, stream: Stream, size: int) -> bytes:
        """Up to ``size`` bytes of a stream, as soon as any are there; b"" at EOF."""
        ...

    def wait(self) -> int:
        """Block until the rank exits: its code, or -N when signal N killed it."""
        ...

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the rank's whole process group (no-op once it exited)."""
        ...


class StatusFilter:
    """Takes the watchdog's status trailer out of a rank's stderr.

    The watchdog writes ``STATUS_MARK<status>\\n`` the moment the program
    exits, before it ends what the program left behind, so the launcher
    learns which rank failed first without waiting for the cleanup.
    """

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self.raw_read = read
        self.held = b""
        self.status: int | None = None
        self.settled = threading.Event()  # the status arrived, or stderr ended without one

    def read(self, size: int) -> bytes:
        mark = watchdog.STATUS_MARK
        while True:
            chunk = self.raw_read(size)
            if not chunk:
                held, self.held = self.held, b""
                self.settled.set()
                return held
            data = self.held + chunk
            start = data.find(mark)
            if start < 0:
                # Hold back a tail that may be the start of a trailer cut by the chunking.
                keep = next(
                    (
                        n
                        for n in range(min(len(mark) - 1, len(data)), 0, -1)
                        if mark.startswith(data[-n:])
                    ),
                    0,
                )
                self.held = data[len(data) - keep :] if keep else b""
                data = data[: len(data) - keep]
                if data:
                    return data
                continue
            end = data.find(b"\n", start)
            if end < 0:  # the trailer's number is not complete yet
                self.held = data[start:]
                data = data[:start]
            else:
                try:
                    self.status = int(data[start + len(mark) : end])
                    self.settled.set()
                    data = data[:start] + data[end + 1 :]
                except ValueError:
                    pass  # not our trailer after all: pass it on as output
                self.held = b""
            if data:
                return data


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
