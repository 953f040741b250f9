"""What the benchmarks share: timing a launcher process, statistics, the machine, sections.

A run is timed from ``Popen`` to the launcher's exit.  Its own CPU time is read from
``/proc/PID/stat`` once it is a zombie (``waitid(WNOWAIT)``: exited, not yet reaped), so
it is exact and counts the launcher's threads but not its children; the CPU of everything
it started and reaped (ranks, watchdogs, daemons) comes from ``wait4``'s rusage.  Its peak
memory is ``VmHWM`` of the launcher process itself, sampled while it runs.
"""

from __future__ import annotations

import contextlib
import os
import platform
import pty
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DOC = REPO / "docs" / "benchmarks.md"
CHARTS = REPO / "docs" / "benchmarks"
SAMPLE_S = 0.01


@dataclass(frozen=True)
class Sample:
    wall_s: float
    launcher_cpu_s: float  # the launcher process alone (its threads)
    all_cpu_s: float  # the launcher and every descendant it reaped
    peak_rss: int  # bytes, the launcher process alone (VmHWM)
    returncode: int
    output: bytes = b""


@dataclass
class Series:
    """Runs of one configuration."""

    name: str
    command: str
    samples: list[Sample] = field(default_factory=list)

    def values(self, what: Callable[[Sample], float]) -> list[float]:
        return [what(s) for s in self.samples]

    def median(self, what: Callable[[Sample], float]) -> float:
        return statistics.median(self.values(what)) if self.samples else float("nan")

    @property
    def failures(self) -> int:
        return sum(1 for s in self.samples if s.returncode != 0)


def bench_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a launcher run: as a user's (bytecode caches on), venv first."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def read_stat(pid: int) -> tuple[str, float] | None:
    """(state, utime + stime) of ``pid`` itself."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[0].decode(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_hwm(pid: int) -> int:
    """Peak resident memory of ``pid`` so far (bytes), 0 once it has no memory."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def drain(fd: int, into: list[bytes] | None, limit_s: float | None = None) -> None:
    """Read ``fd`` to its end (keeping what is read unless ``into`` is None)."""
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except OSError:  # a pty's EIO once the other side is closed
            return
        if not chunk:
            return
        if into is not None:
            into.append(chunk)


