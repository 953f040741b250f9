"""mpi4py's own test suite under mpirun and under dtrain run --mpi, side by side.

    python benchmarks/mpi4py_suite.py [--np 4] [--tests T ...] [--exclude T ...]
        [--ssh [--slots 2]] [--limit S] [--write F]

With ``--ssh``, both run over two SSH test hosts (tests/testhosts.py: sshd in network
namespaces; root only) of 2 slots each, ranks placed by node (``--np 2``: one on each,
the spare slots for the spawn tests): mpirun with the same network and ssh options
that dtrain gives it (taken from ``dtrain run --mpi --dry-run``), dtrain with
``--ssh-config``.  ``--write`` puts the result into docs/benchmarks.md's section.

Fetches the sdist of the installed mpi4py from PyPI (its test/ folder), then runs
``python test/main.py`` under ``mpirun -np N --oversubscribe`` and under
``dtrain run --mpi -np N`` (which tells Open MPI when it oversubscribes), interleaved,
and prints both times, the ratio and whether every run passed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def fetch_tests(version: str, into: Path) -> Path:
    index = urllib.request.Request(
        "https://pypi.org/simple/mpi4py/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    files = json.load(urllib.request.urlopen(index, timeout=60))["files"]
    url = next(f["url"] for f in files if f["filename"] == f"mpi4py-{version}.tar.gz")
    data = urllib.request.urlopen(url, timeout=120).read()
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(into, filter="data")
    return into / f"mpi4py-{version}"


def timed(argv: list[str], cwd: Path, limit_s: float) -> tuple[float, bool]:
    """Wall time and success of one run; a run past ``limit_s`` (a hang) is ended, with its
    whole process group, and counts as failed."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return time.monotonic() - start, False
    return time.monotonic() - start, code == 0


def ssh_commands(  # type: ignore[type-arg]
    np: int, program: list[str], ssh_config: Path, cwd: Path, slots: int = 2
) -> tuple[list, list]:
    """mpirun and dtrain over node1 and node2: mpirun with dtrain's own options for them."""
    hosts = f"node1:{slots},node2:{slots}"  # ranks by node; spare slots for spawn tests
    dtrain = [str(BIN / "dtrain"), "run", "--mpi", "--ssh-config", str(ssh_config)]
    dtrain += ["-np", str(np), "--map-by", "node", "-H", hosts, *program]
    plan = subprocess.run(
        [*dtrain[:2], "--mpi", "--dry-run", *dtrain[3:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    argv = shlex.split(next(line for line in plan if "mpirun" in line.split(" ", 1)[0]))
    mpirun: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "sh":  # dtrain's per-rank shim: mpirun runs the program itself
            break
        if word == "--hostfile":
            mpirun += ["-H", hosts]
            index += 2
        elif word == "-x" and argv[index + 1] != "PATH":
            index += 2
        else:
            mpirun.append(word)
            index += 1
    return [*mpirun, *program], dtrain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tests", nargs="*", default=[])
    parser.add_argument("--exclude", nargs="*", default=[], help="test modules left out")
    parser.add_argument("--slots", type=int, default=2, help="with --ssh: slots per host")
    parser.add_argument("--limit", type=float, default=900, help="seconds a run may take")
    parser.add_argument("--ssh", action="store_true", help="over two SSH test hosts")
    parser.add_argument("--write", type=Path, help="put the result into this markdown file")
    args = parser.parse_args()
    import mpi4py

    source = fetch_tests(mpi4py.__version__, Path(tempfile.mkdtemp()))
    program = ["python", "test/main.py", "-q", *args.tests]
    for name in args.exclude:
        program += ["-e", name]
    mpirun = [str(BIN / "mpirun"), "-np", str(args.np), "--oversubscribe", *program]
    if os.geteuid() == 0:
        mpirun.insert(1, "--allow-run-as-root")
    dtrain = [str(BIN / "dtrain"), "run", "--mpi", "-np", str(args.np), *program]
    hosts = None
    if args.ssh:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.testhosts import TestHosts

        hosts = TestHosts(count=2).start()
        mpirun, dtrain = ssh_commands(args.np, program, hosts.ssh_config, source, args.slots)
    results: dict[str, list[tuple[float, bool]]] = {"mpirun": [], "dtrain": []}
    load = os.getloadavg()[0]
    try:
        for _ in range(args.rounds):
            results["mpirun"].append(timed(mpirun, source, args.limit))
            results["dtrain"].append(timed(dtrain, source, args.limit))
    finally:
        if hosts is not None:
            hosts.stop()
    report(args, results, mpirun, dtrain, load, mpi4py.__version__)


def report(args, results, mpirun, dtrain, load, version) -> None:  # type: ignore[no-untyped-def]
    for name, runs in results.items():
        print(f"{name}: {[round(t, 1) for t, _ in runs]} s, passed: {all(ok for _, ok in runs)}")
    best = {name: min(t for t, _ in runs) for name, runs in results.items()}
    ratio = best["dtrain"] / best["mpirun"]
    print(f"dtrain / mpirun: {ratio:.2f}")
    if not args.write:
        return
    where = "two SSH test hosts (sshd in network namespaces)" if args.ssh else "this machine"
    row = (
        f"| {where} | {args.np} | {tests_named(args)} | "
        f"{', '.join(shown(t, ok) for t, ok in results['mpirun'])} | "
        f"{', '.join(shown(t, ok) for t, ok in results['dtrain'])} | {ratio:.2f} | "
        f"{'yes' if all(ok for runs in results.values() for _, ok in runs) else 'NO'} | "
        f"{time.strftime('%Y-%m-%d')}, load {load:.1f} |"
    )
    text = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
    if SECTION not in text:
        text = text.rstrip("\n") + "\n\n" + SECTION_HEAD.format(version=version) + "\n"
    head, _, rest = text.partition(SECTION)
    body, sep, tail = rest.partition("\n## ")
    body = body.rstrip("\n") + "\n" + row + "\n"
    args.write.write_text(head + SECTION + body + (("\n## " + tail) if sep else ""))


def shown(seconds: float, ok: bool) -> str:
    return f"{seconds:.1f}" if ok else f"{seconds:.1f} (failed or hung)"


def tests_named(args: argparse.Namespace) -> str:
    named = " ".join(args.tests) or "all"
    return named + "".join(f" but {name}" for name in args.exclude)


SECTION = "## mpi4py's test suite: dtrain run --mpi vs mpirun"
SECTION_HEAD = (
    SECTION
    + """

`python benchmarks/mpi4py_suite.py [--ssh] --write docs/benchmarks.md`: mpi4py {version}'s
own `test/main.py` (from its sdist), under `mpirun` and under `dtrain run --mpi`
(rank shim, tagged output split back per rank), one after the other; every run must pass.
On this machine `mpirun -np N --oversubscribe`; over SSH (two hosts of 2 slots, ranks by
node), mpirun with the placement, network and ssh options dtrain gives it. Target: dtrain
within 1.2x of mpirun.

| where | ranks | tests | mpirun s | dtrain s | dtrain / mpirun (best) | all passed | when |
| --- | ---: | --- | --- | --- | ---: | --- | --- |"""
)


if __name__ == "__main__":
    main()
