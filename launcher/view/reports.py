"""The launcher's own reports: error lines, the summary of a failed or interrupted job,
how a recorded job ended, ``--dry-run``'s plan and ``dtrain check``'s report."""

from __future__ import annotations

import json
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
