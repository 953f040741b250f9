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


JOB_COLUMNS = ("job", "state", "exit", "took", "ranks", "hosts", "size", "age", "command")
GIVING_WAY = ("size", "hosts", "ranks", "took")  # on a narrow terminal, one by one
LEAST_COMMAND = 24  # columns of the command kept before another column gives way
COMMAND_CHARS = 50  # of a job's command, at most


def format_jobs(summaries: Sequence[JobSummary], width: int | None = None) -> list[str]:
    """``dtrain jobs``: one row per job.  Wider than ``width`` (a terminal's), a job's hosts
    are its first and how many more, then the size, hosts, ranks and time columns give way,
    one at a time, until the command has room; it is cut to what is left (an id never)."""
    rows: list[tuple[str, ...]] = [JOB_COLUMNS]
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
            " ".join(" ".join(s.command).split())[:COMMAND_CHARS],  # one line: python -c "a\nb"
        )
        for s in summaries
    ]
    lines = format_table(rows)
    if width is None or max(len(line) for line in lines) <= width:
        return lines
    hosts = JOB_COLUMNS.index("hosts")
    rows = [rows[0]] + [
        (*row[:hosts], few_hosts(s.hosts), *row[hosts + 1 :])
        for row, s in zip(rows[1:], summaries, strict=True)
    ]
    kept = list(JOB_COLUMNS)
    for column in GIVING_WAY:
        if table_width(rows, kept[:-1]) + 2 + LEAST_COMMAND <= width:
            break
        kept.remove(column)
    room = max(width - table_width(rows, kept[:-1]) - 2, len("command"))
    picked = [[row[JOB_COLUMNS.index(name)] for name in kept] for row in rows]
    for row in picked[1:]:
        if len(row[-1]) > room:
            row[-1] = row[-1][: room - 1] + "\u2026"
    return format_table(picked)


def few_hosts(hosts: Sequence[str]) -> str:
    """A job's hosts in a narrow table: the first and how many more (``node1+3``)."""
    if not hosts:
        return "-"
    return hosts[0] + (f"+{len(hosts) - 1}" if len(hosts) > 1 else "")


def table_width(rows: Sequence[Sequence[str]], names: Sequence[str]) -> int:
    """The width of these columns of ``rows``, two spaces apart."""
    widths = [max(len(row[JOB_COLUMNS.index(name)]) for row in rows) for name in names]
    return sum(widths) + 2 * (len(widths) - 1)


def format_hosts(hosts: Sequence[Host]) -> list[str]:
    """``dtrain hosts``: a row per host; a host whose slots are counted there (a bare
    hostfile line, ``host:*``) shows ``*``, said under the table."""
    rows = [("host", "user", "slots", "max_slots", "gpus")]
    for h in hosts:
        rows.append(
            (
                h.name,
                h.user or "-",
                "*" if h.slots_on_host else str(h.slots),
                str(h.max_slots) if h.max_slots is not None else "-",
                ",".join(h.gpus) if h.gpus is not None else "-",
            )
        )
    lines = format_table(rows)
    counted = sum(1 for h in hosts if h.slots_on_host)
    slots = sum(h.slots for h in hosts if not h.slots_on_host)
    total = f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}"
    if counted < len(hosts):
        total += f", {slots} slots" + (f" on {len(hosts) - counted}" if counted else "")
    if counted:
        total += "; * counted when a job starts there (its GPUs, else its CPUs)"
    lines.append(total)
    return lines


def hosts_as_json(hosts: Sequence[Host]) -> str:
    return json.dumps(
        [
            {
                "host": h.name,
                "user": h.user,
                "slots": None if h.slots_on_host else h.slots,  # None: counted there
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
