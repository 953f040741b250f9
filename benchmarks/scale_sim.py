"""1,000 hosts x 8 ranks, simulated: dtrain's own cost as the job grows.

Every size runs in a fresh Python process (``--one HOSTS``) that drives the real job
layer (``launcher.run.job.run_job``: plan, survey, specs, supervisor, outlets, the job
directory) with ``simtransport.SimTransport`` in place of SSH and ``sim_survey`` in
place of the survey.  Measured there:

* planning: ``plan_job`` and ``build_job_specs`` for the host list (pure; also at 5,000
  hosts, where nothing is run);
* a whole job: every rank starts after its host's latency, prints 10 lines, exits 0
  after 0.2 s: the launcher's CPU time (``time.process_time``: all its threads, the
  simulator's one scheduler thread included), its peak memory (``ru_maxrss``), its
  threads and file descriptors at their peak, the time until every rank ran and the
  time to the end;
* teardown: rank 0 fails after 0.5 s while the others run on; the time from that
  failure until every rank has exited and until ``run_job`` returned;
* the end: from the last rank's exit until ``run_job`` returned (the job's end recorded in
  the job directory, the summary ready to print), in both runs.

    python benchmarks/scale_sim.py [--quick] [--write docs/benchmarks.md]
    python benchmarks/scale_sim.py --compare /tmp/base [--hosts 1000] [--reps 5]

``--compare TREE`` measures only the end, at one size, interleaved with another checkout
of dtrain (its own ``benchmarks/scale_sim.py --one``): medians with min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from types import MappingProxyType
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# dtrain itself: this checkout's, or another's (``--compare``: the same benchmark, on the
# code before a change).
TREE_VARIABLE = "SCALE_SIM_TREE"
sys.path.insert(0, os.environ.get(TREE_VARIABLE) or str(HERE.parent))
# Where the runs' job directories go (``--one`` leaves its own there).  They are removed
# only once every run is over: ext4 without a journal, as here, skips an inode deleted in
# the last 30 s when it allocates one ("recently_deleted"), so that 8,000 files removed
# just before a run made its 8,000 files cost 0.25 ms each instead of 0.015 ms; removed
# after each run, every run but the first measured the cleanup of the one before.  The
# root is in the home directory, as ``~/.dtrain/jobs`` is, not in /tmp, where other
# programs' temporary files come and go by the thousand (2 s for 8,000 files measured in
# a folder of /tmp while tests ran, 0.1 s in the home directory at the same time).
ROOT_VARIABLE = "SCALE_SIM_ROOT"


JOBS_IN = "SCALE_SIM_JOBS_IN"  # (--jobs-in: another folder than ~/.cache; /dev/shm: no disk)


def jobs_root() -> Path:
    """A new folder for the runs' job directories (removed by the caller)."""
    parent = Path(os.environ.get(JOBS_IN) or Path.home() / ".cache")
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="dtrain-sim-jobs-", dir=parent))


RANKS_PER_HOST = 8
TITLE = "## 1,000 hosts x 8 ranks, simulated"
TARGET_CPU_PER_RANK_S = 0.005
TARGET_PLAN_S = 1.0
TARGET_END_S = 0.5  # from the last rank's exit to run_job's return (issue 28)


class QuietFrontend:
    """The job's terminal, discarding everything (the job directory still gets every line)."""

    def open_view(
        self, job_id: str, plan: Any, remote: bool = False, attempt: int = 0
    ) -> tuple[Any, Any]:
        from launcher.view.lineviews import QuietView

        return QuietView(), nullcontext()

    def notice(self, text: str) -> None:
        pass


def host_list(hosts: int) -> str:
    return ",".join(f"sim{i:05d}:{RANKS_PER_HOST}" for i in range(hosts))


def config_for(hosts: int, job_dir: Path, grace_s: float = 1.0) -> Any:
    from launcher.core.config import JobConfig, PlacementConfig

    return JobConfig(
        command=("train",),
        placement=PlacementConfig(host_lists=(host_list(hosts),)),
        job_dir=str(job_dir),
        grace_s=grace_s,
    )


