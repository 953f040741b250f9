"""The live view on a colour terminal: rank lines scroll above a status line, and ranks'
progress bars are drawn in place (rich Live, loaded only once the region starts)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any, TextIO

from launcher.core.command import LaunchSpec
from launcher.core.outcome import RankState, Stream
from launcher.view.lineviews import LineView, decode_lines
from launcher.view.terminal import terminal_width

MAX_BARS = 8  # more ranks drawing progress bars than this: one summary line instead
LIVE_AFTER_S = 0.3  # the live region starts this far into a job (see LiveView)
SUSPEND_WAIT_S = 1.0  # Ctrl-Z: how long giving the terminal back may take (then dtrain stops)


class LiveView:
    """On a terminal: log lines scroll above a status line (rich Live).

    Progress-bar updates (lines a bare ``\\r`` ended) are drawn in place in the
    live region, one per rank, until a newline closes them.

    The live region starts ``LIVE_AFTER_S`` into the job: a job done before then (a
    test, a short command) shows its tagged lines and one closing status line without
    loading rich (28 ms of its start).  Until then lines are written as rich would print
    them: the same text (tag, ``<stderr>`` mark, colours) to the same file (``out``, stderr
    lines too), so where a line goes never depends on when it came.

    Ctrl-Z (SIGTSTP) gives the terminal back as the shell needs it before dtrain stops
    (the region erased, the cursor shown), and ``fg`` draws the region again, as ``less``
    and ``top`` do.
    """

    def __init__(
        self,
        out: TextIO,
        line_view: LineView,
        job_id: str,
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.console: Any = None  # rich's, once the live region starts
        self.line_view = line_view
        self.job_id = job_id
        self.world_size = world_size
        self.clock = clock
        self.started = clock()
        self.states: dict[int, RankState] = {}
        self.progress: dict[int, tuple[LaunchSpec, Stream, str]] = {}  # rank -> its bar now
        self.live: Any = None
        self.attempt = 0  # --max-restarts: the job's restarts before this attempt
        self.lock = threading.Lock()  # the live region starts between lines, never in one
        self.timer: threading.Timer | None = None
        self.closed = False
        self.broken = False  # ``out`` went away before the live region started
        self.suspended = False  # stopped by Ctrl-Z: no region until dtrain goes on
        self.stop_handler: Any = None  # SIGTSTP's handler before ours...
        self.handling_stop = False  # ...while ours is set

    def __enter__(self) -> LiveView:
        self.timer = threading.Timer(LIVE_AFTER_S, self.start_live)
        self.timer.daemon = True
        self.timer.start()
        if threading.current_thread() is threading.main_thread():  # (signals: only there)
            self.stop_handler = signal.signal(signal.SIGTSTP, self.stop_signalled)
            self.handling_stop = True
        return self

    def stop_signalled(self, signum: int, frame: FrameType | None) -> None:
        """Ctrl-Z, in the main thread: the terminal given back (``suspend``, on a thread of
        its own: this thread may hold what it needs, a notice half printed, and a paused
        terminal takes nothing, so after ``SUSPEND_WAIT_S`` dtrain stops anyway), then
        dtrain stops as it would have, and once continued the region comes back."""
        given_back, continued = threading.Event(), threading.Event()
        threading.Thread(
            target=self.suspend, args=(given_back, continued), name="dtrain-suspend", daemon=True
        ).start()
        given_back.wait(SUSPEND_WAIT_S)
        ours = signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        try:
            os.kill(os.getpid(), signal.SIGTSTP)  # stopped here until SIGCONT (fg, bg)
        finally:
            signal.signal(signal.SIGTSTP, ours)
            continued.set()

    def suspend(self, given_back: threading.Event, continued: threading.Event) -> None:
        """Erase the live region and show the cursor; draw a new region once continued."""
        with self.lock:
            self.suspended = True
            live, self.live = self.live, None
            if live is not None:
                live.stop()  # (transient: the region erased, then the cursor shown)
        given_back.set()
        continued.wait()
        with self.lock:
            self.suspended = False
        self.start_live()  # a new region where the cursor is (below the shell's lines)

    def start_live(self) -> None:
        """The live region, from now on (on the timer's thread)."""
        from rich.console import Console
        from rich.live import Live

        with self.lock:
            if self.closed or self.live is not None or self.suspended:
                return
            self.console = Console(file=self.out)
            self.live = Live(
                get_renderable=self.render,
                console=self.console,
                refresh_per_second=4,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self.live.start()

    def __exit__(self, *exc: object) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.handling_stop and threading.current_thread() is threading.main_thread():
            before = self.stop_handler  # (None: a handler set outside Python, lost)
            signal.signal(signal.SIGTSTP, before if before is not None else signal.SIG_DFL)
            self.handling_stop = False
        with self.lock:
            self.closed = True
        states = list(self.states.values())
        ended = len(states) == self.world_size and all(s.status is not None for s in states)
        # (else the view was given up (Ctrl-C twice) before the ends came: a status line
        # would say "running" above the launcher's own summary of how the job ended)
        if self.live is not None:
            self.live.stop()
            if ended:
                self.console.print(
                    self.status_text(self.console.width),
                    highlight=False,
                    no_wrap=True,
                    overflow="ellipsis",
                )
        elif ended:  # as rich would print it, without loading rich
            width = terminal_width(self.out)
            text = self.status_text(width)
            if len(text) > width:
                text = text[: width - 1] + "…"
            try:
                self.out.write(text + "\n")
                self.out.flush()
            except (BrokenPipeError, ValueError):
                pass

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        self.show_group((spec,), stream, lines)

    def show_group(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: Sequence[bytes],
        at: float | None = None,
    ) -> None:
        """Lines of one rank, or lines several ranks said alike (tagged with their set)."""
        with self.lock:
            self.show_locked(specs, stream, lines, at)

    def show_locked(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: Sequence[bytes],
        at: float | None = None,
    ) -> None:
        finished = [line for line in lines if not line.endswith(b"\r")]
        if len(finished) != len(lines):
            last = next(line for line in reversed(lines) if line.endswith(b"\r"))
            if last != b"\r":  # a bare carriage return before the first state: nothing yet
                bar = decode_lines([last])[0]
                for spec in specs:
                    self.progress[spec.rank] = (spec, stream, bar)
        if not finished:
            return
        ended = [self.progress.pop(spec.rank, None) for spec in specs]
        prefix = self.line_view.tag(specs, stream, at)
        block = "".join(prefix + line + "\n" for line in decode_lines(finished))
        if self.live is None:  # not yet started: the bars wait for it, the lines go out
            self.write_plain(block)
            return
        from rich.text import Text

        if any(bar is not None for bar in ended):
            self.live.refresh()  # the bar goes before the line that ends it is printed
        text = Text.from_ansi(block)
        text.rstrip()
        self.console.print(text, highlight=False, soft_wrap=True)

    def write_plain(self, block: str) -> None:
        """Tagged lines as rich would print them, without rich (before the live region)."""
        if self.broken:
            return
        try:
            self.out.write(block)
            self.out.flush()
        except BrokenPipeError:  # the terminal went away: the job goes on unseen
            self.broken = True

    def update(self, state: RankState) -> None:
        self.states[state.rank] = state

    def status_text(self, width: int | None = None) -> str:
        """The status line; narrower than ``width``, it leaves out what matters least first
        (the job id, said at the start; the hosts; restarts while there were none)."""
        states = list(self.states.values())  # rich's refresh thread calls this too
        running = sum(1 for s in states if s.status is None)
        stopped = sum(1 for s in states if s.status is not None and s.stopped)
        failed = sum(1 for s in states if s.status not in (None, 0) and not s.stopped)
        exited = sum(1 for s in states if s.status is not None)
        hosts: dict[str, list[int]] = {}
        for s in states:
            counts = hosts.setdefault(s.host, [0, 0])
            counts[0] += s.status is None
            counts[1] += 1
        per_host = "  ".join(f"{h} {r}/{t}" for h, (r, t) in hosts.items())
        elapsed = int(self.clock() - self.started)
        restarts = self.attempt + sum(s.restarts for s in states)
        clock = f"{elapsed // 3600:02d}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
        head = f"dtrain {self.job_id}: "
        parts = [
            f"{running}/{self.world_size} running",
            per_host,
            f"exited {exited} (failed {failed}, stopped {stopped})",
            f"restarts {restarts}",
            clock,
        ]
        text = head + "  ".join(parts)
        for step in ("job id", "hosts", "restarts"):
            if width is None or len(text) <= width:
                break
            if step == "job id":
                head = "dtrain: "
            elif step == "hosts":
                parts[1] = ""
            elif restarts == 0:
                parts[3] = ""
            text = head + "  ".join(p for p in parts if p)
        return text

    def render(self) -> Any:
        """The live area: each rank's progress bar (tagged and coloured as its lines), or one
        line summing them up when they would not fit, and the status line, never wider than
        the terminal."""
        from rich.console import Group
        from rich.text import Text

        bars = sorted(self.progress.items())  # rich's refresh thread: a copy
        room = max(1, min(MAX_BARS, self.console.height - 6))
        if len(bars) <= room:
            rows = [
                Text.from_ansi(self.line_view.prefix(spec, stream) + text, no_wrap=True)
                for _, (spec, stream, text) in bars
            ]
        else:
            rows = [Text(progress_summary({r: text for r, (_, _, text) in bars}), no_wrap=True)]
        status = Text(
            self.status_text(self.console.width), style="bold", no_wrap=True, overflow="ellipsis"
        )
        for row in rows:
            row.truncate(self.console.width, overflow="ellipsis")
        status.truncate(self.console.width, overflow="ellipsis")
        return Group(*rows, status)


PERCENT = re.compile(r"(\d+(?:\.\d+)?)%")


def progress_summary(bars: Mapping[int, str]) -> str:
    """Many ranks' progress bars in one line: min, median and max of their percentages, the
    slowest rank named (or, without percentages, how many draw bars)."""
    percents = {}
    for rank, text in bars.items():
        found = PERCENT.findall(text)
        if found:
            percents[rank] = float(found[0])
    if not percents:
        return f"{len(bars)} ranks drawing progress bars"
    ordered = sorted(percents.values())
    slowest = min(percents, key=lambda r: (percents[r], r))
    median = ordered[len(ordered) // 2]
    return (
        f"progress of {len(percents)} ranks: min {ordered[0]:g}% (rank {slowest}), "
        f"median {median:g}%, max {ordered[-1]:g}%"
    )
