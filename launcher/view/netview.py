"""``dtrain check --network``'s report: a table of the hosts (bandwidth out and in, round
trip, verdict), the allreduce's bus bandwidth, then one line per slow host or pair and per
failure; or all of it as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TextIO

from launcher.core.netcheck import (
    AllreduceOutcome,
    HostFigure,
    NetReport,
    format_rate,
)
from launcher.view.reports import fit
from launcher.view.tables import format_table

COLUMNS = ("host", "address", "out", "in", "rtt ms", "verdict")


def network_lines(report: NetReport) -> list[str]:
    verdict = report.verdict
    rows = [list(COLUMNS)] + [
        host_row(h, verdict.bar_bytes_per_s is not None) for h in verdict.hosts
    ]
    said = [allreduce_line(report.allreduce), *verdict.named, *verdict.failures]
    if report.allreduce.state == "failed":
        said.append(f"dtrain: the allreduce failed: {report.allreduce.reason}")
    said.append(summary_line(report))
    # (the table as wide as its hosts' names; dtrain's own lines within 80 columns)
    return format_table(rows) + [row for line in said for row in fit(line)]


def rate(value: float | None) -> str:
    return "-" if value is None else format_rate(value)


def host_row(host: HostFigure, judged: bool) -> list[str]:
    where = "-" if host.address is None else f"{host.address} ({host.interface})"
    if host.error is not None:
        state = "FAILED"
    elif host.slow:
        state = "SLOW " + " and ".join(host.slow)
    else:
        state = "ok" if judged else "-"
    trip = "-" if host.rtt_ms is None else f"{host.rtt_ms:.3f}"
    return [host.name, where, rate(host.out_bytes_per_s), rate(host.in_bytes_per_s), trip, state]


def allreduce_line(outcome: AllreduceOutcome) -> str:
    if outcome.state != "done":
        return f"allreduce: {outcome.state} ({outcome.reason})"
    size = f"{(outcome.bytes or 0) / (1 << 20):g} MiB"
    return (  # (nccl-tests' words: busbw = algbw * 2(n-1)/n)
        f"allreduce ({outcome.backend}, {outcome.hosts} hosts, {size}): "
        f"busbw {rate(outcome.busbw_bytes_per_s)} (algbw {rate(outcome.algbw_bytes_per_s)})"
    )


def summary_line(report: NetReport) -> str:
    """``3 of 3 hosts measured, median 410 MB/s; below half the median (205 MB/s): node2``."""
    verdict = report.verdict
    measured = sum(1 for h in verdict.hosts if h.error is None)
    head = f"{measured} of {len(verdict.hosts)} hosts measured"
    if verdict.median_bytes_per_s is not None:
        head += f", median {rate(verdict.median_bytes_per_s)}"
    if verdict.bar_bytes_per_s is None:
        return f"{head}; {verdict.bar} (or give --min-bandwidth)"
    slow = [h.name for h in verdict.hosts if h.slow]
    slow += [f"{p.sender} -> {p.receiver}" for p in verdict.slow_pairs]
    bar = f"below {verdict.bar}"
    if "--min-bandwidth" not in verdict.bar:  # (a floor's bar says its rate already)
        bar += f" ({rate(verdict.bar_bytes_per_s)})"
    return f"{head}; {bar}: {', '.join(slow)}" if slow else f"{head}; none {bar}"


def print_network_report(report: NetReport, out: TextIO) -> None:
    out.write("\n".join(network_lines(report)) + "\n")


def network_report_as_json(report: NetReport) -> str:
    verdict = report.verdict
    return json.dumps(
        {
            "ok": report.ok,
            "hosts": [asdict(h) for h in verdict.hosts],
            "pairs": [asdict(p) for p in verdict.pairs],
            "median_bytes_per_s": verdict.median_bytes_per_s,
            "bar_bytes_per_s": verdict.bar_bytes_per_s,
            "bar": verdict.bar,
            "named": list(verdict.named),
            "failures": list(verdict.failures),
            "allreduce": asdict(report.allreduce),
            "transfer_s": report.bulk_s,
            "refused_connections": dict(report.refused),
        },
        indent=2,
    )
