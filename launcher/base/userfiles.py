"""Files a user names, read safely (DESIGN rule 14): a regular file only, with a bound.

A hostfile, an env file, a project file, an SSH config, a sweep's record: each is opened
without blocking (a FIFO would wait for a writer forever), checked to be a regular file
(``/dev/zero`` or ``/dev/urandom`` never end; a directory is no file), refused above a size
(a 2 GB sparse file is refused by its size before a byte is read) and decoded as UTF-8,
with a binary or undecodable file named as such.  Every refusal is one ``UsageError``
naming the option and the path: ``--hostfile /dev/zero: a character device, not a file``.
"""

from __future__ import annotations

import errno
import os
import stat

from launcher.base.errors import UsageError

MIB = 1 << 20
HOSTFILE_LIMIT = 16 * MIB  # a hostfile of 100,000 hosts is about 3 MiB
TEXT_LIMIT = 1 * MIB  # env files, project files, SSH configs, a discovery script's output
RECORD_LIMIT = 64 * MIB  # dtrain's own records read back (a sweep's record)
BINARY_SNIFF = 8192  # a NUL in the first bytes: a binary file (as git and grep decide)
DEVNULL = "/dev/null"  # OpenSSH's -F /dev/null: an empty config


def special_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def read_user_bytes(path: str, what: str, limit: int = TEXT_LIMIT, null_ok: bool = False) -> bytes:
    """A named file's bytes: a regular file of at most ``limit`` bytes (``/dev/null`` reads
    as empty where ``null_ok``); anything else is one ``UsageError`` for ``what path``."""
    named = f"{what} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"{named}: no such file", "check the path") from None
    except PermissionError:
        raise UsageError(f"{named}: permission denied", "check the file's permissions") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # (a socket: open(2) refuses it)
            raise UsageError(f"{named}: a socket, not a file", "name a regular file") from None
        reason = exc.strerror or str(exc)
        raise UsageError(f"{named}: cannot read it ({reason})", "check the path") from None
    except ValueError:  # (a NUL in the name)
        raise UsageError(f"{named}: not a valid path", "check the path") from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            if null_ok and stat.S_ISCHR(found.st_mode) and os.path.samefile(path, DEVNULL):
                return b""
            raise UsageError(
                f"{named}: {special_kind(found.st_mode)}, not a file", "name a regular file"
            )
        if found.st_size > limit:
            raise too_large(named, found.st_size, limit)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # (it may grow while read: the bound holds whatever its size said)
            try:
                chunk = os.read(fd, min(MIB, limit + 1 - size))
            except OSError as exc:
                raise UsageError(
                    f"{named}: cannot read it ({exc.strerror})", "check the file"
                ) from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise too_large(named, size, limit)
        return b"".join(chunks)
    finally:
        os.close(fd)


def too_large(named: str, size: int, limit: int) -> UsageError:
    return UsageError(
        f"{named}: {shown_size(size)}, over the {shown_size(limit)} such a file may have",
        "name the right file",
    )


def shown_size(size: int) -> str:
    if size >= MIB:
        return f"{size / MIB:.4g} MiB"
    return f"{size} bytes"


def read_user_text(path: str, what: str, limit: int = TEXT_LIMIT, null_ok: bool = False) -> str:
    """``read_user_bytes`` as UTF-8 text; a binary or undecodable file is named as such."""
    data = read_user_bytes(path, what, limit, null_ok)
    return decode_user_text(data, f"{what} {path}")


def decode_user_text(data: bytes, named: str, how: str | None = None) -> str:
    """UTF-8 text (a leading BOM dropped, as editors on Windows write one); a NUL byte means a
    binary file, other bad bytes an encoding that is not UTF-8: each one line with where
    (``how``: the hint, where the text is not a file's: a program's output)."""
    if b"\0" in data[:BINARY_SNIFF]:
        what = "binary" if how else "a binary file"  # (a program's output is no file)
        raise UsageError(f"{named}: {what}, not text", how or "name the text file meant")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UsageError(
            f"{named}:{line}: not UTF-8 text (byte {exc.start + 1})", how or "save it as UTF-8"
        ) from None
    if "\0" in text:
        line = text.count("\n", 0, text.index("\0")) + 1
        raise UsageError(f"{named}:{line}: a NUL character in text", how or "save it as plain text")
    return text.removeprefix("\ufeff")
