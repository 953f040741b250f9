"""Everything dtrain shows (the view layer): tagged lines, plans, hosts, the failure report.

Rank output is written as plain text with a tag per line; on a terminal the
tag is coloured per rank (rich computes the escape codes once per rank, so
the hot path stays string joins).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from itertools import chain
from typing import Any, TextIO

from launcher.base.errors import LauncherError
from launcher.core.command import LaunchSpec
from launcher.core.config import ViewConfig, parse_ranks, rank_set
from launcher.core.hosts import Host
from launcher.core.outcome import JobResult, OutputSink, PassesTiming, RankState, Stream
from launcher.core.plan import Plan
from launcher.core.policy import describe_status
from launcher.streams.collapse import Collapsed, Collapser
from launcher.streams.jobdir import JobSummary, LogLine
from launcher.streams.outlets import TimedSink

DEFAULT_TAG = "[{rank}]"
HOST_TAG = "[{rank}@{host}]"  # when the job spans several hosts
ROLE_TAG = "[{role}{task}]"  # parameter-server jobs: [worker1], [ps0]; the chief is [chief]
ROLE_HOST_TAG = "[{role}{task}@{host}]"


def default_tag(roles: Iterable[str], hosts: Iterable[str], remote: bool = False) -> str:
    """The tag of a job's lines: rank (and host when several, or when any is not this
    machine), or role and task in ps jobs."""
    several_hosts = len(set(hosts)) > 1 or remote
    if any(role != "worker" for role in roles):
        return ROLE_HOST_TAG if several_hosts else ROLE_TAG
    return HOST_TAG if several_hosts else DEFAULT_TAG


RANK_COLORS = (
    "cyan",
    "magenta",
    "green",
    "yellow",
    "blue",
    "bright_cyan",
    "bright_magenta",
    "bright_green",
    "bright_yellow",
    "bright_blue",
)
STANDARD_NAMES = ("black", "red", "green", "yellow", "blue", "magenta", "cyan", "white")
STDERR_MARK = "<stderr>"
GROUP_COLOR = "bright_white"  # the tag of a line several ranks said
BAR_EVERY_S = 1.0  # a piped view shows a rank's progress bar at most this often


class LineView:
    """The ``OutputSink`` for a terminal or a pipe: one tagged line per rank line."""

    def __init__(
        self,
        out: TextIO,
        err: TextIO,
        *,
        tag_format: str = DEFAULT_TAG,
        color: bool = False,
        color_system: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.files: dict[Stream, TextIO] = {"stdout": out, "stderr": err}
        self.tag_format = tag_format
        self.timed = "{time" in tag_format
        self.color = color
        self.color_system = color_system
        self.clock = clock
        self.prefixes: dict[tuple[int, Stream], str] = {}
        self.broken: set[TextIO] = set()
        self.announced: dict[int, int] = {}  # rank -> the restart last announced
        self.bar_shown: dict[tuple[int, Stream], float] = {}  # when a progress state was shown

    def update(self, state: RankState) -> None:
        """Rank states are not shown line by line, but a restart is announced (once)."""
        if (
            state.restarts
            and state.status is None
            and self.announced.get(state.rank) != (state.restarts)
        ):
            self.announced[state.rank] = state.restarts
            role = f" ({state.role})" if state.role != "worker" else " (worker)"
            self.files["stderr"].write(
                f"dtrain: restarted rank {state.rank}{role} on {state.host} "
                f"(restart {state.restarts})\n"
            )
            self.files["stderr"].flush()

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        self.write(self.prefix(spec, stream), spec.rank, stream, lines)

    def show_group(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: list[bytes],
        at: float | None = None,
    ) -> None:
        """Lines that several ranks said alike, once, tagged with their rank set; ``at``:
        when they were written (a ``{time}`` tag shows it; None: now)."""
        self.write(self.tag(specs, stream, at), specs[0].rank, stream, lines)

    def tag(self, specs: Sequence[LaunchSpec], stream: Stream, at: float | None = None) -> str:
        """The prefix of lines of these ranks: one rank's own, or the group's."""
        if len(specs) == 1:
            return self.prefix(specs[0], stream, at)
        return self.group_prefix(specs, stream, at)

    def write(self, prefix: str, rank: int, stream: Stream, lines: list[bytes]) -> None:
        file = self.files[stream]
        if file in self.broken:
            return
        marker = ("\n" + prefix).encode()
        block = marker[1:] + marker.join(lines) + b"\n"
        if b"\r" in block:  # progress bars to thin and markers to drop: line by line
            if any(line.endswith(b"\r") for line in lines):
                lines = self.thin_bars((rank, stream), lines)
                if not lines:
                    return
            block = "".join(prefix + line + "\n" for line in decode_lines(lines)).encode()
        try:
            # One decode per batch; a bad UTF-8 sequence cannot swallow the "\n" after it.
            file.write(block.decode("utf-8", "replace"))
            file.flush()
        except BrokenPipeError:
            # The reader went away (`| head`): the job goes on, its output no longer shown.
            self.broken.add(file)

    def thin_bars(self, key: tuple[int, Stream], lines: list[bytes]) -> list[bytes]:
        """Progress-bar states (lines a bare ``\\r`` ends) at most once a second per rank, so a
        piped log is not mostly bar states; the line that ends a bar always shows."""
        kept = []
        for line in lines:
            if line == b"\r":
                continue  # a carriage return before the first state: nothing to show
            if line.endswith(b"\r"):
                now = self.clock()
                if now - self.bar_shown.get(key, float("-inf")) < BAR_EVERY_S:
                    continue
                self.bar_shown[key] = now
            kept.append(line)
        return kept

    def prefix(self, spec: LaunchSpec, stream: Stream, at: float | None = None) -> str:
        key = (spec.rank, stream)
        cached = self.prefixes.get(key)
        if cached is not None:
            return cached
        # A chief is one of a kind: "[chief]", not "[chief0]", under the role tags.
        task = (
            ""
            if spec.role == "chief" and self.tag_format in (ROLE_TAG, ROLE_HOST_TAG)
            else spec.task
        )
        tag = (
            f"[{spec.label}]"
            if spec.label
            else self.tag_format.format(
                rank=spec.rank,
                host=spec.host.name,
                local_rank=spec.local_rank,
                node_rank=spec.node_rank,
                role=spec.role,
                task=task,
                time=self.time_of(at),
            )
        )
        mark = STDERR_MARK if stream == "stderr" else ""
        if self.color:
            tag = self.paint(tag, RANK_COLORS[spec.rank % len(RANK_COLORS)])
            mark = self.paint(mark, "red") if mark else ""
        prefix = f"{tag}{mark} "
        if not self.timed:
            self.prefixes[key] = prefix
        return prefix

    def time_of(self, at: float | None) -> str:
        return time.strftime("%H:%M:%S", time.localtime(self.clock() if at is None else at))

    def group_prefix(
        self, specs: Sequence[LaunchSpec], stream: Stream, at: float | None = None
    ) -> str:
        """The tag of a collapsed line: ``{rank}`` is the rank set (``0-3,5``), ``{host}`` the
        hosts, the other fields likewise; one colour for every group."""

        def distinct(values: Iterable[str]) -> str:
            return ",".join(dict.fromkeys(values))

        chief = all(s.role == "chief" for s in specs)
        by_role: dict[str, list[int]] = {}
        for s in specs:
            by_role.setdefault(s.role, []).append(s.task)
        # several roles: each with its own tasks (``worker0-2,ps0``), not the role and task
        # sets side by side (``worker,ps0-2`` reads as ps0, ps1, ps2)
        role_task = ",".join(
            role + ("" if role == "chief" else rank_set(tasks)) for role, tasks in by_role.items()
        )
        tag = self.tag_format.replace("{role}{task}", "{role_task}").format(
            role_task=role_task,
            rank=rank_set(s.rank for s in specs),
            host=distinct(s.host.name for s in specs),
            local_rank=rank_set(s.local_rank for s in specs),
            node_rank=rank_set(s.node_rank for s in specs),
            role=distinct(s.role for s in specs),
            task="" if chief else rank_set(s.task for s in specs),
            time=self.time_of(at),
        )
        mark = STDERR_MARK if stream == "stderr" else ""
        if self.color:
            tag = self.paint(tag, GROUP_COLOR)
            mark = self.paint(mark, "red") if mark else ""
        return f"{tag}{mark} "

    def paint(self, text: str, color: str) -> str:
        code = SGR_COLORS.get(color)
        if code is not None:  # what rich writes for a standard colour, in every colour system
            return f"\x1b[{code}m{text}\x1b[0m"
        from rich.color import ColorSystem
        from rich.style import Style

        systems = {"truecolor": ColorSystem.TRUECOLOR, "256": ColorSystem.EIGHT_BIT}
        system = systems.get(self.color_system or "", ColorSystem.STANDARD)
        return Style(color=color).render(text, color_system=system)


def decode_lines(lines: list[bytes]) -> list[str]:
    """Lines as text (invalid UTF-8 replaced), progress markers dropped; one decode per batch."""
    joined = b"\n".join(lines)
    text = joined.decode("utf-8", "replace").split("\n")
    if len(text) != len(lines):  # a decoded replacement never adds "\n": defensive only
        text = [line.decode("utf-8", "replace") for line in lines]
    if b"\r" in joined:
        text = [line[:-1] if line.endswith("\r") else line for line in text]
    return text


SGR_COLORS = {  # the standard colours' SGR codes (rich renders them so in every system)
    **{name: 30 + i for i, name in enumerate(STANDARD_NAMES)},
    **{f"bright_{name}": 90 + i for i, name in enumerate(STANDARD_NAMES)},
}


def make_line_view(out: TextIO, err: TextIO, tag_format: str, color: bool | None) -> LineView:
    """A LineView coloured when ``out`` is a terminal (as rich decides, honouring NO_COLOR)."""
    if color is False or (color is None and not forced_terminal() and not out.isatty()):
        # Not a terminal, as rich would find: no need to load rich (a local launch's start).
        return LineView(out, err, tag_format=tag_format)
    if color is None and not rich_overrides():
        # A terminal: rich's own reading of TERM, COLORTERM and NO_COLOR, without loading
        # rich (28 ms of a short job's start).
        system = terminal_color_system()
        use = system is not None and os.environ.get("NO_COLOR", "") == ""
        return LineView(out, err, tag_format=tag_format, color=use, color_system=system)
    from rich.console import Console

    probe = Console(file=out, force_terminal=color)
    use_color = probe.is_terminal and probe.color_system is not None and not probe.no_color
    return LineView(
        out, err, tag_format=tag_format, color=use_color, color_system=probe.color_system
    )


def forced_terminal() -> bool:
    """Variables by which rich takes any file for a terminal (force-color.org)."""
    return os.environ.get("TTY_COMPATIBLE") == "1" or bool(os.environ.get("FORCE_COLOR"))


def rich_overrides() -> bool:
    """Variables by which rich decides other than by the terminal alone: rich reads them."""
    return any(name in os.environ for name in ("TTY_COMPATIBLE", "FORCE_COLOR"))


def terminal_color_system(environ: Mapping[str, str] | None = None) -> str | None:
    """The colour system rich finds for a terminal (``Console._detect_color_system``)."""
    env = os.environ if environ is None else environ
    term = env.get("TERM", "").strip().lower()
    if env.get("TERM", "").lower() in ("dumb", "unknown"):
        return None
    if env.get("COLORTERM", "").strip().lower() in ("truecolor", "24bit"):
        return "truecolor"
    return {"kitty": "256", "256color": "256"}.get(term.rpartition("-")[2], "standard")


def format_error(error: LauncherError) -> str:
    line = f"dtrain: error: {error.message}"
    if error.hint:
        line += f" (hint: {error.hint})"
    return " ".join(line.split("\n"))


def format_failure(result: JobResult) -> list[str]:
    """The summary after a failed or interrupted job (empty when it succeeded)."""
    lines: list[str] = []
    failure = result.failure
    if failure is not None:
        role = f" ({failure.role})" if failure.role != "worker" else ""
        if failure.cause is not None:
            what = f"failed ({failure.cause})"
        elif failure.role == "ps" and failure.status == 0:
            what = "exited (exit code 0) while the job ran: a ps task must not end"
        elif failure.status == -9:  # not dtrain's: the OOM killer, most often
            what = f"failed (killed by SIGKILL: out of memory? see dmesg on {failure.host})"
        else:
            what = f"failed ({describe_status(failure.status)})"
        who = f"rank {failure.rank}{role} on {failure.host}"
        if failure.rank < 0:  # mpirun's own status, without its report of a rank
            who, what = "mpirun", f"{what} and did not name the rank that failed"
        lines.append(
            f"dtrain: {who} {what}; "
            f"{describe_stopped(result, others=True)}; dtrain exits {result.exit_code}"
        )
        if failure.last_lines:
            lines.append(f"dtrain: last {failure.stream} lines of rank {failure.rank}:")
            lines.extend(f"    {line}" for line in failure.last_lines)
        elif failure.rank >= 0:
            lines.append(f"dtrain: rank {failure.rank} wrote nothing (no output)")
    elif result.timeout is not None:
        lines.append(
            f"dtrain: {result.timeout}; "
            f"{describe_stopped(result, others=False)}; dtrain exits {result.exit_code}"
        )
    elif result.interrupt is not None:
        import signal

        lines.append(
            f"dtrain: interrupted by {signal.Signals(result.interrupt).name}; "
            f"{describe_stopped(result, others=False)}; dtrain exits {result.exit_code}"
        )
    return lines


def describe_stopped(result: JobResult, others: bool) -> str:
    """How many ranks dtrain had to stop (the others had ended by themselves), and how."""
    count = result.stopped
    if count == 0:
        return "no other rank was running" if others else "no rank was running"
    plural = "s" if count != 1 else ""
    if others and count == result.world_size - 1:
        text = f"stopped the other {count} rank{plural}"
    elif count == result.world_size:
        text = f"stopped {count} rank{plural}"
    else:
        text = f"stopped the {count} rank{plural} still running"
    if result.sigkilled:
        cause = f" {result.kill_cause}" if result.kill_cause else ""
        text += f" ({result.sigkilled} with SIGKILL{cause})"
    return text


def format_plan(entries: Sequence[Mapping[str, object]]) -> list[str]:
    """``--dry-run`` as text: one block per rank with its command and environment."""
    lines: list[str] = []
    for entry in entries:
        gpus = entry["gpus"]
        gpu_text = (",".join(gpus) or "none") if isinstance(gpus, list) else "-"
        lines.append(
            f"rank {entry['rank']}  host {entry['host']}  local_rank {entry['local_rank']}  "
            f"node_rank {entry['node_rank']}  gpus {gpu_text}"
        )
        argv = entry["argv"]
        assert isinstance(argv, list)
        shown = " ".join(shell_quote(a) for a in argv) or "(not started here: your coordinator)"
        lines.append("  argv: " + shown)
        env = entry["env"]
        assert isinstance(env, dict)
        lines.extend(f"  env:  {k}={shell_quote(v)}" for k, v in env.items())
    return lines


def format_plan_json(entries: Sequence[Mapping[str, object]]) -> str:
    return json.dumps(list(entries), indent=2)


def format_dry_run(
    entries: Sequence[Mapping[str, object]],
    mpirun: Sequence[str] | None,
    hostfile: str | None,
    mpirun_env: Mapping[str, str],
    as_json: bool,
) -> str:
    """``--dry-run``: the ranks, or under ``--mpi`` mpirun's command line, the variables it
    forwards (``-x NAME``: the values travel in its environment) and its hostfile."""
    if mpirun is not None:
        if as_json:
            plan = {"mpirun": list(mpirun), "env": dict(mpirun_env), "hostfile": hostfile}
            return json.dumps(plan, indent=2)
        env = "".join(f"# env: {k}={shell_quote(v)}\n" for k, v in mpirun_env.items())
        return shell_join(mpirun) + "\n" + env + "# hostfile:\n" + (hostfile or "").rstrip()
    return format_plan_json(entries) if as_json else "\n".join(format_plan(entries))


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
            " ".join(s.command)[:50],
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


WIDE_CHECK = 130  # narrower terminals get the check report host by host


def print_check_report(rows: Sequence[Mapping[str, Any]], out: TextIO) -> None:
    """``dtrain check`` as a rich table, one row per host (a block per host on a terminal
    narrower than the table); failures in red with their cause."""
    from rich.console import Console

    console = Console(file=out)
    if console.width < WIDE_CHECK:
        for row in rows:
            console.print(*check_block(row), sep="\n", highlight=False)
    else:
        console.print(check_table(rows))
    failed = sum(1 for row in rows if not row["ok"])
    console.print(f"{len(rows) - failed} of {len(rows)} hosts ok", highlight=False)


def check_block(row: Mapping[str, Any]) -> list[str]:
    """One host of ``dtrain check``, in lines that fit 80 columns."""
    if not row["ok"]:
        return [f"[bold]{row['host']}[/bold]  [red]FAILED[/red]  {row['error']}"]
    versions = row["versions"]
    rtt = "-" if row["rtt_ms"] is None else f"{row['rtt_ms']:.2f}"
    frameworks = "  ".join(
        f"{name} {versions.get(name) or '-'}"
        for name in ("dtrain", "torch", "tensorflow", "mpi4py")
    )
    return [
        f"[bold]{row['host']}[/bold]  [green]ok[/green]  rtt {rtt} ms  "
        f"clock {row['clock_offset_ms']:+.1f} ms  free port {row['free_port']}",
        f"  python {row['python_version']} {row['python']}",
        f"  {frameworks}",
        f"  gpus {row['gpus']} ({row['gpus_busy']} busy)",
    ]


def check_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(show_lines=False)
    for column in (
        "host",
        "state",
        "rtt ms",
        "python",
        "dtrain",
        "torch",
        "tensorflow",
        "mpi4py",
        "gpus (busy)",
        "free port",
        "clock ms",
    ):
        table.add_column(column)
    for row in rows:
        if not row["ok"]:
            table.add_row(row["host"], "[red]FAILED[/red]", row["error"], *[""] * 8)
            continue
        versions = row["versions"]
        table.add_row(
            row["host"],
            "[green]ok[/green]",
            "-" if row["rtt_ms"] is None else f"{row['rtt_ms']:.2f}",
            f"{row['python_version']} {row['python']}",
            *(versions.get(name) or "-" for name in ("dtrain", "torch", "tensorflow", "mpi4py")),
            f"{row['gpus']} ({row['gpus_busy']})",
            str(row["free_port"]),
            f"{row['clock_offset_ms']:+.1f}",
        )
    return table


class JsonLinesView:
    """``--json``: one JSON object per output line, for machines."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.time) -> None:
        self.out = out
        self.clock = clock

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        now = round(self.clock(), 6)
        base = {"time": now, "host": spec.host.name, "rank": spec.rank, "role": spec.role}
        self.out.write(
            "".join(
                json.dumps({**base, "stream": stream, "text": text}) + "\n"
                for text in decode_lines(lines)
            )
        )
        self.out.flush()

    def show_group(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: list[bytes],
        at: float | None = None,
    ) -> None:
        """Collapsed lines: the first rank's fields and every rank in ``ranks``; ``time`` is
        ``at``, when the first rank wrote them (None: now)."""
        first = specs[0]
        base = {
            "time": round(self.clock() if at is None else at, 6),
            "host": first.host.name,
            "rank": first.rank,
            "ranks": [s.rank for s in specs],
            "role": first.role,
        }
        if len({s.host.name for s in specs}) > 1:
            base["hosts"] = list(dict.fromkeys(s.host.name for s in specs))
        self.out.write(
            "".join(
                json.dumps({**base, "stream": stream, "text": text}) + "\n"
                for text in decode_lines(lines)
            )
        )
        self.out.flush()

    def update(self, state: RankState) -> None:
        """Only output lines are written."""


