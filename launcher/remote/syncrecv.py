"""``--sync``'s receiving side: run on a host as text (``python -c``), stdlib only.

It never trusts the sender: every name and link target is checked here again, and every
link of a built tree is followed (inside the tree only) to where it really leads.  Layout
under the cache folder (``~/.cache/dtrain/sync`` by default; every folder 0700):

    store/DIGEST[x]   each file's content once, read-only (``x``: the executable ones)
    trees/KEY/        a tree: hard links into the store (a copy where links fail)
    trees/.tmp-*      a tree being built (renamed to trees/KEY only when complete) or removed
    trees/.dtrain-trees   tells a host's agent that a rank's folder is in a synced tree

The cache is dtrain's own.  An existing cache folder must be the user's and writable by no
one else, and so must every folder above it (or root's; a sticky one such as /tmp may be
writable by all), as OpenSSH checks those above ``~/.ssh``; otherwise it is refused with
one line, never repaired.  Inside it every step is relative to a folder's descriptor and
never follows a link (``O_NOFOLLOW``, ``lstat``), and only what matches what this program
makes (a tree's name, a blob's name, owned by the user) is ever removed.

A tree in use is never pruned: the agent of a job running in it holds a shared ``flock`` on
its folder for the job's life; prune takes it exclusively without waiting and skips a tree
it cannot lock.  This program holds the shared lock from choosing the tree until it exits,
and prune also keeps a tree used in the last ``RECENT_S`` (the launch between the answer
and the agent's lock takes seconds; an hour leaves room for any).

Talk, over the SSH channel: the sender writes one JSON line (``key``, ``entries``); this
answers ``MARK {"tree": PATH}`` when the tree is there, else ``MARK {"missing": [...]}``,
reads each missing blob's bytes in that order, builds the tree and answers
``MARK {"tree": PATH, "received": BYTES}``.  A refusal is ``MARK {"refused": WHY, "hint":
HOW}`` (and ``"blob"`` for content that does not match its digest) and exit code 3.  An
end of input before that (the launcher interrupted, the connection lost) removes what was
half written, and the process ends with code 4.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time
from typing import IO, Any

MARK = "DTRAIN-SYNC "  # before each answer: the login shell may print lines of its own
CHUNK = 1 << 20
STALE_S = 3600  # a .tmp- tree or an unlinked blob this old is a leftover
RECENT_S = 3600  # a tree used this recently is kept (its job may not hold its lock yet)
TREES_MARK = ".dtrain-trees"  # in trees/: the agent's sign that a rank's folder is a tree
MAX_HOPS = 64  # links followed for one name at most (more is a loop, which stays inside)
MAX_SIZE = 1 << 44  # a file bigger than 16 TiB is a lie
HEX = frozenset("0123456789abcdef")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CACHE_HINT = "set DTRAIN_SYNC_CACHE to a folder of your own that only you can write"
Entry = tuple[str, str, Any]  # (path, "link", target) or (path, "file", (blob, size))


class Refused(Exception):
    def __init__(self, message: str, hint: str = "", blob: str = "") -> None:
        super().__init__(message)
        self.hint = hint
        self.blob = blob


# ---- the request ----


def check_name(path: Any) -> str:
    parts = path.split("/") if isinstance(path, str) else [""]
    if "\0" in parts[0] or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise Refused(f"refusing the name {path!r}: names must stay inside the tree")
    return str(path)


def check_target(path: str, target: Any) -> str:
    if not isinstance(target, str) or not target or "\0" in target or target.startswith("/"):
        raise Refused(f"refusing the link {path!r} -> {target!r}")
    inside = os.path.normpath(os.path.join(os.path.dirname(path), target))
    if inside == ".." or inside.startswith("../"):
        raise Refused(f"refusing the link {path!r} -> {target!r}: it leaves the tree")
    return target


def check_file(path: str, row: list[Any]) -> tuple[str, int]:
    """A file row's blob name (its digest, and ``x`` when executable) and size."""
    if len(row) != 5:
        raise Refused(f"refusing the file {path!r}: a file row has 5 fields")
    size, executable, digest = row[2], row[3], row[4]
    if type(size) is not int or not 0 <= size <= MAX_SIZE:
        raise Refused(f"refusing the file {path!r}: bad size {size!r}")
    if not isinstance(executable, bool):
        raise Refused(f"refusing the file {path!r}: bad executable bit {executable!r}")
    if not isinstance(digest, str) or len(digest) != 64 or not HEX.issuperset(digest):
        raise Refused(f"refusing the file {path!r}: bad digest {digest!r}")
    return digest + ("x" if executable else ""), size


