"""``dtrain top``: a running job's ranks, live (view layer).

Each refresh asks the job's launcher for every rank's figures (it gathers them
where the ranks run); CPU % is the CPU time a rank's processes used between two
refreshes, over the time between them on that host's clock.  A rank's steps per second
come from its progress lines (the launcher measures them, ``core/progress.py``); with
three ranks or more that have one, each is also shown as a share of their median.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from launcher.base.errors import UsageError
from launcher.core.progress import MIN_RANKS, median_of

Sample = Mapping[int, Mapping[str, Any]]  # rank -> its figures, as the launcher gathered them
REFRESH_S = 1.0


def rows_between(
    before: Mapping[int, Mapping[str, Any]], after: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One row per rank of ``after``, with CPU % measured since ``before``."""
    rows = []
    for rank in sorted(after):
        now, then = after[rank], before.get(rank, {})
        cpu = None
        if "cpu_s" in now and "cpu_s" in then and now["time"] > then["time"]:
            cpu = round(100 * (now["cpu_s"] - then["cpu_s"]) / (now["time"] - then["time"]), 1)
        status = now.get("status")
        rows.append(
            {
                "rank": rank,
                "host": now.get("host"),
                "role": now.get("role"),
                "pid": now.get("pid"),
                "state": "running" if status is None else f"exited {status}",
                "cpu_percent": cpu,
                "rss_mib": round(now["rss"] / 2**20, 1) if "rss" in now else None,
                "gpu_mib": now.get("gpu_mib"),
                "gpu_percent": now.get("gpu_percent"),
                "silent_s": now.get("silent_s"),
                "step": now.get("step"),
                "steps_per_s": now.get("steps_per_s"),
                "last_line": now.get("last_line", ""),
                **({"error": now["error"]} if "error" in now else {}),
            }
        )
    return with_rate_ratios(rows)


def with_rate_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's ``rate_ratio``: its steps per second over the median of the ranks that
    have a rate, when there are three or more of them (None otherwise)."""
    rates = [row["steps_per_s"] for row in rows if row["steps_per_s"] is not None]
    median = median_of(rates) if len(rates) >= MIN_RANKS else 0.0
    for row in rows:
        rate = row["steps_per_s"]
        row["rate_ratio"] = round(rate / median, 2) if rate is not None and median > 0 else None
    return rows


def top_table(job_id: str, rows: list[dict[str, Any]]) -> Any:
    """The rows as a rich table (the last line takes what width is left)."""
    from rich import box
    from rich.table import Table

    # light rules and no GPU column where no rank has a GPU: at 80 columns the last line,
    # the column that tells most, keeps room to be read
    table = Table(
        title=f"dtrain top: job {job_id}",
        title_justify="left",
        expand=True,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    gpus = any(row["gpu_mib"] is not None for row in rows)
    rates = any(row.get("steps_per_s") is not None for row in rows)
    for name, justify in (
        ("rank", "right"), ("host", "left"), ("pid", "right"), ("state", "left"),
        ("cpu %", "right"), ("rss", "right"),
        *([("gpu", "right")] if gpus else []),
        *([("steps/s", "right")] if rates else []),
        ("quiet", "right"),
    ):  # fmt: skip
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    table.add_column("last line", overflow="ellipsis", no_wrap=True, ratio=1)
    for row in rows:
        table.add_row(
            str(row["rank"]),
            str(row["host"]),
            str(row["pid"] or "-"),
            row["state"],
            shown(row["cpu_percent"]),
            mib_shown(row["rss_mib"]),
            *([gpu_shown(row["gpu_mib"], row.get("gpu_percent"))] if gpus else []),
            *([rate_shown(row.get("steps_per_s"), row.get("rate_ratio"))] if rates else []),
            shown(row["silent_s"]),
            row.get("error") or row["last_line"],
        )
    return table


def format_top(job_id: str, rows: list[dict[str, Any]]) -> list[str]:
    """The table as plain lines (``--once``)."""
    from rich.console import Console

    console = Console()
    with console.capture() as captured:
        console.print(top_table(job_id, rows))
    return [line.rstrip() for line in captured.get().splitlines()]  # (rich pads each row)


def watch_top(
    job_id: str,
    before: Sample,
    sample: Callable[[], Sample],
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """The table, refreshed every second until the job ends (True: its last figures stay) or
    Ctrl-C (False: how one leaves a live view, as top's q).  ``sample`` raises UsageError
    once the job's launcher is gone."""
    from rich.live import Live

    try:
        with Live(auto_refresh=False) as live:
            while True:
                sleep(REFRESH_S)
                try:
                    after = sample()
                except UsageError:  # the job ended
                    return True
                live.update(top_table(job_id, rows_between(before, after)), refresh=True)
                before = after
    except KeyboardInterrupt:
        return False


def shown(value: object) -> str:
    return "-" if value is None else str(value)


def gpu_shown(mib: float | None, percent: float | None) -> str:
    """A rank's GPU memory and the utilisation of its busiest GPU in one short cell."""
    if mib is None:
        return "-"
    memory = mib_shown(mib)
    return memory if percent is None else f"{memory} {percent:.0f}%"


def rate_shown(rate: float | None, ratio: float | None) -> str:
    """A rank's steps per second, and its share of the median: ``20.0 1.00x``, ``8.02 0.40x``."""
    if rate is None:
        return ""
    shown = f"{rate:.2f}" if rate < 10 else f"{rate:.1f}" if rate < 100 else f"{rate:.0f}"
    return shown if ratio is None else f"{shown} {ratio:.2f}x"


def mib_shown(mib: float | None) -> str:
    """``110.6`` -> ``111M``, ``1200`` -> ``1.2G``."""
    if mib is None:
        return "-"
    return f"{mib:.0f}M" if mib < 1024 else f"{mib / 1024:.1f}G"
