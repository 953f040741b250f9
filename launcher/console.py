"""Everything dtrain shows (the view layer): tagged lines, plans, hosts, the failure report.

Rank output is written as plain text with a tag per line; on a terminal the
tag is coloured per rank (rich computes the escape codes once per rank, so
the hot path stays string joins).
"""

from __future__ import annotations

import json
import re
import string
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TextIO

from launcher.command import LaunchSpec
from launcher.errors import LauncherError, UsageError
from launcher.hosts import Host
from launcher.plan import Plan
from launcher.policy import describe_status
from launcher.supervisor import JobResult, RankState
from launcher.transport.base import Stream

MPI_TAGGED = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>: ?")
MPI_FIRST_EXIT = re.compile(r"Process name: \[[^\]]*,(\d+)\]\s*\n\s*Exit code:\s*(\d+)")
MPI_FIRST_SIGNAL = re.compile(
    r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)"
)
TAIL_LINES = 20
DEFAULT_TAG = "[{rank}]"
TAG_FIELDS = ("rank", "host", "local_rank", "node_rank", "role", "time")
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
STDERR_MARK = "<stderr>"


def check_tag_format(tag_format: str) -> None:
    """Reject a ``--tag-format`` with unknown fields before anything starts."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(tag_format) if f is not None]
    except ValueError as exc:
        raise UsageError(
            f"--tag-format {tag_format!r}: {exc}", "write e.g. '[{rank}@{host}]'"
        ) from exc
    unknown = [f for f in fields if f not in TAG_FIELDS]
    if unknown:
        raise UsageError(
            f"--tag-format {tag_format!r}: unknown field {{{unknown[0]}}}",
            "fields are " + ", ".join("{" + f + "}" for f in TAG_FIELDS),
        )
    try:
        tag_format.format(rank=0, host="h", local_rank=0, node_rank=0, role="worker", time="t")
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise UsageError(
            f"--tag-format {tag_format!r}: {exc}", "write e.g. '[{rank}@{host}]'"
        ) from None


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

    def update(self, state: RankState) -> None:
        """Rank states are not shown line by line, but a restart is announced."""
        if state.restarts and state.status is None:
            role = f" ({state.role})" if state.role != "worker" else " (worker)"
            self.files["stderr"].write(
                f"dtrain: restarted rank {state.rank}{role} on {state.host} "
                f"(restart {state.restarts})\n"
            )
            self.files["stderr"].flush()

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        prefix = self.prefix(spec, stream)
        file = self.files[stream]
        if file in self.broken:
            return
        marker = ("\n" + prefix).encode()
        block = marker[1:] + marker.join(lines) + b"\n"
        if b"\r" in block:  # progress markers to drop: the slower, per-line way
            block = "".join(prefix + line + "\n" for line in decode_lines(lines)).encode()
        try:
            # One decode per batch; a bad UTF-8 sequence cannot swallow the "\n" after it.
            file.write(block.decode("utf-8", "replace"))
            file.flush()
        except BrokenPipeError:
            # The reader went away (`| head`): the job goes on, its output no longer shown.
            self.broken.add(file)

    def prefix(self, spec: LaunchSpec, stream: Stream) -> str:
        key = (spec.rank, stream)
        cached = self.prefixes.get(key)
        if cached is not None:
            return cached
        tag = (
            f"[{spec.label}]"
            if spec.label
            else self.tag_format.format(
                rank=spec.rank,
                host=spec.host.name,
                local_rank=spec.local_rank,
                node_rank=spec.node_rank,
                role=spec.role,
                time=time.strftime("%H:%M:%S", time.localtime(self.clock())),
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

    def paint(self, text: str, color: str) -> str:
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


def make_line_view(out: TextIO, err: TextIO, tag_format: str, color: bool | None) -> LineView:
    """A LineView coloured when ``out`` is a terminal (rich decides, honouring NO_COLOR)."""
    from rich.console import Console

    probe = Console(file=out, force_terminal=color, no_color=True if color is False else None)
    use_color = probe.is_terminal and probe.color_system is not None and not probe.no_color
    return LineView(
        out, err, tag_format=tag_format, color=use_color, color_system=probe.color_system
    )


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
        others = result.world_size - 1
        role = f" ({failure.role})" if failure.role != "worker" else ""
        lines.append(
            f"dtrain: rank {failure.rank}{role} on {failure.host} failed "
            f"({describe_status(failure.status)}); "
            f"stopped the other {others} rank{'s' if others != 1 else ''}; "
            f"dtrain exits {result.exit_code}"
        )
        if failure.last_lines:
            lines.append(f"dtrain: last {failure.stream} lines of rank {failure.rank}:")
            lines.extend(f"    {line}" for line in failure.last_lines)
    elif result.interrupt is not None:
        import signal

        lines.append(
            f"dtrain: interrupted by {signal.Signals(result.interrupt).name}; "
            f"stopped {result.world_size} rank{'s' if result.world_size != 1 else ''}; "
            f"dtrain exits {result.exit_code}"
        )
    return lines


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
        lines.append("  argv: " + " ".join(shell_quote(a) for a in argv))
        env = entry["env"]
        assert isinstance(env, dict)
        lines.extend(f"  env:  {k}={shell_quote(v)}" for k, v in env.items())
    return lines


def format_plan_json(entries: Sequence[Mapping[str, object]]) -> str:
    return json.dumps(list(entries), indent=2)


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
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
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


def print_check_report(rows: Sequence[Mapping[str, Any]], out: TextIO) -> None:
    """``dtrain check`` as a rich table, one row per host; failures in red with their cause."""
    from rich.console import Console
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
    console = Console(file=out)
    console.print(table)
    failed = sum(1 for row in rows if not row["ok"])
    console.print(f"{len(rows) - failed} of {len(rows)} hosts ok", highlight=False)


class MpiOutput:
    """An output sink in front of the view: splits mpirun's ``[1,R]<stream>:`` lines by rank.

    Lines without a tag are mpirun's own and are shown under the mpirun spec.
    """

    def __init__(self, view: Any, specs: Mapping[int, LaunchSpec], launcher: LaunchSpec) -> None:
        self.view = view
        self.specs = specs
        self.launcher = launcher
        self.own_lines: list[str] = []
        self.tails: dict[int, deque[str]] = {}

    def update(self, state: RankState) -> None:
        """mpirun's state stands for every rank it runs (mpirun tells no more)."""
        for rank, spec in self.specs.items():
            self.view.update(replace(state, rank=rank, host=spec.host.name, role=spec.role))

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        batch: list[bytes] = []
        current: tuple[int, Stream] | None = None
        for line in lines:
            match = MPI_TAGGED.match(line)
            key: tuple[int, Stream]
            if match and int(match[1]) in self.specs:
                key = (int(match[1]), "stdout" if match[2] == b"stdout" else "stderr")
                text = line[match.end() :]
            else:
                key, text = (-1, stream), line
                self.own_lines.append(line.decode("utf-8", "replace"))
            if key[0] >= 0 and key[1] == "stderr":
                self.tails.setdefault(key[0], deque(maxlen=TAIL_LINES)).append(
                    text.decode("utf-8", "replace")
                )
            if key != current and batch and current is not None:
                self.forward(current, batch)
                batch = []
            current = key
            batch.append(text)
        if batch and current is not None:
            self.forward(current, batch)

    def forward(self, key: tuple[int, Stream], lines: list[bytes]) -> None:
        rank, stream = key
        spec = self.specs[rank] if rank >= 0 else self.launcher
        self.view.show(spec, stream, lines)

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, status) of the first failed rank, from mpirun's own report."""
        text = "\n".join(self.own_lines)
        exit_match = MPI_FIRST_EXIT.search(text)
        if exit_match:
            return int(exit_match[1]), int(exit_match[2])
        signal_match = MPI_FIRST_SIGNAL.search(text)
        if signal_match:
            return int(signal_match[1]), -int(signal_match[3])
        return None