def check_entries(rows: Any) -> list[Entry]:
    """(path, kind, ...) rows, checked; any malformed one is a refusal."""
    if not isinstance(rows, list):
        raise Refused("refusing the request: its entries are not a list")
    entries: list[Entry] = []
    seen: set[str] = set()
    sizes: dict[str, int] = {}
    for row in rows:
        if not isinstance(row, list) or len(row) < 3:
            raise Refused(f"refusing the entry {row!r}: not a [name, kind, ...] row")
        path, kind = check_name(row[0]), row[1]
        if path in seen:
            raise Refused(f"refusing the name {path!r} twice")
        seen.add(path)
        if kind == "link" and len(row) == 3:
            entries.append((path, kind, check_target(path, row[2])))
        elif kind == "file":
            blob, size = check_file(path, row)
            if sizes.setdefault(blob, size) != size:
                raise Refused(f"refusing the file {path!r}: its content has two sizes")
            entries.append((path, kind, (blob, size)))
        else:
            raise Refused(f"refusing {path!r}: unknown kind {kind!r}")
    for path in seen:  # a file or link may not stand where another entry needs a folder
        parent = os.path.dirname(path)
        while parent:
            if parent in seen:
                raise Refused(f"refusing {path!r}: {parent!r} is not a folder")
            parent = os.path.dirname(parent)
    return sorted(entries, key=lambda entry: entry[0].split("/"))  # each folder's together


def read_request(stream: IO[bytes]) -> tuple[str, list[Entry]]:
    line = stream.readline()
    if not line:
        raise EOFError("the sender stopped")
    try:
        request = json.loads(line)
    except ValueError:
        raise Refused("refusing the request: not JSON") from None
    if not isinstance(request, dict) or "entries" not in request:
        raise Refused("refusing the request: not a {key, entries} object")
    key = request.get("key")
    if not isinstance(key, str) or not 0 < len(key) <= 64 or not HEX.issuperset(key):
        raise Refused(f"refusing the tree key {key!r}")
    return key, check_entries(request["entries"])


# ---- where links really lead ----


def escapes(top: str, path: str, absolute_root: str | None = None) -> bool:
    """Whether following ``path`` (relative to the folder ``top``) leads out of ``top``.

    Links are resolved one name at a time, as the kernel does, and only inside ``top``
    (none outside it is ever read): a ``..`` above ``top`` or an absolute target leaves it,
    unless the target is under ``absolute_root`` (``top``'s own absolute path, for a sender
    whose links name DIR absolutely)."""
    done: list[str] = []
    todo = list(reversed(path.split("/")))
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                return True
            done.pop()
            continue
        here = os.path.join(top, *done, part)
        try:
            is_link = stat.S_ISLNK(os.lstat(here).st_mode)
        except OSError:  # missing (a dangling link, or ignored): the rest is as written
            is_link = False
        if not is_link:
            done.append(part)
            continue
        hops += 1
        if hops > MAX_HOPS:
            return False  # a loop: every step so far stayed inside
        target = os.readlink(here)
        if target.startswith("/"):  # (its own names, not normalised: each may be a link)
            base = (absolute_root or "").rstrip("/") + "/"
            if absolute_root is None or not (target + "/").startswith(base):
                return True
            done, target = [], target[len(base) :]
        todo.extend(reversed(target.split("/")))
    return False


def check_links(top: str, entries: list[Entry]) -> None:
    for path, kind, detail in entries:
        if kind == "link" and escapes(top, path):
            raise Refused(f"refusing the link {path!r} -> {detail!r}: it leads out of the tree")


# ---- the cache folder, checked as OpenSSH checks ~/.ssh ----


def owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def unsafe(status: os.stat_result, uid: int, own: bool) -> str:
    """Why a folder may not hold (``own``: be) the cache; "" when it may."""
    if not stat.S_ISDIR(status.st_mode):
        return "not a folder"
    if status.st_uid != uid and (own or status.st_uid != 0):
        return f"owned by {owner_name(status.st_uid)}"
    if status.st_mode & 0o022 and (own or not status.st_mode & stat.S_ISVTX):
        return f"writable by others (mode {stat.S_IMODE(status.st_mode):o})"
    return ""


def open_step(parent: int, name: str, shown: str, uid: int, own: bool) -> int:
    """The folder ``name`` in ``parent``, made (0700) where it is missing, once checked."""
    for _ in range(2):
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
            break
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
        except OSError as exc:
            why = "a link" if exc.errno == 40 else exc.strerror  # ELOOP: O_NOFOLLOW met one
            raise Refused(f"refusing the sync cache: {shown} is {why}", CACHE_HINT) from None
    else:
        raise Refused(f"refusing the sync cache: cannot make {shown}", CACHE_HINT)
    reason = unsafe(os.fstat(fd), uid, own)
    if reason:
        os.close(fd)
        raise Refused(f"refusing the sync cache: {shown} is {reason}", CACHE_HINT)
    return fd


def open_cache(root: str, uid: int) -> tuple[int, str]:
    """The cache folder's descriptor and real path, walked from ``/`` one folder at a time
    (each checked; the missing ones made).  A link as the cache itself must be the user's."""
    path = os.path.abspath(os.path.expanduser(root))
    try:
        status = os.lstat(path)
        if stat.S_ISLNK(status.st_mode) and status.st_uid not in (uid, 0):
            why = f"a link owned by {owner_name(status.st_uid)}"
            raise Refused(f"refusing the sync cache: {path} is {why}", CACHE_HINT)
    except FileNotFoundError:
        pass
    real = os.path.realpath(path)
    parts = [p for p in real.split("/") if p]
    fd = os.open("/", DIR_FLAGS)
    reason = unsafe(os.fstat(fd), uid, not parts)
    if reason:
        raise Refused(f"refusing the sync cache: / is {reason}", CACHE_HINT)
    for index, name in enumerate(parts):
        shown = "/" + "/".join(parts[: index + 1])
        try:
            below = open_step(fd, name, shown, uid, index == len(parts) - 1)
        finally:
            os.close(fd)
        fd = below
    return fd, real


# ---- inside the cache: descriptors, no link followed ----


def our_folder(parent: int, name: str, shown: str, uid: int) -> int:
    return open_step(parent, name, shown, uid, True)


def is_ours(status: os.stat_result, uid: int, kind: int) -> bool:
    return stat.S_IFMT(status.st_mode) == kind and status.st_uid == uid


def blob_ok(store: int, blob: str, size: int, uid: int) -> bool:
    try:
        status = os.stat(blob, dir_fd=store, follow_symlinks=False)
    except OSError:
        return False
    return is_ours(status, uid, stat.S_IFREG) and status.st_size == size


def fresh_name(prefix: str) -> str:
    return f".tmp-{prefix}-{os.getpid()}-{os.urandom(4).hex()}"


def receive_blob(stream: IO[bytes], store: int, blob: str, size: int) -> None:
    """``size`` bytes from the sender into the store, checked against their digest."""
    temporary = fresh_name(blob)
    fd = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=store
    )
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            left = size
            while left:
                chunk = stream.read(min(CHUNK, left))
                if not chunk:
                    raise EOFError("the sender stopped")
                digest.update(chunk)
                f.write(chunk)
                left -= len(chunk)
            os.fchmod(f.fileno(), 0o500 if blob.endswith("x") else 0o400)
        if digest.hexdigest() != blob[:64]:
            raise Refused("a file's content does not match its digest", blob=blob)
        os.rename(temporary, blob, src_dir_fd=store, dst_dir_fd=store)
        temporary = ""
    finally:
        if temporary:
            os.unlink(temporary, dir_fd=store)


def copy_blob(store: int, blob: str, folder: int, name: str) -> None:
    """A private copy where a hard link cannot be made (another file system)."""
    mode = 0o500 if blob.endswith("x") else 0o400
    source = os.open(blob, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=store)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        target = os.open(name, flags, mode, dir_fd=folder)
        try:
            while chunk := os.read(source, CHUNK):
                while chunk:
                    chunk = chunk[os.write(target, chunk) :]
        finally:
            os.close(target)
    finally:
        os.close(source)


