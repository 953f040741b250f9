"""The job's frontend on this process's terminal: the phase line while hosts connect, and
the view a job's options ask for (``make_view``), with its rank filter."""

from __future__ import annotations

import contextlib
import errno
import io
import select
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, BinaryIO, TextIO, cast

from launcher.core.command import LaunchSpec
from launcher.core.config import ViewConfig, parse_ranks
from launcher.core.outcome import OutputSink, PassesTiming, RankState, Stream
from launcher.core.plan import Plan
from launcher.streams.outlets import TimedSink
from launcher.view.lineviews import (
    CollapsingView,
    JsonLinesView,
    QuietView,
    default_tag,
    make_line_view,
)
from launcher.view.liveview import LiveView

GONE_ERRNOS = (errno.EIO, errno.EPIPE)  # a hung-up terminal; a pipe whose reader left
ASCII_COMPATIBLE = frozenset({"utf-8", "utf8", "ascii", "us-ascii", "latin-1", "iso8859-1"})


class TerminalFile:
    """dtrain's stdout or stderr as the views and notices write to it: once it is gone
    (EIO: the terminal was hung up, a closed window or a dropped SSH session; EPIPE: the
    reader of a pipe left), whatever is written is dropped, never raised into the job,
    which goes on unseen and ends as it would (a hang-up's SIGHUP stops it in order)."""

    def __init__(self, file: TextIO) -> None:
        self.file = file
        self.gone = False
        # The bytes under the text, where ASCII is written as it is (an ASCII-compatible
        # encoding): rank output, mostly ASCII, then skips a decode and an encode per batch.
        # Only under a plain text file's own ``write``: a caller's sys.stdout (launch())
        # whose class does more there (a tee into a log) must get every line through it.
        encoding = getattr(file, "encoding", None) or ""
        buffer = getattr(file, "buffer", None)
        compatible = encoding.lower().replace("_", "-") in ASCII_COMPATIBLE
        plain = getattr(type(file), "write", None) is io.TextIOWrapper.write
        self.raw: BinaryIO | None = buffer if compatible and plain else None
        # PYTHONUNBUFFERED (common in containers) leaves no buffer between the text and the
        # file: a write(2) may take part of a block (a non-blocking terminal, a signal), and
        # neither file writes the rest.  Then text and bytes alike go through ``write_all``.
        self.unbuffered = self.raw is not None and isinstance(buffer, io.RawIOBase)

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                if self.unbuffered:
                    self.write_all(text.encode(self.file.encoding, self.file.errors or "strict"))
                else:
                    self.file.write(text)
            except OSError as exc:
                self.drop_when_gone(exc)
        return len(text)

    def write_ascii(self, data: bytes) -> bool:
        """Write ASCII ``data`` as bytes, flushed.  False: this file takes text only."""
        if self.raw is None:
            return False
        if not self.gone:
            try:
                self.file.flush()  # (text written before goes first)
                if self.unbuffered:
                    self.write_all(data)
                else:
                    self.raw.write(data)
                    self.raw.flush()
            except OSError as exc:
                self.drop_when_gone(exc)
        return True

    def write_all(self, data: bytes) -> None:
        """All of ``data`` to the unbuffered file: what a write(2) left is written after it,
        once a full non-blocking terminal takes more."""
        raw = cast(io.RawIOBase, self.raw)
        rest = memoryview(data)
        while rest:
            written = raw.write(rest)
            if written is None:  # non-blocking, and full: nothing was taken
                select.select([], [raw], [])
                continue
            rest = rest[written:]

    def flush(self) -> None:
        if not self.gone:
            try:
                self.file.flush()
            except OSError as exc:
                self.drop_when_gone(exc)

    def drop_when_gone(self, exc: OSError) -> None:
        """(Plain try/except at each write, not a context manager: they run per batch.)"""
        if exc.errno not in GONE_ERRNOS:
            raise exc
        self.gone = True

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding...: the file's
        return getattr(self.file, name)


