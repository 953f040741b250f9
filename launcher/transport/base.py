"""The one transport protocol (DESIGN.md rule 2): local and SSH fill it in."""

from __future__ import annotations

from typing import Literal, Protocol

from launcher.command import LaunchSpec

Stream = Literal["stdout", "stderr"]


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


class Transport(Protocol):
    def start(self, spec: LaunchSpec) -> Process: ...

    def close(self) -> None: ...
