"""``--sync DIR``'s tree as values (pure): its entries, the key that names it, the size
limit and its message, safe names and link targets, and the ranks' folder in the copy.

The listing and hashing (``run/syncfiles.py``), the sending (``transport/syncsend.py``)
and the receiving (``remote/syncrecv.py``, which checks every name again: it never
trusts the sender) live elsewhere; what they agree on is here.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from launcher.base.errors import UsageError

DEFAULT_SYNC_MAX_BYTES = 1 << 30  # 1 GiB: more is data or a build, not code
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SIZE_TEXT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", re.IGNORECASE)
BIGGEST_SHOWN = 3  # entries named in the over-the-limit message


@dataclass(frozen=True)
class SyncEntry:
    """One path of the tree, relative to DIR with ``/``: a file (its size, content digest,
    executable bit) or a symbolic link (its target, relative and inside DIR)."""

    path: str
    kind: str  # "file" or "link"
    size: int = 0
    executable: bool = False
    digest: str = ""  # sha256 of a file's content (filled once hashed)
    target: str = ""  # a link's target

    @property
    def blob(self) -> str:
        """The name of the file's content in a host's store: the digest, and ``x`` when it is
        executable (a hard link shares its mode, so the two modes are two blobs)."""
        return self.digest + ("x" if self.executable else "")

    def as_row(self) -> list[object]:
        if self.kind == "link":
            return [self.path, "link", self.target]
        return [self.path, "file", self.size, self.executable, self.digest]


def tree_key(entries: Iterable[SyncEntry]) -> str:
    """The name of a tree on a host: the digest of its sorted entries (names, modes, contents)."""
    import hashlib  # (here: OpenSSL's module loads only for a --sync job, about 3 ms)
    import json

    rows = sorted((entry.as_row() for entry in entries), key=lambda row: str(row[0]))
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:32]


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB``, ``123456`` (bytes) -> bytes."""
    found = SIZE_TEXT.fullmatch(text)
    if found is None:
        raise UsageError(
            f"--sync-max-size {text!r}: not a size", "write bytes, or a number with K, M or G (2G)"
        )
    return int(float(found.group(1)) * SIZE_UNITS[found.group(2).upper()])


def format_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # (not reached)


def biggest(entries: Sequence[SyncEntry], count: int = BIGGEST_SHOWN) -> list[tuple[str, int]]:
    """The biggest top-level files and folders (``data/``) and their sizes, biggest first."""
    sizes: dict[str, int] = {}
    for entry in entries:
        head, slash, _ = entry.path.partition("/")
        name = head + slash
        sizes[name] = sizes.get(name, 0) + entry.size
    return sorted(sizes.items(), key=lambda item: (-item[1], item[0]))[:count]


def check_size(entries: Sequence[SyncEntry], limit: int, folder: str) -> int:
    """The size in bytes; over ``limit``, the error that says what is big and how to fix it."""
    total = sum(entry.size for entry in entries)
    if total > limit:
        named = ", ".join(f"{name} {format_size(size)}" for name, size in biggest(entries))
        raise UsageError(
            f"--sync {folder}: {format_size(total)} in {len(entries)} files, over the "
            f"{format_size(limit)} limit (biggest: {named})",
            "list what the ranks do not need in .gitignore, or raise --sync-max-size (e.g. 2G)",
        )
    return total


def check_name(path: str) -> str:
    """A relative name that stays inside the tree, or the error that says why not."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts):
        raise UsageError(f"--sync: refusing the name {path!r}", "names must stay inside DIR")
    return path


def link_target(path: str, target: str, folder: str) -> str:
    """A link's target as kept in the copy: relative, and inside DIR (``folder``, absolute,
    real) as written; a target that leaves DIR is refused, naming the link and its target as
    written.  An absolute target under DIR becomes the same names relative to the link (its
    ``..`` kept as written: each follows the links met on the way, as the kernel does).
    Where the link really leads, its links followed, is the caller's check."""
    kept = target
    if posixpath.isabs(target):
        base = folder.rstrip("/") + "/"
        rest = target[len(base) :].lstrip("/") if (target + "/").startswith(base) else "/"
        kept = posixpath.join(*[".."] * path.count("/"), rest or ".")
    inside = posixpath.normpath(posixpath.join(posixpath.dirname(path), kept))
    if inside == ".." or inside.startswith("../") or posixpath.isabs(inside):
        raise UsageError(
            f"--sync {folder}: the link {path} points outside it (to {target})",
            "copy the file it points to into the folder, or add the link to .gitignore",
        )
    return kept


def synced_workdir(copy: str, folder: str, workdir: str) -> str:
    """The ranks' folder on a host that got the copy: the working directory's place in DIR."""
    inside = posixpath.relpath(workdir, folder)
    if inside == ".." or inside.startswith("../"):
        raise UsageError(
            f"--sync {folder}: the working directory {workdir} is not inside it",
            "run dtrain from inside the folder, or give --workdir inside it",
        )
    return copy if inside == "." else posixpath.join(copy, inside)
