"""``--sync DIR``: the tree (which files, sizes, links), the receiver that never trusts the
sender, and copies to real SSH test hosts that the ranks run in."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from launcher.base.errors import HostConnectionError, UsageError
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
from launcher.run.syncfiles import hash_entries, list_entries, read_blobs, walk_listing
from launcher.transport.syncsend import read_answer
from tests.conftest import DTRAIN, REPO, child_env, run_dtrain
from tests.otheruser import OtherUser
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


# ---- the sender: links by where they lead, unreadable entries, files that change ----


def test_chained_links_that_leave_dir_are_refused(tmp_path: Path) -> None:
    project = make_tree(tmp_path / "p", {"train.py": "print(1)\n", "sub/m.py": "x = 1\n"})
    (project / "a").symlink_to(".")
    (project / "in").symlink_to("a/a/sub/../train.py")  # (really inside: kept)
    (project / "sub/up").symlink_to("../a/train.py")
    assert {e.path: e.target for e in list_entries(str(project)) if e.kind == "link"} == {
        "a": ".",
        "in": "a/a/sub/../train.py",
        "sub/up": "../a/train.py",
    }
    (project / "up4").symlink_to("a/a/a/a/../../../..")  # reads as ".", leads 4 folders up
    with pytest.raises(UsageError, match="the link up4 points outside it"):
        list_entries(str(project))
    (project / "up4").unlink()
    (project / "sub/self").symlink_to("..")
    (project / "sub/out").symlink_to(f"{project}/sub/self/..")  # absolute, through a link
    with pytest.raises(UsageError, match="the link sub/out points outside it"):
        list_entries(str(project))


def test_a_file_changed_while_syncing_is_named(tmp_path: Path) -> None:
    project = make_tree(tmp_path, {"train.py": "print(1)\n", "data.txt": "abc"})
    entries = {e.path: e for e in hash_entries(str(project), list_entries(str(project)))}
    (project / "data.txt").write_text("xyz")  # same size, other bytes
    with pytest.raises(UsageError, match=re.escape("data.txt changed while syncing: run again")):
        list(read_blobs(str(project), entries["data.txt"]))
    (project / "data.txt").write_text("a")  # shorter
    with pytest.raises(UsageError, match=re.escape("data.txt changed while syncing")):
        list(read_blobs(str(project), entries["data.txt"]))
    # the receiver's word for it (content unlike its digest) names the file too
    refusal = {"refused": "a file's content does not match its digest", "hint": "",
               "blob": entries["train.py"].blob}  # fmt: skip
    lines = io.BytesIO(b"chatter\n" + (MARK + json.dumps(refusal) + "\n").encode())
    with pytest.raises(UsageError, match=re.escape("train.py changed while syncing: run again")):
        read_answer(lines, None, "node1", {e.blob: e for e in entries.values()})


def test_a_cache_refusal_is_said_as_the_host_says_it() -> None:
    refusal = {"refused": "refusing the sync cache: /tmp/c is owned by bob", "hint": "set X"}
    lines = io.BytesIO((MARK + json.dumps(refusal) + "\n").encode())
    with pytest.raises(HostConnectionError) as raised:
        read_answer(lines, None, "node1", {})
    assert str(raised.value) == "node1: refusing the sync cache: /tmp/c is owned by bob (set X)"


def python_for(other_user: OtherUser) -> list[str]:
    """A way for the other user to run dtrain: this Python's version from a system path
    (this interpreter may sit in root's home), with this checkout and its packages."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    packages = sysconfig.get_paths()["purelib"]
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        done = other_user.run(
            ["env", f"PYTHONPATH={REPO}:{packages}", candidate, "-c", "import launcher, click"]
        )
        if done.returncode == 0:
            return ["env", f"PYTHONPATH={REPO}:{packages}", candidate, "-m", "launcher"]
    pytest.skip(f"no {version} the user {other_user.name} can run with this checkout")


@pytest.mark.parametrize(
    ("unreadable", "named"), [("secret.txt", "secret.txt"), ("private", "private/")]
)
def test_an_unreadable_entry_is_one_line_before_anything_is_sent(
    other_user: OtherUser, shared_tmp: Path, unreadable: str, named: str
) -> None:
    other_user.sh(
        f"cd {shared_tmp}; mkdir p p/private; echo 'print(1)' > p/train.py; "
        f"echo s > p/secret.txt; chmod 000 p/{unreadable}"
    )
    done = other_user.run(
        [*python_for(other_user), "run", "--dry-run", "-np", "1", "-H", "host:1",
         "--sync", ".", "true"],
        cwd=shared_tmp / "p",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"dtrain: error: --sync {shared_tmp}/p: cannot read {shared_tmp}/p/{named} "
        "(permission denied) (hint: make it readable, or list it in .gitignore)"
    ]


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


JOB = """
import os, sys, time
print("STARTED", os.getcwd(), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
print("STILL", open("data/words.txt").read().strip(), os.path.isdir(os.getcwd()), flush=True)
"""


@pytest.mark.sshhosts
@pytest.mark.timeout(240)
def test_a_running_jobs_tree_survives_syncs_of_other_code(
    ssh_hosts: TestHosts, tmp_path: Path
) -> None:
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = {**child_env(), "DTRAIN_SYNC_CACHE": str(cache)}
    common = ["--plain", "-H", "node1", "--ssh-config", str(ssh_hosts.ssh_config), "--sync", "."]
    project = make_tree(tmp_path / "job", {"train.py": JOB, "data/words.txt": "hello"})
    job = subprocess.Popen(
        [*DTRAIN, "run", *common, "python", "train.py", str(go)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=project,
    )  # fmt: skip
    try:
        assert job.stdout is not None
        line = job.stdout.readline()
        assert "STARTED" in line, line + (job.stderr.read() if job.stderr else "")
        tree = Path(line.split()[-1])
        old = time.time() - 7200
        os.utime(tree, (old, old))  # (long ago: only the agent's lock keeps it)
        for n in range(6):  # more than the 5 trees kept
            other = make_tree(tmp_path / f"other{n}", {"train.py": f"print({n})\n"})
            done = run_dtrain("run", *common, "python", "train.py", env=env, cwd=other)
            assert done.returncode == 0, done.stderr
        assert tree.is_dir() and len(os.listdir(cache / "trees")) == 1 + 7  # (and the mark)
        go.touch()
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, err
    assert "STILL hello True" in out, out


@pytest.mark.sshhosts
@pytest.mark.timeout(120)
def test_a_loose_cache_is_refused_in_one_line_and_left_as_it_is(
    ssh_hosts: TestHosts, tmp_path: Path
) -> None:
    project = make_tree(tmp_path / "p", {"train.py": "print(1)\n"})
    cache = tmp_path / "loose"
    cache.mkdir()
    cache.chmod(0o777)
    env = {**child_env(), "DTRAIN_SYNC_CACHE": str(cache)}
    done = run_dtrain(
        "run", "--plain", "-H", "node1", "--ssh-config", str(ssh_hosts.ssh_config),
        "--sync", ".", "python", "train.py", env=env, cwd=project,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"dtrain: error: node1: refusing the sync cache: {cache} is writable by others "
        "(mode 777) (hint: set DTRAIN_SYNC_CACHE to a folder of your own that only you can "
        "write)"
    ), done.stderr
    assert cache.stat().st_mode & 0o777 == 0o777 and not list(cache.iterdir())
