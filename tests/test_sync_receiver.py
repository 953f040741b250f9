"""``--sync``'s receiver (``remote/syncrecv.py``) fed crafted requests, run as it runs on a
host (its text under ``python -I -S -c``, the request on stdin): it never trusts the
sender, never prunes a tree a job holds, and keeps out of a cache others can write."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher import remote
from launcher.remote.syncrecv import MARK, TREES_MARK
from tests.otheruser import OtherUser

KEY = "ab12"


def receive(
    cache: Path, request: object, blobs: bytes = b"", **args: object
) -> tuple[int, list[dict[str, object]], str]:
    """The receiver's exit code, its answers and its stderr."""
    line = request if isinstance(request, bytes) else json.dumps(request).encode()
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", remote.source("syncrecv"),
         json.dumps({"root": str(cache), "keep": 2, **args})],
        input=line + b"\n" + blobs,
        capture_output=True,
        check=False,
        timeout=60,
    )  # fmt: skip
    answers = [
        json.loads(text[len(MARK) :])
        for text in done.stdout.decode().splitlines()
        if text.startswith(MARK)
    ]
    return done.returncode, answers, done.stderr.decode()


def file_row(path: str, content: bytes, size: int | None = None) -> list[object]:
    digest = hashlib.sha256(content).hexdigest()
    return [path, "file", len(content) if size is None else size, False, digest]


def assert_refused(code: int, answers: list[dict[str, object]], err: str, why: str) -> None:
    """One line on stderr, one refusal answer, exit 3: no traceback."""
    assert code == 3, err
    assert len(err.splitlines()) == 1 and err.startswith("dtrain sync: "), err
    assert why in err, err
    assert "refused" in answers[-1] and "tree" not in answers[-1]


def trees_in(cache: Path) -> list[str]:
    return sorted(n for n in os.listdir(cache / "trees") if n != TREES_MARK)


# ---- malformed requests: one refusal line each ----


@pytest.mark.parametrize(
    ("entries", "why"),
    [
        ([["../escape.py", "file", 1, False, "0" * 64]], "refusing the name"),
        ([["/tmp/abs.py", "file", 1, False, "0" * 64]], "refusing the name"),
        ([["a/../../b", "file", 1, False, "0" * 64]], "refusing the name"),
        ([[".", "link", "x"]], "refusing the name"),
        ([["link", "link", "../../etc/passwd"]], "refusing the link"),
        ([["link", "link", "/etc/passwd"]], "refusing the link"),
        ([["d/link", "link", "../.."]], "leaves the tree"),
        ([["x", "file", 1, False, "../../../etc"]], "bad digest"),
        ([["link", "link", 123]], "refusing the link"),
        ([["link", "link", None]], "refusing the link"),
        ([["link", "link", ["x"]]], "refusing the link"),
        ([[123, "file", 1, False, "0" * 64]], "refusing the name"),
        (["not-a-row"], "not a [name, kind, ...] row"),
        ([{"path": "x"}], "not a [name, kind, ...] row"),
        ([["x"]], "not a [name, kind, ...] row"),
        ([["x", "file", -1, False, "0" * 64]], "bad size"),
        ([["x", "file", "10", False, "0" * 64]], "bad size"),
        ([["x", "file", 1.5, False, "0" * 64]], "bad size"),
        ([["x", "file", True, False, "0" * 64]], "bad size"),
        ([["x", "file", 1, "yes", "0" * 64]], "bad executable bit"),
        ([["x", "file", 1, False]], "5 fields"),
        ([["x", "fifo", 1]], "unknown kind"),
        ([["x", "link", "y"], ["x", "link", "z"]], "twice"),
        ([["x", "link", "y"], ["x/y", "link", "z"]], "is not a folder"),
        ([["a", "file", 1, False, "0" * 64], ["b", "file", 2, False, "0" * 64]], "two sizes"),
        ("entries", "not a list"),
    ],
)
def test_malformed_entries_are_one_refusal_line(tmp_path: Path, entries: object, why: str) -> None:
    code, answers, err = receive(tmp_path / "cache", {"key": KEY, "entries": entries})
    assert_refused(code, answers, err, why)
    assert not (tmp_path / "escape.py").exists()
    assert not list(tmp_path.glob("cache/trees/*"))  # (refused before the cache is touched)


