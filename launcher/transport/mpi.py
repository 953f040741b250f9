"""The transports' part of ``--mpi``: mpirun, not dtrain's agents, starts the ranks, so an
``--mpi`` job's processes are found by their ``DTRAIN_JOB_ID`` on each host, here or
over an open SSH connection: their Python stacks (``dtrain stacks``), and what mpirun
left of them once it ended.  And mpirun's output: its ``[1,R]<stream>:`` tagged lines
split back by rank (``MpiOutput``), its own report of the first failed rank kept."""

from __future__ import annotations

import dataclasses
import re
from collections import deque
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from launcher.core.command import LaunchSpec
from launcher.core.mpi import parse_first_failure
from launcher.core.outcome import OutputSink, PassesTiming, RankState, Stream, keep_tail, new_tails
from launcher.transport.local import local_py_spy

if TYPE_CHECKING:
    from launcher.transport.ssh import SshConnection


def local_mpi_stacks(job_id: str) -> dict[str, Any]:
    """The Python stacks of an ``--mpi`` job's ranks on this machine (rank as text -> dump)."""
    from launcher.remote import agent

    found: dict[str, Any] = agent.dump_mpi_stacks(job_id, local_py_spy())
    return found


def kill_local_mpi_leftovers(job_id: str) -> list[int]:
    """SIGKILL what mpirun left of an ``--mpi`` job on this machine; the pids killed."""
    from launcher.remote import agent

    killed: list[int] = agent.kill_job_processes(job_id)["killed"]
    return killed


def dump_remote_mpi_stacks(
    connection: SshConnection, job_id: str, timeout_s: float
) -> dict[str, Any]:
    """The Python stacks of an ``--mpi`` job's ranks on a remote host (mpirun started them,
    not an agent)."""
    from launcher.remote import agent
    from launcher.transport.remotecalls import agent_call  # paramiko: remote hosts only

    call = f"dump_mpi_stacks({job_id!r}, {agent.find_py_spy(None)!r})"
    return agent_call(connection, call, timeout_s)


def kill_remote_mpi_leftovers(
    connection: SshConnection, job_id: str, timeout_s: float
) -> dict[str, Any]:
    """SIGKILL what mpirun left of an ``--mpi`` job on a remote host (pids in ``killed``)."""
    from launcher.transport.remotecalls import agent_call  # paramiko: remote hosts only

    return agent_call(connection, f"kill_job_processes({job_id!r})", timeout_s)


MPI_TAGGED = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>: ?")


class MpiOutput(PassesTiming):
    """An output sink in front of the view: splits mpirun's ``[1,R]<stream>:`` lines by rank.

    Lines without a tag are mpirun's own and are shown under the mpirun spec.
    """

    def __init__(
        self, view: OutputSink, specs: Mapping[int, LaunchSpec], launcher: LaunchSpec
    ) -> None:
        self.view = view
        self.specs = specs
        self.launcher = launcher
        self.own_lines: list[str] = []
        self.tails: dict[int, dict[Stream, deque[bytes]]] = {}  # last lines per rank, stream
        # A view that holds lines (the collapsing view): its timing is passed on (outlets'
        # ``TimedSink``), else held lines would come out late, and the last ones never.
        self.timed: Any = view if hasattr(view, "show_at") else None

    def update(self, state: RankState) -> None:
        """mpirun's state stands for every rank it runs (mpirun tells no more)."""
        for rank, spec in self.specs.items():
            self.view.update(
                dataclasses.replace(state, rank=rank, host=spec.host.name, role=spec.role)
            )

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        self.show_at(spec, stream, lines, None)

    def show_at(
        self, spec: LaunchSpec, stream: Stream, lines: list[bytes], at: float | None
    ) -> None:
        """mpirun's lines, posted at ``at`` (None: now), split by rank for the view."""
        batch: list[bytes] = []
        current: tuple[int, Stream] | None = None
        for key, text in self.split(stream, lines):
            if key[0] < 0:
                self.own_lines.append(text.decode("utf-8", "replace"))
            if key[0] >= 0:
                keep_tail(self.tails.setdefault(key[0], new_tails())[key[1]], [text])
            if key != current and batch and current is not None:
                self.forward(current, batch, at)
                batch = []
            current = key
            batch.append(text)
        if batch and current is not None:
            self.forward(current, batch, at)

    def split(
        self, stream: Stream, lines: list[bytes]
    ) -> Iterator[tuple[tuple[int, Stream], bytes]]:
        """Each line's pieces by rank: mpirun writes a rank's partial line (unittest's dots)
        and then another rank's tag on the same line; NUL bytes (from Open MPI's messages)
        never reach a view."""
        for raw in lines:
            line = raw.replace(b"\0", b"")
            tags = [m for m in MPI_TAGGED.finditer(line) if int(m[1]) in self.specs]
            if not tags or tags[0].start() > 0:
                head = line[: tags[0].start()] if tags else line
                yield (-1, stream), head
            for index, tag in enumerate(tags):
                end = tags[index + 1].start() if index + 1 < len(tags) else len(line)
                which: Stream = "stdout" if tag[2] == b"stdout" else "stderr"
                yield (int(tag[1]), which), line[tag.end() : end]

    def forward(self, key: tuple[int, Stream], lines: list[bytes], at: float | None) -> None:
        rank, stream = key
        spec = self.specs[rank] if rank >= 0 else self.launcher
        if at is not None and self.timed is not None:
            self.timed.show_at(spec, stream, lines, at)
        else:
            self.view.show(spec, stream, lines)

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, status) of the first failed rank, from mpirun's own report."""
        return parse_first_failure("\n".join(self.own_lines))
