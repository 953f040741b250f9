"""The launcher's own reports: error lines, the summary of a failed or interrupted job,
how a recorded job ended, ``--dry-run``'s plan and ``dtrain check``'s report."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from launcher.base.errors import LauncherError
from launcher.core.outcome import JobResult
from launcher.core.policy import describe_status
from launcher.view.tables import shell_join, shell_quote


def format_error(error: LauncherError) -> str:
    line = f"dtrain: error: {error.message}"
    if error.hint:
        line += f" (hint: {error.hint})"
    return " ".join(line.split("\n"))


WIDTH = 80  # every line of dtrain's own fits this many columns (a terminal's least)
INDENT = "    "  # a line broken to fit goes on under this; so do lines meant to be pasted
EXCERPT_ROWS = 8  # the failure summary's excerpt of the rank's last lines, in rows of WIDTH
EXCERPT_LINE_ROWS = 2  # ...of which one line takes at most this many (longer: cut)
EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(: .*)?")  # ValueError: ..., torch.OutOfMemoryError


def fit(text: str, width: int = WIDTH) -> list[str]:
    """A line of dtrain's own as lines of at most ``width`` columns, broken between words
    (an id, a path or a host name is never broken: a longer word stands on a line alone)."""
    if len(text) <= width:
        return [text]
    import textwrap

    return textwrap.wrap(
        text,
        width,
        subsequent_indent=INDENT,
        break_long_words=False,
        break_on_hyphens=False,
    )


def format_failure(result: JobResult) -> list[str]:
    """The summary after a failed or interrupted job (empty when it succeeded): for a failed
    rank, a short excerpt of its last lines (its output was just shown whole) and what torch's
    error file says; how many ranks dtrain stopped; and last, on one line, who failed, why,
    and what dtrain exits with, so that on a small terminal that line is what stays."""
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
        if failure.last_lines:
            whose = "mpirun" if failure.rank < 0 else f"rank {failure.rank}"
            lines.append(f"dtrain: last {failure.stream} lines of {whose}:")
            lines.extend(f"{INDENT}{line}" for line in excerpt(failure.last_lines))
        elif failure.rank >= 0:
            lines.append(f"dtrain: rank {failure.rank} wrote nothing (no output)")
        if failure.error is not None:  # torch's @record wrote it: where it was raised
            lines += fit(f"dtrain: rank {failure.rank} raised {failure.error}")
            lines += fit(f"{INDENT}at {failure.error_at}") if failure.error_at else []
        lines += fit(f"dtrain: {describe_stopped(result, others=True)}")
        lines += fit(f"dtrain: {who} {what}; dtrain exits {result.exit_code}")
    elif result.timeout is not None:
        lines += fit(f"dtrain: {describe_stopped(result, others=False)}")
        lines += fit(f"dtrain: {result.timeout}; dtrain exits {result.exit_code}")
    elif result.interrupt is not None:
        import signal

        lines += fit(f"dtrain: {describe_stopped(result, others=False)}")
        lines += fit(
            f"dtrain: interrupted by {signal.Signals(result.interrupt).name}; "
            f"dtrain exits {result.exit_code}"
        )
    if result.incomplete is not None:  # lines may be missing: said first, or alone
        if not lines:
            return fit(f"dtrain: {result.incomplete}; dtrain exits {result.exit_code}")
        lines = fit(f"dtrain: warning: {result.incomplete}") + lines
    return lines


def excerpt(lines: Sequence[str]) -> list[str]:
    """A failed rank's last lines, short: up to its exception line (a Python traceback's last
    line: what follows it is most often noise, a destructor's warning), and the lines before
    it that fit ``EXCERPT_ROWS`` rows; a line longer than ``EXCERPT_LINE_ROWS`` rows is cut."""
    end = exception_index(lines)
    chosen = list(lines[: len(lines) if end is None else end + 1])
    room = EXCERPT_LINE_ROWS * WIDTH - len(INDENT)
    shown: list[str] = []
    rows = 0
    for line in reversed(chosen):
        line = line if len(line) <= room else line[: room - 1] + "\u2026"
        rows += -(-(len(INDENT) + len(line)) // WIDTH) or 1
        if rows > EXCERPT_ROWS and shown:
            break
        shown.append(line)
    shown.reverse()
    if len(shown) < len(chosen):  # cut: begin at a frame of the traceback, not inside one
        frame = next((i for i, line in enumerate(shown) if line.lstrip().startswith("File ")), 0)
        shown = shown[frame:]
    return shown


def exception_index(lines: Sequence[str]) -> int | None:
    """Where the last Python exception line is: a line like ``ValueError: bad batch``, not
    indented, right after a traceback's indented frame lines (None: no traceback)."""
    for index in range(len(lines) - 1, 0, -1):
        line, before = lines[index], lines[index - 1]
        if before[:1].isspace() and EXCEPTION_LINE.fullmatch(line):
            return index
    return None


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


