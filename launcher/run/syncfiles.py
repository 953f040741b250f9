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
from launcher.base.userfiles import HOSTFILE_LIMIT, read_user_bytes
from launcher.core.synctree import SyncEntry, check_size, link_target
from launcher.remote.syncrecv import escapes

HASH_CHUNK = 1 << 20
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
UNREADABLE_HINT = "make it readable, or list it in .gitignore"


def unreadable(folder: str, name: str, exc: OSError) -> UsageError:
    """The one line for an entry of DIR that cannot be read (before anything is sent)."""
    shown = os.path.join(folder, name) if name != "." else folder
    why = (exc.strerror or type(exc).__name__).lower()
    return UsageError(f"--sync {folder}: cannot read {shown} ({why})", UNREADABLE_HINT)


def changed(entry: SyncEntry) -> UsageError:
    return UsageError(
        f"{entry.path} changed while syncing: run again",
        "wait until it is written, or list it in .gitignore",
    )


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
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
    except (FileNotFoundError, NotADirectoryError):
        return None
    import pathspec  # loaded when a folder without git is synced

    data = read_user_bytes(str(path), "--sync: the ignore file", HOSTFILE_LIMIT)
    lines = data.decode("utf-8", errors="replace").splitlines()
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
        try:
            items = sorted(os.scandir(here), key=lambda e: e.name)
            spec = ignore_spec(here)
        except FileNotFoundError:  # (removed while listed)
            return
        except OSError as exc:
            raise unreadable(folder, relative or ".", exc) from None
        if spec is not None:
            specs = [*specs, (relative, spec)]
        for item in items:
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
        path = os.path.join(root, name)
        try:
            status = os.lstat(path)
            if stat.S_ISLNK(status.st_mode):
                entries.append(link_entry(root, name, os.readlink(path)))
            elif stat.S_ISREG(status.st_mode):
                if not os.access(path, os.R_OK):
                    raise PermissionError(13, "permission denied")
                executable = bool(status.st_mode & stat.S_IXUSR)
                entries.append(SyncEntry(name, "file", status.st_size, executable))
            else:  # a git submodule's folder, a socket, a fifo: not code to send
                LOG.debug("--sync %s: skipping %s (not a file or a link)", folder, name)
        except FileNotFoundError:  # deleted but still in git's index
            continue
        except OSError as exc:
            raise unreadable(folder, name, exc) from None
    return entries


def link_entry(root: str, name: str, target: str) -> SyncEntry:
    """A link kept as a link: its target as written must stay inside DIR (``root``, real),
    and so must where it really leads, its links followed one by one inside DIR as they will
    be on the hosts (``ln -s . a; ln -s a/a/../.. up`` leaves DIR though ``a/a/../..`` reads
    as ``.``)."""
    kept = link_target(name, target, root)
    if escapes(root, name, absolute_root=root):
        raise UsageError(
            f"--sync {root}: the link {name} points outside it (to {target}, through links)",
            "copy the file it points to into the folder, or add the link to .gitignore",
        )
    return SyncEntry(name, "link", target=kept)


def hash_entries(folder: str, entries: Sequence[SyncEntry]) -> list[SyncEntry]:
    """The entries with their files' content digests."""
    root = os.path.realpath(folder)
    hashed = []
    for entry in entries:
        if entry.kind != "file":
            hashed.append(entry)
            continue
        digest = hashlib.sha256()
        for chunk in read_file(root, entry, None):
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


def read_file(root: str, entry: SyncEntry, size: int | None) -> Iterator[bytes]:
    """A listed file's bytes in chunks (``size`` of them, else to its end); no link is
    followed and nothing but a regular file is read (one swapped for a FIFO never hangs)."""
    try:
        fd = os.open(os.path.join(root, entry.path), READ_FLAGS)
    except FileNotFoundError:
        raise changed(entry) from None
    except OSError as exc:
        raise unreadable(root, entry.path, exc) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise changed(entry)
        left = entry.size if size is None else size
        while left > 0 or size is None:
            try:
                chunk = os.read(fd, HASH_CHUNK if size is None else min(HASH_CHUNK, left))
            except OSError as exc:
                raise unreadable(root, entry.path, exc) from None
            if not chunk:
                break
            left -= len(chunk)
            yield chunk
        if size is not None and left:
            raise changed(entry)
    finally:
        os.close(fd)


def read_blobs(folder: str, entry: SyncEntry) -> Iterator[bytes]:
    """A file's bytes in chunks, exactly as many as when it was listed, and the same bytes
    as when it was hashed (else "changed while syncing", after its last chunk: the receiver
    would refuse them too)."""
    digest = hashlib.sha256()
    for chunk in read_file(os.path.realpath(folder), entry, entry.size):
        digest.update(chunk)
        yield chunk
    if digest.hexdigest() != entry.digest:
        raise changed(entry)
