"""The job's view inside the program that called ``launcher.launch``: a notebook cell or a
script's stdout.

It is ``dtrain run``'s terminal frontend with the view ``--plain`` makes (tagged lines, no
live region, no cursor movement: a notebook's output is no terminal), identical lines of
several ranks still collapsed, and the function's result lines (``core/results.py``) left
out: they go to the job directory only.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, TextIO

from launcher.core.command import LaunchSpec
from launcher.core.config import ViewConfig
from launcher.core.outcome import OutputSink, Stream, batch_lines
from launcher.core.plan import Plan
from launcher.core.results import is_result_line, may_hold_results
from launcher.view.frontend import LineFilter, TerminalFrontend


def caller_view_config(config: ViewConfig) -> ViewConfig:
    """``--plain``, collapsed and without colour unless the caller said otherwise."""
    return replace(
        config,
        plain=True,
        collapse=True if config.collapse is None else config.collapse,
        color=False if config.color is None else config.color,
    )


class CallerFrontend(TerminalFrontend):
    """``TerminalFrontend`` on the caller's streams, its view without the result lines."""

    def __init__(self, config: ViewConfig, out: TextIO, err: TextIO) -> None:
        super().__init__(caller_view_config(config), out, err)

    def open_view(
        self, job_id: str, plan: Plan, remote: bool = False, attempt: int = 0
    ) -> tuple[OutputSink, AbstractContextManager[Any]]:
        view, showing = super().open_view(job_id, plan, remote, attempt)
        return ResultsLeftOut(view), showing


class ResultsLeftOut(LineFilter):
    """A view's sink without the function's result lines (the job directory keeps them)."""

    def kept(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> Sequence[bytes]:
        if stream != "stdout" or not may_hold_results(batch_lines(lines)):
            return lines
        return [line for line in lines if not is_result_line(line)]
