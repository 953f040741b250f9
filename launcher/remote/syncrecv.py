"""``--sync``'s receiving side: run on a host as text (``python -c``), stdlib only.

It never trusts the sender: every name and link target is checked here again.  Layout
under the cache folder (``~/.cache/dtrain/sync`` by default; every folder 0700):

    store/DIGEST[x]   each file's content once, read-only (``x``: the executable ones)
    trees/KEY/        a tree: hard links into the store (a copy where links fail)
    trees/.tmp-*      a tree being built: renamed to trees/KEY only when complete

Talk, over the SSH channel: the sender writes one JSON line (``key``, ``entries``); this
answers ``MARK {"tree": PATH}`` when the tree is there, else ``MARK {"missing": [...]}``,
reads each missing blob's bytes in that order, builds the tree and answers
``MARK {"tree": PATH, "received": BYTES}``.  An end of input before that (the launcher
interrupted, the connection lost) removes what was half written, and the process ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from typing import IO, Any

MARK = "DTRAIN-SYNC "  # before each answer: the login shell may print lines of its own
CHUNK = 1 << 20
STALE_S = 3600  # a .tmp- tree or an unlinked blob this old is a leftover


class Refused(Exception):
    pass


def check_name(path: str) -> str:
    parts = path.split("/") if isinstance(path, str) else [""]
    if not path or path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts):
        raise Refused(f"refusing the name {path!r}: names must stay inside the tree")
    return path


def check_target(path: str, target: Any) -> str:
    inside = os.path.normpath(os.path.join(os.path.dirname(path), target))
    if not isinstance(target, str) or not target or "\0" in target or os.path.isabs(target):
        raise Refused(f"refusing the link {path!r} -> {target!r}")
    if inside == ".." or inside.startswith("../"):
        raise Refused(f"refusing the link {path!r} -> {target!r}: it leaves the tree")
    return target


def check_entries(rows: list[list[Any]]) -> list[tuple[str, str, Any]]:
    """(path, kind, ...) rows, checked; a file's blob name is hexadecimal (and ``x``)."""
    entries: list[tuple[str, str, Any]] = []
    seen: set[str] = set()
    for row in rows:
        path, kind = check_name(row[0]), row[1]
        if path in seen:
            raise Refused(f"refusing the name {path!r} twice")
        seen.add(path)
        if kind == "link":
            entries.append((path, kind, check_target(path, row[2])))
        elif kind == "file":
            size, executable, digest = int(row[2]), bool(row[3]), str(row[4])
            if size < 0 or len(digest) != 64 or digest.strip("0123456789abcdef"):
                raise Refused(f"refusing the file {path!r}: bad size or digest")
            entries.append((path, kind, (digest + ("x" if executable else ""), size)))
        else:
            raise Refused(f"refusing {path!r}: unknown kind {kind!r}")
    for path in seen:  # a file or link may not stand where another entry needs a folder
        parent = os.path.dirname(path)
        while parent:
            if parent in seen:
                raise Refused(f"refusing {path!r}: {parent!r} is not a folder")
            parent = os.path.dirname(parent)
    return entries


def answer(data: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(data) + "\n")
    sys.stdout.flush()


def private_folder(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def blob_ok(path: str, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def receive_blob(stream: IO[bytes], store: str, blob: str, size: int) -> None:
    """``size`` bytes from the sender into the store, checked against their digest."""
    temporary = os.path.join(store, f".tmp-{blob}-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(temporary, "wb") as f:
            left = size
            while left:
                chunk = stream.read(min(CHUNK, left))
                if not chunk:
                    raise EOFError("the sender stopped")
                digest.update(chunk)
                f.write(chunk)
                left -= len(chunk)
        if digest.hexdigest() != blob[:64]:
            raise Refused("a file's content does not match its digest")
        os.chmod(temporary, 0o500 if blob.endswith("x") else 0o400)
        os.rename(temporary, os.path.join(store, blob))
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def place(store: str, folder: str, entries: list[tuple[str, str, Any]]) -> None:
    for path, kind, detail in entries:
        target = os.path.join(folder, path)
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700)
        if kind == "link":
            os.symlink(detail, target)
            continue
        blob = os.path.join(store, detail[0])
        try:
            os.link(blob, target)
        except OSError:  # another file system, or links refused: a private copy
            shutil.copyfile(blob, target)
            os.chmod(target, 0o500 if detail[0].endswith("x") else 0o400)


def prune(trees: str, store: str, keep: int, current: str) -> None:
    """Keep the ``keep`` trees used last (and ``current``); drop leftovers and blobs no tree
    links any more (a blob's link count is 1: only the store has it)."""
    now = time.time()
    names = [n for n in os.listdir(trees) if not n.startswith(".tmp-")]
    names.sort(key=lambda n: os.stat(os.path.join(trees, n)).st_mtime, reverse=True)
    for name in [n for n in names if n != current][max(keep - 1, 0) :]:
        shutil.rmtree(os.path.join(trees, name), ignore_errors=True)
    for name in os.listdir(trees):
        path = os.path.join(trees, name)
        if name.startswith(".tmp-") and now - os.lstat(path).st_mtime > STALE_S:
            shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(store):
        status = os.lstat(os.path.join(store, name))
        if status.st_nlink <= 1 and now - status.st_mtime > STALE_S:
            try:
                os.unlink(os.path.join(store, name))
            except OSError:
                pass


def build(trees: str, store: str, key: str, entries: list[tuple[str, str, Any]]) -> str:
    """The tree, built aside and renamed into place complete (another host sharing this home
    may have built it first: then theirs is kept)."""
    folder = os.path.join(trees, key)
    temporary = os.path.join(trees, f".tmp-{key}-{os.getpid()}")
    try:
        private_folder(temporary)
        place(store, temporary, entries)
        try:
            os.rename(temporary, folder)
        except OSError:
            if not os.path.isdir(folder):
                raise
    finally:
        if os.path.lexists(temporary):
            shutil.rmtree(temporary, ignore_errors=True)
    return folder


def receive(args: dict[str, Any], stream: IO[bytes]) -> None:
    root = os.path.expanduser(args["root"])
    request = json.loads(stream.readline() or b"null")
    if not isinstance(request, dict):
        raise EOFError("the sender stopped")
    key = str(request["key"])
    if not key or key.strip("0123456789abcdef"):
        raise Refused(f"refusing the tree key {key!r}")
    entries = check_entries(request["entries"])
    os.umask(0o077)
    private_folder(root)
    store, trees = (
        private_folder(os.path.join(root, "store")),
        private_folder(os.path.join(root, "trees")),
    )
    folder = os.path.join(trees, key)
    if not os.path.isdir(folder):
        sizes = {d[0]: d[1] for _, kind, d in entries if kind == "file"}
        missing = sorted(
            b for b, size in sizes.items() if not blob_ok(os.path.join(store, b), size)
        )
        answer({"missing": missing})
        for blob in missing:
            receive_blob(stream, store, blob, sizes[blob])
        received = sum(sizes[b] for b in missing)
        for blob in sizes:  # fresh again: the pruning below keeps it
            os.utime(os.path.join(store, blob))
        folder = build(trees, store, key, entries)
    else:
        received = 0
    os.utime(folder)  # the trees used last are the ones kept
    prune(trees, store, int(args.get("keep", 5)), key)
    answer({"tree": folder, "received": received})


def main() -> None:
    args = json.loads(sys.argv[1])
    try:
        receive(args, sys.stdin.buffer)
    except Refused as exc:
        sys.stderr.write(f"dtrain sync: {exc}\n")
        sys.exit(3)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        sys.exit(4)


if __name__ == "__main__":
    main()
