"""``--sync DIR``'s files on this machine: which (as git would say), their sizes, links and
content digests.

In a git work tree the list is git's own (``git ls-files --cached --others
--exclude-standard``: tracked files and new ones not ignored); elsewhere ``.gitignore``
files are read with ``pathspec``, git's matching rules in a library, a file of each
folder applying below it with the deeper one deciding.  ``.git`` never travels.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from launcher.base.errors import UsageError
from launcher.base.log import LOG
from launcher.core.synctree import SyncEntry, check_size, link_target

HASH_CHUNK = 1 << 20


def git_listing(folder: str) -> list[str] | None:
    """The files git lists in ``folder`` (relative to it), or None outside a git work tree
    (or without git)."""
    try:
        found = subprocess.run(
            ["git", "-C", folder, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=False,
        )
    except OSError:
        return None
    if found.returncode != 0:
        return None
    return [name for name in found.stdout.decode("utf-8", "surrogateescape").split("\0") if name]


def ignore_spec(folder: Path) -> Any:
    """The folder's ``.gitignore`` as a matcher, or None where it has none."""
    path = folder / ".gitignore"
    if not path.is_file():
        return None
    import pathspec  # loaded when a folder without git is synced

    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def ignored(specs: Sequence[tuple[str, Any]], path: str, is_dir: bool) -> bool:
    """Whether the ``.gitignore`` files above ``path`` ignore it (the deepest file that says
    anything about it decides, as in git)."""
    verdict = False
    for base, spec in specs:
        relative = path[len(base) :] + ("/" if is_dir else "")
        result = spec.check_file(relative)
        if result.include is not None:
            verdict = bool(result.include)
    return verdict


def walk_listing(folder: str) -> list[str]:
    """The files under ``folder`` that its ``.gitignore`` files do not ignore (no git)."""
    found: list[str] = []

    def visit(relative: str, specs: list[tuple[str, Any]]) -> None:
        here = Path(folder, relative)
        spec = ignore_spec(here)
        if spec is not None:
            specs = [*specs, (relative, spec)]
        for item in sorted(os.scandir(here), key=lambda e: e.name):
            path = relative + item.name
            is_dir = item.is_dir(follow_symlinks=False)
            if item.name == ".git" or ignored(specs, path, is_dir):
                continue
            if is_dir:
                visit(path + "/", specs)
            else:
                found.append(path)

    visit("", [])
    return found


def list_entries(folder: str) -> list[SyncEntry]:
    """The tree to sync: files (sizes, executable bits) and links (kept as links when they
    stay inside ``folder``; one that leaves it is an error naming it).  Not yet hashed."""
    root = os.path.realpath(folder)
    names = git_listing(root)
    LOG.debug("--sync %s: %s", folder, "git's file list" if names is not None else ".gitignore")
    entries = []
    for name in names if names is not None else walk_listing(root):
        try:
            status = os.lstat(os.path.join(root, name))
        except FileNotFoundError:  # deleted but still in git's index
            continue
        if stat.S_ISLNK(status.st_mode):
            target = link_target(name, os.readlink(os.path.join(root, name)), root)
            entries.append(SyncEntry(name, "link", target=target))
        elif stat.S_ISREG(status.st_mode):
            executable = bool(status.st_mode & stat.S_IXUSR)
            entries.append(SyncEntry(name, "file", status.st_size, executable))
        else:  # a git submodule's folder, a socket, a fifo: not code to send
            LOG.debug("--sync %s: skipping %s (not a file or a link)", folder, name)
    return entries


def hash_entries(folder: str, entries: Sequence[SyncEntry]) -> list[SyncEntry]:
    """The entries with their files' content digests."""
    root = os.path.realpath(folder)
    hashed = []
    for entry in entries:
        if entry.kind != "file":
            hashed.append(entry)
            continue
        digest = hashlib.sha256()
        with open(os.path.join(root, entry.path), "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
        hashed.append(
            SyncEntry(entry.path, "file", entry.size, entry.executable, digest.hexdigest())
        )
    return hashed


def scan_folder(folder: str, max_bytes: int) -> list[SyncEntry]:
    """The entries of ``--sync folder`` once checked: a folder, and within the size limit."""
    if not os.path.isdir(folder):
        raise UsageError(f"--sync {folder}: no such folder", "check the path")
    entries = list_entries(folder)
    check_size(entries, max_bytes, folder)
    return entries


def read_blobs(folder: str, entry: SyncEntry) -> Iterator[bytes]:
    """A file's bytes in chunks, exactly as many as when it was listed."""
    left = entry.size
    with open(os.path.join(os.path.realpath(folder), entry.path), "rb") as f:
        while left:
            chunk = f.read(min(HASH_CHUNK, left))
            if not chunk:
                raise UsageError(
                    f"--sync {folder}: {entry.path} changed while it was sent",
                    "run again once it is written",
                )
            left -= len(chunk)
            yield chunk