def place(store: int, top: int, entries: list[Entry]) -> None:
    """The entries as links and files in the folder ``top`` (entries sorted by folder)."""
    open_folders: dict[str, int] = {"": top}
    try:
        for path, kind, detail in entries:
            parent = os.path.dirname(path)
            for other in [p for p in open_folders if p and not (parent + "/").startswith(p + "/")]:
                os.close(open_folders.pop(other))
            folder = top
            for index, part in enumerate(parent.split("/") if parent else []):
                below = "/".join(parent.split("/")[: index + 1])
                if below not in open_folders:
                    try:
                        os.mkdir(part, 0o700, dir_fd=folder)
                    except FileExistsError:
                        pass
                    open_folders[below] = os.open(part, DIR_FLAGS, dir_fd=folder)
                folder = open_folders[below]
            name = os.path.basename(path)
            if kind == "link":
                os.symlink(detail, name, dir_fd=folder)
                continue
            try:
                os.link(detail[0], name, src_dir_fd=store, dst_dir_fd=folder, follow_symlinks=False)
            except OSError:  # another file system, or links refused: a private copy
                copy_blob(store, detail[0], folder, name)
    finally:
        for path, fd in open_folders.items():
            if path:
                os.close(fd)


def clear(folder: int) -> None:
    """Remove everything in the folder ``folder`` (a descriptor), following no link."""
    for entry in list(os.scandir(folder)):
        try:
            if entry.is_dir(follow_symlinks=False):
                below = os.open(entry.name, DIR_FLAGS, dir_fd=folder)
                try:
                    clear(below)
                finally:
                    os.close(below)
                os.rmdir(entry.name, dir_fd=folder)
            else:
                os.unlink(entry.name, dir_fd=folder)
        except OSError:  # (what a job made unremovable stays)
            pass


def removable(status: os.stat_result, uid: int, used_before: float | None) -> bool:
    """A folder of the user's, not used after ``used_before`` (None: whenever)."""
    recent = used_before is not None and status.st_mtime > used_before
    return is_ours(status, uid, stat.S_IFDIR) and not recent


def remove_folder(trees: int, name: str, uid: int, used_before: float | None) -> None:
    """Remove trees/``name``, a folder of the user's, unless a job holds its lock (or it was
    used after ``used_before``): renamed aside under the exclusive lock, then emptied."""
    import fcntl

    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=trees)
    except OSError:
        return
    try:
        # Checked before locking too: a tree used lately is never locked, even for a moment
        # (an agent starting a job in it would fail its shared lock, and never retry it).
        if not removable(os.fstat(fd), uid, used_before):
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not removable(os.fstat(fd), uid, used_before):
            return
        if not name.startswith(".tmp-"):
            aside = fresh_name("gone-" + name)
            os.rename(name, aside, src_dir_fd=trees, dst_dir_fd=trees)
            name = aside
        clear(fd)
        os.rmdir(name, dir_fd=trees)
    except OSError:  # locked (in use), or a race with another host's prune
        pass
    finally:
        os.close(fd)


def is_key(name: str) -> bool:
    return 0 < len(name) <= 64 and HEX.issuperset(name)


def prune(trees: int, store: int, keep: int, current: str, recent_s: float, uid: int) -> None:
    """Keep the ``keep`` trees used last (and ``current``), and every tree in use (locked)
    or used in the last ``recent_s``; drop leftovers and blobs no tree links any more (a
    blob's link count is 1: only the store has it).  Only names this program makes, owned
    by the user, are candidates."""
    now = time.time()
    found = [(e.name, e.stat(follow_symlinks=False)) for e in os.scandir(trees)]
    kept = sorted(
        ((s.st_mtime, n) for n, s in found if is_key(n) and is_ours(s, uid, stat.S_IFDIR)),
        reverse=True,
    )
    for _, name in [item for item in kept if item[1] != current][max(keep - 1, 0) :]:
        remove_folder(trees, name, uid, now - recent_s)
    for name, status in found:
        if name.startswith(".tmp-") and now - status.st_mtime > STALE_S:
            remove_folder(trees, name, uid, None)
    for entry in os.scandir(store):
        blob = entry.name.split("-")[1] if entry.name.startswith(".tmp-") else entry.name
        if not (len(blob.rstrip("x")) == 64 and HEX.issuperset(blob.rstrip("x"))):
            continue
        status = entry.stat(follow_symlinks=False)
        old = now - status.st_mtime > STALE_S
        if is_ours(status, uid, stat.S_IFREG) and status.st_nlink <= 1 and old:
            try:
                os.unlink(entry.name, dir_fd=store)
            except OSError:
                pass


