"""``dtrain sweep`` on the terminal (view layer): the live table of trials, plain lines when
not a terminal, a followed trial's tagged lines, and the results table (text or JSON)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from launcher.core.sweep import (
    Trial,
    TrialRow,
    format_value,
    metric_names,
    rows_as_json,
    sort_rows,
)
from launcher.streams.joblogs import LogLine
from launcher.view.reports import INDENT, fit
from launcher.view.tables import format_table, shell_join

REFRESH_S = 0.5  # the live table is redrawn at most this often
LIVE_METRICS = 4  # metrics shown in the live table (the results table has all)
TABLE_SIZE = (80, 24)  # the live table's room when it is not shown (a test draws it)
TABLE_LINES = 6  # lines of the live table that are not trials: title, header, border, more


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
        objective: str | None = None,
    ) -> None:
        self.sweep_id = sweep_id
        self.objective = objective  # first of the metrics in the live table
        self.out = out
        self.err = err
        self.want_live = live
        self.clock = clock
        self.live: Any = None
        self.shown: dict[int, str] = {}  # trial -> the state last told (plain lines)
        self.drawn = 0.0
        self.gone = False  # the terminal went away (SIGHUP): the sweep goes on, unseen

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
            with contextlib.suppress(OSError):
                self.live.stop()
            self.live = None

    def update(self, rows: Sequence[TrialRow]) -> None:
        if self.live is not None:
            changed = any(self.shown.get(r.trial) != r.state for r in rows)
            self.shown = {r.trial: r.state for r in rows}
            if (changed or self.clock() - self.drawn >= REFRESH_S) and not self.gone:
                self.drawn = self.clock()
                try:
                    self.live.update(self.table(rows), refresh=True)
                except OSError:
                    self.gone = True
            return
        for row in rows:
            if self.shown.get(row.trial) != row.state:
                self.shown[row.trial] = row.state
                if row.state != "pending":
                    self.notice(describe_change(row))

    def table(self, rows: Sequence[TrialRow]) -> Any:
        """The live table, as large as the terminal: trial, state, a column per parameter and
        the elapsed time always; then the objective, the hosts and other metrics while they
        fit (a column squeezed by rich would show none of its values); when not every trial
        fits, the running ones first, and how many are left out."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        console = self.live.console if self.live is not None else None
        width, height = (console.width, console.height) if console else TABLE_SIZE
        title = f"dtrain sweep {self.sweep_id}: {count_states(rows)}"
        shown = pick_rows(rows, height - TABLE_LINES - len(title) // max(width, 1))
        kept = fit_columns(live_columns(shown, self.objective), width)
        table = Table()
        for header, _, _ in kept:
            table.add_column(header, no_wrap=True)
        for index in range(len(shown)):
            table.add_row(*(cells[index] for _, cells, _ in kept))
        parts: list[Any] = [Text(title), table]
        if len(shown) < len(rows):
            numbers = {row.trial for row in shown}
            left_out = [row for row in rows if row.trial not in numbers]
            parts.append(Text(f"... and {len(left_out)} more: {count_states(left_out)}"))
        return Group(*parts)

    def show_line(self, trial: int, line: LogLine) -> None:
        text = line.text.decode(errors="replace")
        mark = " <stderr>" if line.stream == "stderr" else ""
        self.write(self.out, f"[t{trial}:{line.rank}]{mark} {text}")

    def notice(self, text: str) -> None:
        self.write(self.err, text)

    def write(self, stream: TextIO, text: str) -> None:
        """A line above the live table (which stays whole), or on ``stream``; nothing once
        the terminal is gone (the job directories keep every line)."""
        if self.gone:
            return
        try:
            if self.live is not None:
                self.live.console.print(text, highlight=False, markup=False, soft_wrap=True)
                return
            stream.write(text + "\n")
            stream.flush()
        except OSError:  # EIO after a hang-up, EPIPE: the view ends, not the sweep
            self.gone = True


Column = tuple[str, list[str], int]  # header, a cell per row, priority (0: always shown)


def live_columns(rows: Sequence[TrialRow], objective: str | None) -> list[Column]:
    """The live table's columns in their order on screen, each with its priority: the lower,
    the longer it stays when the terminal is narrow."""
    params = [name for name, _ in rows[0].params] if rows else []
    metrics = metric_names(rows)
    if objective in metrics:
        metrics.remove(objective)
        metrics.insert(0, objective)

    def metric(name: str) -> list[str]:
        return [format_value(row.metrics.get(name)) for row in rows]

    columns: list[Column] = [
        ("trial", [str(row.trial) for row in rows], 0),
        (
            "state",
            [row.state + (f" ({row.exit_code})" if row.exit_code else "") for row in rows],
            0,
        ),
        *((name, [dict(row.params).get(name, "-") for row in rows], 0) for name in params),
        ("hosts", [row.hosts or "-" for row in rows], 2),
        ("elapsed", [format_seconds(row.duration_s) for row in rows], 0),
    ]
    for rank, name in enumerate(metrics[:LIVE_METRICS]):
        columns.append((name, metric(name), 1 if rank == 0 else 3 + rank))
    return columns


def count_states(rows: Sequence[TrialRow]) -> str:
    """``2 running, 3 pending``: how many trials are in each state."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in counts.items())


def pick_rows(rows: Sequence[TrialRow], room: int) -> list[TrialRow]:
    """The trials the live table shows in ``room`` lines: all when they fit, else the running
    ones, then those that failed or stopped, then the latest that succeeded, then the next
    to start; in trial order."""
    if len(rows) <= room:
        return list(rows)
    rank = {"running": 0, "failed": 1, "stopped": 1, "succeeded": 2}

    def preference(row: TrialRow) -> tuple[int, int]:
        order = rank.get(row.state, 3)
        return (order, -row.trial if order == 2 else row.trial)

    chosen = sorted(rows, key=preference)[: max(room, 1)]
    return sorted(chosen, key=lambda row: row.trial)


def fit_columns(columns: Sequence[Column], width: int) -> list[Column]:
    """The columns that fit ``width`` (rich's box: 3 characters per column and 1), leaving
    out the highest priorities first; those of priority 0 stay whatever the width."""
    kept = list(columns)

    def needed(chosen: Sequence[Column]) -> int:
        return 1 + sum(3 + max([len(h), *(len(c) for c in cells)]) for h, cells, _ in chosen)

    while needed(kept) > width:
        worst = max(kept, key=lambda column: column[2])
        if worst[2] == 0:
            break
        kept.remove(worst)
    return kept


def format_sweep_start(sweep_id: str, count: int, total: int, slots: int) -> list[str]:
    """The sweep's first lines: what it runs, and the command that resumes it on a line of
    its own (to paste; both fit 80 columns)."""
    head = f"dtrain: sweep {sweep_id}: {count} of {total} trial(s), {slots} slot(s); to resume:"
    return [*fit(head), f"{INDENT}dtrain sweep --resume {sweep_id}"]


def format_nothing_left(sweep_id: str, rows: Sequence[TrialRow], failed_too: bool) -> list[str]:
    """``--resume`` of a sweep whose every trial finished: nothing runs, and it says so."""
    lines = fit(f"dtrain: sweep {sweep_id}: nothing left to run ({count_states(rows)})")
    if not failed_too and any(row.state == "failed" for row in rows):
        lines.append("dtrain: --retry-failed runs the failed trials again")
    return lines


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


def format_results(
    rows: Sequence[TrialRow],
    objective: str | None,
    maximize: bool,
    width: int | None = None,
    sweep_id: str = "SWEEP",
) -> list[str]:
    """The results table: trial, parameters, state, exit code, time, every metric (the
    objective first), job; best first by ``objective``.  Wider than ``width`` (a terminal's),
    the job column gives way to a line that says how trials' jobs are named (``-tN-K``:
    a rerun; ``--json`` has every job), and then the last metrics, one at a time (the
    objective last of all), to a line naming them."""
    ordered = sort_rows(rows, objective, maximize)
    params = [name for name, _ in ordered[0].params] if ordered else []
    names = metric_names(ordered)
    if objective in names:
        names.remove(objective)
        names.insert(0, objective)
    table = [("trial", *params, "state", "exit", "time", *names, "job")]
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
    lines = format_table(table)
    if width is None or max(len(line) for line in lines) <= width:
        return lines
    kept = len(names)
    lines = format_table([row[:-1] for row in table])
    while kept > 0 and max(len(line) for line in lines) > width:
        kept -= 1
        lines = format_table([row[: len(row) - 1 - len(names) + kept] for row in table])
    notes = [f"(a trial's logs: dtrain logs {sweep_id}-tN, N its number)"]
    if kept < len(names):
        left = ", ".join(names[kept:])
        notes.append(f"(too wide for the terminal: {left}; --json has every metric)")
    return [*lines, *notes]


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
