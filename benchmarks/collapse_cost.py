"""What collapsing identical lines costs, and what it saves (``--collapse``).

Two producers, 8 ranks each writing 200,000 lines of 80 bytes in large chunks
(the log-throughput benchmark's producer and tags):

* distinct: every line carries its rank and sequence number, so nothing can
  collapse; this is the cost of looking (``--collapse`` against ``--no-collapse``);
* identical: every rank writes the same lines (sequence number only), so each
  line can print once for all 8 ranks; this is what it saves (bytes on the pipe).

Runs are interleaved (plain, collapse, plain, ...); medians.  The pipe's
content is checked: with ``--no-collapse`` every rank's line under its tag; with
``--collapse`` every line of every rank once expanded from its rank-set tag.

    python benchmarks/collapse_cost.py [--reps 3] [--lines 200000] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from log_throughput import CHUNK_LINES, PRODUCER, RANKS, Run, run_launcher, write_section

SECTION = "## Collapsing identical lines: cost and savings"
TARGET_FEWER = 7.0  # identical lines of 8 ranks: at least this many times fewer bytes (issue 28)
TARGET_RATE = 1_000_000  # ...at no fewer lines per second than this
SAME_PRODUCER = PRODUCER.replace("template % (rank, seq)", "template % (0, seq)")
TAG = re.compile(rb"^\[([\d,-]+)\] rank=(\d+) seq=(\d+) ", re.M)


def expand(ranks: bytes) -> list[int]:
    found: list[int] = []
    for part in ranks.decode().split(","):
        first, _, last = part.partition("-")
        found.extend(range(int(first), int(last or first) + 1))
    return found


def check(stdout: bytes, lines: int, same: bool) -> str:
    """Every rank's every line present once, in order within the rank (tags expanded)."""
    seen: dict[int, list[int]] = {r: [] for r in range(RANKS)}
    for match in TAG.finditer(stdout):
        for rank in expand(match[1]):
            if not same and int(match[2]) != rank:
                return f"rank {rank}'s tag on rank {int(match[2])}'s line"
            seen[rank].append(int(match[3]))
    bad = [r for r, seqs in seen.items() if seqs != list(range(lines))]
    return "ok" if not bad else f"ranks {bad} lost or reordered lines"


def one_run(
    dtrain: str, producer: Path, lines: int, collapse: bool, tree: Path | None = None
) -> tuple[Run, int, str]:
    """One run (``tree``: dtrain from that checkout, by PYTHONPATH: a baseline)."""
    flag = "--collapse" if collapse else "--no-collapse"
    env = dict(os.environ) | ({"PYTHONPATH": str(tree)} if tree is not None else {})
    launcher = [dtrain] if tree is None else launcher_of(tree)
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        argv = [*launcher, "run", "-np", str(RANKS), "--plain", flag, "--job-dir", tmp]
        run = run_launcher([*argv, sys.executable, str(producer), str(lines)], env)
    if run.returncode != 0:
        raise SystemExit(run.stderr.decode("utf-8", "replace")[-2000:])
    return run, len(run.stdout), check(run.stdout, lines, "same" in producer.name)


def launcher_of(tree: Path) -> list[str]:
    """dtrain from another checkout: its own entry point (the installed ``dtrain`` script
    names this checkout's, which an older one may not have)."""
    module = "entry" if (tree / "launcher" / "cli" / "entry.py").exists() else "main"
    code = f"import sys; from launcher.cli.{module} import run_main; sys.exit(run_main())"
    return [sys.executable, "-P", "-c", code]  # (-P: not this directory's launcher first)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--write", type=Path, help="put the section into this markdown file")
    parser.add_argument(
        "--baseline", type=Path, help="also run --collapse from this checkout, interleaved"
    )
    args = parser.parse_args()
    baseline: dict[str, list[tuple[Run, int, str]]] = {}
    dtrain = shutil.which("dtrain") or str(Path(sys.executable).parent / "dtrain")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        producers = {
            "distinct": Path(tmp, "distinct.py"),
            "identical": Path(tmp, "same.py"),
        }
        producers["distinct"].write_text(PRODUCER)
        producers["identical"].write_text(SAME_PRODUCER)
        load_before = os.getloadavg()[0]
        for kind, producer in producers.items():
            runs: dict[bool, list[tuple[Run, int, str]]] = {False: [], True: []}
            for _ in range(args.reps):
                for collapse in (False, True):
                    runs[collapse].append(one_run(dtrain, producer, args.lines, collapse))
                if args.baseline is not None:
                    found = one_run(dtrain, producer, args.lines, True, args.baseline)
                    baseline.setdefault(kind, []).append(found)
            rows.append((kind, runs))
        load_after = os.getloadavg()[0]
    text = section(rows, args, load_before, load_after)
    print(text)
    for kind, runs in rows:  # the spread behind each median
        for collapse, done in runs.items():
            walls = [r.wall_s for r, _, _ in done]
            print(
                f"{kind} {'--collapse' if collapse else '--no-collapse'}: wall "
                f"{statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f})"
            )
    for kind, done in baseline.items():
        wall = statistics.median(r.wall_s for r, _, _ in done)
        print(
            f"baseline {args.baseline}, {kind} --collapse: {wall:.2f} s "
            f"({min(r.wall_s for r, _, _ in done):.2f}-{max(r.wall_s for r, _, _ in done):.2f}), "
            f"{RANKS * args.lines / wall:,.0f} lines/s, launcher CPU "
            f"{statistics.median(r.launcher_cpu_s for r, _, _ in done):.2f} s, "
            f"{statistics.median(n for _, n, _ in done):,.0f} bytes; "
            f"checked: {sorted({c for *_, c in done})}"
        )
    if args.write:
        write_section(args.write, text, SECTION)
    return 0


