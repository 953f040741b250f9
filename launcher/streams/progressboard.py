"""Every rank's progress while the job runs, as its lines show it (streams layer).

``ProgressBoard.tap`` puts the board in front of the job directory's sink: that sink's
writer sees every line of every rank once (split per rank under ``--mpi``), on a thread of
its own, so the readers and the supervisor's loop never do this work and the kill path
never waits on it.  Per batch the board reads the clock once and, unless the rank's
sample is due (``RankProgress.wants``), does nothing more; ``dtrain top`` (the control
socket's threads) and the straggler watch read the board under its lock.  A failure in
here never costs the job its logs: the board turns itself off and the lines go on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from launcher.base.log import LOG
from launcher.core.command import LaunchSpec
from launcher.core.outcome import OutputSink, RankState, Stream
from launcher.core.progress import ProgressFigures, ProgressParser, RankProgress


class ProgressBoard:
    """Each rank's ``RankProgress`` (a restarted rank starts a new one), its host, and
    whether it still runs."""

    def __init__(self, parser: ProgressParser, clock: Callable[[], float] = time.monotonic) -> None:
        self.parser = parser
        self.clock = clock  # monotonic seconds: the straggler watch's clock
        self.lock = threading.Lock()
        self.ranks: dict[int, RankProgress] = {}
        self.hosts: dict[int, str] = {}
        self.restarts: dict[int, int] = {}
        self.ended: set[int] = set()
        self.broken = False

    def tap(self, sink: OutputSink) -> OutputSink:
        """``sink``, with every line and state it gets seen by the board first."""
        return ProgressTap(sink, self)

    def observe(self, spec: LaunchSpec, lines: Sequence[bytes]) -> None:
        """A batch of a rank's lines (on the tapped sink's writer thread)."""
        if spec.label or self.broken:  # (mpirun's own lines are no rank's)
            return
        progress = self.ranks.get(spec.rank)
        if progress is None:
            with self.lock:
                progress = self.ranks[spec.rank] = RankProgress()
                self.hosts[spec.rank] = spec.host.name
        now = self.clock()
        if not progress.wants(now):
            return
        step = self.parser.last_step(lines)
        if step is None:
            progress.missed(now)
            return
        with self.lock:
            progress.add(now, step)

    def update(self, state: RankState) -> None:
        """A rank started, restarted or ended."""
        with self.lock:
            self.hosts[state.rank] = state.host
            if state.restarts != self.restarts.get(state.rank, 0):
                self.restarts[state.rank] = state.restarts
                self.ranks[state.rank] = RankProgress()  # a new run counts from its start
            if state.status is None:
                self.ended.discard(state.rank)
            else:
                self.ended.add(state.rank)

    def figures(self, now: float | None = None) -> dict[int, ProgressFigures]:
        """Every rank's step and rate that printed a step (an ended rank has no rate)."""
        now = self.clock() if now is None else now
        with self.lock:
            found = {rank: p.figures(now) for rank, p in self.ranks.items()}
            ended = set(self.ended)
        return {
            rank: ProgressFigures(f.step, None) if rank in ended else f
            for rank, f in found.items()
            if f is not None
        }

    def rates(self, now: float) -> dict[int, float]:
        """The running ranks that have a rate now, and their rates."""
        return {rank: f.rate for rank, f in self.figures(now).items() if f.rate is not None}

    def host_of(self) -> dict[int, str]:
        with self.lock:
            return dict(self.hosts)

    def turn_off(self, error: BaseException) -> None:
        LOG.debug("progress of the ranks no longer watched: %r", error)
        self.broken = True


class ProgressTap:
    """A sink in front of another: the board sees each batch and state, then the sink."""

    def __init__(self, sink: OutputSink, board: ProgressBoard) -> None:
        self.sink = sink
        self.board = board

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        try:
            self.board.observe(spec, lines)
        except Exception as exc:  # a bug here must not cost the job its logs
            self.board.turn_off(exc)
        self.sink.show(spec, stream, lines)

    def update(self, state: RankState) -> None:
        try:
            self.board.update(state)
        except Exception as exc:
            self.board.turn_off(exc)
        self.sink.update(state)
