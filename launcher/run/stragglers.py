"""Stragglers named while an attempt runs (job layer).

``ProgressWatch`` holds the attempt's ``ProgressBoard`` (tapped into the job directory's
sink, read by ``dtrain top``) and, unless ``--no-stragglers``, a thread that compares the
ranks' rates (on the attempt's clock) every ``check_every`` seconds: a rank that stayed
below ``--straggler-ratio`` times the median rate for ``--straggler-after`` is said once
per episode, as a notice (the terminal, above a live view; a detached job's launcher.log)
and in the job directory's ``stragglers.log``.  One thread per attempt, however many
ranks; it never touches the ranks, so nothing of the kill path waits on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from launcher.base.clock import Clock
from launcher.base.log import LOG
from launcher.core.config import JobConfig, compile_progress_regex
from launcher.core.outcome import OutputSink
from launcher.core.progress import ProgressParser, StragglerRule, describe_stragglers
from launcher.streams.jobdir import STRAGGLERS_LOG, JobDir, open_private
from launcher.streams.progressboard import ProgressBoard

LONGEST_CHECK_S = 1.0  # the rates are compared at least this often...
SHORTEST_CHECK_S = 0.1  # ...and at most this often (a --straggler-after of 0.2 s)
NOTICE_WIDTH = 80  # columns of a notice's lines (a terminal's least)


def check_every(after_s: float) -> float:
    """How often to compare: a quarter of --straggler-after, within bounds."""
    return min(LONGEST_CHECK_S, max(SHORTEST_CHECK_S, after_s / 4))


def within_80_columns(line: str) -> str:
    """The notice as dtrain's own lines are shown (``view/reports.fit``): broken between
    words, the rest indented; a long host name or many ranks of one host make it long."""
    import textwrap  # (only when one is named)

    wrap = textwrap.wrap(
        line, NOTICE_WIDTH, subsequent_indent="    ", break_long_words=False,
        break_on_hyphens=False,
    )  # fmt: skip
    return "\n".join(wrap)


class ProgressWatch:
    """One attempt's progress board and straggler watch."""

    def __init__(
        self, job: JobDir, config: JobConfig, clock: Clock, notice: Callable[[str], None]
    ) -> None:
        pattern = compile_progress_regex(config.progress_regex) if config.progress_regex else None
        self.board = ProgressBoard(ProgressParser(pattern), clock.now)
        self.job = job
        self.clock = clock
        self.notice = notice
        self.rule = StragglerRule(config.straggler_ratio, config.straggler_after_s)
        self.every_s = check_every(config.straggler_after_s)
        self.naming = config.stragglers
        self.done = threading.Event()

    def tap(self, sink: OutputSink) -> OutputSink:
        """The job directory's sink, seen by the board."""
        return self.board.tap(sink)

    def start(self) -> None:
        if self.naming:
            threading.Thread(target=self.watch, name="dtrain-stragglers", daemon=True).start()

    def stop(self) -> None:
        self.done.set()

    def watch(self) -> None:
        # A look now and then on real time; what it sees is on the attempt's clock.  (Its
        # waits are no deadline of the job: a test's clock, whose time jumps at each wait,
        # must not be moved on by this thread's polling.)
        while not self.done.wait(self.every_s):
            try:
                self.check()
            except Exception as exc:  # the job goes on, unwatched
                LOG.debug("the straggler watch stopped: %r", exc)
                return

    def check(self) -> None:
        now = self.clock.now()
        found = self.rule.check(self.board.rates(now), now)
        if not found:
            return
        wall = self.clock.wall()
        for line in describe_stragglers(found, self.board.host_of()):
            self.notice(within_80_columns(line))
            self.record(line, wall)  # (one line each: the log is read by line)

    def record(self, line: str, wall: float) -> None:
        try:
            with open_private(self.job.path / STRAGGLERS_LOG) as f:
                f.write(f"{wall:.6f} {line}\n".encode())
        except OSError:
            pass  # a full disk: the terminal still says it
