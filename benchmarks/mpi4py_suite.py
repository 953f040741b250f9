"""mpi4py's own test suite under mpirun and under dtrain run --mpi, side by side.

    python benchmarks/mpi4py_suite.py [--np 4] [--tests test_spawn ...]

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


def timed(argv: list[str], cwd: Path) -> tuple[float, bool]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    start = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    return time.monotonic() - start, done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tests", nargs="*", default=[])
    args = parser.parse_args()
    import mpi4py

    source = fetch_tests(mpi4py.__version__, Path(tempfile.mkdtemp()))
    program = ["python", "test/main.py", "-q", *args.tests]
    mpirun = [str(BIN / "mpirun"), "-np", str(args.np), "--oversubscribe", *program]
    if os.geteuid() == 0:
        mpirun.insert(1, "--allow-run-as-root")
    dtrain = [str(BIN / "dtrain"), "run", "--mpi", "-np", str(args.np), *program]
    results: dict[str, list[tuple[float, bool]]] = {"mpirun": [], "dtrain": []}
    for _ in range(args.rounds):
        results["mpirun"].append(timed(mpirun, source))
        results["dtrain"].append(timed(dtrain, source))
    for name, runs in results.items():
        print(f"{name}: {[round(t, 1) for t, _ in runs]} s, passed: {all(ok for _, ok in runs)}")
    best = {name: min(t for t, _ in runs) for name, runs in results.items()}
    print(f"dtrain / mpirun: {best['dtrain'] / best['mpirun']:.2f}")


if __name__ == "__main__":
    main()