def format_ending(job_id: str, state: str, result: JobResult | None) -> list[str]:
    """How a recorded job ended, as the launcher said it (``dtrain logs``' last lines)."""
    if state in ("running", "starting", "restarting"):
        return [
            f"dtrain: job {job_id} is still running; to follow it:",
            f"{INDENT}dtrain logs -f {job_id}",
        ]
    if state == "lost":
        return fit(f"dtrain: job {job_id} was lost: its launcher died without recording an end")
    if result is None:
        return [f"dtrain: job {job_id} {state}"]
    if result.exit_code == 0:
        size = f"{result.world_size} rank{'s' if result.world_size != 1 else ''}"
        return fit(f"dtrain: job {job_id} succeeded ({size}, {result.elapsed_s:.1f} s)")
    return format_failure(result) or [
        f"dtrain: job {job_id} {state} (exit code {result.exit_code})"
    ]


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
        hidden = entry.get("env_hidden", [])
        assert isinstance(hidden, list)
        lines.extend(f"  env:  {k}=...  (from dtrain's environment or an env file)" for k in hidden)
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
    forwards (``-x NAME``: the values travel in its environment) and its hostfile; as text,
    what can be pasted into a shell as it is: the hostfile written by a heredoc (a dry run
    writes no file), the variables exported, then mpirun's line."""
    if mpirun is not None:
        if as_json:
            plan = {"mpirun": list(mpirun), "env": dict(mpirun_env), "hostfile": hostfile}
            return json.dumps(plan, indent=2)
        path = mpirun[list(mpirun).index("--hostfile") + 1] if "--hostfile" in mpirun else None
        write = f"cat > {shell_quote(path)} <<'EOF'\n{hostfile or ''}EOF\n" if path else ""
        env = "".join(f"export {k}={shell_quote(v)}\n" for k, v in mpirun_env.items())
        return write + env + shell_join(mpirun)
    return format_plan_json(entries) if as_json else "\n".join(format_plan(entries))


WIDE_CHECK = 150  # narrower terminals get the check report host by host
FRAMEWORKS = ("dtrain", "torch", "tensorflow", "mpi4py")


