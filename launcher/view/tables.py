"""Tables as text (``dtrain jobs``, ``dtrain hosts``, left-aligned columns) and what their
cells hold: sizes, ages, command lines quoted for a shell."""

from __future__ import annotations

import json
from collections.abc import Sequence

from launcher.core.hosts import Host
from launcher.streams.joblist import JobSummary


def format_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def human_size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def human_age(seconds: float) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f}{unit}"
    return f"{seconds:.0f}s"


def format_jobs(summaries: Sequence[JobSummary]) -> list[str]:
    """``dtrain jobs``: one row per job."""
    rows = [("job", "state", "exit", "took", "ranks", "hosts", "size", "age", "command")]
    rows += [
        (
            s.id,
            s.state,
            "-" if s.exit_code is None else str(s.exit_code),
            "-" if s.duration_s is None else human_age(s.duration_s),
            s.world_size,
            ",".join(s.hosts) or "-",
            human_size(s.size),
            human_age(s.age_s),
            " ".join(" ".join(s.command).split())[:50],  # one line: python -c "a\nb"
        )
        for s in summaries
    ]
    return format_table(rows)


def format_hosts(hosts: Sequence[Host]) -> list[str]:
    rows = [("host", "user", "slots", "max_slots", "gpus")]
    for h in hosts:
        rows.append(
            (
                h.name,
                h.user or "-",
                str(h.slots),
                str(h.max_slots) if h.max_slots is not None else "-",
                ",".join(h.gpus) if h.gpus is not None else "-",
            )
        )
    lines = format_table(rows)
    lines.append(
        f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}, {sum(h.slots for h in hosts)} slots"
    )
    return lines


def hosts_as_json(hosts: Sequence[Host]) -> str:
    return json.dumps(
        [
            {
                "host": h.name,
                "user": h.user,
                "slots": h.slots,
                "max_slots": h.max_slots,
                "gpus": list(h.gpus) if h.gpus is not None else None,
            }
            for h in hosts
        ],
        indent=2,
    )


def shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shell_quote(a) for a in argv)
