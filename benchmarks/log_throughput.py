"""Output throughput: ``dtrain run --plain`` against ``mpirun --tag-output``.

8 ranks each write 200,000 lines of 80 bytes (rank and sequence number in
every line) to stdout in large chunks, as fast as they can.  Each launcher's
stdout goes to a pipe that this script reads to the end; then every line is
checked: present exactly once, whole, in order within its rank, under the
right tag.  Runs are interleaved (dtrain, mpirun, dtrain --quiet, dtrain,
...) so that both see the same machine; the table shows medians.

Measured per run:

* wall time, from starting the launcher until it exited and its stdout ended;
* lines per second: all lines of all ranks / wall time;
* launcher CPU: ``utime + stime`` of the launcher process itself (its
  threads included, its children not) from ``/proc/PID/stat``, sampled every
  20 ms, the last sample taken when it is a zombie, before it is reaped.
  mpirun's pid stays the same when it execs into prterun;
* all CPU: the launcher and every descendant it reaped (ranks, dtrain's
  watchdogs, prted), from ``getrusage(RUSAGE_CHILDREN)``.

``dtrain`` also writes every line to its job directory (``rank.N.log``, with a
timestamp), which mpirun does not; ``--quiet`` keeps only that (nothing on
the terminal).  The job directory is checked like the pipe.

    python benchmarks/log_throughput.py [--reps 3] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import read_stat

RANKS = 8
LINES = 200_000
LINE_BYTES = 80
CHUNK_LINES = 8192  # ~640 KiB per write
SAMPLE_S = 0.02
READ_BYTES = 1 << 20
SECTION = "## Output throughput: dtrain vs mpirun --tag-output"
TARGET_RATIO = 4.0  # dtrain's rate / mpirun's (issue 28)
TARGET_FLOOR = 0.8  # dtrain's rate / the one pipe's (issue 28)

# "rank=003 seq=000000042 " is 23 bytes; the filler makes the line 80 with its newline.
LINE_HEAD = b"rank=%03d seq=%09d "
FILLER = (b"abcdefghijklmnopqrstuvwxyz0123456789" * 2)[: LINE_BYTES - 23 - 1]
LINE_TEMPLATE = LINE_HEAD + FILLER + b"\n"

PRODUCER = f"""\
import os
import sys