def print_check_report(rows: Sequence[Mapping[str, Any]], out: TextIO) -> None:
    """``dtrain check`` as a rich table, one row per host (a block per host on a terminal
    narrower than the table); failures in red with their cause; then one line per problem
    (red) or warning (yellow) that ``core/gpucheck.py`` found across the hosts."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=out)
    if console.width < WIDE_CHECK:
        for row in rows:
            console.print(*check_block(row), sep="\n", highlight=False)
    else:
        console.print(check_table(rows))
    for color, key in (("red", "problems"), ("yellow", "warnings")):
        said = list(dict.fromkeys(m for row in rows for m in row.get(key) or ()))  # (in order)
        for message in said:
            console.print(f"[{color}]dtrain: {escape(message)}[/{color}]", highlight=False)
    failed = sum(1 for row in rows if not row["ok"])
    console.print(f"{len(rows) - failed} of {len(rows)} hosts ok", highlight=False)


def check_block(row: Mapping[str, Any]) -> list[str]:
    """One host of ``dtrain check``, in lines that fit 80 columns."""
    from rich.markup import escape

    if row.get("error"):
        return [f"[bold]{row['host']}[/bold]  [red]FAILED[/red]  {escape(row['error'])}"]
    rtt = "-" if row["rtt_ms"] is None else f"{row['rtt_ms']:.2f}"
    frameworks = "  ".join(f"{name} {framework_version(row, name)}" for name in FRAMEWORKS)
    gpus = [f"gpus {row['gpus']} ({row['gpus_busy']} busy)"]
    if row.get("driver"):
        gpus.append(f"driver {row['driver']} (CUDA {row.get('driver_cuda') or '-'})")
    if row.get("ecc_uncorrected"):
        gpus.append(f"ECC errors {sum(row['ecc_uncorrected'].values())}")
    in_use = [f"  in use by {in_use_by(row)}"] if row.get("gpus_in_use") else []
    return [
        f"[bold]{row['host']}[/bold]  {check_state(row)}  rtt {rtt} ms  "
        f"clock {clock_text(row)}  free port {row['free_port']}",
        f"  python {row['python_version']} {escape(row['python'])}",
        f"  {frameworks}",
        "  " + "  ".join(gpus),
        *in_use,
    ]


def clock_text(row: Mapping[str, Any]) -> str:
    """The host's clock offset, or "-" where no `date` answered in time (a busy host)."""
    offset = row.get("clock_offset_ms")
    return "-" if offset is None else f"{offset:+.1f} ms"


def check_state(row: Mapping[str, Any]) -> str:
    return "[green]ok[/green]" if row["ok"] else "[red]FAILED[/red]"


def framework_version(row: Mapping[str, Any], name: str) -> str:
    """``2.11.0 (CUDA 13.0)`` for torch built for CUDA, else the installed version or ``-``."""
    version = row["versions"].get(name) or "-"
    if name == "torch" and row.get("torch_cuda") and version != "-":
        return f"{version} (CUDA {row['torch_cuda']})"
    return str(version)


def in_use_by(row: Mapping[str, Any]) -> str:
    """The pids of other processes on a host's GPUs: ``pid 4242 (GPU 0), pid 7 (GPU 1)``."""
    return ", ".join(f"pid {p['pid'] or '?'} (GPU {p['gpu']})" for p in row["gpus_in_use"])


def check_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(show_lines=False)
    columns = ("host", "state", "rtt ms", "python", *FRAMEWORKS, "gpus (busy)", "driver (CUDA)")
    for column in (*columns, "ECC", "free port", "clock ms"):
        table.add_column(column)
    for row in rows:
        if row.get("error"):
            table.add_row(
                row["host"],
                "[red]FAILED[/red]",
                escape(row["error"]),
                *[""] * (len(table.columns) - 3),
            )
            continue
        ecc = row.get("ecc_uncorrected")
        in_use = f" in use by {in_use_by(row)}" if row.get("gpus_in_use") else ""
        driver = row.get("driver")
        table.add_row(
            row["host"],
            check_state(row),
            "-" if row["rtt_ms"] is None else f"{row['rtt_ms']:.2f}",
            escape(f"{row['python_version']} {row['python']}"),
            *(framework_version(row, name) for name in FRAMEWORKS),
            f"{row['gpus']} ({row['gpus_busy']}){in_use}",
            f"{driver} ({row.get('driver_cuda') or '-'})" if driver else "-",
            str(sum(ecc.values())) if ecc else "-",
            str(row["free_port"]),
            clock_text(row).removesuffix(" ms"),
        )
    return table