class QuietView:
    """``--quiet``: nothing but the summary (the job directory still has everything)."""

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        """Output is kept in the job directory only."""

    def update(self, state: RankState) -> None:
        """States are kept in the job directory only."""


class RankFilter(PassesTiming):
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
        self.view = view
        self.ranks = ranks
        self.local_ranks = local_ranks
        self.hide = set(hide)
        self.timed = view if isinstance(view, TimedSink) else None

    def is_shown(self, spec: LaunchSpec, stream: Stream) -> bool:
        if spec.label:  # mpirun's own lines
            return True
        if stream in self.hide:
            return False
        if self.ranks is not None and spec.rank not in self.ranks:
            return False
        return self.local_ranks is None or spec.local_rank in self.local_ranks

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        if self.is_shown(spec, stream):
            self.view.show(spec, stream, lines)

    def show_at(self, spec: LaunchSpec, stream: Stream, lines: list[bytes], at: float) -> None:
        if not self.is_shown(spec, stream):
            return
        if self.timed is not None:
            self.timed.show_at(spec, stream, lines, at)
        else:
            self.view.show(spec, stream, lines)

    def update(self, state: RankState) -> None:
        self.view.update(state)


class CollapsingView:
    """Identical lines of several ranks shown once, tagged with the rank set (``[0-7] text``):
    ``--collapse``, the default on a terminal.  A line waits at most the window for the same
    line from other ranks.  The window runs on when lines were posted to the outlet (``at``),
    not on when its writer thread got to them (seconds later while the terminal lags: copies
    that came together would split into several groups).  The writer ticks this view when a
    window closes and nothing came meanwhile, and flushes it at the end, so it is only ever
    called from that one thread."""

    def __init__(
        self,
        view: Any,
        world_size: int,
        window_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.view = view
        self.collapser = Collapser(world_size, window_s)
        self.specs: dict[int, LaunchSpec] = {}
        self.clock = clock  # the outlet's clock: what ``at`` and ``tick``'s ``now`` are on
        self.wall = wall  # what a line's time is shown in (a ``{time}`` tag, JSON)
        self.now = -math.inf  # the latest time seen: the collapser's clock never goes back

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        self.show_at(spec, stream, lines, self.clock())

    def show_at(self, spec: LaunchSpec, stream: Stream, lines: list[bytes], at: float) -> None:
        if spec.label:  # mpirun's own lines are nobody's rank: shown as they come
            self.view.show(spec, stream, lines)
            return
        self.specs[spec.rank] = spec
        self.now = max(self.now, at)
        self.emit(self.collapser.add_lines(spec.rank, stream, lines, self.now))

    def update(self, state: RankState) -> None:
        self.view.update(state)

    def next_due(self) -> float | None:
        return self.collapser.next_due()

    def tick(self, now: float | None = None) -> None:
        self.now = max(self.now, self.clock() if now is None else now)
        self.emit(self.collapser.due(self.now))

    def flush(self) -> None:
        self.emit(self.collapser.flush())

    def emit(self, items: Sequence[Collapsed]) -> None:
        """Consecutive lines of the same ranks and stream go to the view as one batch, with
        the wall time when the first of them was written."""
        if not items:
            return
        offset = self.wall() - self.clock()
        start = 0
        for end in range(1, len(items) + 1):
            if end == len(items) or (items[end].ranks, items[end].stream) != (
                items[start].ranks,
                items[start].stream,
            ):
                first = items[start]
                specs = [self.specs[rank] for rank in first.ranks]
                lines = list(chain.from_iterable(item.lines for item in items[start:end]))
                self.view.show_group(specs, first.stream, lines, at=first.time + offset)
                start = end


class LiveView:
    """On a terminal: log lines scroll above a status line (rich Live).

    Progress-bar updates (lines a bare ``\\r`` ended) are drawn in place in the
    live region, one per rank, until a newline closes them.

    The live region starts ``LIVE_AFTER_S`` into the job: a job done before then (a
    test, a short command) shows its tagged lines and one closing status line without
    loading rich (28 ms of its start).  Until then lines are written as rich would print
    them: the same text (tag, ``<stderr>`` mark, colours) to the same file (``out``, stderr
    lines too), so where a line goes never depends on when it came.
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

    def __enter__(self) -> LiveView:
        self.timer = threading.Timer(LIVE_AFTER_S, self.start_live)
        self.timer.daemon = True
        self.timer.start()
        return self

    def start_live(self) -> None:
        """The live region, from now on (on the timer's thread)."""
        from rich.console import Console
        from rich.live import Live

        with self.lock:
            if self.closed or self.live is not None:
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

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        self.show_group((spec,), stream, lines)

    def show_group(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: list[bytes],
        at: float | None = None,
    ) -> None:
        """Lines of one rank, or lines several ranks said alike (tagged with their set)."""
        with self.lock:
            self.show_locked(specs, stream, lines, at)

    def show_locked(
        self,
        specs: Sequence[LaunchSpec],
        stream: Stream,
        lines: list[bytes],
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


MAX_BARS = 8  # more ranks drawing progress bars than this: one summary line instead
LIVE_AFTER_S = 0.3  # the live region starts this far into a job (see LiveView)


def terminal_width(out: TextIO) -> int:
    """The terminal's columns as rich finds them (``COLUMNS`` first), else 80."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(out.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


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


class TerminalFrontend:
    """The job's ``Frontend`` on this process's terminal: the view its options ask for."""

    def __init__(self, config: ViewConfig, out: TextIO, err: TextIO) -> None:
        self.config = config
        self.out = out
        self.err = err

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
        if not self.config.as_json:
            again = f", attempt {attempt}" if attempt else ""  # a host change is no restart
            self.notice(
                f"dtrain: job {job_id} ({plan.world_size} ranks{again}); logs: dtrain logs {job_id}"
            )
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

    def notice(self, text: str) -> None:
        live = getattr(self, "live", None)
        if live is not None and live.live is not None and live.live.is_started:
            live.console.print(text, highlight=False, markup=False, soft_wrap=True)
            return  # above the live area, which stays whole
        self.err.write(text + "\n")
        self.err.flush()


class LogView:
    """``dtrain logs``: a recorded job's lines, tagged as they were when it ran (or JSON)."""

    def __init__(
        self,
        specs: Mapping[int, LaunchSpec],
        out: TextIO,
        as_json: bool = False,
        collapse_window_s: float | None = None,
    ) -> None:
        self.specs = specs
        tag = default_tag((s.role for s in specs.values()), (s.host.name for s in specs.values()))
        self.view: LineView | JsonLinesView = LineView(out, out, tag_format=tag)
        if as_json:
            self.view = JsonLinesView(out)
        self.out = out
        self.notes: list[tuple[float, str]] = []  # (time, line): the launcher's, between lines
        self.noted: set[tuple[float, str]] = set()
        # --collapse: identical lines of several ranks once, grouped by the lines' own times
        self.collapser = (
            Collapser(max(1, len(specs)), collapse_window_s) if collapse_window_s else None
        )
        # Consecutive lines of one rank and stream with one time: a batch as the job's
        # writer recorded it, handed to the collapser whole (as the live view had it), not
        # line by line (a block per line costs the collapser far more).
        self.batch: list[bytes] = []
        self.batch_of: tuple[int, Stream, float] | None = None

    def spec(self, rank: int) -> LaunchSpec:
        return self.specs.get(rank) or LaunchSpec(rank, Host("?"), 0, (), {})

    def add_notes(self, notes: Iterable[tuple[float, str]]) -> None:
        """The launcher's own lines (attempts failed, restarts), shown at their times."""
        fresh = [note for note in notes if note not in self.noted]
        self.noted.update(fresh)
        self.notes = sorted(self.notes + fresh)

    def show_notes(self, until: float) -> None:
        while self.notes and self.notes[0][0] <= until:
            self.out.write(self.notes.pop(0)[1] + "\n")
        self.out.flush()

    def show_line(self, line: LogLine) -> None:
        if self.collapser is not None:
            key = (line.rank, line.stream, line.time)
            if key != self.batch_of:
                self.add_batch()
                if self.notes:
                    self.show_notes(line.time)
                self.batch_of = key
            self.batch.append(line.text)
            return
        if self.notes:
            self.show_notes(line.time)
        if isinstance(self.view, JsonLinesView):
            self.view.clock = lambda: line.time  # the line's own time, not now
        self.view.show(self.spec(line.rank), line.stream, [line.text])

    def add_batch(self) -> None:
        if self.collapser is not None and self.batch_of is not None:
            rank, stream, at = self.batch_of
            self.emit(self.collapser.add_lines(rank, stream, self.batch, at))
            self.batch, self.batch_of = [], None

    def tick(self, now: float) -> None:
        """While following: the groups whose window closed by ``now`` (wall time)."""
        if self.collapser is not None:
            self.add_batch()
            self.emit(self.collapser.due(now))
        self.show_notes(now)

    def finish(self) -> None:
        if self.collapser is not None:
            self.add_batch()
            self.emit(self.collapser.flush())
        self.show_notes(float("inf"))

    def emit(self, items: Sequence[Collapsed]) -> None:
        for item in items:
            specs = [self.spec(rank) for rank in item.ranks]
            self.view.show_group(specs, item.stream, list(item.lines), at=item.time)  # type: ignore[arg-type]


def format_ending(job_id: str, state: str, result: JobResult | None) -> list[str]:
    """How a recorded job ended, as the launcher said it (``dtrain logs``' last lines)."""
    if state in ("running", "starting", "restarting"):
        return [f"dtrain: job {job_id} is still running (dtrain logs -f {job_id} follows it)"]
    if state == "lost":
        return [f"dtrain: job {job_id} was lost: its launcher died without recording an end"]
    if result is None:
        return [f"dtrain: job {job_id} {state}"]
    if result.exit_code == 0:
        return [
            f"dtrain: job {job_id} succeeded ({result.world_size} ranks, {result.elapsed_s:.1f} s)"
        ]
    return format_failure(result) or [
        f"dtrain: job {job_id} {state} (exit code {result.exit_code})"
    ]


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
        for rank in range(world_size)
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
