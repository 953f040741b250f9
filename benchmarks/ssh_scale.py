"""Launch over SSH at 8 to 64 test hosts: dtrain vs ``mpirun`` side by side (the part of
``launch_ssh.py`` that measures scale; it runs it and renders its tables).

Per launcher run, one fresh process, timed from ``Popen``:

- *all running*: until the last rank's start stamp (see ``launch_ssh.stamped``);
- *ended*: until the launcher exits (ranks run ``true``);
- *teardown*: in a second job, whose last rank exits 1 once every rank runs (the others
  sleep), from that rank's exit (a stamp it writes) until no other rank is left on any
  host, and until the launcher exits;
- the CPU time of the launcher and every process it started here (mpirun's ``ssh``
  clients), from a cpuacct cgroup of its own (where there is none: ``wait4``'s, which
  has only the children it waited for); its peak RSS (``VmHWM``: ``wait4``'s ``ru_maxrss``
  would include this benchmark's own, which a child inherits across fork and exec), peak
  threads and open fds, and its child processes and their RSS together, sampled from
  /proc every 20 ms (the children every 200 ms).

A run whose launcher is still there ``HANG_GRACE_S`` after its ranks have run (all
started and ended, or the failing rank exited), or that does not finish within the
overall timeout, is killed with its process group, and whatever it left on the hosts
(daemons, ranks, sessions) is killed too; it is counted as hung, not waited for.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SCALE_HOSTS = (8, 16, 32, 64)
SCALE_SLOTS = (1, 4)
DEFAULT_SCALE_REPEAT = 2
HANG_GRACE_S = 5.0  # the launcher still there this long after its ranks ran: hung
TIMEOUT_BASE_S = 30.0
TIMEOUT_PER_HOST_S = 0.5  # 64 hosts: 62 s in all
SAMPLE_S = 0.02
CHILDREN_EVERY = 10  # samples between counts of the launcher's child processes (a /proc walk)
FAILED_EXIT = 1
CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1, as on the machine this was written on


@dataclass
class Run:
    """One launcher run: what it took, or why it has no times."""

    outcome: str = "ok"  # ok, hung, failed
    why: str = ""
    running_s: float | None = None
    ended_s: float | None = None
    teardown_s: float | None = None  # failing rank's exit -> no other rank on any host
    exit_after_failure_s: float | None = None  # failing rank's exit -> launcher's exit
    cpu_s: float = 0.0
    rss_mib: float = 0.0
    children_rss_mib: float = 0.0  # the children's RSS together, at its peak
    threads: int = 0
    fds: int = 0
    children: int = 0


@dataclass
class Series:
    """The runs of one launcher at one size (hosts x ranks per host) and job."""

    runs: list[Run] = field(default_factory=list)

    def ok(self) -> list[Run]:
        return [r for r in self.runs if r.outcome == "ok"]

    def values(self, name: str) -> list[float]:
        found = (getattr(r, name) for r in self.ok())
        return [float(v) for v in found if v is not None]

    def median(self, name: str) -> float | None:
        values = self.values(name)
        return statistics.median(values) if values else None

    def hangs(self) -> int:
        return sum(r.outcome == "hung" for r in self.runs)

    def failures(self) -> int:
        return sum(r.outcome == "failed" for r in self.runs)


Key = tuple[str, int, int, str]  # launcher, hosts, ranks per host, job ("true" or "fail")


@dataclass
class ScaleReport:
    series: dict[Key, Series] = field(default_factory=dict)
    launchers: tuple[str, ...] = ("dtrain", "mpirun")
    hosts: tuple[int, ...] = SCALE_HOSTS
    slots: tuple[int, ...] = SCALE_SLOTS
    repeat: int = 0
    elapsed_s: float = 0.0
    load: list[str] = field(default_factory=list)  # load averages seen between repetitions
    notes: list[str] = field(default_factory=list)  # why runs failed or hung (first few)

    def of(self, launcher: str, hosts: int, slots: int, job: str) -> Series:
        return self.series.setdefault((launcher, hosts, slots, job), Series())


# --------------------------------------------------------------------------
# one run


def fail_program(stamps: Path, failed: Path, ranks: int) -> tuple[str, ...]:
    """Every rank stamps its start (``stamps/PID``); the last one waits until every rank
    has, stamps its exit in ``failed`` and exits 1; the others sleep (exec'd: the stamp's
    pid is the sleeping rank's)."""
    directory, mark = shlex.quote(str(stamps)), shlex.quote(str(failed))
    script = (
        f"date +%s%N > {directory}/$$; r=${{RANK:-$OMPI_COMM_WORLD_RANK}}; "
        f'if [ "$r" = {ranks - 1} ]; then '
        f"while [ $(ls {directory} | wc -l) -lt {ranks} ]; do sleep 0.05; done; "
        f"date +%s%N > {mark}; exit {FAILED_EXIT}; fi; exec sleep 300"
    )
    return ("sh", "-c", script)


def read_stamps(directory: Path) -> dict[int, float]:
    """pid -> start stamp (seconds since the epoch) of the ranks that wrote one."""
    found = {}
    for path in directory.iterdir():
        with contextlib.suppress(OSError, ValueError):
            found[int(path.name)] = int(path.read_text().strip()) / 1e9
    return found


def status_fields(pid: int) -> dict[str, int]:
    """Threads, VmHWM and VmRSS (KiB) of a live process; empty once it is gone."""
    found = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name = line.split(":", 1)[0]
            if name in ("Threads", "VmHWM", "VmRSS"):
                found[name] = int(line.split()[1])
    return found


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != b"Z":
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


@dataclass
class Watch:
    """What a run is waiting for, as its stamps show."""

    stamps: Path
    ranks: int
    failed: Path | None  # the failing rank's exit stamp (the teardown job), else None
    ran_at: float | None = None  # monotonic time the ranks had run (hang clock starts)
    failed_at: float | None = None  # wall clock of the failing rank's exit
    survivors: list[int] = field(default_factory=list)
    gone_at: float | None = None  # wall clock when no other rank was left

    def look(self, launcher_done: bool) -> None:
        """Update from the stamps and the ranks' pids."""
        if self.failed is None:
            if self.ran_at is None and len(list(self.stamps.iterdir())) >= self.ranks:
                self.ran_at = time.monotonic()  # `true` ends at once
            return
        if self.failed_at is None:
            with contextlib.suppress(OSError, ValueError):
                self.failed_at = int(self.failed.read_text().strip()) / 1e9
                self.ran_at = time.monotonic()
                self.survivors = list(read_stamps(self.stamps))
        if self.failed_at is not None and self.gone_at is None:
            self.survivors = [pid for pid in self.survivors if alive(pid)]
            if not self.survivors:
                self.gone_at = time.time()


class TreeCpu:
    """CPU time of a process and everything it starts: a cpuacct cgroup it joins before it
    execs (None where cgroups cannot be made: not root, cgroup v2 only)."""

    def __init__(self, name: str) -> None:
        self.path: Path | None = CPUACCT / name
        try:
            self.path.mkdir()
        except OSError:
            self.path = None

    def join(self) -> None:
        """In the child, before exec (Popen's preexec_fn)."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def seconds(self) -> float | None:
        if self.path is None:
            return None
        try:
            return int((self.path / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        """Move what is left to the root group and remove ours (processes just killed may
        take a moment to leave: a few tries)."""
        if self.path is None:
            return
        for _ in range(50):
            with contextlib.suppress(OSError):
                for pid in (self.path / "cgroup.procs").read_text().split():
                    (CPUACCT / "cgroup.procs").write_text(pid)
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.02)


def run_once(
    argv: Sequence[str],
    env: dict[str, str],
    watch: Watch,
    timeout_s: float,
    clean_hosts: Callable[[], None],
) -> Run:
    """Start the launcher, sample it until it exits (or is hung), and measure."""
    run = Run()
    tree = TreeCpu(f"dtrain-bench-{os.getpid()}-{time.monotonic_ns()}")
    with tempfile.TemporaryFile() as err:
        wall_clock, started = time.time(), time.monotonic()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # a hung launcher is killed with its ssh children
            env=env,
            preexec_fn=tree.join if tree.path is not None else None,
        )
        samples = 0
        status = usage = None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            now = time.monotonic()
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                run.ended_s = now - started
                break
            status_now = status_fields(proc.pid)
            run.threads = max(run.threads, status_now.get("Threads", 0))
            run.rss_mib = max(run.rss_mib, status_now.get("VmHWM", 0) / 1024)
            run.fds = max(run.fds, open_fds(proc.pid))
            if samples % CHILDREN_EVERY == 0:
                children = children_of(proc.pid)
                run.children = max(run.children, len(children))
                together = sum(status_fields(c).get("VmRSS", 0) for c in children) / 1024
                run.children_rss_mib = max(run.children_rss_mib, together)
            samples += 1
            watch.look(launcher_done=False)
            hung = watch.ran_at is not None and now - watch.ran_at > HANG_GRACE_S
            if hung or now - started > timeout_s:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                proc.returncode = -signal.SIGKILL
                run.outcome = "hung"
                run.why = "ranks ran, the launcher did not end" if hung else "timed out"
                break
            time.sleep(SAMPLE_S)
        deadline = time.monotonic() + HANG_GRACE_S
        while watch.failed is not None and watch.gone_at is None and time.monotonic() < deadline:
            watch.look(launcher_done=True)  # the launcher is gone: are its ranks?
            time.sleep(SAMPLE_S)
        err.seek(0)
        stderr = err.read()
    assert usage is not None
    with contextlib.suppress(ProcessLookupError):  # what it left running here (ssh clients)
        os.killpg(proc.pid, signal.SIGKILL)
    tree_cpu = tree.seconds()
    tree.remove()
    run.cpu_s = tree_cpu if tree_cpu is not None else usage.ru_utime + usage.ru_stime
    stamps = read_stamps(watch.stamps)
    if len(stamps) == watch.ranks:
        run.running_s = max(stamps.values()) - wall_clock
    if watch.failed_at is not None:
        run.exit_after_failure_s = wall_clock + (run.ended_s or 0.0) - watch.failed_at
        if watch.gone_at is not None:
            run.teardown_s = watch.gone_at - watch.failed_at
    expected = FAILED_EXIT if watch.failed is not None else 0
    if run.outcome == "ok":
        if proc.returncode != expected:
            run.outcome, run.why = "failed", f"exit {proc.returncode}: {gist(stderr)}"
        elif len(stamps) != watch.ranks:
            run.outcome, run.why = "failed", f"{len(stamps)} start stamps for {watch.ranks}"
        elif watch.failed is not None and run.teardown_s is None:
            run.outcome, run.why = "failed", "ranks left on the hosts after the launcher ended"
    clean_hosts()  # a hung mpirun's prted, or ranks a launcher left: the next run starts clean
    return run


def gist(stderr: bytes) -> str:
    lines = [
        line.strip()
        for line in stderr.decode(errors="replace").splitlines()
        if line.strip() and "setpgid" not in line and set(line.strip()) != {"-"}
    ]
    return lines[-1][:160] if lines else "no output"


# --------------------------------------------------------------------------
# the series


def run_scale(
    argv_of: Mapping[str, Callable[[str, Sequence[str]], list[str]]],
    env: dict[str, str],
    scratch: Path,
    clean_hosts: Callable[[], None],
    repeat: int,
    hosts: Sequence[int] = SCALE_HOSTS,
    log: Callable[[str], None] = lambda _: None,
) -> ScaleReport:
    """``argv_of[launcher](host_list, program)``: each launcher's command line; every
    launcher runs every configuration once per repetition, in turns that rotate."""
    report = ScaleReport(launchers=tuple(argv_of), hosts=tuple(hosts), repeat=repeat)
    began = time.monotonic()
    turn = 0
    for index in range(repeat):
        for count in hosts:
            jobs = [(slots, "true") for slots in SCALE_SLOTS] + [(1, "fail")]
            for slots, job in jobs:
                ranks = count * slots
                host_list = ",".join(f"node{k}:{slots}" for k in range(1, count + 1))
                order = list(argv_of)
                turn += 1
                order = order[turn % len(order) :] + order[: turn % len(order)]
                for launcher in order:
                    directory = Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
                    failed = directory.with_name(directory.name + ".failed")
                    try:
                        if job == "fail":
                            watch = Watch(directory, ranks, failed)
                            program = fail_program(directory, failed, ranks)
                        else:
                            watch = Watch(directory, ranks, None)
                            program = stamped_true(directory)
                        argv = argv_of[launcher](host_list, program)
                        timeout = TIMEOUT_BASE_S + TIMEOUT_PER_HOST_S * count
                        run = run_once(argv, env, watch, timeout, clean_hosts)
                    finally:
                        shutil.rmtree(directory, ignore_errors=True)
                        failed.unlink(missing_ok=True)
                    report.of(launcher, count, slots, job).runs.append(run)
                    if run.outcome != "ok" and len(report.notes) < 8:
                        report.notes.append(f"{launcher} {count}x{slots} {job}: {run.why}")
            log(f"repetition {index + 1}: {count} hosts done")
        report.load.append(" ".join(f"{x:.1f}" for x in os.getloadavg()))
    report.elapsed_s = time.monotonic() - began
    return report


def stamped_true(directory: Path) -> tuple[str, ...]:
    script = f'date +%s%N > {shlex.quote(str(directory))}/$$ && exec "$@"'
    return ("sh", "-c", script, "stamp", "true")


# --------------------------------------------------------------------------
# output


def spread(values: Sequence[float], scale: float = 1000.0, digits: int = 0) -> str:
    """``median (min-max)``; ``—`` for none."""
    if not values:
        return "—"
    text = f"{statistics.median(values) * scale:.{digits}f}"
    if len(values) > 1:
        text += f" ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"
    return text


def ratio(mine: float | None, theirs: float | None) -> str:
    if mine is None or theirs is None or theirs <= 0:
        return "—"
    return f"{mine / theirs:.2f}"


def ratio_spread(mine: Series, theirs: Series, name: str) -> str:
    """median ratio, and min-max of the per-repetition ratios (runs paired in order)."""
    pairs = [
        (getattr(a, name), getattr(b, name))
        for a, b in zip(mine.runs, theirs.runs, strict=False)
        if a.outcome == b.outcome == "ok" and getattr(a, name) and getattr(b, name)
    ]
    median = ratio(mine.median(name), theirs.median(name))
    if len(pairs) < 2:
        return median
    ratios = [a / b for a, b in pairs]
    return f"{median} ({min(ratios):.2f}-{max(ratios):.2f})"


def not_done(series: Series) -> str:
    parts = []
    if series.hangs():
        parts.append(f"{series.hangs()} hung")
    if series.failures():
        parts.append(f"{series.failures()} failed")
    return f" [{', '.join(parts)}]" if parts else ""


def render_scale(report: ScaleReport) -> list[str]:
    rep = report.repeat
    lines = [
        f"### 8 to 64 hosts, 1 and {max(report.slots)} ranks per host, {rep} repetitions each",
        "",
        "Each size and job runs every launcher once per repetition, in turns that rotate. "
        "Times in ms, median (min-max) of the runs that finished; *ratio* = dtrain / mpirun "
        "of the medians (in brackets: min-max of the ratios of runs paired in order). "
        f"A launcher still there {HANG_GRACE_S:g} s after its ranks ran (or "
        f"{TIMEOUT_BASE_S:g} s + {TIMEOUT_PER_HOST_S:g} s per host in all) is killed with "
        "whatever it left on the hosts, and counted as hung. "
        f"The runs took {report.elapsed_s:.0f} s; load averages after each repetition: "
        f"{'; '.join(report.load) or '—'}.",
        "",
        "| hosts x ranks | launcher | all running | ended | ratio, all running | ratio, ended |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for count in report.hosts:
        for slots in report.slots:
            mpirun = report.of("mpirun", count, slots, "true")
            for launcher in report.launchers:
                s = report.of(launcher, count, slots, "true")
                lines.append(
                    f"| {count} x {slots} | {launcher} | {spread(s.values('running_s'))} | "
                    f"{spread(s.values('ended_s'))}{not_done(s)} | "
                    f"{ratio_spread(s, mpirun, 'running_s')} | "
                    f"{ratio_spread(s, mpirun, 'ended_s')} |"
                )
    lines += [
        "",
        "Teardown after a failure (1 rank per host; the last rank exits 1 once every rank "
        "runs, the others sleep): from that rank's exit until no other rank is left on any "
        "host, and until the launcher has exited. The launcher's cost, in the job above "
        "(`true`, 1 rank per host): CPU time of the launcher and every process it started "
        "on this machine (mpirun's `ssh` clients; a cpuacct cgroup per run), the launcher "
        "process's peak RSS (VmHWM), its peak threads and open files, and its child "
        "processes and their RSS together (sampled every 200 ms); per host: divided by the "
        "hosts.",
        "",
        "| hosts | launcher | failure to no rank left, ms | failure to launcher exit, ms | "
        "CPU, ms | CPU per host, ms | peak RSS, MiB | RSS per host, MiB | threads | fds | "
        "children | children's RSS, MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for count in report.hosts:
        for launcher in report.launchers:
            fail = report.of(launcher, count, 1, "fail")
            cost = report.of(launcher, count, 1, "true")
            cpu, rss = cost.median("cpu_s"), cost.median("rss_mib")
            lines.append(
                f"| {count} | {launcher} | {spread(fail.values('teardown_s'))}{not_done(fail)} | "
                f"{spread(fail.values('exit_after_failure_s'))} | "
                f"{spread(cost.values('cpu_s'))} | "
                f"{'—' if cpu is None else f'{cpu / count * 1000:.1f}'} | "
                f"{spread(cost.values('rss_mib'), 1.0)} | "
                f"{'—' if rss is None else f'{rss / count:.2f}'} | "
                f"{fmt(cost.median('threads'))} | {fmt(cost.median('fds'))} | "
                f"{fmt(cost.median('children'))} | {fmt(cost.median('children_rss_mib'))} |"
            )
    lines += ["", *render_scale_targets(report), ""]
    if report.notes:
        lines += ["Runs that hung or failed (first few):", ""]
        lines += [f"- {note}" for note in report.notes] + [""]
    return lines


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def render_scale_targets(report: ScaleReport) -> list[str]:
    """Issue 28's targets at the largest size, against the smallest."""
    low, high = min(report.hosts), max(report.hosts)
    d_high, d_low = report.of("dtrain", high, 1, "true"), report.of("dtrain", low, 1, "true")
    m_high = report.of("mpirun", high, 1, "true")
    lines = [f"Targets at {high} hosts (1 rank per host):", ""]
    mine, theirs = d_high.median("ended_s"), m_high.median("ended_s")
    if theirs is None:
        lines.append(
            f"- launch <= 1.0x mpirun: not measurable, mpirun finished no run "
            f"({m_high.hangs()} hung, {m_high.failures()} failed); dtrain's growth is the measure"
        )
    else:
        lines.append(f"- launch <= 1.0x mpirun: {ratio(mine, theirs)}x (ended, medians)")
    grown = ratio(mine, d_low.median("ended_s"))
    lines.append(f"- growth {low} -> {high} hosts <= {high // low}x: {grown}x (ended, medians)")
    tear = report.of("dtrain", high, 1, "fail").median("teardown_s")
    shown = fmt(None if tear is None else tear * 1000)
    lines.append(f"- teardown after a failure <= 1 s: {shown} ms (failure to no rank left)")
    for name, label in (("cpu_s", "CPU"), ("rss_mib", "RSS")):
        top, bottom = d_high.median(name), d_low.median(name)
        per = None if top is None or bottom is None else (top / high) / (bottom / low)
        shown = "—" if per is None else f"{per:.2f}x"
        lines.append(f"- {label} per host at {high} hosts within 1.5x of that at {low}: {shown}")
    return lines


def chart_lines(report: ScaleReport) -> dict[str, list[tuple[float, float]]]:
    """Median *ended* (ms) against hosts, per launcher and ranks per host."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for launcher in report.launchers:
        for slots in report.slots:
            points = []
            for count in report.hosts:
                value = report.of(launcher, count, slots, "true").median("ended_s")
                if value is not None:
                    points.append((float(count), value * 1000))
            lines[f"{launcher}, {slots} per host"] = points
    return lines
