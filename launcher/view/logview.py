"""``dtrain logs``' view: a recorded job's lines, tagged as they were when it ran (or as
JSON), the launcher's own notes between them at their times, optionally collapsed."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TextIO

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.outcome import Stream
from launcher.streams.collapse import Collapsed, Collapser
from launcher.streams.joblogs import LogLine
from launcher.view.lineviews import JsonLinesView, LineView, default_tag


class LogView:
    """``dtrain logs``: a recorded job's lines, tagged as they were when it ran (or JSON)."""

    def __init__(
        self,
        specs: Mapping[int, LaunchSpec],
        out: TextIO,
        as_json: bool = False,
        collapse_window_s: float | None = None,
    ) -> None:
        self.specs = specs
        tag = default_tag((s.role for s in specs.values()), (s.host.name for s in specs.values()))
        self.view: LineView | JsonLinesView = LineView(out, out, tag_format=tag)
        if as_json:
            self.view = JsonLinesView(out)
        self.out = out
        self.notes: list[tuple[float, str]] = []  # (time, line): the launcher's, between lines
        self.noted: set[tuple[float, str]] = set()
        # --collapse: identical lines of several ranks once, grouped by the lines' own times
        self.collapser = (
            Collapser(max(1, len(specs)), collapse_window_s) if collapse_window_s else None
        )
        # Consecutive lines of one rank and stream with one time: a batch as the job's
        # writer recorded it, handed to the collapser whole (as the live view had it), not
        # line by line (a block per line costs the collapser far more).
        self.batch: list[bytes] = []
        self.batch_of: tuple[int, Stream, float] | None = None

    def spec(self, rank: int) -> LaunchSpec:
        return self.specs.get(rank) or LaunchSpec(rank, Host("?"), 0, (), {})

    def add_notes(self, notes: Iterable[tuple[float, str]]) -> None:
        """The launcher's own lines (attempts failed, restarts), shown at their times."""
        fresh = [note for note in notes if note not in self.noted]
        self.noted.update(fresh)
        self.notes = sorted(self.notes + fresh)

    def show_notes(self, until: float) -> None:
        while self.notes and self.notes[0][0] <= until:
            self.out.write(self.notes.pop(0)[1] + "\n")
        self.out.flush()

    def show_line(self, line: LogLine) -> None:
        if self.collapser is not None:
            key = (line.rank, line.stream, line.time)
            if key != self.batch_of:
                self.add_batch()
                if self.notes:
                    self.show_notes(line.time)
                self.batch_of = key
            self.batch.append(line.text)
            return
        if self.notes:
            self.show_notes(line.time)
        if isinstance(self.view, JsonLinesView):
            self.view.clock = lambda: line.time  # the line's own time, not now
        self.view.show(self.spec(line.rank), line.stream, [line.text])

    def add_batch(self) -> None:
        if self.collapser is not None and self.batch_of is not None:
            rank, stream, at = self.batch_of
            self.emit(self.collapser.add_lines(rank, stream, self.batch, at))
            self.batch, self.batch_of = [], None

    def tick(self, now: float) -> None:
        """While following: the groups whose window closed by ``now`` (wall time)."""
        if self.collapser is not None:
            self.add_batch()
            self.emit(self.collapser.due(now))
        self.show_notes(now)

    def finish(self) -> None:
        if self.collapser is not None:
            self.add_batch()
            self.emit(self.collapser.flush())
        self.show_notes(float("inf"))

    def emit(self, items: Sequence[Collapsed]) -> None:
        for item in items:
            specs = [self.spec(rank) for rank in item.ranks]
            self.view.show_group(specs, item.stream, list(item.lines), at=item.time)  # type: ignore[arg-type]
