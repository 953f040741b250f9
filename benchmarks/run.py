"""Every benchmark, side by side: writes docs/benchmarks.md (tables) and its PNG charts.

    python benchmarks/run.py            # everything but mpi4py's suite (benchmarks/mpi4py_suite.py:
                                        # an hour of MPI tests); tens of minutes; SSH ones need root
    python benchmarks/run.py --quick    # a smaller pass: local launch, teardown, memory, simulation

In this file's own sections (local launch, teardown, memory, 1,000 simulated hosts) every
table is re-measured; the full pass also reruns the older benchmarks, which rewrite their
own sections (output throughput, launch over SSH, ring-allreduce).  Charts go to
``docs/benchmarks/*.png`` (``pip install -e '.[bench]'`` for matplotlib; without it the
tables are written and the charts are left out).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import launch_local  # noqa: E402
import scale_sim  # noqa: E402
import teardown_memory  # noqa: E402
from common import CHARTS, DOC, REPO, Section, table, write_chart  # noqa: E402

OVERVIEW = "## Overview: every target"
# Paths relative to the repository (the scripts run there): each quotes its own command line
# in the document, which must not name this machine's checkout.
DOC_PATH = str(DOC.relative_to(REPO))
OLDER = [  # (script, its arguments): each writes its own section of the document
    ("log_throughput.py", ["--reps", "3", "--write", DOC_PATH]),
    ("launch_ssh.py", ["--write", DOC_PATH]),
    ("ring_allreduce.py", ["--write", str(DOC.parent.relative_to(REPO))]),
    ("collapse_cost.py", ["--reps", "3", "--write", DOC_PATH]),
]


def replace_section(text: str, title: str, block: str) -> str:
    """``text`` with the ``## title`` section replaced by ``block`` (or appended)."""
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.strip() == title), None)
    if start is None:
        return text.rstrip("\n") + "\n\n" + block.rstrip("\n") + "\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join([*lines[:start], block.rstrip("\n"), "", *lines[end:]]).rstrip("\n") + "\n"


def render(section: Section, charts: dict[str, Path | None]) -> str:
    images = [
        f"![{chart.title}](benchmarks/{chart.name}.png)"
        for chart in section.charts
        if charts.get(chart.name) is not None
    ]
    return "\n".join([section.title, "", *section.body, *images, ""])


def overview(sections: Sequence[Section], quick: bool, seconds: float) -> str:
    rows = [list(row) for section in sections for row in section.summary]
    return "\n".join(
        [
            OVERVIEW,
            "",
            f"`python benchmarks/run.py{' --quick' if quick else ''}` "
            f"({time.strftime('%Y-%m-%d %H:%M')}, "
            f"{seconds:.0f} s). Each row comes from a section below, which says how it was "
            "measured and on what machine.",
            "",
            *table(["what", "dtrain", "peer", "target"], rows),
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs, smaller sizes")
    parser.add_argument("--baseline", help="also time local launch of dtrain at this git ref")
    parser.add_argument("--skip-older", action="store_true", help="not the older benchmarks")
    args = parser.parse_args(argv)
    began = time.monotonic()
    sections = [
        launch_local.run(args.quick, args.baseline),
        *teardown_memory.run(args.quick),
        scale_sim.run(args.quick),
    ]
    if not args.quick and not args.skip_older:
        for script, script_args in OLDER:
            print(f"running {script}", file=sys.stderr)
            subprocess.run(
                [sys.executable, str(HERE / script), *script_args],
                check=False,
                env=os.environ,
                cwd=REPO,
            )
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if OVERVIEW not in text:  # first: after the document's title
        head, _, rest = text.partition("\n## ")
        text = head.rstrip("\n") + "\n\n" + OVERVIEW + "\n\n" + ("## " + rest if rest else "")
    text = replace_section(text, OVERVIEW, overview(sections, args.quick, time.monotonic() - began))
    for section in sections:
        charts = {chart.name: write_chart(chart, CHARTS) for chart in section.charts}
        text = replace_section(text, section.title, render(section, charts))
    DOC.write_text(text)
    print(f"wrote {DOC} and {CHARTS}/*.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
