"""The rank logs' open files, as raw descriptors (streams layer).

The job directory's writer appends every batch of a rank's lines with one ``os.write``
on a descriptor opened ``O_APPEND``: no Python file object per rank (``os.fdopen``'s
buffered writer cost 80 us to make, a tenth of a second per thousand ranks, and a
flush per batch), and no buffer that a crash could lose.  At most ``MAX_OPEN_LOGS``
stay open (thousands of ranks: not one descriptor each); one closed and opened again
later loses nothing (append mode).

Creating a file is the costly part (15 us to 0.3 ms each on ext4, allocating its inode
in the kernel; a round trip on NFS): ``create_ahead`` has a thread of its own create the
logs of a job's ranks, in rank order, while the job starts (a thousand hosts' survey and
start take seconds), so that the writer, which gets the ranks' first lines in about that
order, opens files that are there.  A line whose file the thread is about to make waits
for it: two threads creating files in one folder spin on its lock in the kernel (a
core's worth of CPU, taken from the launcher's other threads) and end no sooner.  A log
far ahead of the thread, or not in its list (mpirun's), the writer makes itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

MAX_OPEN_LOGS = 256  # rank logs kept open (append mode: one closed and reopened loses nothing)
FILE_MODE = 0o600
AWAIT_FILES = 256  # a log at most this far ahead of the creating thread is waited for
APPEND_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC


def append_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (a regular file may take less than asked, near a full disk)."""
    written = os.write(fd, data)
    if written < len(data):
        view = memoryview(data)[written:]
        while view:
            view = view[os.write(fd, view) :]


class LogFiles:
    """Open rank logs by name, the least recently used closed past ``limit``."""

    def __init__(self, folder: Path, limit: int = MAX_OPEN_LOGS) -> None:
        self.folder = folder
        self.prefix = f"{folder}{os.sep}"
        self.limit = limit
        self.fds: dict[str, int] = {}  # (in use order: the last is the most recently used)
        # The writer's thread appends; a late line (after the drain's cut) comes on its
        # reader's, as the job's end closes the logs: no descriptor is closed mid-write
        # (its number, taken by the next file opened, would get the line).
        self.lock = threading.Lock()
        self.closed = False  # the job ended: a late line opens its file for itself
        self.creating: threading.Thread | None = None
        # Creating ahead: each name's place in the order, how many are made (or were there),
        # the place the writer waits for (None: it does not), and the thread's end.
        self.order: dict[str, int] = {}
        self.created = 0
        self.wanted: int | None = None
        self.progress = threading.Condition()
        self.ahead_done = True

    def append(self, name: str, data: bytes) -> None:
        """Append ``data`` to the log ``name`` (raises OSError: a full disk, a gone folder)."""
        if name not in self.fds:
            self.await_creation(name)  # (outside the lock: close stops the thread)
        with self.lock:
            fd = None if self.closed else self.fds.pop(name, None)
            if fd is None:
                fd = os.open(self.prefix + name, APPEND_FLAGS, FILE_MODE)
                if self.closed:  # a line after the job's end (its reader had waited)
                    try:
                        append_all(fd, data)
                    finally:
                        os.close(fd)
                    return
                if len(self.fds) >= self.limit:
                    os.close(self.fds.pop(next(iter(self.fds))))  # the least recently used
            self.fds[name] = fd
            append_all(fd, data)

    def await_creation(self, name: str) -> None:
        """A file the thread is about to create: wait for it rather than create it here too."""
        place = self.order.get(name)
        if place is None or self.ahead_done or not 0 <= place - self.created < AWAIT_FILES:
            return
        with self.progress:
            self.wanted = place  # (set before looking: the thread reads it after counting)
            while self.created <= place and not self.ahead_done:
                self.progress.wait()
            self.wanted = None

    def create_ahead(self, names: Sequence[str]) -> None:
        """Create these logs (empty, if not yet there) in a thread of their own, in this
        order; it stops at ``close``."""
        if not names or self.creating is not None:
            return
        self.order = {name: place for place, name in enumerate(names)}
        self.ahead_done = False

        def create() -> None:
            try:
                for place, name in enumerate(names):
                    if self.closed:
                        return
                    os.close(os.open(self.prefix + name, APPEND_FLAGS, FILE_MODE))
                    self.created = place + 1
                    wanted = self.wanted
                    if wanted is not None and wanted <= place:
                        with self.progress:
                            self.progress.notify_all()
            except OSError:
                pass  # a full disk: the writer finds out and says so
            finally:
                with self.progress:
                    self.ahead_done = True
                    self.progress.notify_all()

        self.creating = threading.Thread(target=create, name="dtrain-log-files", daemon=True)
        self.creating.start()

    def close(self) -> None:
        """Close every open log; lines that still come open their file for themselves."""
        with self.lock:  # (after the write in progress, if any)
            self.closed = True
            fds, self.fds = self.fds, {}
            for fd in fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self.creating is not None:
            self.creating.join()  # (it stops at the next file: no file created after this)
