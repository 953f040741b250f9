"""``--sync DIR``: the tree (which files, sizes, links), the receiver that never trusts the
sender, and copies to real SSH test hosts that the ranks run in."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import remote
from launcher.base.errors import UsageError
from launcher.core.synctree import (
    SyncEntry,
    check_name,
    check_size,
    link_target,
    parse_size,
    synced_workdir,
    tree_key,
)
from launcher.remote.syncrecv import MARK
from launcher.run.syncfiles import hash_entries, list_entries, walk_listing
from tests.conftest import child_env, run_dtrain
from tests.testhosts import TestHosts

# ---- the tree (no SSH) ----


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def git(folder: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


GITIGNORED = {
    ".gitignore": "*.log\n!keep.log\nbuild/\n",
    "train.py": "print('hi')\n",
    "a.log": "x",
    "keep.log": "x",
    "build/out.bin": "x",
    "pkg/.gitignore": "secret.txt\n",
    "pkg/secret.txt": "x",
    "pkg/mod.py": "x",
}
KEPT = [".gitignore", "keep.log", "pkg/.gitignore", "pkg/mod.py", "train.py"]


def test_gitignore_without_git(tmp_path: Path) -> None:
    make_tree(tmp_path, {**GITIGNORED, ".git/config": "not git's: never sent"})
    assert sorted(walk_listing(str(tmp_path))) == KEPT
    assert sorted(e.path for e in list_entries(str(tmp_path))) == KEPT


def test_gitignore_in_a_git_work_tree(tmp_path: Path) -> None:
    make_tree(tmp_path, GITIGNORED)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "train.py")
    assert sorted(e.path for e in list_entries(str(tmp_path))) == KEPT


def test_links_inside_kept_leaving_refused_and_exec_bits(tmp_path: Path) -> None:
    make_tree(tmp_path, {"run.sh": "#!/bin/sh\n", "data/a.txt": "a"})
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "link").symlink_to("data/a.txt")
    (tmp_path / "abs").symlink_to(tmp_path / "data")
    entries = {e.path: e for e in list_entries(str(tmp_path))}
    assert entries["run.sh"].executable and not entries["data/a.txt"].executable
    assert (entries["link"].kind, entries["link"].target) == ("link", "data/a.txt")
    assert entries["abs"].target == "data"  # an absolute link inside: relative in the copy
    (tmp_path / "out").symlink_to("../elsewhere")
    with pytest.raises(UsageError, match="the link out points outside it"):
        list_entries(str(tmp_path))


def test_link_targets() -> None:
    assert link_target("a/b", "../c", "/d") == "../c"
    assert link_target("a/b", "/d/c", "/d") == "../c"
    for path, target in [("a", "../x"), ("a/b", "../../x"), ("a", "/etc/passwd")]:
        with pytest.raises(UsageError, match="points outside"):
            link_target(path, target, "/d")


def test_a_link_leaving_dir_is_named_with_the_target_it_has() -> None:
    # (an absolute target is said as the link has it, not as a path relative to the link)
    with pytest.raises(
        UsageError, match=re.escape("the link a/b points outside it (to /etc/passwd)")
    ):
        link_target("a/b", "/etc/passwd", "/d")


def test_names() -> None:
    assert check_name("a/b.py") == "a/b.py"
    for bad in ["", "/etc/x", "../x", "a/../../x", "a//b", "./a", "a\0b"]:
        with pytest.raises(UsageError):
            check_name(bad)


def test_sizes_and_the_limit() -> None:
    assert [parse_size(t) for t in ["123", "500M", "2G", "1.5GiB", "4k"]] == [
        123,
        500 << 20,
        2 << 30,
        3 << 29,
        4096,
    ]
    with pytest.raises(UsageError):
        parse_size("lots")
    entries = [
        SyncEntry("data/x.bin", "file", 900 << 20),
        SyncEntry("data/y.bin", "file", 200 << 20),
        SyncEntry("model.pt", "file", 50 << 20),
        SyncEntry("train.py", "file", 10),
    ]
    assert check_size(entries, 2 << 30, "/p") == sum(e.size for e in entries)
    with pytest.raises(UsageError) as raised:
        check_size(entries, 1 << 30, "/p")
    assert "1.1 GiB in 4 files, over the 1.0 GiB limit (biggest: data/ 1.1 GiB, model.pt" in str(
        raised.value
    )
    assert "--sync-max-size" in (raised.value.hint or "")


def test_tree_key_changes_with_content_and_modes() -> None:
    one = [SyncEntry("a", "file", 1, False, "0" * 64)]
    assert tree_key(one) == tree_key(list(one))
    assert tree_key(one) != tree_key([SyncEntry("a", "file", 1, True, "0" * 64)])
    assert tree_key(one) != tree_key([SyncEntry("a", "file", 1, False, "1" * 64)])


def test_workdir_in_the_copy() -> None:
    assert synced_workdir("/c/k", "/p", "/p") == "/c/k"
    assert synced_workdir("/c/k", "/p", "/p/sub") == "/c/k/sub"
    with pytest.raises(UsageError, match="not inside it"):
        synced_workdir("/c/k", "/p", "/elsewhere")


# ---- the receiver, run as it is on a host (its text, fed on stdin) ----


def receive(cache: Path, request: dict[str, object], blobs: bytes = b"") -> tuple[int, str, str]:
    args = json.dumps({"root": str(cache), "keep": 2})
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", remote.source("syncrecv"), args],
        input=json.dumps(request).encode() + b"\n" + blobs,
        capture_output=True,
        check=False,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.parametrize(
    "row",
    [
        ["../escape.py", "file", 1, False, "0" * 64],
        ["/tmp/abs.py", "file", 1, False, "0" * 64],
        ["a/../../b", "file", 1, False, "0" * 64],
        ["link", "link", "../../etc/passwd"],
        ["link", "link", "/etc/passwd"],
        ["x", "file", 1, False, "../../../etc"],
    ],
)
def test_receiver_refuses_names_leaving_the_tree(tmp_path: Path, row: list[object]) -> None:
    code, out, err = receive(tmp_path / "cache", {"key": "ab12", "entries": [row]})
    assert code == 3 and "refusing" in err and MARK not in out
    assert not (tmp_path / "escape.py").exists() and not list(tmp_path.glob("cache/trees/*"))


def test_receiver_builds_private_trees_and_keeps_exec_bits(tmp_path: Path) -> None:
    make_tree(tmp_path / "p", {"run.sh": "#!/bin/sh\necho hi\n", "lib/m.py": "x = 1\n"})
    (tmp_path / "p/run.sh").chmod(0o775)
    (tmp_path / "p/m").symlink_to("lib/m.py")
    entries = hash_entries(str(tmp_path / "p"), list_entries(str(tmp_path / "p")))
    rows = [e.as_row() for e in entries]
    blobs = {e.blob: (tmp_path / "p" / e.path).read_bytes() for e in entries if e.kind == "file"}
    request = {"key": tree_key(entries), "entries": rows}
    code, out, err = receive(tmp_path / "cache", request, b"".join(blobs[b] for b in sorted(blobs)))
    assert code == 0, err
    tree = Path(json.loads(out.splitlines()[-1][len(MARK) :])["tree"])
    assert (tree / "run.sh").stat().st_mode & 0o777 == 0o500
    assert (tree / "lib/m.py").stat().st_mode & 0o777 == 0o400
    assert (tree / "lib").stat().st_mode & 0o777 == 0o700
    assert os.readlink(tree / "m") == "lib/m.py" and (tree / "m").read_text() == "x = 1\n"
    # again: the tree is there, nothing is asked for
    code, out, _ = receive(tmp_path / "cache", request)
    assert code == 0 and '"received": 0' in out and "missing" not in out


def test_receiver_stopped_halfway_leaves_no_tree(tmp_path: Path) -> None:
    entries = [SyncEntry("big", "file", 1000, False, "a" * 64)]
    request = {"key": tree_key(entries), "entries": [e.as_row() for e in entries]}
    code, _, _ = receive(tmp_path / "cache", request, b"only part")
    assert code == 4
    assert os.listdir(tmp_path / "cache/trees") == []
    assert os.listdir(tmp_path / "cache/store") == []


def test_over_the_size_limit_starts_nothing(tmp_path: Path) -> None:
    make_tree(tmp_path, {"train.py": "print(1)\n", "data.bin": "x" * 5000})
    done = run_dtrain(
        "run", "-H", "localhost,node9", "--sync", str(tmp_path), "--sync-max-size", "4K",
        "python", "train.py", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert re.search(r"over the 4\.0 KiB limit \(biggest: data\.bin", done.stderr)
    assert "node9" not in done.stderr  # (nothing connected)


# ---- real copies to SSH test hosts ----

SCRIPT = """
import os, sys
here = os.getcwd()
print("CWD", here, open("data/words.txt").read().strip(), os.access("tool.sh", os.X_OK))
"""


def sync_run(hosts: TestHosts, project: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**child_env(), "DTRAIN_SYNC_CACHE": str(cache)}
    return run_dtrain(
        "run", "--plain", "--verbose", "-H", "node1,node2", "--ssh-config", str(hosts.ssh_config),
        "--sync", ".", "python", "train.py", env=env, cwd=project,
    )  # fmt: skip


def sent(output: str) -> tuple[int, int]:
    found = re.search(r"synced .*: sent (\d+), (\d+) bytes;", output)
    assert found, output
    return int(found.group(1)), int(found.group(2))


@pytest.mark.sshhosts
@pytest.mark.timeout(180)
def test_sync_to_two_hosts_then_only_what_changed(ssh_hosts: TestHosts, tmp_path: Path) -> None:
    project = make_tree(
        tmp_path / "project",
        {"train.py": SCRIPT, "data/words.txt": "hello", "tool.sh": "#!/bin/sh\n", "x.log": "no"},
    )
    (project / ".gitignore").write_text("*.log\n")
    (project / "tool.sh").chmod(0o755)
    cache = tmp_path / "cache"
    first = sync_run(ssh_hosts, project, cache)
    assert first.returncode == 0, first.stderr
    cwds = re.findall(r"CWD (\S+) hello True", first.stdout)
    assert len(cwds) == 2 and all(c.startswith(str(cache / "trees")) for c in cwds), first.stdout
    assert sent(first.stderr)[0] >= 4  # (two hosts share this file system: at most twice)
    tree = Path(cwds[0])
    assert not (tree / "x.log").exists()
    modes = {p.name: p.stat().st_mode & 0o777 for p in tree.rglob("*")}
    assert modes == {"train.py": 0o400, "data": 0o700, "words.txt": 0o400, "tool.sh": 0o500,
                     ".gitignore": 0o400}  # fmt: skip
    (project / "data/words.txt").write_text("hello again")
    second = sync_run(ssh_hosts, project, cache)
    assert second.returncode == 0, second.stderr
    assert sent(second.stderr)[1] <= 2 * len("hello again")  # only the changed file
    assert 1 <= sent(second.stderr)[0] <= 2
    third = sync_run(ssh_hosts, project, cache)
    assert sent(third.stderr) == (0, 0)


def test_project_file_sync_keys(tmp_path: Path) -> None:
    make_tree(tmp_path, {"train.py": "print(1)\n", "data.bin": "x" * 5000})
    (tmp_path / "dtrain.toml").write_text('[run]\nsync = "."\nsync_max_size = "4K"\n')
    (tmp_path / "sub").mkdir()
    done = run_dtrain("run", "-H", "localhost,node9", "python", "train.py", cwd=tmp_path / "sub")
    assert done.returncode == 2
    assert f"--sync {tmp_path}: " in done.stderr and "over the 4.0 KiB limit" in done.stderr
