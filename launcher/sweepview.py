"""``dtrain sweep`` on the terminal (view layer): the live table of trials, plain lines when
not a terminal, a followed trial's tagged lines, and the results table (text or JSON)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from launcher.console import format_table, shell_join
from launcher.jobs import LogLine
from launcher.sweep import (
    Trial,
    TrialRow,
    format_value,
    metric_names,
    rows_as_json,
    sort_rows,
)

REFRESH_S = 0.5  # the live table is redrawn at most this often
LIVE_METRICS = 4  # metrics shown in the live table (the results table has all)


def format_params(params: Sequence[tuple[str, str]]) -> str:
    return " ".join(f"{name}={value}" for name, value in params)


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{seconds:.1f}s"
    return f"{whole // 3600:d}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def format_metrics(metrics: Any, names: Sequence[str]) -> str:
    return " ".join(f"{n}={format_value(metrics[n])}" for n in names if n in metrics)


class SweepView:
    """The sweep's ``SweepFrontend``: a rich live table on a terminal (stderr), otherwise a
    line per change of a trial's state; followed lines and notices go above the table."""

    def __init__(
        self,
        sweep_id: str,
        out: TextIO,
        err: TextIO,
        live: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sweep_id = sweep_id
        self.out = out
        self.err = err
        self.want_live = live
        self.clock = clock
        self.live: Any = None
        self.shown: dict[int, str] = {}  # trial -> the state last told (plain lines)
        self.drawn = 0.0

    def know(self, rows: Sequence[TrialRow]) -> None:
        """Trials whose state is known already (not run this time): not told again."""
        self.shown.update({row.trial: row.state for row in rows})

    @contextlib.contextmanager
    def showing(self) -> Iterator[None]:
        if not self.want_live:
            yield
            return
        from rich.console import Console
        from rich.live import Live

        # No refresh thread: the sweep's loop redraws (and forks trials' launchers alone).
        self.live = Live(
            console=Console(file=self.err),
            auto_refresh=False,
            transient=True,  # the results table follows
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start()
        try:
            yield
        finally:
            self.live.stop()
            self.live = None

    def update(self, rows: Sequence[TrialRow]) -> None:
        if self.live is not None:
            changed = any(self.shown.get(r.trial) != r.state for r in rows)
            self.shown = {r.trial: r.state for r in rows}
            if changed or self.clock() - self.drawn >= REFRESH_S:
                self.drawn = self.clock()
                self.live.update(self.table(rows), refresh=True)
            return
        for row in rows:
            if self.shown.get(row.trial) != row.state:
                self.shown[row.trial] = row.state
                if row.state != "pending":
                    self.notice(describe_change(row))

    def table(self, rows: Sequence[TrialRow]) -> Any:
        from rich.table import Table

        counts: dict[str, int] = {}
        for row in rows:
            counts[row.state] = counts.get(row.state, 0) + 1
        summary = ", ".join(f"{n} {state}" for state, n in counts.items())
        table = Table(title=f"dtrain sweep {self.sweep_id}: {summary}", title_justify="left")
        names = metric_names(rows)[:LIVE_METRICS]
        for column in ("trial", "state", "params", "hosts", "elapsed", *names):
            table.add_column(column, no_wrap=column != "params")
        for row in rows:
            table.add_row(
                str(row.trial),
                row.state + (f" ({row.exit_code})" if row.exit_code else ""),
                format_params(row.params),
                row.hosts or "-",
                format_seconds(row.duration_s),
                *(format_value(row.metrics.get(n)) for n in names),
            )
        return table

    def show_line(self, trial: int, line: LogLine) -> None:
        text = line.text.decode(errors="replace")
        mark = " <stderr>" if line.stream == "stderr" else ""
        self.write(self.out, f"[t{trial}:{line.rank}]{mark} {text}")

    def notice(self, text: str) -> None:
        self.write(self.err, text)

    def write(self, stream: TextIO, text: str) -> None:
        if self.live is not None:  # above the live table, which stays whole
            self.live.console.print(text, highlight=False, markup=False, soft_wrap=True)
            return
        stream.write(text + "\n")
        stream.flush()


def describe_change(row: TrialRow) -> str:
    """``dtrain: trial 2 running on node1:1 (lr=0.1): job ...``, or how it ended."""
    params = format_params(row.params)
    if row.state == "running":
        return f"dtrain: trial {row.trial} running on {row.hosts} ({params}): job {row.job}"
    metrics = format_metrics(row.metrics, list(row.metrics))
    took = format_seconds(row.duration_s)
    return f"dtrain: trial {row.trial} {row.state} (exit code {row.exit_code}, {took}) {params}" + (
        f": {metrics}" if metrics else ""
    )


def format_results(rows: Sequence[TrialRow], objective: str | None, maximize: bool) -> list[str]:
    """The results table: trial, parameters, state, exit code, time, every metric, job;
    best first by ``objective``."""
    ordered = sort_rows(rows, objective, maximize)
    params = [name for name, _ in ordered[0].params] if ordered else []
    names = metric_names(ordered)
    header = ("trial", *params, "state", "exit", "time", *names, "job")
    table = [header]
    for row in ordered:
        values = dict(row.params)
        table.append(
            (
                str(row.trial),
                *(values.get(p, "-") for p in params),
                row.state,
                "-" if row.exit_code is None else str(row.exit_code),
                format_seconds(row.duration_s),
                *(format_value(row.metrics.get(n)) for n in names),
                row.job or "-",
            )
        )
    return format_table(table)


def results_json(
    sweep_id: str, rows: Sequence[TrialRow], objective: str | None, maximize: bool
) -> str:
    ordered = sort_rows(rows, objective, maximize)
    return json.dumps(
        {
            "sweep": sweep_id,
            "objective": objective,
            "direction": "max" if maximize else "min",
            "trials": rows_as_json(ordered),
        }
    )


def format_trials(trials: Sequence[Trial], as_json: bool) -> list[str]:
    """``--dry-run``: every trial's parameters and command."""
    if as_json:
        return [
            json.dumps(
                [
                    {"trial": t.index, "params": dict(t.params), "command": list(t.command)}
                    for t in trials
                ]
            )
        ]
    rows = [("trial", "params", "command")]
    rows += [(str(t.index), format_params(t.params), shell_join(t.command)) for t in trials]
    return format_table(rows)
