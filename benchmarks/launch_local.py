"""Local launch: 8 x ``true`` with dtrain, mpirun and torchrun on this machine.

Each configuration is a fresh launcher process, timed from ``Popen`` to its exit
(``common.run_launcher``); runs are interleaved (every configuration once per round,
the order turning each round) after one warm-up round that is not counted.

* ``dtrain run -np 8 --plain true``, its output on a pipe;
* ``dtrain run -np 8 true`` on a pseudo-terminal (TERM=xterm-256color): the terminal view
  (its live status region starts 0.3 s into a job: a job this short prints its lines and
  one closing status line, without loading rich);
* ``mpirun --allow-run-as-root --oversubscribe -np 8 true`` (Open MPI);
* ``torchrun --nproc-per-node 8 --no-python true``;
* with ``--baseline REF``, dtrain as it was at git REF (a worktree of it, the same
  Python), ``--plain``: before and after; ``--baseline-tree DIR`` takes a checkout that
  is already there instead (nothing is added to git).

dtrain runs as a user's install runs it: its ``dtrain`` console script in a virtual
environment of its own (made in a scratch folder, the same Python) whose ``.pth`` file puts
the checkout and this environment's packages (click, rich...) on ``sys.path``; not this
checkout's development install (``pip install -e``), whose import hook (setuptools'
editable finder: ``pathlib``, ``importlib.util``...) every start of ``.venv/bin/dtrain``
loads first.  The baseline runs the same way from its own tree.  ``--dev-install`` times
``.venv/bin/dtrain`` instead.

Every dtrain run gets a fresh ``--job-dir`` root (the job directory is part of its work).
Every launcher runs in a scratch directory.

    python benchmarks/launch_local.py [--quick | --reps N] [--baseline REF | --baseline-tree DIR]
        [--dev-install] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    BIN,
    REPO,
    Chart,
    Sample,
    Section,
    Series,
    bench_env,
    describe_machine,
    interleave,
    machine_line,
    ratio,
    run_launcher,
    spread,
    table,
)

TITLE = "## Local launch: 8 x true, dtrain vs mpirun vs torchrun"
RANKS = 8
TARGET_MPIRUN = 4.0  # dtrain at most 4x mpirun's wall time
TARGET_TORCHRUN = 0.05  # ...and at most 0.05x torchrun's


# pip's console script, as ``pip install`` writes it for ``[project.scripts]``.
CONSOLE_SCRIPT = """#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from {module} import {function}
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit({function}())
"""


def install(tree: Path, into: Path) -> Path:
    """``tree`` installed as a user's ``pip install`` leaves it (a virtual environment
    whose ``.pth`` names the tree, and this one's packages for its dependencies, and a
    ``dtrain`` console script); the script's path."""
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", "--without-pip", str(into)], check=True)
    python = into / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]  # click, rich...: not this folder's .pth files
    (Path(site) / "dtrain.pth").write_text(f"{tree}\n{ours}\n")
    module, function = entry_point(tree).split(":")
    script = into / "bin" / "dtrain"
    script.write_text(CONSOLE_SCRIPT.format(python=python, module=module, function=function))
    script.chmod(0o755)
    return script