def section(rows: list, args: argparse.Namespace, before: float, after: float) -> str:  # type: ignore[type-arg]
    total = RANKS * args.lines
    out = [
        SECTION,
        "",
        f"`python benchmarks/collapse_cost.py --reps {args.reps} --write docs/benchmarks.md` "
        f"({time.strftime('%Y-%m-%d')}).",
        "",
        f"Machine: {os.cpu_count()} cores ({platform.machine()}, Linux {platform.release()}), "
        f"Python {platform.python_version()}. {RANKS} ranks on this machine, each writing "
        f"{args.lines:,} lines of 80 bytes in ~{CHUNK_LINES * 80 // 1024} KiB writes "
        f"({total:,} lines); dtrain's stdout is a pipe read to the end. {args.reps} runs of "
        f"each, interleaved; medians. Load average before / after: {before:.1f} / {after:.1f}.",
        "",
        "| lines | flag | wall s | lines/s | launcher CPU s | bytes on the pipe | checked |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    walls: dict[tuple[str, bool], float] = {}
    cpus: dict[tuple[str, bool], float] = {}
    sizes: dict[tuple[str, bool], float] = {}
    each_size: dict[tuple[str, bool], list[int]] = {}
    for kind, runs in rows:
        for collapse in (False, True):
            done = runs[collapse]
            wall = walls[kind, collapse] = statistics.median(r.wall_s for r, _, _ in done)
            cpu = cpus[kind, collapse] = statistics.median(r.launcher_cpu_s for r, _, _ in done)
            size = sizes[kind, collapse] = statistics.median(n for _, n, _ in done)
            each_size[kind, collapse] = [n for _, n, _ in done]
            checks = sorted({c for _, _, c in done})
            out.append(
                f"| {kind} | `{'--collapse' if collapse else '--no-collapse'}` | {wall:.2f} | "
                f"{total / wall:,.0f} | {cpu:.2f} | {size:,.0f} | {', '.join(checks)} |"
            )
    slower = walls["distinct", True] / walls["distinct", False] - 1
    busier = cpus["distinct", True] / cpus["distinct", False] - 1
    fewer = sizes["identical", False] / sizes["identical", True]
    same_rate = total / walls["identical", True]
    cost = "met" if slower <= 0.10 else "missed"
    saving = "met" if fewer >= TARGET_FEWER else "missed"
    rate = "met" if same_rate >= TARGET_RATE else "missed"
    sizes_run = each_size["identical", True]
    per_run = ", ".join(f"{n / 1e6:.1f}" for n in sizes_run)
    spread = (
        "; more in a run means its ranks got further apart than the window (0.5 s; seen at "
        "start on a loaded machine): a line that comes a window late can no longer join"
        if max(sizes_run) > 1.5 * min(sizes_run)
        else ""
    )
    out += [
        "",
        f"* Distinct lines (nothing to collapse): `--collapse` takes {slower:+.0%} of the wall "
        f"time of `--no-collapse` (target: at most +10%: {cost}), and {busier:+.0%} of its "
        "launcher CPU time.",
        f"* Identical lines: {fewer:.1f}x fewer bytes reach the terminal with `--collapse` "
        f"({RANKS} ranks; target: at least {TARGET_FEWER:g}x: {saving}), at {same_rate:,.0f} "
        f"lines/s (target: at least {TARGET_RATE:,.0f}: {rate}). MB on the pipe per run: "
        f"{per_run}{spread}.",
        "* How: a flood that nothing shares (more than `FLOOD_LINES` lines of two ranks or "
        "more since a line was last shared) goes straight out for up to `FLOOD_PASS_S` or "
        "until it ends, without a look-up per line (`launcher/streams/collapse.py`). Identical "
        "lines join a run at a time: a rank's batch is compared as bytes with the held block "
        "of another rank that it goes on as, and who said them is kept per run of lines "
        "(`launcher/streams/heldlines.py`), so a look-up is made where a run starts, not per "
        "line.",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