def run_launcher(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    terminal: bool = False,
    reader: Callable[[int], None] | None = None,
    timeout_s: float = 120.0,
    cwd: Path | None = None,
) -> Sample:
    """Run ``argv`` with stdout and stderr on a pipe (or a pty), read by ``reader``
    (default: read everything); return its times and peak memory."""
    if terminal:
        ours, theirs = pty.openpty()
    else:
        ours, theirs = os.pipe()
    out: list[bytes] = []
    began = time.perf_counter()
    popen = subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL, stdout=theirs, stderr=theirs, env=dict(env), cwd=cwd
    )
    os.close(theirs)
    consume = reader or (lambda fd: drain(fd, out))
    thread = threading.Thread(target=consume, args=(ours,), daemon=True)
    thread.start()
    peak = [0]
    done = threading.Event()

    def sample() -> None:  # the launcher's peak memory while it runs
        while not done.wait(SAMPLE_S):
            peak[0] = max(peak[0], read_hwm(popen.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    killer = threading.Timer(timeout_s, popen.kill)
    killer.start()
    os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    wall_s = time.perf_counter() - began
    killer.cancel()
    done.set()
    sampler.join()
    stat = read_stat(popen.pid)
    cpu_s = stat[1] if stat else 0.0
    _, status, usage = os.wait4(popen.pid, 0)
    popen.returncode = os.waitstatus_to_exitcode(status)
    thread.join(10)
    os.close(ours)
    return Sample(
        wall_s=wall_s,
        launcher_cpu_s=cpu_s,
        all_cpu_s=usage.ru_utime + usage.ru_stime,
        peak_rss=peak[0],
        returncode=popen.returncode,
        output=b"".join(out),
    )


def interleave(series: Sequence[Series], runs: Sequence[Callable[[], Sample]], reps: int) -> None:
    """``reps`` rounds; in each, every configuration once, the order turning each round."""
    for rep in range(reps):
        for offset in range(len(series)):
            index = (rep + offset) % len(series)
            series[index].samples.append(runs[index]())


def spread(values: Sequence[float], scale: float = 1000.0, digits: int = 0) -> str:
    """``median (min-max)`` of ``values`` times ``scale`` (ms by default)."""
    if not values:
        return "-"
    fmt = f"{{:.{digits}f}}"
    med, low, high = (fmt.format(v * scale) for v in (statistics.median(values), *minmax(values)))
    return f"{med} ({low}-{high})"


def minmax(values: Sequence[float]) -> tuple[float, float]:
    return min(values), max(values)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def first_line(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except OSError:
        return "?"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[0] if lines else "?"


def describe_machine() -> dict[str, str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
        memory = f"{kib / 2**20:.0f} GiB"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": f"{os.cpu_count()} x {cpu}",
        "memory": memory,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "open mpi": first_line([str(BIN / "mpirun"), "--version"]),
        "dtrain commit": first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
        "processes running": str(sum(1 for p in os.listdir("/proc") if p.isdigit())),
        "load average": load_average(),
    }


def machine_line(machine: Mapping[str, str]) -> str:
    return "; ".join(f"{k}: {v}" for k, v in machine.items())


def usage_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: int = 1) -> list[str]:
    """A Markdown table; columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def ratio(mine: float, theirs: float) -> str:
    if not theirs or theirs != theirs or mine != mine:
        return "-"
    return f"{mine / theirs:.2f}x"


@dataclass(frozen=True)
class Chart:
    """A PNG made by run.py: lines of (x, y) per label."""

    name: str  # file name without .png
    title: str
    xlabel: str
    ylabel: str
    lines: dict[str, list[tuple[float, float]]]
    logx: bool = False
    logy: bool = False
    bars: bool = False  # one bar per label (x ignored)


@dataclass(frozen=True)
class Section:
    """One benchmark's part of docs/benchmarks.md."""

    title: str  # "## ..." heading
    body: list[str]
    charts: list[Chart] = field(default_factory=list)
    summary: list[tuple[str, str, str, str]] = field(
        default_factory=list
    )  # what, dtrain, peer, target


def write_chart(chart: Chart, directory: Path) -> Path | None:
    """The chart as ``directory/name.png`` (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    if chart.bars:
        labels = list(chart.lines)
        heights = [chart.lines[label][0][1] for label in labels]
        axes.bar(
            range(len(labels)),
            heights,
            color=["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"][: len(labels)],
        )
        axes.set_xticks(range(len(labels)))
        axes.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)  # long names fit
        for index, height in enumerate(heights):
            axes.annotate(f"{height:.0f}", (index, height), ha="center", va="bottom")
    else:
        for label, points in chart.lines.items():
            xs, ys = zip(*sorted(points), strict=True) if points else ((), ())
            axes.plot(xs, ys, marker="o", label=label)
        axes.legend()
    if chart.logx:
        axes.set_xscale("log")
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        xs_all = sorted({x for points in chart.lines.values() for x, _ in points})
        axes.set_xticks(xs_all)  # the sizes measured, written plainly (not 2x10^0)
        axes.xaxis.set_major_formatter(ScalarFormatter())
        axes.xaxis.set_minor_formatter(NullFormatter())
    if chart.logy:
        axes.set_yscale("log")
    else:
        axes.set_ylim(bottom=0)  # a difference looks as large as it is
    axes.set_title(chart.title)
    axes.set_xlabel(chart.xlabel)
    axes.set_ylabel(chart.ylabel)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    path = directory / f"{chart.name}.png"
    figure.savefig(path)
    plt.close(figure)
    return path