@pytest.mark.parametrize(
    ("request_line", "why"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a {key, entries} object"),
        (json.dumps({"key": "../x", "entries": []}).encode(), "tree key"),
        (json.dumps({"key": 7, "entries": []}).encode(), "tree key"),
    ],
)
def test_malformed_requests_are_one_refusal_line(
    tmp_path: Path, request_line: bytes, why: str
) -> None:
    code, answers, err = receive(tmp_path / "cache", request_line)
    assert_refused(code, answers, err, why)


# ---- links, followed after building ----


@pytest.mark.parametrize(
    "links",
    [
        [["a", "link", "."], ["up4", "link", "a/a/a/a/../../../.."]],  # ln -s . a; ln -s a/a/...
        [["a", "link", "."], ["b", "link", "a/.."]],
        [["d/self", "link", ".."], ["d/out", "link", "self/.."]],
        [["d/up", "link", ".."], ["d/e/out", "link", "../up/.."]],
    ],
)
def test_links_that_really_lead_out_refuse_the_whole_tree(
    tmp_path: Path, links: list[list[object]]
) -> None:
    rows = [*links, file_row("train.py", b"print(1)\n")]
    code, answers, err = receive(tmp_path / "cache", {"key": KEY, "entries": rows}, b"print(1)\n")
    assert_refused(code, answers, err, "it leads out of the tree")
    assert trees_in(tmp_path / "cache") == []  # the built tree is removed, no .tmp- left


def test_links_inside_are_kept(tmp_path: Path) -> None:
    rows = [
        ["a", "link", "."],
        ["in", "link", "a/a/sub/../train.py"],
        ["sub/up", "link", "../a/train.py"],
        ["sub/dangling", "link", "nothing/here"],
        ["loop1", "link", "loop2"],
        ["loop2", "link", "loop1"],
        file_row("train.py", b"print(1)\n"),
    ]
    code, answers, err = receive(tmp_path / "cache", {"key": KEY, "entries": rows}, b"print(1)\n")
    assert code == 0, err
    tree = Path(str(answers[-1]["tree"]))
    assert (tree / "in").read_text() == "print(1)\n" == (tree / "sub/up").read_text()


# ---- contents that lie ----


def test_a_digest_that_lies_is_refused_and_nothing_is_kept(tmp_path: Path) -> None:
    row = file_row("train.py", b"print(1)\n")
    code, answers, err = receive(tmp_path / "cache", {"key": KEY, "entries": [row]}, b"print(2)\n")
    assert_refused(code, answers, err, "does not match its digest")
    assert answers[-1]["blob"] == row[4]  # (the launcher names the file: changed while syncing)
    assert os.listdir(tmp_path / "cache/store") == [] and trees_in(tmp_path / "cache") == []


def test_a_size_that_lies_is_refused_or_ends_with_nothing_left(tmp_path: Path) -> None:
    content = b"hello, world\n"
    short = file_row("a.txt", content, size=5)  # reads 5 bytes: not what the digest says
    code, answers, err = receive(tmp_path / "cache", {"key": KEY, "entries": [short]}, content)
    assert_refused(code, answers, err, "does not match its digest")
    long = file_row("a.txt", content, size=1 << 40)  # waits for bytes that never come
    code, _, _ = receive(tmp_path / "cache", {"key": KEY, "entries": [long]}, content)
    assert code == 4
    assert os.listdir(tmp_path / "cache/store") == [] and trees_in(tmp_path / "cache") == []


