"""A real second local user for the shared-machine tests (DESIGN rule 14, issue 33).

What another user plants is made by that user's own processes (``OtherUser.run``), not by
root changing an owner afterwards: the kernel decides what they may write, as on a login
node.  The user is created with ``useradd`` once per pytest process and removed after; a
test that needs one is skipped with one line where that cannot be done (not root, no
``useradd``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class OtherUser:
    name: str
    uid: int
    gid: int

    def run(
        self, args: Sequence[str], cwd: Path | str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``args`` run as this user (its own uid, gid and no supplementary groups)."""
        return subprocess.run(
            ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", "HOME": "/", "LC_ALL": "C"},
            check=False,
        )

    def sh(self, script: str, cwd: Path | str | None = None) -> str:
        """A shell script run as this user; its failure fails the test."""
        done = self.run(["sh", "-ec", script], cwd=cwd)
        assert done.returncode == 0, f"as {self.name}: {script!r}: {done.stderr}"
        return done.stdout

    def write(self, path: Path, text: str, mode: int = 0o644) -> Path:
        """A file this user writes (in a folder it may write to)."""
        self.run(["rm", "-f", str(path)])
        self.sh(
            f"umask 022; cat > '{path}' <<'DTRAIN_EOF'\n{text}\nDTRAIN_EOF\nchmod {mode:o} '{path}'"
        )
        return path


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "a second local user needs root (useradd)"
    for tool in ("useradd", "userdel", "setpriv"):
        if shutil.which(tool) is None:
            return f"a second local user needs {tool}"
    return None


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    name = f"dtrain-o{uuid.uuid4().hex[:8]}"  # (32 characters at most; one per pytest process)
    made = subprocess.run(
        ["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/bin/sh",
         "--user-group", name],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"useradd {name}: {made.stderr.strip()}")
    entry = pwd.getpwnam(name)
    try:
        yield OtherUser(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, check=False)
        subprocess.run(["userdel", name], capture_output=True, check=False)


@pytest.fixture
def shared_tmp(other_user: OtherUser) -> Iterator[Path]:
    """A folder as ``/tmp`` is (mode 1777: everyone may create, none may rename another's),
    outside pytest's private ``tmp_path`` that the other user cannot enter."""
    folder = Path(f"/tmp/dtrain-shared-{uuid.uuid4().hex[:12]}")
    folder.mkdir(mode=0o700)
    try:
        folder.chmod(0o1777)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
