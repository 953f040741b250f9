"""``--sync DIR`` in a job: check the tree before anything connects (a folder, within the
size limit), then copy it to every remote host over the survey's SSH connections, in
parallel, and say where each host's ranks run.  Ranks on this machine use DIR itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.base.errors import UsageError
from launcher.base.log import LOG, PHASES
from launcher.base.parallel import run_parallel
from launcher.core.config import JobConfig
from launcher.core.synctree import SyncEntry, format_size, synced_workdir, tree_key

CACHE_VARIABLE = "DTRAIN_SYNC_CACHE"  # the cache folder on the hosts (default in the home)


@dataclass(frozen=True)
class SyncRequest:
    """What to copy: the folder (absolute), its checked entries, the working directory."""

    folder: str
    entries: Sequence[SyncEntry]
    workdir: str

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.entries)


def prepare_sync(
    config: JobConfig, workdir: str, through_slurm: bool, remote: bool
) -> SyncRequest | None:
    """The checked tree of ``--sync`` (None without it, or with no remote host to copy to):
    a bad folder or one over the size limit is an error before any host is reached."""
    if config.env.sync is None:
        return None
    if config.mpi is not None or through_slurm:
        how = "--mpi" if config.mpi is not None else "a Slurm allocation"
        raise UsageError(
            f"--sync is not supported with {how} yet",
            "put the code on a file system the hosts share, or drop --mpi",
        )
    from launcher.run.syncfiles import scan_folder

    folder = os.path.abspath(config.env.sync)
    entries = scan_folder(folder, config.env.sync_max_size)
    synced_workdir(folder, folder, os.path.abspath(workdir))  # checks it is inside
    if not remote:
        LOG.debug("--sync %s: every rank is on this machine: nothing to copy", folder)
        return None
    return SyncRequest(folder, entries, os.path.abspath(workdir))


def sync_hosts(
    request: SyncRequest,
    connections: Mapping[str, Any],
    config: JobConfig,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """Copy the tree to every host of ``connections``; each host's working directory there."""
    from launcher.run.syncfiles import hash_entries, read_blobs
    from launcher.transport.ssh import SshConnection
    from launcher.transport.syncsend import DEFAULT_CACHE, SyncResult, sync_to_host

    entries = hash_entries(request.folder, request.entries)
    key = tree_key(entries)
    files = sum(1 for e in entries if e.kind == "file")
    PHASES.info(
        "syncing %d files (%s) to %d hosts", files, format_size(request.size), len(connections)
    )
    cache = environ.get(CACHE_VARIABLE) or DEFAULT_CACHE

    def copy(name: str) -> SyncResult:
        connection: SshConnection = connections[name]
        return sync_to_host(
            connection,
            sys.executable,
            key,
            entries,
            lambda entry: read_blobs(request.folder, entry),
            config.ssh.timeout_s,
            cache,
        )

    done = run_parallel(list(connections), copy)
    errors = [result for result in done.values() if isinstance(result, BaseException)]
    if errors:
        raise errors[0]
    results = {n: r for n, r in done.items() if not isinstance(r, BaseException)}
    for result in results.values():
        LOG.debug(
            "--sync to %s: %s, sent %d file(s), %d byte(s)",
            result.host,
            result.tree,
            result.files_sent,
            result.bytes_sent,
        )
    sent_files = sum(r.files_sent for r in results.values())
    PHASES.info(
        "synced %d files (%s) to %d hosts: sent %d, %d bytes; %d were there",
        files,
        format_size(request.size),
        len(connections),
        sent_files,
        sum(r.bytes_sent for r in results.values()),
        files * len(connections) - sent_files,
    )
    return {
        name: synced_workdir(result.tree, request.folder, request.workdir)
        for name, result in results.items()
    }