def test_receiver_builds_private_trees_and_keeps_exec_bits(tmp_path: Path) -> None:
    tool, module = b"#!/bin/sh\necho hi\n", b"x = 1\n"
    tool_digest, module_digest = (hashlib.sha256(c).hexdigest() for c in (tool, module))
    rows = [
        ["run.sh", "file", len(tool), True, tool_digest],
        file_row("lib/m.py", module),
        ["m", "link", "lib/m.py"],
    ]
    blobs = {tool_digest + "x": tool, module_digest: module}
    request = {"key": KEY, "entries": rows}
    code, answers, err = receive(
        tmp_path / "cache", request, b"".join(blobs[b] for b in sorted(blobs))
    )
    assert code == 0, err
    tree = Path(str(answers[-1]["tree"]))
    assert (tree / "run.sh").stat().st_mode & 0o777 == 0o500
    assert (tree / "lib/m.py").stat().st_mode & 0o777 == 0o400
    assert (tree / "lib").stat().st_mode & 0o777 == 0o700
    assert os.readlink(tree / "m") == "lib/m.py" and (tree / "m").read_text() == "x = 1\n"
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    code, answers, _ = receive(tmp_path / "cache", request)  # there: nothing is asked for
    assert code == 0 and answers == [{"tree": str(tree), "received": 0}]


# ---- a tree in use is never pruned ----

HOLDER = """
import sys
namespace = {"__name__": "dtrain_watchdog"}
exec(compile(open(sys.argv[2]).read(), "dtrain-watchdog", "exec"), namespace)
namespace["hold_tree"](sys.argv[1])
print("held", *sorted(namespace["held_trees"]), flush=True)
sys.stdin.read()
"""


def sync_tree(cache: Path, name: str, **args: object) -> Path:
    content = f"print({name!r})\n".encode()
    key = hashlib.sha256(content).hexdigest()[:32]
    request = {"key": key, "entries": [file_row("train.py", content)]}
    code, answers, err = receive(cache, request, content, **args)
    assert code == 0, err
    return Path(str(answers[-1]["tree"]))