def rank_specs(plan: Plan, template: LaunchSpec) -> dict[int, LaunchSpec]:
    """Specs that stand for each MPI rank in the view (tags show rank and host)."""
    return {
        r.rank: replace(
            template, rank=r.rank, host=r.host, local_rank=r.local_rank, node_rank=r.node_rank
        )
        for r in plan.ranks
    }


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

    def update(self, state: RankState) -> None:
        """Only output lines are written."""


class QuietView:
    """``--quiet``: nothing but the summary (the job directory still has everything)."""

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        """Output is kept in the job directory only."""

    def update(self, state: RankState) -> None:
        """States are kept in the job directory only."""


class RankFilter:
    """``--ranks 0,3``: only these ranks reach the terminal."""

    def __init__(self, view: Any, ranks: set[int]) -> None:
        self.view = view
        self.ranks = ranks

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        if spec.rank in self.ranks or spec.label:
            self.view.show(spec, stream, lines)

    def update(self, state: RankState) -> None:
        self.view.update(state)


class LiveView:
    """On a terminal: log lines scroll above a status line (rich Live).

    Progress-bar updates (lines a bare ``\\r`` ended) are drawn in place in the
    live region, one per rank, until a newline closes them.
    """

    def __init__(
        self,
        out: TextIO,
        line_view: LineView,
        job_id: str,
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from rich.console import Console

        self.console = Console(file=out)
        self.line_view = line_view
        self.job_id = job_id
        self.world_size = world_size
        self.clock = clock
        self.started = clock()
        self.states: dict[int, RankState] = {}
        self.progress: dict[int, str] = {}
        self.live: Any = None

    def __enter__(self) -> LiveView:
        from rich.live import Live

        self.live = Live(
            get_renderable=self.render,
            console=self.console,
            refresh_per_second=4,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()
            self.console.print(self.status_text(), highlight=False)

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        from rich.text import Text

        finished = [line for line in lines if not line.endswith(b"\r")]
        if len(finished) != len(lines):
            last = next(line for line in reversed(lines) if line.endswith(b"\r"))
            self.progress[spec.rank] = decode_lines([last])[0]
        if not finished:
            return
        self.progress.pop(spec.rank, None)
        prefix = self.line_view.prefix(spec, stream)
        text = Text.from_ansi("".join(prefix + line + "\n" for line in decode_lines(finished)))
        text.rstrip()
        self.console.print(text, highlight=False, soft_wrap=True)

    def update(self, state: RankState) -> None:
        self.states[state.rank] = state

    def status_text(self) -> str:
        states = list(self.states.values())  # rich's refresh thread calls this too
        running = sum(1 for s in states if s.status is None)
        failed = sum(1 for s in states if s.status not in (None, 0))
        exited = sum(1 for s in states if s.status is not None)
        hosts: dict[str, list[int]] = {}
        for s in states:
            counts = hosts.setdefault(s.host, [0, 0])
            counts[0] += s.status is None
            counts[1] += 1
        per_host = "  ".join(f"{h} {r}/{t}" for h, (r, t) in hosts.items())
        elapsed = int(self.clock() - self.started)
        restarts = sum(s.restarts for s in states)
        return (
            f"dtrain {self.job_id}: {running}/{self.world_size} running  {per_host}  "
            f"exited {exited} (failed {failed})  restarts {restarts}  "
            f"{elapsed // 3600:02d}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
        )

    def render(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        rows = [Text(f"[{rank}] {text}") for rank, text in sorted(self.progress.items())]
        return Group(*rows, Text(self.status_text(), style="bold"))
