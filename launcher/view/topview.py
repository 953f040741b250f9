"""``dtrain top``: a running job's ranks, live (view layer).

Each refresh asks the job's launcher for every rank's figures (it gathers them
where the ranks run); CPU % is the CPU time a rank's processes used between two
refreshes, over the time between them on that host's clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from launcher.base.errors import UsageError

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
                "last_line": now.get("last_line", ""),
                **({"error": now["error"]} if "error" in now else {}),
            }
        )
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
    for name, justify in (
        ("rank", "right"), ("host", "left"), ("pid", "right"), ("state", "left"),
        ("cpu %", "right"), ("rss", "right"),
        *([("gpu", "right")] if gpus else []),
        ("quiet s", "right"),
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


def mib_shown(mib: float | None) -> str:
    """``110.6`` -> ``111M``, ``1200`` -> ``1.2G``."""
    if mib is None:
        return "-"
    return f"{mib:.0f}M" if mib < 1024 else f"{mib / 1024:.1f}G"
