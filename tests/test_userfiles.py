"""A file the user names (an env file, a hostfile, an SSH config, a project file) is read by
``base/userfiles.py``: a regular UTF-8 text file within its bound, or one line saying what it
is instead (DESIGN rule 14: what is read is checked, never blocking, never unbounded)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from launcher.base.errors import UsageError
from launcher.base.userfiles import (
    BINARY_SNIFF,
    MIB,
    read_user_bytes,
    read_user_text,
    special_kind,
)


def refusal(path: str, limit: int = MIB) -> str:
    with pytest.raises(UsageError) as caught:
        read_user_text(path, "--env-file", limit)
    return f"{caught.value.message} (hint: {caught.value.hint})"


def test_what_is_not_a_regular_file_is_named(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # (opened without blocking: no writer is waited for)
    assert refusal(str(fifo)) == (
        f"--env-file {fifo}: a FIFO (named pipe), not a file (hint: name a regular file)"
    )
    assert refusal("/dev/zero").startswith("--env-file /dev/zero: a character device, not")
    assert refusal(str(tmp_path)).startswith(f"--env-file {tmp_path}: a folder, not a file")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "sock"))
        assert refusal(str(tmp_path / "sock")) == (
            f"--env-file {tmp_path}/sock: a socket, not a file (hint: name a regular file)"
        )
    assert special_kind(stat.S_IFBLK) == "a block device"
    assert special_kind(stat.S_IFSOCK) == "a socket"
    assert special_kind(0) == "not a regular file"


def test_a_path_that_cannot_be_one_is_said(tmp_path: Path) -> None:
    assert refusal("bad\0name") == "--env-file bad\0name: not a valid path (hint: check the path)"
    assert refusal(str(tmp_path / "none")) == (
        f"--env-file {tmp_path}/none: no such file (hint: check the path)"
    )
    inside_a_file = tmp_path / "file"
    inside_a_file.write_text("A=1\n")
    assert refusal(f"{inside_a_file}/x") == (
        f"--env-file {inside_a_file}/x: cannot read it (Not a directory) (hint: check the path)"
    )


def test_a_file_over_its_bound_is_refused_by_its_size(tmp_path: Path) -> None:
    big = tmp_path / "big.env"
    big.write_bytes(b"A=1\n" * (MIB // 2))  # 2 MiB
    assert refusal(str(big)) == (
        f"--env-file {big}: 2 MiB, over the 1 MiB such a file may have (hint: name the right file)"
    )
    assert refusal(str(big), limit=100).endswith(
        "2 MiB, over the 100 bytes such a file may have (hint: name the right file)"
    )
    assert read_user_bytes(str(big), "--env-file", 2 * MIB) == big.read_bytes()


def test_a_nul_past_the_first_bytes_is_named_by_its_line(tmp_path: Path) -> None:
    text = tmp_path / "late-nul.env"
    text.write_bytes(b"A=1\n" * (BINARY_SNIFF // 4) + b"B=2\nC=\0\n")
    line = BINARY_SNIFF // 4 + 2
    assert refusal(str(text)) == (
        f"--env-file {text}:{line}: a NUL character in text (hint: save it as plain text)"
    )
    early = tmp_path / "binary.env"
    early.write_bytes(b"\x7fELF\0\0")
    assert refusal(str(early)).startswith(f"--env-file {early}: a binary file, not text")
    bom = tmp_path / "bom.env"
    bom.write_bytes("\ufeffA=1\n".encode())
    assert read_user_text(str(bom), "--env-file") == "A=1\n"