# ---- one request ----


def answer(data: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(data) + "\n")
    sys.stdout.flush()


def hold_tree(trees: int, key: str, uid: int) -> int | None:
    """trees/``key`` opened and share-locked (prune skips it while this runs), its use time
    now; None where it is missing or being removed."""
    import fcntl

    try:
        fd = os.open(key, DIR_FLAGS, dir_fd=trees)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Refused(f"refusing the tree trees/{key}: {exc.strerror}", CACHE_HINT) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # a prune is removing it: build it again
        os.close(fd)
        return None
    if not is_ours(os.fstat(fd), uid, stat.S_IFDIR):
        os.close(fd)
        raise Refused(f"refusing the tree trees/{key}: not a folder of yours", CACHE_HINT)
    os.utime(fd)  # the trees used last are the ones kept
    return fd


def build(trees: int, trees_path: str, store: int, key: str, entries: list[Entry]) -> None:
    """The tree, built aside, its links followed, then renamed into place complete (another
    host sharing this home may have built it first: then theirs is kept).  A link that
    leads out of it refuses the whole tree, and what was built is removed."""
    temporary = fresh_name(key)
    os.mkdir(temporary, 0o700, dir_fd=trees)
    top = os.open(temporary, DIR_FLAGS, dir_fd=trees)
    try:
        place(store, top, entries)
        check_links(os.path.join(trees_path, temporary), entries)
        try:
            os.rename(temporary, key, src_dir_fd=trees, dst_dir_fd=trees)
            temporary = ""
        except OSError:
            if not stat.S_ISDIR(os.stat(key, dir_fd=trees, follow_symlinks=False).st_mode):
                raise
    finally:
        if temporary:
            clear(top)
            os.rmdir(temporary, dir_fd=trees)
        os.close(top)


def receive(args: dict[str, Any], stream: IO[bytes]) -> None:
    key, entries = read_request(stream)
    uid = os.geteuid()
    os.umask(0o077)
    root, real = open_cache(str(args["root"]), uid)
    store = our_folder(root, "store", real + "/store", uid)
    trees = our_folder(root, "trees", real + "/trees", uid)
    trees_path = real + "/trees"
    os.close(os.open(TREES_MARK, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=trees))
    held, received = hold_tree(trees, key, uid), 0
    if held is None:
        sizes = {d[0]: d[1] for _, kind, d in entries if kind == "file"}
        missing = sorted(b for b, size in sizes.items() if not blob_ok(store, b, size, uid))
        answer({"missing": missing})
        for blob in missing:
            receive_blob(stream, store, blob, sizes[blob])
        received = sum(sizes[b] for b in missing)
        for blob in sizes:  # fresh again: the pruning below keeps it
            os.utime(blob, dir_fd=store, follow_symlinks=False)
        build(trees, trees_path, store, key, entries)
        held = hold_tree(trees, key, uid)
        if held is None:
            raise Refused(f"the tree trees/{key} was removed while it was built", "run again")
    else:
        check_links(os.path.join(trees_path, key), entries)  # (one an older dtrain built)
    prune(trees, store, int(args.get("keep", 5)), key, float(args.get("recent_s", RECENT_S)), uid)
    answer({"tree": os.path.join(trees_path, key), "received": received})


def refuse(exc: Refused) -> None:
    sys.stderr.write(f"dtrain sync: {exc}\n")
    try:
        answer({"refused": str(exc), "hint": exc.hint, "blob": exc.blob})
    except OSError:
        pass
    sys.exit(3)


def main() -> None:
    try:
        args = json.loads(sys.argv[1])
        receive(args, sys.stdin.buffer)
    except Refused as exc:
        refuse(exc)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        sys.exit(4)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        refuse(Refused(f"cannot write the sync cache: {exc.strerror}{where}", CACHE_HINT))


if __name__ == "__main__":
    main()
