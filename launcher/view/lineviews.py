"""The views that print ranks' lines: tagged (``LineView``), as JSON (``JsonLinesView``),
not at all (``QuietView``), and several ranks' identical lines once (``CollapsingView``).

Rank output is written as plain text with a tag per line; on a terminal the
tag is coloured per rank (rich computes the escape codes once per rank, so
the hot path stays string joins).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any, TextIO

from launcher.core.command import LaunchSpec
from launcher.core.config import rank_set
from launcher.core.outcome import LineBatch, RankState, Stream
from launcher.streams.collapse import Collapsed, Collapser
from launcher.view.terminal import forced_terminal, rich_overrides, terminal_color_system

DEFAULT_TAG = "[{rank}]"
HOST_TAG = "[{rank}@{host}]"  # when the job spans several hosts
ROLE_TAG = "[{role}{task}]"  # parameter-server jobs: [worker1], [ps0]; the chief is [chief]
ROLE_HOST_TAG = "[{role}{task}@{host}]"


def default_tag(roles: Iterable[str], hosts: Iterable[str], remote: bool = False) -> str:
    """The tag of a job's lines: rank (and host when several, or when any is not this
    machine), or role and task in ps jobs."""
    several_hosts = len(set(hosts)) > 1 or remote
    if any(role != "worker" for role in roles):
        return ROLE_HOST_TAG if several_hosts else ROLE_TAG
    return HOST_TAG if several_hosts else DEFAULT_TAG


RANK_COLORS = (
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "bright_cyan",
    "bright_magenta",
    "bright_green",
    "bright_yellow",
    "bright_blue",
)
STANDARD_NAMES = ("black", "red", "green", "yellow", "blue", "magenta", "cyan", "white")
STDERR_MARK = "<stderr>"
GROUP_COLOR = "bright_white"  # the tag of a line several ranks said
BAR_EVERY_S = 1.0  # a piped view shows a rank's progress bar at most this often


class LineView:
    """The ``OutputSink`` for a terminal or a pipe: one tagged line per rank line."""

    def __init__(
        self,
        out: TextIO,
        err: TextIO,
        *,
        tag_format: str = DEFAULT_TAG,
        color: bool = False,
        color_system: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.files: dict[Stream, TextIO] = {"stdout": out, "stderr": err}
        self.tag_format = tag_format
        self.timed = "{time" in tag_format
        self.color = color
        self.color_system = color_system
        self.clock = clock
        # by rank, label and stream: mpirun's own lines (its spec stands on rank 0, labelled)
        # are not tagged as rank 0's, nor rank 0's as mpirun's
        self.prefixes: dict[tuple[int, str | None, Stream], str] = {}
        self.broken: set[TextIO] = set()
        self.announced: dict[int, int] = {}  # rank -> the restart last announced
        self.bar_shown: dict[tuple[int, Stream], float] = {}  # when a progress state was shown

    def update(self, state: RankState) -> None:
        """Rank states are not shown line by line, but a restart is announced (once)."""
        if (
            state.restarts
            and state.status is None
            and self.announced.get(state.rank) != (state.restarts)
        ):
            self.announced[state.rank] = state.restarts
            role = f" ({state.role})" if state.role != "worker" else " (worker)"
            self.files["stderr"].write(
                f"dtrain: restarted rank {state.rank}{role} on {state.host} "
                f"(restart {state.restarts})\n"
            )
            self.files["stderr"].flush()

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        self.write(self.prefix(spec, stream), spec.rank, stream, lines)

    def show_group(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: Sequence[bytes],
        at: float | None = None,
    ) -> None:
        """Lines that several ranks said alike, once, tagged with their rank set; ``at``:
        when they were written (a ``{time}`` tag shows it; None: now)."""
        self.write(self.tag(specs, stream, at), specs[0].rank, stream, lines)

    def tag(self, specs: Sequence[LaunchSpec], stream: Stream, at: float | None = None) -> str:
        """The prefix of lines of these ranks: one rank's own, or the group's."""
        if len(specs) == 1:
            return self.prefix(specs[0], stream, at)
        return self.group_prefix(specs, stream, at)

    def write(self, prefix: str, rank: int, stream: Stream, lines: Sequence[bytes]) -> None:
        file = self.files[stream]
        if file in self.broken:
            return
        marker = ("\n" + prefix).encode()
        if isinstance(lines, LineBatch):  # plain lines (no \r): tagged in one pass over them
            block = b"".join((marker[1:], lines.data.replace(b"\n", marker), b"\n"))
        else:
            block = marker[1:] + marker.join(lines) + b"\n"
            if b"\r" in block:  # progress bars to thin and markers to drop: line by line
                if any(line.endswith(b"\r") for line in lines):
                    lines = self.thin_bars((rank, stream), lines)
                    if not lines:
                        return
                block = "".join(prefix + line + "\n" for line in decode_lines(lines)).encode()
        try:
            write_ascii = getattr(file, "write_ascii", None)  # (a TerminalFile's: flushed)
            if write_ascii is None or not block.isascii() or not write_ascii(block):
                # One decode per batch; a bad UTF-8 sequence cannot swallow the "\n" after it.
                file.write(block.decode("utf-8", "replace"))
                file.flush()
        except BrokenPipeError:
            # The reader went away (`| head`): the job goes on, its output no longer shown.
            self.broken.add(file)

    def thin_bars(self, key: tuple[int, Stream], lines: Sequence[bytes]) -> list[bytes]:
        """Progress-bar states (lines a bare ``\\r`` ends) at most once a second per rank, so a
        piped log is not mostly bar states; the line that ends a bar always shows."""
        kept = []
        for line in lines:
            if line == b"\r":
                continue  # a carriage return before the first state: nothing to show
            if line.endswith(b"\r"):
                now = self.clock()
                if now - self.bar_shown.get(key, float("-inf")) < BAR_EVERY_S:
                    continue
                self.bar_shown[key] = now
            kept.append(line)
        return kept

    def prefix(self, spec: LaunchSpec, stream: Stream, at: float | None = None) -> str:
        key = (spec.rank, spec.label, stream)
        cached = self.prefixes.get(key)
        if cached is not None:
            return cached
        # A chief is one of a kind: "[chief]", not "[chief0]", under the role tags.
        task = (
            ""
            if spec.role == "chief" and self.tag_format in (ROLE_TAG, ROLE_HOST_TAG)
            else spec.task
        )
        tag = (
            f"[{spec.label}]"
            if spec.label
            else self.tag_format.format(
                rank=spec.rank,
                host=spec.host.name,
                local_rank=spec.local_rank,
                node_rank=spec.node_rank,
                role=spec.role,
                task=task,
                time=self.time_of(at),
            )
        )
        mark = STDERR_MARK if stream == "stderr" else ""
        if self.color:
            tag = self.paint(tag, RANK_COLORS[spec.rank % len(RANK_COLORS)])
            mark = self.paint(mark, "red") if mark else ""
        prefix = f"{tag}{mark} "
        if not self.timed:
            self.prefixes[key] = prefix
        return prefix

    def time_of(self, at: float | None) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self.clock() if at is None else at))

    def group_prefix(
        self, specs: Sequence[LaunchSpec], stream: Stream, at: float | None = None
    ) -> str:
        """The tag of a collapsed line: ``{rank}`` is the rank set (``0-3,5``), ``{host}`` the
        hosts, the other fields likewise; one colour for every group."""

        def distinct(values: Iterable[str]) -> str:
            return ",".join(dict.fromkeys(values))

        chief = all(s.role == "chief" for s in specs)
        by_role: dict[str, list[int]] = {}
        for s in specs:
            by_role.setdefault(s.role, []).append(s.task)
        # several roles: each with its own tasks (``worker0-2,ps0``), not the role and task
        # sets side by side (``worker,ps0-2`` reads as ps0, ps1, ps2)
        role_task = ",".join(
            role + ("" if role == "chief" else rank_set(tasks)) for role, tasks in by_role.items()
        )
        tag = self.tag_format.replace("{role}{task}", "{role_task}").format(
            role_task=role_task,
            rank=rank_set(s.rank for s in specs),
            host=distinct(s.host.name for s in specs),
            local_rank=rank_set(s.local_rank for s in specs),
            node_rank=rank_set(s.node_rank for s in specs),
            role=distinct(s.role for s in specs),
            task="" if chief else rank_set(s.task for s in specs),
            time=self.time_of(at),
        )
        mark = STDERR_MARK if stream == "stderr" else ""
        if self.color:
            tag = self.paint(tag, GROUP_COLOR)
            mark = self.paint(mark, "red") if mark else ""
        return f"{tag}{mark} "

    def paint(self, text: str, color: str) -> str:
        code = SGR_COLORS.get(color)
        if code is not None:  # what rich writes for a standard colour, in every colour system
            return f"\x1b[{code}m{text}\x1b[0m"
        from rich.color import ColorSystem
        from rich.style import Style

        systems = {"truecolor": ColorSystem.TRUECOLOR, "256": ColorSystem.EIGHT_BIT}
        system = systems.get(self.color_system or "", ColorSystem.STANDARD)
        return Style(color=color).render(text, color_system=system)


def decode_lines(lines: Sequence[bytes]) -> list[str]:
    """Lines as text (invalid UTF-8 replaced), progress markers dropped; one decode per batch."""
    joined = b"\n".join(lines)
    text = joined.decode("utf-8", "replace").split("\n")
    if len(text) != len(lines):  # a decoded replacement never adds "\n": defensive only
        text = [line.decode("utf-8", "replace") for line in lines]
    if b"\r" in joined:
        text = [line[:-1] if line.endswith("\r") else line for line in text]
    return text


SGR_COLORS = {  # the standard colours' SGR codes (rich renders them so in every system)
    **{name: 30 + i for i, name in enumerate(STANDARD_NAMES)},
    **{f"bright_{name}": 90 + i for i, name in enumerate(STANDARD_NAMES)},
}


def make_line_view(out: TextIO, err: TextIO, tag_format: str, color: bool | None) -> LineView:
    """A LineView coloured when ``out`` is a terminal (as rich decides, honouring NO_COLOR)."""
    if color is False or (color is None and not forced_terminal() and not out.isatty()):
        # Not a terminal, as rich would find: no need to load rich (a local launch's start).
        return LineView(out, err, tag_format=tag_format)
    if color is None and not rich_overrides():
        # A terminal: rich's own reading of TERM, COLORTERM and NO_COLOR, without loading
        # rich (28 ms of a short job's start).
        system = terminal_color_system()
        use = system is not None and os.environ.get("NO_COLOR", "") == ""
        return LineView(out, err, tag_format=tag_format, color=use, color_system=system)
    from rich.console import Console

    probe = Console(file=out, force_terminal=color)
    use_color = probe.is_terminal and probe.color_system is not None and not probe.no_color
    return LineView(
        out, err, tag_format=tag_format, color=use_color, color_system=probe.color_system
    )


class JsonLinesView:
    """``--json``: one JSON object per output line, for machines."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.time) -> None:
        self.out = out
        self.clock = clock

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        now = round(self.clock(), 6)
        base: dict[str, object] = {"time": now, "host": spec.host.name, "rank": spec.rank}
        base["role"] = spec.role
        if spec.label:  # mpirun's own lines (its spec stands on rank 0): nobody's rank
            base = {"time": now, "rank": None, "label": spec.label}
        self.out.write(
            "".join(
                json.dumps({**base, "stream": stream, "text": text}) + "\n"
                for text in decode_lines(lines)
            )
        )
        self.out.flush()

    def show_group(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: Sequence[bytes],
        at: float | None = None,
    ) -> None:
        """Collapsed lines: the first rank's fields and every rank in ``ranks``; ``time`` is
        ``at``, when the first rank wrote them (None: now)."""
        first = specs[0]
        base = {
            "time": round(self.clock() if at is None else at, 6),
            "host": first.host.name,
            "rank": first.rank,
            "ranks": [s.rank for s in specs],
            "role": first.role,
        }
        if len({s.host.name for s in specs}) > 1:
            base["hosts"] = list(dict.fromkeys(s.host.name for s in specs))
        self.out.write(
            "".join(
                json.dumps({**base, "stream": stream, "text": text}) + "\n"
                for text in decode_lines(lines)
            )
        )
        self.out.flush()

    def update(self, state: RankState) -> None:
        """Only output lines are written."""


