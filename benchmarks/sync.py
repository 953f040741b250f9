"""``--sync``: copying this repository (its git-tracked and new unignored files) to 4 SSH
test hosts, first and second time, against ``rsync -a`` over ssh to the same hosts.

dtrain's side is timed in-process around ``sync_hosts`` (the connections are opened
first, as a job's survey opens them, and not counted); rsync's is one ``rsync -a
--files-from`` per host, the 4 in parallel, each a fresh ssh login (counted: it is what
rsync costs).  Bytes are what travelled: dtrain's file contents sent, rsync's
``--stats`` "Total bytes sent".  The test hosts share this machine's file system, so each
host gets its own cache folder (dtrain) and destination (rsync), as separate machines have.

    .venv/bin/python benchmarks/sync.py

Needs root, ``ip``/``unshare``, ``openssh-server`` (the netns test hosts) and rsync.
Do not run it next to the test suite (one set of test hosts at a time).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from launcher.core.config import EnvConfig, JobConfig, SshConfig  # noqa: E402
from launcher.core.hosts import Host  # noqa: E402
from launcher.run.syncfiles import scan_folder  # noqa: E402
from launcher.run.syncing import SyncRequest, sync_hosts  # noqa: E402
from launcher.transport.ssh import connect_all  # noqa: E402
from launcher.transport.sshconfig import SshSettings, load_ssh_config  # noqa: E402
from tests.testhosts import TestHosts  # noqa: E402

HOSTS = 4


def dtrain_sync(hosts: TestHosts, scratch: Path) -> list[tuple[float, int]]:
    """(seconds, bytes sent) of the first and the second sync, each host its own cache."""
    config = JobConfig(("true",), env=EnvConfig(sync=str(REPO)), ssh=SshConfig())
    settings = SshSettings(config_file=str(hosts.ssh_config))
    names = list(hosts.names)[:HOSTS]
    connections = connect_all([Host(n) for n in names], settings, load_ssh_config(settings))
    request = SyncRequest(str(REPO), scan_folder(str(REPO), 1 << 30), str(REPO))
    import logging

    from launcher.base.log import PHASES

    lines: list[str] = []
    PHASES.sink = lines.append
    logging.getLogger("dtrain").setLevel(logging.WARNING)
    figures = []
    try:
        for _ in range(2):
            sent = 0
            start = time.perf_counter()
            with ThreadPoolExecutor(len(names)) as pool:  # a cache per host: as separate machines
                jobs = [
                    pool.submit(
                        sync_hosts,
                        request,
                        {n: connections[n]},
                        config,
                        {"DTRAIN_SYNC_CACHE": str(scratch / f"cache-{n}")},
                    )
                    for n in names
                ]
                for job in jobs:
                    job.result()
            elapsed = time.perf_counter() - start
            for line in lines:
                found = re.search(r"sent \d+, (\d+) bytes", line)
                sent += int(found.group(1)) if found else 0
            lines.clear()
            figures.append((elapsed, sent))
    finally:
        for connection in connections.values():
            connection.close()
    return figures


def rsync_once(hosts: TestHosts, name: str, scratch: Path, listing: Path) -> int:
    done = subprocess.run(
        ["rsync", "-a", "--stats", "--files-from", str(listing),
         "-e", f"ssh -F {hosts.ssh_config}", f"{REPO}/", f"{name}:{scratch}/rsync-{name}/"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = re.search(r"Total bytes sent: ([\d,.]+)", done.stdout)
    return int(found.group(1).replace(",", "").replace(".", "")) if found else 0


def rsync_sync(hosts: TestHosts, scratch: Path, listing: Path) -> list[tuple[float, int]]:
    names = list(hosts.names)[:HOSTS]
    figures = []
    for _ in range(2):
        start = time.perf_counter()
        with ThreadPoolExecutor(len(names)) as pool:
            sent = sum(pool.map(lambda n: rsync_once(hosts, n, scratch, listing), names))
        figures.append((time.perf_counter() - start, sent))
    return figures


def main() -> None:
    if shutil.which("rsync") is None:
        sys.exit("benchmarks/sync.py: rsync is not installed (apt-get install -y rsync)")
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-sync-bench-"))
    try:
        listing = scratch / "files"
        names = [e.path for e in scan_folder(str(REPO), 1 << 30)]
        listing.write_text("\n".join(names) + "\n")
        size = sum(os.lstat(REPO / n).st_size for n in names)
        with TestHosts(HOSTS) as hosts:
            ours = dtrain_sync(hosts, scratch)
            theirs = rsync_sync(hosts, scratch, listing)
        print(f"{len(names)} files, {size / 2**20:.1f} MiB, to {HOSTS} hosts\n")
        print("| | first: seconds | first: MiB sent | second: seconds | second: bytes sent |")
        print("|---|---:|---:|---:|---:|")
        for label, ((t1, b1), (t2, b2)) in (("dtrain --sync", ours), ("rsync -a", theirs)):
            print(f"| {label} | {t1:.2f} | {b1 / 2**20:.1f} | {t2:.2f} | {b2:,} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