def entry_point(tree: Path) -> str:
    """The ``dtrain`` script's ``module:function`` in ``tree``'s pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    with open(tree / "pyproject.toml", "rb") as file:
        return str(tomllib.load(file)["project"]["scripts"]["dtrain"])


def dtrain_argv(script: Path, extra: Sequence[str], job_root: Path) -> list[str]:
    return [str(script), "run", "-np", str(RANKS), *extra, "--job-dir", str(job_root), "true"]


def configurations(
    baseline: Path | None, scratch: Path, dev_install: bool = False
) -> list[tuple[Series, Callable[[], Sample]]]:
    env = bench_env()
    term_env = bench_env({"TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"})
    mpirun = [
        str(BIN / "mpirun"),
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(RANKS),
        "true",
    ]
    torchrun = [str(BIN / "torchrun"), "--nproc-per-node", str(RANKS), "--no-python", "true"]

    ours = BIN / "dtrain" if dev_install else install(REPO, scratch / "installed")

    def dtrain(script: Path, extra: Sequence[str], terminal: bool) -> Callable[[], Sample]:
        run_env = dict(term_env if terminal else env)

        def run() -> Sample:
            root = Path(tempfile.mkdtemp(dir=scratch))
            try:
                return run_launcher(
                    dtrain_argv(script, extra, root), run_env, terminal=terminal, cwd=scratch
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)

        return run

    found = [
        (
            Series("dtrain --plain", f"dtrain run -np {RANKS} --plain true"),
            dtrain(ours, ["--plain"], False),
        ),
        (Series("dtrain (live view, pty)", f"dtrain run -np {RANKS} true"), dtrain(ours, [], True)),
        (
            Series("mpirun", " ".join(["mpirun", *mpirun[1:]])),
            lambda: run_launcher(mpirun, env, cwd=scratch),
        ),
        (
            Series("torchrun", " ".join(["torchrun", *torchrun[1:]])),
            lambda: run_launcher(torchrun, env, cwd=scratch),
        ),
    ]
    if baseline is not None:
        found.append(
            (
                Series(
                    "dtrain --plain, before",
                    f"dtrain run -np {RANKS} --plain true (at {baseline.name})",
                ),
                dtrain(install(baseline, scratch / "installed-baseline"), ["--plain"], False),
            )
        )
    return found


def make_baseline(ref: str, scratch: Path) -> Path:
    """A worktree of ``ref`` (removed by ``remove_baseline``)."""
    tree = scratch / f"baseline-{ref}"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref],
        check=True,
        capture_output=True,
    )
    return tree


def remove_baseline(tree: Path) -> None:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
        check=False,
        capture_output=True,
    )


def measure(
    reps: int,
    baseline_ref: str | None,
    baseline_tree: Path | None = None,
    dev_install: bool = False,
) -> tuple[list[Series], dict[str, str]]:
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-bench-launch-"))
    made = make_baseline(baseline_ref, scratch) if baseline_ref else None
    baseline = made or baseline_tree
    try:
        pairs = configurations(baseline, scratch, dev_install)
        series = [s for s, _ in pairs]
        runs = [r for _, r in pairs]
        for run in runs:  # warm-up: caches, bytecode; not counted
            run()
        machine = describe_machine()
        interleave(series, runs, reps)
        machine["load average after"] = " ".join(f"{x:.2f}" for x in __import__("os").getloadavg())
        return series, machine
    finally:
        if made is not None:
            remove_baseline(made)
        shutil.rmtree(scratch, ignore_errors=True)


def render(
    series: list[Series], machine: dict[str, str], reps: int, command: str, dev_install: bool
) -> Section:
    by_name = {s.name: s for s in series}
    wall = lambda s: s.wall_s  # noqa: E731
    mpirun, torchrun = by_name["mpirun"].median(wall), by_name["torchrun"].median(wall)
    rows = []
    for s in series:
        rows.append(
            [
                f"`{s.command}`"
                if not s.name.startswith("dtrain (live")
                else f"`{s.command}` (pty)",
                spread(s.values(wall)),
                spread(s.values(lambda x: x.launcher_cpu_s)),
                spread(s.values(lambda x: x.all_cpu_s)),
                ratio(s.median(wall), mpirun),
                ratio(s.median(wall), torchrun),
                str(s.failures),
            ]
        )
    body = [
        f"`{command}`. {reps} runs of each, interleaved (one of each per round, the order "
        "turning), after one warm-up round. Times in ms: median (min-max). *Launcher CPU*: the "
        "launcher process alone (its threads); *all CPU*: it and every process it started and "
        "reaped (ranks, watchdogs, daemons). dtrain writes its job directory (plan, status, "
        "one log per rank) in every run; mpirun and torchrun keep no record. On the pty the "
        "live status region starts 0.3 s into a job: one this short prints its tagged lines and "
        "one closing status line without loading rich (the region itself is tested in "
        "tests/test_terminal.py). "
        + (
            "dtrain is this checkout's development install (`.venv/bin/dtrain`, `pip install "
            "-e`: setuptools' import hook loads first at every start)."
            if dev_install
            else "dtrain runs as a user's install does: its console script in a virtual "
            "environment of its own, the checkout on its path (not the development install's "
            "import hook)."
        ),
        "",
        f"Machine: {machine_line(machine)}.",
        "",
        *table(
            [
                "launcher",
                "wall ms",
                "launcher CPU ms",
                "all CPU ms",
                "/ mpirun",
                "/ torchrun",
                "failed",
            ],
            rows,
        ),
        "",
    ]
    summary = []
    for name in ("dtrain --plain", "dtrain (live view, pty)"):
        mine = by_name[name].median(wall)
        vs_mpirun, vs_torchrun = mine / mpirun, mine / torchrun
        met_mpirun, met_torchrun = vs_mpirun <= TARGET_MPIRUN, vs_torchrun <= TARGET_TORCHRUN
        verdict = (
            f"<= {TARGET_MPIRUN:g}x mpirun: {'met' if met_mpirun else 'missed'} "
            f"({vs_mpirun:.1f}x), <= {TARGET_TORCHRUN:g}x torchrun: "
            f"{'met' if met_torchrun else 'missed'} ({vs_torchrun:.3f}x)"
        )
        body.append(f"* {name}: {mine * 1000:.0f} ms: {verdict}")
        summary.append(
            (
                f"local launch, 8 x true ({name})",
                f"{mine * 1000:.0f} ms",
                f"mpirun {mpirun * 1000:.0f} ms, torchrun {torchrun * 1000:.0f} ms",
                verdict,
            )
        )
    chart = Chart(
        name="launch_local",
        title="Local launch, 8 x true (median wall time)",
        xlabel="",
        ylabel="ms",
        lines={s.name: [(0, s.median(wall) * 1000)] for s in series},
        bars=True,
        logy=True,
    )
    return Section(TITLE, body, [chart], summary)


def run(
    quick: bool,
    baseline: str | None = None,
    baseline_tree: Path | None = None,
    reps: int | None = None,
    dev_install: bool = False,
) -> Section:
    reps = reps or (5 if quick else 15)
    series, machine = measure(reps, baseline, baseline_tree, dev_install)
    command = "python benchmarks/launch_local.py" + (" --quick" if quick else "")
    if baseline:
        command += f" --baseline {baseline}"
    elif baseline_tree is not None:
        command += f" --baseline-tree {baseline_tree}"
    if dev_install:
        command += " --dev-install"
    return render(series, machine, reps, command, dev_install)


def write_section(section: Section, doc: Path) -> None:
    """Replace this benchmark's section of ``doc`` (and its chart), as run.py does."""
    from common import CHARTS, write_chart
    from run import render as render_section
    from run import replace_section

    charts = {chart.name: write_chart(chart, CHARTS) for chart in section.charts}
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    doc.write_text(replace_section(text, section.title, render_section(section, charts)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 15")
    parser.add_argument("--reps", type=int, help="rounds (default 15, 5 with --quick)")
    parser.add_argument("--baseline", help="also time dtrain as it was at this git ref")
    parser.add_argument(
        "--baseline-tree", type=Path, help="also time dtrain from this checkout (not git-made)"
    )
    parser.add_argument(
        "--dev-install",
        action="store_true",
        help="time this checkout's .venv/bin/dtrain (pip install -e) instead of an install",
    )
    parser.add_argument("--write", type=Path, help="replace this benchmark's section there")
    args = parser.parse_args(argv)
    section = run(args.quick, args.baseline, args.baseline_tree, args.reps, args.dev_install)
    print("\n".join([section.title, "", *section.body]))
    if args.write is not None:
        write_section(section, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