class QuietView:
    """``--quiet``: nothing but the summary (the job directory still has everything)."""

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        """Output is kept in the job directory only."""

    def update(self, state: RankState) -> None:
        """States are kept in the job directory only."""


class CollapsingView:
    """Identical lines of several ranks shown once, tagged with the rank set (``[0-7] text``):
    ``--collapse``, the default on a terminal.  A line waits the window for the same line from
    other ranks, and one that some ranks said waits up to seconds more for the others (see
    ``Collapser``).  The window runs on when lines were posted to the outlet (``at``), not on
    when its writer thread got to them (seconds later while the terminal lags: copies that
    came together would split into several groups).  The writer ticks this view when held
    lines are due and nothing came meanwhile, and flushes it at the end, so it is only ever
    called from that one thread.  The times shown never go back."""

    def __init__(
        self,
        view: Any,
        world_size: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.view = view
        self.collapser = Collapser(world_size, window_s)
        self.specs: dict[int, LaunchSpec] = {}
        self.clock = clock  # the outlet's clock: what ``at`` and ``tick``'s ``now`` are on
        self.wall = wall  # what a line's time is shown in (a ``{time}`` tag, JSON)
        self.now = -math.inf  # the latest time seen: the collapser's clock never goes back
        self.shown_at = -math.inf  # the wall time of the latest group shown

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        self.show_at(spec, stream, lines, self.clock())

    def show_at(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes], at: float) -> None:
        if spec.label:  # mpirun's own lines are nobody's rank: shown as they come
            self.view.show(spec, stream, lines)
            return
        self.specs[spec.rank] = spec
        self.now = max(self.now, at)
        # (the batch as it came: one whose bytes are joined is matched as bytes)
        self.emit(self.collapser.add_lines(spec.rank, stream, lines, self.now))

    def update(self, state: RankState) -> None:
        self.view.update(state)

    def next_due(self) -> float | None:
        return self.collapser.next_due()

    def tick(self, now: float | None = None) -> None:
        self.now = max(self.now, self.clock() if now is None else now)
        self.emit(self.collapser.due(self.now))

    def flush(self) -> None:
        self.emit(self.collapser.flush())

    def emit(self, items: Sequence[Collapsed]) -> None:
        """Consecutive lines of the same ranks and stream go to the view as one batch, with
        the wall time when the first of them was written (or the latest shown, if later: the
        wall clock may have been set back since)."""
        if not items:
            return
        offset = self.wall() - self.clock()
        start = 0
        for end in range(1, len(items) + 1):
            if end == len(items) or (items[end].ranks, items[end].stream) != (
                items[start].ranks,
                items[start].stream,
            ):
                first = items[start]
                specs = [self.specs[rank] for rank in first.ranks]
                lines = (
                    first.lines
                    if end - start == 1
                    else list(chain.from_iterable(item.lines for item in items[start:end]))
                )
                self.shown_at = max(self.shown_at, first.time + offset)
                self.view.show_group(specs, first.stream, lines, at=self.shown_at)
                start = end