rank = int(os.environ.get("RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
lines, chunk_lines = int(sys.argv[1]), {CHUNK_LINES}
template = {LINE_TEMPLATE!r}
for start in range(0, lines, chunk_lines):
    view = memoryview(
        b"".join([template % (rank, seq) for seq in range(start, min(lines, start + chunk_lines))])
    )
    while view:
        view = view[os.write(1, view) :]
"""

DTRAIN_TAG = re.compile(rb"\[(\d+)\] ")
MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<stdout>: ")
LOG_PREFIX = re.compile(rb"\d+\.\d+ o ")


def expected_lines(rank: int, lines: int) -> list[bytes]:
    """What rank ``rank`` writes, one line each, without the newline."""
    template = LINE_TEMPLATE[:-1]
    return [template % (rank, seq) for seq in range(lines)]


@dataclass(frozen=True)
class Check:
    ok: bool
    lines: int  # lines of rank output found
    detail: str


def check_ranks(per_rank: dict[int, list[bytes]], foreign: int, lines: int) -> Check:
    """Every line of every rank once, whole, in order, under its own rank's tag."""
    problems: list[str] = []
    if foreign:
        problems.append(f"{foreign} lines without a rank tag")
    if sorted(per_rank) != list(range(RANKS)):
        problems.append(f"ranks seen: {sorted(per_rank)}")
    found = 0
    for rank in range(RANKS):
        got = per_rank.get(rank, [])
        found += len(got)
        want = expected_lines(rank, lines)
        if got == want:
            continue
        counts = Counter(got)
        wanted = set(want)
        missing = sum(1 for line in want if line not in counts)
        duplicated = sum(n - 1 for line, n in counts.items() if n > 1 and line in wanted)
        torn = sum(n for line, n in counts.items() if line not in wanted)
        in_order = [line for line in got if line in wanted]
        disorder = sum(1 for a, b in itertools.pairwise(in_order) if a >= b)
        problems.append(
            f"rank {rank}: {len(got)} lines, {missing} missing, {duplicated} duplicated, "
            f"{torn} torn or foreign, {disorder} out of order"
        )
    detail = "; ".join(problems) if problems else f"all {found:,} lines ok"
    return Check(not problems, found, detail)


def check_tagged(data: bytes, tag: re.Pattern[bytes], lines: int) -> Check:
    """A launcher's stdout: ``<tag><line>`` per line, ranks interleaved."""
    per_rank: dict[int, list[bytes]] = {}
    foreign = 0
    if data and not data.endswith(b"\n"):
        foreign += 1  # a last line cut short
    for line in data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"):
        match = tag.match(line)
        if match is None:
            foreign += 1
            continue
        rank = int(match[1])
        group = per_rank.get(rank)
        if group is None:
            group = per_rank[rank] = []
        group.append(line[match.end() :])
    return check_ranks(per_rank, foreign, lines)


def check_job_dir(job_root: Path, lines: int) -> Check:
    """dtrain's ``rank.N.log`` files: ``<unix time> o <line>`` per line."""
    logs = list(job_root.glob("*/rank.*.log"))
    per_rank: dict[int, list[bytes]] = {}
    foreign = 0
    for path in logs:
        rank = int(path.name.split(".")[1])
        group = per_rank[rank] = []
        for line in path.read_bytes().split(b"\n")[:-1]:
            match = LOG_PREFIX.match(line)
            if match is None:
                foreign += 1
            else:
                group.append(line[match.end() :])
    return check_ranks(per_rank, foreign, lines)


@dataclass(frozen=True)
class Run:
    wall_s: float
    launcher_cpu_s: float
    all_cpu_s: float
    stdout: bytes
    stderr: bytes
    returncode: int


def drain(fd: int, into: list[bytes]) -> None:
    while True:
        chunk = os.read(fd, READ_BYTES)
        if not chunk:
            return
        into.append(chunk)


def run_launcher(argv: list[str], env: dict[str, str]) -> Run:
    """Run ``argv`` with stdout and stderr to pipes read here; measure wall and CPU time."""
    out: list[bytes] = []
    err: list[bytes] = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert popen.stdout is not None and popen.stderr is not None
    readers = [
        threading.Thread(target=drain, args=(popen.stdout.fileno(), out)),
        threading.Thread(target=drain, args=(popen.stderr.fileno(), err)),
    ]
    for reader in readers:
        reader.start()
    cpu_s = 0.0
    while True:  # not reaped until it is a zombie: the last sample is its final CPU time
        sample = read_stat(popen.pid)
        if sample is None:
            break
        state, cpu_s = sample
        if state in ("Z", "X"):
            break
        time.sleep(SAMPLE_S)
    returncode = popen.wait()
    for reader in readers:
        reader.join()
    wall_s = time.perf_counter() - started
    popen.stdout.close()
    popen.stderr.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    all_cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Run(wall_s, cpu_s, all_cpu_s, b"".join(out), b"".join(err), returncode)


@dataclass(frozen=True)
class Config:
    name: str
    argv: Callable[[Path], list[str]]  # job-dir root -> command line
    check_stdout: re.Pattern[bytes] | None
    job_dir: bool
    env: dict[str, str] | None = None  # added to the environment (a baseline's PYTHONPATH)
    floor: bool = False  # no launcher: the ranks' output straight into the one pipe


# The floor: the 8 ranks writing straight into the one pipe that is read here, no launcher
# between (what no launcher can beat on this machine).  Their chunks interleave untagged
# (a write of more than PIPE_BUF bytes may be split): counted, not checked.
FLOOR_SHELL = 'for r in 0 1 2 3 4 5 6 7; do RANK=$r "$@" & done; wait'


@dataclass(frozen=True)
class Result:
    run: Run
    stdout_check: Check | None
    job_dir_check: Check | None


def configs(
    dtrain: str,
    mpirun: str,
    producer: Path,
    lines: int,
    quiet: bool,
    baseline: Path | None = None,
) -> list[Config]:
    program = [sys.executable, str(producer), str(lines)]
    mpi_extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    dtrain_base = [dtrain, "run", "-np", str(RANKS), "--plain"]
    found = [
        Config(
            "dtrain --plain",
            lambda root: [*dtrain_base, "--job-dir", str(root), *program],
            DTRAIN_TAG,
            True,
        ),
        Config(
            "mpirun --tag-output",
            lambda root: [
                mpirun,
                *mpi_extra,
                "-np",
                str(RANKS),
                "--oversubscribe",
                "--bind-to",
                "none",
                "--tag-output",
                *program,
            ],
            MPI_TAG,
            False,
        ),
    ]
    found.append(
        Config(
            "one pipe (floor)",
            lambda root: ["sh", "-c", FLOOR_SHELL, "sh", *program],
            None,
            False,
            floor=True,
        )
    )
    if baseline is not None:  # the code before a change, interleaved with it
        found.insert(
            1,
            Config(
                "dtrain --plain (baseline)",
                # (its own entry point: this checkout's console script may import a module
                # the baseline lacks; -P: nothing from the working directory)
                lambda root: [
                    sys.executable,
                    "-P",
                    "-m",
                    "launcher",
                    *dtrain_base[1:],
                    "--job-dir",
                    str(root),
                    *program,
                ],
                DTRAIN_TAG,
                True,
                env={"PYTHONPATH": str(baseline)},
            ),
        )
    if quiet:
        found.append(
            Config(
                "dtrain --quiet",
                lambda root: [*dtrain_base, "--quiet", "--job-dir", str(root), *program],
                None,
                True,
            )
        )
    return found


def run_config(config: Config, env: dict[str, str], lines: int) -> Result:
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        root = Path(tmp) / "jobs"
        run = run_launcher(config.argv(root), {**env, **(config.env or {})})
        if run.returncode != 0:
            sys.stderr.write(run.stderr.decode("utf-8", "replace")[-2000:])
            raise SystemExit(f"{config.name}: exit code {run.returncode}")
        stdout_check = (
            check_tagged(run.stdout, config.check_stdout, lines) if config.check_stdout else None
        )
        if config.floor:
            count = run.stdout.count(b"\n")
            want = RANKS * lines
            stdout_check = Check(count == want, count, f"{count:,} of {want:,} lines (counted)")
        elif config.check_stdout is None and run.stdout:
            stdout_check = Check(False, 0, f"{len(run.stdout)} bytes on stdout with --quiet")
        job_check = check_job_dir(root, lines) if config.job_dir else None
    return Result(
        Run(run.wall_s, run.launcher_cpu_s, run.all_cpu_s, b"", b"", 0), stdout_check, job_check
    )


def median(values: list[float]) -> float:
    return statistics.median(values)


def describe_check(results: list[Result]) -> str:
    parts: list[str] = []
    for label, checks in (
        ("pipe", [r.stdout_check for r in results]),
        ("job dir", [r.job_dir_check for r in results]),
    ):
        present = [c for c in checks if c is not None]
        if not present:
            continue
        bad = [c for c in present if not c.ok]
        if bad:
            parts.append(f"{label}: FAILED in {len(bad)}/{len(present)} runs ({bad[0].detail})")
        else:
            parts.append(f"{label}: {present[0].lines:,} lines ok x{len(present)}")
    return "; ".join(parts)


def table(names: list[str], results: dict[str, list[Result]], total_lines: int) -> list[str]:
    rows = [
        "| launcher | wall s (median) | lines/s (median) | launcher CPU s | all CPU s "
        "| runs (wall s) | every line checked |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name in names:
        runs = results[name]
        walls = [r.run.wall_s for r in runs]
        wall = median(walls)
        rows.append(
            f"| `{name}` | {wall:.2f} | {total_lines / wall:,.0f} "
            f"| {median([r.run.launcher_cpu_s for r in runs]):.2f} "
            f"| {median([r.run.all_cpu_s for r in runs]):.2f} "
            f"| {', '.join(f'{w:.2f}' for w in walls)} | {describe_check(runs)} |"
        )
    return rows


def rate(results: list[Result], total_lines: int) -> float:
    return total_lines / median([r.run.wall_s for r in results])


def best_rate(results: list[Result], total_lines: int) -> float:
    return total_lines / min(r.run.wall_s for r in results)


def section(
    rows: list[str],
    summary: list[str],
    reps: int,
    lines: int,
    mpirun_version: str,
    load: tuple[float, float],
) -> str:
    cpus = os.cpu_count()
    return "\n".join(
        [
            SECTION,
            "",
            f"`{' '.join(['python benchmarks/log_throughput.py', *sys.argv[1:]])}` "
            f"({time.strftime('%Y-%m-%d')}).",
            "",
            f"Machine: {cpus} cores ({platform.machine()}, Linux {platform.release()}), "
            f"Python {platform.python_version()}, {mpirun_version}. "
            f"{RANKS} ranks on this one machine (oversubscribed), each writing {lines:,} lines "
            f"of {LINE_BYTES} bytes (rank and sequence number in each) to stdout in "
            f"~{CHUNK_LINES * LINE_BYTES // 1024} KiB writes, as fast as it can: "
            f"{RANKS * lines:,} lines, {RANKS * lines * LINE_BYTES / 1e6:.0f} MB. "
            "The launcher's stdout is a pipe that the benchmark reads to the end. "
            f"{reps} runs of each launcher, interleaved in the same session "
            "(one run of each launcher in turn, repeated); medians. "
            f"Load average before / after: {load[0]:.1f} / {load[1]:.1f} "
            "(other work shares the machine; interleaving spreads it over all rows).",
            "",
            "* `dtrain run -np 8 --plain --job-dir TMP python producer.py`: tagged lines on the "
            "pipe **and** every line in the job directory (`rank.N.log`, timestamped).",
            "* `mpirun -np 8 --oversubscribe --bind-to none --tag-output python producer.py` "
            "(Open MPI; no job directory).",
            *(
                ["* `dtrain ... --quiet`: nothing on the pipe, the job directory only."]
                if any("--quiet" in row for row in rows)
                else []
            ),
            "",
            "Wall: start of the launcher until it exited and its stdout ended. Lines/s: all "
            "lines / wall. Launcher CPU: utime+stime of the launcher process itself (its "
            "threads, not its children) from `/proc/PID/stat`, sampled every 20 ms, last "
            "sample taken as a zombie before reaping (mpirun execs into prterun: same pid). "
            "All CPU: the launcher plus every descendant it reaped (ranks, dtrain's "
            "watchdogs, prted), from `getrusage(RUSAGE_CHILDREN)`. Every line is checked, "
            "on the pipe and in the job directory: present exactly once, whole, in order "
            "within its rank, under its own rank's tag (`[R] ` for dtrain, `[1,R]<stdout>: ` "
            "for mpirun).",
            "",
            *rows,
            "",
            *summary,
            "",
        ]
    )


def write_section(path: Path, text: str, title: str = SECTION) -> None:
    """Replace (or append) only the section ``title``; others' sections stay as they are."""
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = current.split("\n")
    start = next((i for i, line in enumerate(lines) if line.strip() == title), None)
    if start is None:
        new = current.rstrip("\n") + "\n\n" + text
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        before = "\n".join(lines[:start]).rstrip("\n")
        after = "\n".join(lines[end:]).strip("\n")
        new = (before + "\n\n" if before else "") + text + ("\n" + after + "\n" if after else "")
    path.write_text(new.rstrip("\n") + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="runs of each launcher (default 5)")
    parser.add_argument("--lines", type=int, default=LINES, help="lines per rank")
    parser.add_argument("--no-quiet", action="store_true", help="skip the dtrain --quiet row")
    parser.add_argument("--dtrain", default=str(Path(sys.executable).parent / "dtrain"))
    parser.add_argument(
        "--mpirun",
        default=shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun",
    )
    parser.add_argument("--write", type=Path, help="replace this benchmark's section there")
    parser.add_argument(
        "--baseline", type=Path, help="also run dtrain from this checkout (PYTHONPATH), interleaved"
    )
    args = parser.parse_args()
    lines: int = args.lines

    load_before = os.getloadavg()[0]
    env = dict(os.environ)
    env.pop("DTRAIN_JOB_DIR", None)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        producer = Path(tmp) / "producer.py"
        producer.write_text(PRODUCER)
        chosen = configs(
            args.dtrain, args.mpirun, producer, lines, not args.no_quiet, args.baseline
        )
        names = [c.name for c in chosen]
        results: dict[str, list[Result]] = {name: [] for name in names}
        for rep in range(args.reps):
            for config in chosen:
                result = run_config(config, env, lines)
                results[config.name].append(result)
                print(
                    f"# run {rep + 1}/{args.reps} {config.name}: {result.run.wall_s:.2f} s, "
                    f"launcher CPU {result.run.launcher_cpu_s:.2f} s, "
                    f"{describe_check([result])}",
                    file=sys.stderr,
                    flush=True,
                )

    total = RANKS * lines
    rows = table(names, results, total)
    dtrain_rate = rate(results["dtrain --plain"], total)
    mpi_rate = rate(results["mpirun --tag-output"], total)
    ratio = dtrain_rate / mpi_rate
    best_ratio = best_rate(results["dtrain --plain"], total) / best_rate(
        results["mpirun --tag-output"], total
    )
    all_ok = all(
        c.ok
        for runs in results.values()
        for r in runs
        for c in (r.stdout_check, r.job_dir_check)
        if c is not None
    )
    summary = [
        f"**dtrain / mpirun rate: {ratio:.2f}x** "
        f"(target ≥ {TARGET_RATIO:.0f}x: {'met' if ratio >= TARGET_RATIO else 'not met'}); "
        f"every line checked: {'all runs intact' if all_ok else 'FAILURES, see table'}.",
        f"Best run against best run: {best_ratio:.2f}x.",
    ]
    floor = "one pipe (floor)"
    if floor in results:
        against_floor = dtrain_rate / rate(results[floor], total)
        summary.append(
            f"**dtrain / one pipe: {against_floor:.2f}x** (target ≥ {TARGET_FLOOR}x: "
            f"{'met' if against_floor >= TARGET_FLOOR else 'not met'}; the floor "
            f"{rate(results[floor], total) / 1e6:.2f} M lines/s)."
        )
    before = "dtrain --plain (baseline)"
    if before in results:
        summary.append(
            f"The baseline ({args.baseline}): {rate(results[before], total) / mpi_rate:.2f}x "
            f"mpirun, {rate(results[before], total) / 1e6:.2f} M lines/s; this tree "
            f"{dtrain_rate / 1e6:.2f} M lines/s."
        )
    if "dtrain --quiet" in results:
        quiet_rate = rate(results["dtrain --quiet"], total)
        summary.append(
            f"dtrain --quiet / mpirun: {quiet_rate / mpi_rate:.2f}x "
            "(the job directory alone, nothing on the pipe)."
        )
    version = subprocess.run(
        [args.mpirun, "--version"], capture_output=True, text=True, check=False
    ).stdout.split("\n")[0]
    print("\n".join([*rows, "", *summary]))
    if args.write is not None:
        write_section(
            args.write,
            section(
                rows,
                summary,
                args.reps,
                lines,
                version.strip(),
                (load_before, os.getloadavg()[0]),
            ),
        )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