class TerminalFrontend:
    """The job's ``Frontend`` on this process's terminal: the view its options ask for."""

    def __init__(self, config: ViewConfig, out: TextIO, err: TextIO) -> None:
        self.config = config
        self.out = cast(TextIO, TerminalFile(out))
        self.err = cast(TextIO, TerminalFile(err))

    def show_phases(self) -> None:
        """While dtrain connects to hosts and starts their agents, one line on a terminal says
        which phase it is in and how many hosts are done (it goes when the job's view opens)."""
        from launcher.base.log import PHASES

        if not (self.err.isatty() and not self.config.as_json and not self.config.quiet):
            return
        err = self.err

        def show(text: str) -> None:
            err.write(f"\r\x1b[2Kdtrain: {text}")
            err.flush()

        PHASES.sink = show

    def end_phases(self) -> None:
        from launcher.base.log import PHASES

        if PHASES.sink is not None:
            PHASES.sink = None
            self.err.write("\r\x1b[2K")  # the phase line goes
            self.err.flush()

    def open_view(
        self, job_id: str, plan: Plan, remote: bool = False, attempt: int = 0
    ) -> tuple[OutputSink, AbstractContextManager[Any]]:
        self.end_phases()
        self.announce(job_id, plan.world_size, attempt)
        tag = default_tag((r.role for r in plan.ranks), (h.name for h in plan.hosts), remote)
        view, showing = make_view(
            self.config,
            job_id,
            plan.world_size,
            tag,
            self.out,
            self.err,
            attempt,
            local_rank_of={r.rank: r.local_rank for r in plan.ranks},
        )
        self.live = showing if isinstance(showing, LiveView) else None
        return view, showing

    def announce(self, job_id: str, world_size: int, attempt: int) -> None:
        """The job's first line: its id and size, and the command that shows its logs on a
        line of its own (to paste; both fit 80 columns).  With ``--json``, the first object
        names the job (``job``, ``world_size``, ``attempt``; the lines' objects have
        ``text``)."""
        if self.config.as_json:
            import json
            import time

            first = {"time": round(time.time(), 6), "job": job_id, "world_size": world_size}
            with contextlib.suppress(OSError, ValueError):  # a closed stdout: the view's end
                self.out.write(json.dumps({**first, "attempt": attempt}) + "\n")
                self.out.flush()
            return
        again = f", attempt {attempt}" if attempt else ""  # a host change is no restart
        size = f"{world_size} rank{'s' if world_size != 1 else ''}"
        self.notice(f"dtrain: job {job_id} ({size}{again}); its logs:")
        self.notice(f"    dtrain logs {job_id}")

    def notice(self, text: str) -> None:
        live = getattr(self, "live", None)
        if live is not None and live.live is not None and live.live.is_started:
            live.console.print(text, highlight=False, markup=False, soft_wrap=True)
            return  # above the live area, which stays whole
        self.err.write(text + "\n")
        self.err.flush()

    def say(self, text: str) -> None:
        """A line on stderr (the job's summary), dropped when the terminal is gone."""
        self.err.write(text + "\n")
        self.err.flush()


def make_view(
    config: ViewConfig,
    job_id: str,
    world_size: int,
    default_tag_format: str,
    out: TextIO,
    err: TextIO,
    attempt: int = 0,
    local_rank_of: Mapping[int, int] | None = None,
) -> tuple[OutputSink, AbstractContextManager[Any]]:
    """The view a job's options ask for: quiet, JSON lines, the live view on a colour
    terminal, or plain tagged lines; collapsed lines of the ranks shown; ``--ranks``
    filters it (first: a rank not shown is not waited for).  ``local_rank_of``: each rank's
    local rank (by rank), for ``--local-ranks``.  The context shows it."""
    tag_format = config.tag_format or default_tag_format
    line_view = make_line_view(out, err, tag_format, config.color)
    view: OutputSink
    showing: AbstractContextManager[Any] = contextlib.nullcontext()
    if config.quiet:
        view = QuietView()
    elif config.as_json:
        view = JsonLinesView(out)
    elif line_view.color and not config.plain and out.isatty():
        live = LiveView(out, line_view, job_id, world_size)
        live.attempt = attempt  # whole-job restarts so far count in the status line
        view, showing = live, live
    else:
        view = line_view
    ranks, local = config.rank_set, config.local_ranks
    local_set = set(parse_ranks(local, "--local-ranks")) if local is not None else None
    shown = [
        rank
        for rank in (sorted(local_rank_of) if local_rank_of is not None else range(world_size))
        if (ranks is None or rank in ranks)
        and (local_set is None or local_rank_of is None or local_rank_of.get(rank) in local_set)
    ]
    collapse = config.collapse
    if collapse is None:  # the default: on a terminal, where copies cost the reader
        collapse = out.isatty() and not config.as_json
    if collapse and not config.quiet and len(shown) > 1:
        # A line counts as every rank's once every rank shown said it (it comes out then).
        view = CollapsingView(view, len(shown), config.collapse_window_s)
    if ranks is not None or local_set is not None or config.hide:
        view = RankFilter(view, set(ranks) if ranks is not None else None, local_set, config.hide)
    return view, showing


class LineFilter(PassesTiming):
    """A sink in front of a view that lets only some lines through (``kept``); it passes the
    timing of a collapsing view behind it (``TimedSink``) on."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.timed = view if isinstance(view, TimedSink) else None

    def kept(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> Sequence[bytes]:
        return lines

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        lines = self.kept(spec, stream, lines)
        if lines:
            self.view.show(spec, stream, lines)

    def show_at(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes], at: float) -> None:
        lines = self.kept(spec, stream, lines)
        if not lines:
            return
        if self.timed is not None:
            self.timed.show_at(spec, stream, lines, at)
        else:
            self.view.show(spec, stream, lines)

    def update(self, state: RankState) -> None:
        self.view.update(state)


class RankFilter(LineFilter):
    """``--ranks 0,3``, ``--local-ranks 0``, torchrun's ``--redirects 1|2``: only these ranks
    (or local ranks), and these streams, reach the terminal.  It comes first, before the
    collapsing view it may wrap, whose timing (``TimedSink``) it passes on."""

    def __init__(
        self,
        view: Any,
        ranks: set[int] | None = None,
        local_ranks: set[int] | None = None,
        hide: Iterable[str] = (),
    ) -> None:
        super().__init__(view)
        self.ranks = ranks
        self.local_ranks = local_ranks
        self.hide = set(hide)

    def is_shown(self, spec: LaunchSpec, stream: Stream) -> bool:
        if spec.label:  # mpirun's own lines
            return True
        if stream in self.hide:
            return False
        if self.ranks is not None and spec.rank not in self.ranks:
            return False
        return self.local_ranks is None or spec.local_rank in self.local_ranks

    def kept(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> Sequence[bytes]:
        return lines if self.is_shown(spec, stream) else []