def time_planning(hosts: int, job_dir: Path) -> dict[str, float]:
    from simtransport import sim_survey

    from launcher.core.specs import build_job_specs
    from launcher.run.planning import plan_job

    config = config_for(hosts, job_dir)
    environ = {"PATH": "/usr/bin:/bin", "HOME": "/root"}
    began = time.perf_counter()
    plan = plan_job(config, environ)
    planned = time.perf_counter()
    site = sim_survey(plan, config, environ, "/tmp").site
    surveyed = time.perf_counter()
    specs = build_job_specs(plan, site, config, job_id="sim", extra={}, environ=environ, cwd="/tmp")
    built = time.perf_counter()
    assert len(specs) == hosts * RANKS_PER_HOST
    return {"plan_s": planned - began, "specs_s": built - surveyed}


def current_rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_sampler(into: dict[str, int], stop: threading.Event) -> None:
    while not stop.wait(0.05):
        into["threads"] = max(into.get("threads", 0), threading.active_count())
        into["fds"] = max(into.get("fds", 0), len(os.listdir("/proc/self/fd")))


def run_simulated(
    transport: Any,
    hosts: int,
    job_dir: Path,
    environ: Mapping[str, str] = MappingProxyType({"PATH": "/usr/bin:/bin", "HOME": "/root"}),
) -> Any:
    """The real job layer's ``run_job`` over ``hosts`` simulated hosts, through ``transport``
    (a ``SimTransport``); its outcome."""
    from simtransport import sim_survey

    from launcher.run.job import run_job

    return run_job(
        config_for(hosts, job_dir),
        dict(environ),
        QuietFrontend(),  # type: ignore[arg-type]
        survey=sim_survey,
        transports=lambda survey, config, env: transport,
    )


def run_job_once(hosts: int, job_dir: Path, fail: bool) -> dict[str, Any]:
    from simtransport import SimHosts, SimTransport

    sim = SimHosts(run_s=None if fail else 0.2, fail_rank=0 if fail else None)
    transport = SimTransport(sim)
    transport.expected = hosts * RANKS_PER_HOST
    peaks: dict[str, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=peak_sampler, args=(peaks, stop), daemon=True)
    sampler.start()
    base_rss = current_rss()  # dtrain loaded and the hosts planned once: before any rank
    cpu0, began = time.process_time(), time.monotonic()
    outcome = run_simulated(transport, hosts, job_dir)
    ended, cpu = time.monotonic(), time.process_time() - cpu0
    stop.set()
    sampler.join()
    result = outcome.result  # type: ignore[union-attr]
    started = sum(1 for p in transport.processes.values() if p.pid)
    return {
        "exit_code": result.exit_code,
        "ranks": len(transport.processes),
        "started": started,
        "ended": transport.ended,
        "cpu_s": cpu,
        "wall_s": ended - began,
        "start_s": (transport.all_running or ended) - began,
        "start_calls_s": (transport.last_start_call or ended) - (transport.first_start or began),
        "teardown_ranks_s": (transport.all_ended - transport.first_failure)
        if fail and transport.all_ended and transport.first_failure
        else None,
        "teardown_exit_s": (ended - transport.first_failure)
        if fail and transport.first_failure
        else None,
        "end_s": ended - transport.all_ended if transport.all_ended else None,
        "base_rss": base_rss,
        "threads": peaks.get("threads", 0),
        "fds": peaks.get("fds", 0),
        "logged_lines": sum(p.read_bytes().count(b"\n") for p in job_dir.glob("*/rank.*.log")),
    }