def test_a_tree_a_job_holds_survives_syncs_of_other_trees(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    job_tree = sync_tree(cache, "the job")
    (job_tree / "sub").mkdir()
    (job_tree / "sub/checkpoint.pt").write_text("epoch 3")
    # the agent's lock, taken by the watchdog's own code (as the agent runs it) from a rank's
    # working directory inside the tree
    holder = subprocess.Popen(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            HOLDER,
            str(job_tree / "sub"),
            str(remote.path("watchdog")),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().split() == ["held", str(job_tree)]
        old = time.time() - 7200
        os.utime(job_tree, (old, old))  # (long ago: only its lock keeps it)
        others = [sync_tree(cache, f"other {n}", recent_s=0) for n in range(6)]
        assert job_tree.is_dir() and (job_tree / "sub/checkpoint.pt").read_text() == "epoch 3"
        assert trees_in(cache) == sorted([job_tree.name, others[-2].name, others[-1].name])
    finally:
        holder.kill()
        holder.wait()
    os.utime(job_tree, (old, old))
    sync_tree(cache, "after the job", recent_s=0)  # released: an old tree like any other
    assert not job_tree.exists()
    assert not [n for n in os.listdir(cache / "trees") if n.startswith(".tmp-")]


def test_a_tree_used_lately_is_kept_until_its_job_locks_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = sync_tree(cache, "just synced")  # its launcher is starting the ranks
    for n in range(4):
        sync_tree(cache, f"other {n}")
    assert first.is_dir() and len(trees_in(cache)) == 5
    for n in range(2):
        sync_tree(cache, f"later {n}", recent_s=0)
    assert not first.exists() and len(trees_in(cache)) == 2


PRUNER = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
from launcher.remote.syncrecv import remove_folder
trees = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
print("pruning", flush=True)
end = time.time() + float(sys.argv[3])
while time.time() < end:
    remove_folder(trees, os.path.basename(sys.argv[4]), os.geteuid(), time.time() - 3600)
"""


def test_a_prune_never_locks_a_tree_used_lately_so_a_starting_agent_always_locks_it(
    tmp_path: Path,
) -> None:
    """A prune (another job's sync) that looks at a tree just synced must not take its
    exclusive lock even for a moment: an agent starting the tree's job then fails its shared
    lock (non-blocking, never retried) and the job runs unprotected (reviewer's race: ~20% of
    the agent's tries failed while a prune looped)."""
    import fcntl

    cache = tmp_path / "cache"
    tree = sync_tree(cache, "the job")  # just synced: used lately
    repo = str(Path(__file__).resolve().parent.parent)
    pruner = subprocess.Popen(
        [sys.executable, "-c", PRUNER, str(cache / "trees"), repo, "1.5", str(tree)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert pruner.stdout is not None and pruner.stdout.readline().strip() == "pruning"
        failed = tries = 0
        while pruner.poll() is None:
            fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                failed += 1
            finally:
                os.close(fd)
            tries += 1
    finally:
        pruner.kill()
        pruner.wait()
    assert tries > 100 and failed == 0, f"{failed} of {tries} shared locks failed"
    assert tree.is_dir()


# ---- a cache others can write: refused, nothing of theirs touched ----


def snapshot(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every path under ``folder``: mode, owner, and a link's target."""
    found = {}
    for path in [folder, *folder.rglob("*")]:
        status = path.lstat()
        target = os.readlink(path) if path.is_symlink() else ""
        found[str(path)] = (status.st_mode, status.st_uid, target)
    return found


def plant(other_user: OtherUser, shared: Path) -> None:
    """The other user's folders and files, and a cache of theirs full of links to them."""
    other_user.sh(
        f"""cd {shared}
        mkdir -m 755 victim victim/a victim/b victim/c victim/d victim/e victim/f
        echo precious > victim/old.txt; touch -d '2 hours ago' victim/old.txt victim/*
        mkdir -m 777 cache cache/trees cache/store
        for n in a b c d e f; do ln -s {shared}/victim/$n cache/trees/$n$n$n$n; done
        ln -s {shared}/victim/old.txt cache/store/{"0" * 64}
        ln -s {shared}/victim cache/trees/.tmp-x
        touch {shared}/cache/trees/{TREES_MARK}
        ln -s {shared}/victim link-cache
        mkdir -m 777 theirs"""
    )


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("cache", "cache is owned by"),
        ("link-cache", "link-cache is a link owned by"),
        ("theirs/cache", "theirs is owned by"),
        ("victim/a/cache", "victim is owned by"),
    ],
)
def test_a_cache_of_another_user_is_refused_untouched(
    other_user: OtherUser, shared_tmp: Path, where: str, why: str
) -> None:
    plant(other_user, shared_tmp)
    before = snapshot(shared_tmp)
    content = b"print(1)\n"
    request = {"key": KEY, "entries": [file_row("train.py", content)]}
    code, answers, err = receive(shared_tmp / where, request, content, recent_s=0, keep=1)
    assert_refused(code, answers, err, why)
    assert "DTRAIN_SYNC_CACHE" in str(answers[-1]["hint"])
    assert snapshot(shared_tmp) == before  # nothing removed, chmodded or made


def test_a_cache_of_ours_that_others_can_write_is_refused_not_chmodded(
    other_user: OtherUser, shared_tmp: Path
) -> None:
    (shared_tmp / "cache").mkdir()
    (shared_tmp / "cache").chmod(0o777)
    other_user.sh(f"mkdir {shared_tmp}/cache/trees; ln -s /etc {shared_tmp}/cache/store")
    before = snapshot(shared_tmp)
    request = {"key": KEY, "entries": [["x", "link", "y"]]}
    code, answers, err = receive(shared_tmp / "cache", request)
    assert_refused(code, answers, err, "cache is writable by others (mode 777)")
    assert snapshot(shared_tmp) == before


def test_a_new_cache_in_a_sticky_shared_folder_is_made_private(
    other_user: OtherUser, shared_tmp: Path
) -> None:
    content = b"print(1)\n"
    request = {"key": KEY, "entries": [file_row("train.py", content)]}
    code, answers, err = receive(shared_tmp / "mine/cache", request, content)
    assert code == 0, err
    for folder in ("mine", "mine/cache", "mine/cache/trees", "mine/cache/store"):
        status = (shared_tmp / folder).lstat()
        assert (status.st_uid, status.st_mode & 0o777) == (os.geteuid(), 0o700), folder
    assert Path(str(answers[-1]["tree"]), "train.py").read_bytes() == content
