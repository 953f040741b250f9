"""``--sync``'s reading of DIR on this machine (``run/syncfiles.py``), in process: what is not
a file is left out, and a file that changes or turns into something else between the listing
and its reading is one line ("changed while syncing", "cannot read"), never a hang."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from launcher.base.errors import UsageError
from launcher.core.synctree import SyncEntry
from launcher.run.syncfiles import hash_entries, list_entries, read_file, scan_folder


def message(error: pytest.ExceptionInfo[UsageError]) -> str:
    return f"{error.value.message} (hint: {error.value.hint})"


def test_a_folder_without_git_lists_its_files_and_links_only(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a\n")
    os.mkfifo(tmp_path / "pipe")  # (not code to send: left out, never opened)
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "sock"))
        (tmp_path / "link.py").symlink_to("train.py")
        entries = list_entries(str(tmp_path))
    assert [(e.path, e.kind) for e in entries] == [
        ("data/a.txt", "file"),
        ("link.py", "link"),
        ("train.py", "file"),
    ]
    hashed = hash_entries(str(tmp_path), entries)
    assert [len(e.digest) for e in hashed] == [64, 0, 64]
    with pytest.raises(UsageError) as error:
        scan_folder(str(tmp_path / "none"), 1 << 20)
    assert message(error) == f"--sync {tmp_path}/none: no such folder (hint: check the path)"


def test_a_file_that_changes_after_the_listing_is_said(tmp_path: Path) -> None:
    entry = SyncEntry("train.py", "file", size=9)
    with pytest.raises(UsageError) as error:  # gone since it was listed
        list(read_file(str(tmp_path), entry, None))
    assert message(error) == (
        "train.py changed while syncing: run again "
        "(hint: wait until it is written, or list it in .gitignore)"
    )
    os.mkfifo(tmp_path / "train.py")  # swapped for a FIFO: opened without blocking, refused
    with pytest.raises(UsageError) as error:
        list(read_file(str(tmp_path), entry, None))
    assert message(error).startswith("train.py changed while syncing")
    os.unlink(tmp_path / "train.py")
    (tmp_path / "train.py").symlink_to("/etc/hostname")  # swapped for a link: never followed
    with pytest.raises(UsageError) as error:
        list(read_file(str(tmp_path), entry, None))
    assert message(error) == (
        f"--sync {tmp_path}: cannot read {tmp_path}/train.py (too many levels of symbolic "
        "links) (hint: make it readable, or list it in .gitignore)"
    )