def one(hosts: int, run: bool, fail: bool) -> dict[str, Any]:
    root = os.environ.get(ROOT_VARIABLE)
    job_dir = Path(tempfile.mkdtemp(prefix="dtrain-sim-", dir=root))
    try:
        found: dict[str, Any] = {"hosts": hosts, **time_planning(hosts, job_dir)}
        if run:
            found.update(run_job_once(hosts, job_dir, fail))
        found["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return found
    finally:
        if root is None:  # (else removed with the root, after every run)
            shutil.rmtree(job_dir, ignore_errors=True)


def child_env(root: Path, tree: Path | None = None) -> dict[str, str]:
    env = {**os.environ, ROOT_VARIABLE: str(root)}
    env.pop(TREE_VARIABLE, None)
    return env if tree is None else {**env, TREE_VARIABLE: str(tree)}


def measure(sizes: Sequence[int], plan_only: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    root = jobs_root()
    try:
        for hosts in [*sizes, *plan_only]:
            for fail in (False, True) if hosts in sizes else (False,):
                args = ["--one", str(hosts)] + (["--fail"] if fail else [])
                if hosts not in sizes:
                    args.append("--plan-only")
                row = one_run(args, child_env(root))
                row["fail"] = fail
                rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def one_run(args: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """One size in a fresh process."""
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, check=False, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"scale_sim {args}: {done.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def run(quick: bool) -> Any:
    from common import Chart, Section, describe_machine, machine_line, table

    sizes = [10, 100, 300] if quick else [10, 100, 1000]
    plan_only = [1000] if quick else [5000]
    machine = describe_machine()
    rows = measure(sizes, plan_only)
    runs = [r for r in rows if "cpu_s" in r and not r["fail"]]
    fails = {r["hosts"]: r for r in rows if r["fail"]}
    lines = []
    for r in runs:
        ranks = r["hosts"] * RANKS_PER_HOST
        f = fails.get(r["hosts"], {})
        lines.append(
            [
                f"{r['hosts']:,}",
                f"{ranks:,}",
                f"{r['plan_s'] * 1000:.0f} + {r['specs_s'] * 1000:.0f}",
                f"{r['cpu_s']:.2f}",
                f"{r['cpu_s'] / ranks * 1000:.2f}",
                f"{r['cpu_s'] / r['hosts'] * 1000:.1f}",
                f"{r['peak_rss'] / 2**20:.0f}",
                f"{(r['peak_rss'] - r['base_rss']) / ranks / 1024:.1f}",
                f"{r['threads']:,}",
                f"{r['fds']:,}",
                f"{r['start_s']:.2f}",
                f"{r['wall_s']:.2f}",
                f"{f.get('teardown_ranks_s') or 0:.2f} / {f.get('teardown_exit_s') or 0:.2f}",
                f"{r['end_s'] or 0:.2f} / {f.get('end_s') or 0:.2f}",
                "ok"
                if r["started"] == r["ended"] == ranks and r["logged_lines"] == ranks * 10
                else "LOST",
            ]
        )
    plans = [
        [f"{r['hosts']:,}", f"{r['plan_s'] * 1000:.1f}", f"{r['specs_s'] * 1000:.1f}"]
        for r in rows
        if not r["fail"]
    ]
    body = [
        f"`python benchmarks/scale_sim.py{' --quick' if quick else ''}`. Simulated hosts "
        "(`benchmarks/simtransport.py`): each rank runs 5-10 ms after it is started (latency and "
        "jitter), prints 10 lines, exits 0 after 0.2 s; the real job layer plans, builds the "
        "specs, supervises, and writes the job directory (every line, status.json). One fresh "
        "process per size. CPU: the launcher process (all threads; the simulator's one scheduler "
        "thread included). RSS per rank: the peak less the RSS before the job started, per rank. "
        "Teardown: rank 0 fails after 0.5 s, the others run until signalled; "
        "from its failure until every rank exited / until `run_job` returned. "
        "End: from the last rank's exit until `run_job` returned (the job's end recorded, "
        "the summary ready), in the run where every rank exits 0 / where rank 0 fails. "
        "The job directories go to one folder in `~/.cache`, removed only after the last run "
        "(ext4 without a journal skips inodes deleted in the last 30 s when it makes a file: "
        "8,000 logs removed right before a run made its 8,000 logs cost 0.25 ms each "
        "instead of 0.015 ms).",
        "",
        f"Machine: {machine_line(machine)}.",
        "",
        *table(
            [
                "hosts",
                "ranks",
                "plan + specs ms",
                "CPU s",
                "CPU ms / rank",
                "CPU ms / host",
                "peak RSS MiB",
                "RSS KiB / rank",
                "threads",
                "fds",
                "all running s",
                "job s",
                "teardown s",
                "end s",
                "every rank, every line",
            ],
            lines,
        ),
        "",
        "Planning alone (pure: `plan_job` and `build_job_specs`):",
        "",
        *table(["hosts", "plan ms", "specs ms"], plans),
        "",
    ]
    biggest = runs[-1]
    per_rank = biggest["cpu_s"] / (biggest["hosts"] * RANKS_PER_HOST)
    plan_max = max(rows, key=lambda r: r["hosts"])
    plan_s = plan_max["plan_s"] + plan_max["specs_s"]
    end_s = max(biggest["end_s"] or 0, fails.get(biggest["hosts"], {}).get("end_s") or 0)
    summary = [
        (
            f"the job's end after the last rank's exit, {biggest['hosts']:,} simulated hosts",
            f"{end_s:.2f} s",
            "-",
            f"<= 0.5 s: {'met' if end_s <= TARGET_END_S else 'missed'}",
        ),
        (
            f"launcher CPU per rank, {biggest['hosts']:,} simulated hosts",
            f"{per_rank * 1000:.2f} ms",
            "-",
            f"<= 5 ms: {'met' if per_rank <= TARGET_CPU_PER_RANK_S else 'missed'}",
        ),
        (
            f"planning, {plan_max['hosts']:,} hosts",
            f"{plan_s * 1000:.0f} ms",
            "-",
            f"<= 1 s: {'met' if plan_s <= TARGET_PLAN_S else 'missed'}",
        ),
    ]
    charts = [
        Chart(
            "sim_cpu_per_rank",
            "Launcher CPU per rank (simulated hosts)",
            "hosts",
            "ms per rank",
            {
                "dtrain": [
                    (r["hosts"], r["cpu_s"] / r["hosts"] / RANKS_PER_HOST * 1000) for r in runs
                ]
            },
            logx=True,
        ),
        Chart(
            "sim_start",
            "Time until every rank runs (simulated hosts)",
            "hosts",
            "s",
            {"dtrain": [(r["hosts"], r["start_s"]) for r in runs]},
            logx=True,
        ),
        Chart(
            "sim_planning",
            "Planning time (plan + specs)",
            "hosts",
            "ms",
            {
                "dtrain": [
                    (r["hosts"], (r["plan_s"] + r["specs_s"]) * 1000) for r in rows if not r["fail"]
                ]
            },
            logx=True,
            logy=True,
        ),
    ]
    return Section(TITLE, body, charts, summary)


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def compare(baseline: Path, hosts: int, reps: int) -> str:
    """The end (and the whole job) interleaved: this tree against ``baseline``."""
    trees = {"before": baseline, "after": HERE.parent}
    found: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    root = jobs_root()
    try:
        for _ in range(reps):
            for fail in (False, True):
                for name, tree in trees.items():
                    args = ["--one", str(hosts)] + (["--fail"] if fail else [])
                    row = one_run(args, child_env(root, tree))
                    found.setdefault((name, fail), []).append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [f"{hosts:,} simulated hosts, {reps} runs of each, interleaved; medians (min-max):"]
    for fail in (False, True):
        for name in trees:
            rows = found[(name, fail)]
            lost = sum(1 for r in rows if r["logged_lines"] != r["ranks"] * 10)
            lines.append(
                f"  {'rank 0 fails' if fail else 'all exit 0  '} {name:6s}: end "
                f"{spread([r['end_s'] for r in rows])}, job {spread([r['wall_s'] for r in rows])}, "
                f"CPU {spread([r['cpu_s'] for r in rows])}"
                + (f", LOST lines in {lost} runs" if lost else "")
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10, 100 and 300 hosts")
    parser.add_argument("--one", type=int, help="(internal) one size, JSON on stdout")
    parser.add_argument("--fail", action="store_true", help="(internal) rank 0 fails")
    parser.add_argument("--plan-only", action="store_true", help="(internal) plan only")
    parser.add_argument("--compare", type=Path, help="the end only, against this checkout")
    parser.add_argument("--hosts", type=int, default=1000, help="with --compare (1000)")
    parser.add_argument("--reps", type=int, default=5, help="with --compare (5)")
    parser.add_argument("--write", type=Path, help="replace this benchmark's section there")
    parser.add_argument("--jobs-in", type=Path, help="the job directories' folder (~/.cache)")
    args = parser.parse_args(argv)
    if args.jobs_in is not None:
        os.environ[JOBS_IN] = str(args.jobs_in)
    if args.one is not None:
        print(json.dumps(one(args.one, not args.plan_only, args.fail)))
        return 0
    if args.compare is not None:
        print(compare(args.compare, args.hosts, args.reps))
        return 0
    section = run(args.quick)
    print("\n".join([section.title, "", *section.body]))
    if args.write is not None:
        from launch_local import write_section

        write_section(section, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
