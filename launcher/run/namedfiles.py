"""Files and output the user names, read safely (the job layer's part of DESIGN rule 14).

A hostfile, an env file, the SSH config and key, and what ``--host-discovery-script``
prints: each is read through ``base/userfiles.py`` (a regular file only, never blocking on
open, with a bound, a binary or undecodable file named as such) before anything starts.
The SSH config and key are checked whenever they are given, as the hostfile and env files
are, not only when a remote host needs them: ``--ssh-config /dev/zero`` is a mistake on
this machine too.  ``--ssh-config /dev/null`` is an empty config (OpenSSH's ``-F
/dev/null``).  A discovery script's output is read with the hostfile's bound: a script
that prints without end is stopped there, not kept in memory.
"""

from __future__ import annotations

import os
import selectors
import signal
import stat
import subprocess
import time
from collections.abc import Sequence

from launcher.base.errors import UsageError
from launcher.base.userfiles import (
    HOSTFILE_LIMIT,
    TEXT_LIMIT,
    decode_user_text,
    read_user_text,
    shown_size,
)
from launcher.core.config import SshConfig

SSH_KEY_LIMIT = TEXT_LIMIT  # a private key is a few KiB
STDERR_KEPT = 64 * 1024  # of a discovery script's stderr: its end, for its last line
CHUNK = 1 << 16
EXIT_POLL_S = 0.25  # how often a script's exit is looked at while its pipes stay open


def read_text(path: str, what: str, limit: int = TEXT_LIMIT) -> str:
    """A user-named file's text (``what`` is the option: ``--hostfile``); anything but a
    readable regular UTF-8 text file of at most ``limit`` bytes is a usage error."""
    return read_user_text(path, what, limit)


def read_hostfile(path: str) -> str:
    return read_user_text(path, "--hostfile", HOSTFILE_LIMIT)


def check_ssh_files(ssh: SshConfig) -> None:
    """``--ssh-config`` and ``--ssh-identity`` are files that can be read (``/dev/null``
    as an empty config): said now, in one line, rather than as a hang or at connect time."""
    if ssh.config_file:
        read_user_text(os.path.expanduser(ssh.config_file), "--ssh-config", TEXT_LIMIT, True)
    if ssh.identity:
        # (a private key is text, as OpenSSH and paramiko read it: PEM or OpenSSH's format)
        read_user_text(os.path.expanduser(ssh.identity), "--ssh-identity", SSH_KEY_LIMIT)


def read_head(path: str, size: int) -> bytes | None:
    """The first ``size`` bytes of a regular file (None: none there, not a regular file, or
    unreadable): for a peek at a script, never blocking on a FIFO's open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        return os.read(fd, size) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def run_bounded(argv: Sequence[str], limit: int, timeout_s: float) -> tuple[int, bytes, bytes]:
    """Run ``argv`` (no stdin) and return its exit code, stdout and the end of its stderr.
    Over ``limit`` bytes of stdout, or past ``timeout_s``, its process group is killed and
    ``OverflowError`` or ``TimeoutError`` raised; ``OSError`` when it cannot start."""
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # (its children too are ended with it)
    )
    assert process.stdout is not None and process.stderr is not None
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ, out)
        selector.register(process.stderr, selectors.EVENT_READ, err)
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                ready = selector.select(min(left, EXIT_POLL_S))
                if not ready and process.poll() is not None:
                    break  # (it exited; what it left running may hold its pipes: not waited)
                for key, _ in ready:
                    chunk = os.read(key.fd, CHUNK)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if key.data is err:
                        del err[:-STDERR_KEPT]
                    elif len(out) > limit:
                        raise OverflowError
            code = process.wait(max(deadline - time.monotonic(), 0.001))
        except BaseException:  # (too much, too long, or dtrain interrupted: none left behind)
            end_group(process)
            raise
        finally:
            process.stdout.close()
            process.stderr.close()
    return code, bytes(out), bytes(err)


def end_group(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    process.wait()


def discovery_output(script: str, timeout_s: float) -> str:
    """What ``--host-discovery-script`` printed (16 MiB at most, UTF-8), after it exited 0."""
    named = f"--host-discovery-script {script}"
    how = "give an executable that prints one host[:slots] per line"
    try:
        code, out, err = run_bounded([script], HOSTFILE_LIMIT, timeout_s)
    except OverflowError:
        limit = shown_size(HOSTFILE_LIMIT)
        raise UsageError(
            f"{named}: printed over {limit}, the most a host list may have", how
        ) from None
    except (TimeoutError, subprocess.TimeoutExpired):
        raise UsageError(f"{named}: cannot run it (no end after {timeout_s:g} s)", how) from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{named}: cannot run it ({exc})", how) from None
    if code != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise UsageError(
            f"{named}: exit code {code} ({(lines or ['no output'])[-1]})",
            "the script must exit 0 and print one host[:slots] per line",
        )
    return decode_user_text(out, f"{named}'s output", "the script must print host[:slots] lines")
