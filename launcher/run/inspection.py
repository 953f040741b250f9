"""Looking into a running attempt's ranks: the report of a hang and the control socket.

On ``--hang-timeout`` the supervisor takes every rank's Python stack; ``HangReport``
shows them grouped to the terminal, keeps them in the job directory (``stacks.txt``)
and says in one line where the ranks were, for the failure summary.  ``open_control``
answers ``dtrain stacks`` and ``dtrain top`` from another terminal while the job runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.base.clock import Clock
from launcher.base.log import LOG
from launcher.core.config import rank_set
from launcher.loop.supervisor import Supervisor
from launcher.streams.control import ControlServer
from launcher.streams.jobdir import CONTROL_SOCKET, STACKS, JobDir, open_private
from launcher.streams.progressboard import ProgressBoard

if TYPE_CHECKING:  # loaded when needed: a plain job never takes a stack
    from launcher.core.stacks import StackGroup

STACKS_TIMEOUT_S = 25.0  # dtrain stacks: how long taking every rank's stack may take
STATS_TIMEOUT_S = 5.0  # dtrain top: how long asking every rank's figures may take


@dataclass(frozen=True)
class HangReport:
    """--hang-timeout's report, which the supervisor is given: when no rank printed for
    ``silent_s``, every rank's stack goes to the terminal (``notice``) and to the job
    directory, and where the ranks were is returned, for the failure summary."""

    job: JobDir
    world: int
    silent_s: float
    notice: Callable[[str], None]
    clock: Clock

    def __call__(self, dumps: Mapping[int, tuple[str, Mapping[str, Any]]], /) -> str:
        from launcher.core.stacks import format_stacks, group_stacks

        groups = group_stacks(dumps)
        text = format_stacks(groups, self.world)
        path = self.job.path / STACKS
        try:
            with open_private(path, "ab") as f:
                now = time.localtime(self.clock.wall())
                f.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S', now)}\n".encode())
                f.write(("\n".join(text) + "\n").encode())
        except OSError:
            pass  # a full disk: the terminal still shows them
        self.notice(f"dtrain: no output from any rank for {self.silent_s:g} s; their stacks:")
        for line in text:
            self.notice("    " + line if line else "")
        self.notice(f"dtrain: (also in {path})")
        return ": " + stuck_where(groups) if groups else ""


def stuck_where(groups: Sequence[StackGroup]) -> str:
    """``ranks 0-6 in all_reduce (train.py:9), rank 7 in load (data.py:4)``."""
    parts = []
    for group in groups:
        who = (
            f"rank {group.ranks[0]}" if len(group.ranks) == 1 else f"ranks {rank_set(group.ranks)}"
        )
        if group.frames:
            name, path, line = group.frames[0]
            parts.append(f"{who} in {name} ({Path(path).name}:{line})")
        else:
            parts.append(f"{who}: {group.error or 'no stack'}")
    return ", ".join(parts)


def open_control(
    job: JobDir, supervisor: Supervisor, progress: ProgressBoard | None = None
) -> ControlServer | None:
    """Let ``dtrain stacks`` and ``dtrain top`` ask this job (a job directory where no socket
    fits goes without); ``progress``: each rank's step and rate, for ``dtrain top``."""

    def answer(request: Mapping[str, Any]) -> Mapping[str, Any]:
        if request.get("op") == "stacks":
            dumps = supervisor.dump_stacks(STACKS_TIMEOUT_S)
            return {"stacks": {str(rank): [host, dump] for rank, (host, dump) in dumps.items()}}
        if request.get("op") == "stats":
            rows = supervisor.stats(STATS_TIMEOUT_S)
            if progress is not None:
                add_progress(rows, progress)
            return {"ranks": {str(rank): row for rank, row in rows.items()}}
        return {"error": f"unknown request {request.get('op')!r}"}

    try:
        return ControlServer(job.path / CONTROL_SOCKET, answer)
    except OSError as exc:  # e.g. a path longer than a Unix socket's 107 bytes
        LOG.debug("no control socket in %s: %s", job.path, exc)
        return None


def add_progress(rows: Mapping[int, dict[str, Any]], progress: ProgressBoard) -> None:
    """Each rank's step (as it printed it) and steps per second, where it printed steps."""
    for rank, figures in progress.figures().items():
        if rank in rows:
            step = int(figures.step) if figures.step.is_integer() else figures.step
            rate = None if figures.rate is None else round(figures.rate, 3)
            rows[rank].update(step=step, steps_per_s=rate)
