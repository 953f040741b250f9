"""The threads that feed ranks' output and exits to the supervisor: one per transport, not
three per rank (two stream readers and a waiter).

A transport whose processes have ``attach`` hands each rank's chunks and status to the
``RankFeed`` it is given (``rankrun.RankRun``):

* ``PipeReader``: one thread reading many pipes (``selectors``), for local ranks;
* ``Pump``: one thread handing on chunks that another thread received (an SSH host's
  demultiplexer, the simulator), in their order, so that the receiving thread never waits
  on output.

Neither thread waits on the outlets: a rank whose share of them is full is skipped until
there is room (``PipeReader``: its pipe is no longer read; over SSH its credit is withheld,
``agentlink``), so one slow or paused rank never holds up the others.  Exits go through
threads that never feed output, so the kill path never waits on it.
"""

from __future__ import annotations

import os
import queue
import selectors
import threading
from collections.abc import Callable

from launcher.base.log import Log
from launcher.core.outcome import READ_BYTES

LOG = Log("dtrain.feeds")

# A pipe's chunks as they come, then b"" at its end; False: read no more of it until
# ``PipeReader.resume`` (None or True: go on).
Chunk = Callable[[bytes], bool | None]


class PipeReader:
    """One daemon thread that reads every pipe added to it and calls the pipe's callback with
    each chunk, then with b"" once at its end (the pipe is then unregistered; the caller
    closes it).  A callback that returns False pauses its pipe until ``resume``: the other
    pipes are read meanwhile.  The thread starts with the first pipe and ends after
    ``close`` once its pipes have ended."""

    def __init__(self, name: str, size: int = READ_BYTES) -> None:
        self.name = name
        self.size = size
        self.lock = threading.Lock()
        self.added: list[tuple[int, Chunk]] = []
        self.resumed: list[int] = []  # paused pipes to read again (``resume``)
        self.paused: dict[int, Chunk] = {}  # the reader thread's own
        self.closing = False
        self.thread: threading.Thread | None = None
        self.wake_read = self.wake_write = -1  # -1: no thread

    def add(self, fd: int, callback: Chunk) -> None:
        with self.lock:
            self.added.append((fd, callback))
            if self.wake_write < 0:  # no thread yet (or it ended after ``close``)
                self.closing = False
                self.start()
        self.wake()

    def start(self) -> None:
        """A thread (and its wake-up pipe), under the lock."""
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self.thread.start()

    def wake(self) -> None:
        with self.lock:
            if self.wake_write < 0:
                return  # the thread has ended
            try:
                os.write(self.wake_write, b"x")
            except OSError:
                pass  # already woken (the pipe is full)

    def resume(self, fd: int) -> None:
        """From any thread: read a pipe that its callback paused again."""
        with self.lock:
            self.resumed.append(fd)
        self.wake()

    def close(self) -> None:
        with self.lock:
            self.closing = True
        self.wake()

    def run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.wake_read, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in selector.select():
                    if key.fd == self.wake_read:
                        os.read(self.wake_read, 4096)
                        self.take_news(selector)
                        continue
                    try:
                        data = os.read(key.fd, self.size)
                    except OSError:
                        data = b""  # the pipe went away with its process
                    if not data:
                        selector.unregister(key.fd)
                        call(key.data, data)
                    elif call(key.data, data) is False:  # until ``resume`` (a wake-up)
                        selector.unregister(key.fd)
                        self.paused[key.fd] = key.data
                with self.lock:
                    idle = not self.added and not self.paused and len(selector.get_map()) == 1
                    if self.closing and idle:
                        return
        finally:
            selector.close()
            with self.lock:
                os.close(self.wake_read)
                os.close(self.wake_write)
                self.wake_write = -1
                if self.added:  # added while it was ending: a new thread reads them
                    self.start()
                    os.write(self.wake_write, b"x")

    def take_news(self, selector: selectors.BaseSelector) -> None:
        """Pipes added, and paused pipes to read again, since the last wake-up."""
        with self.lock:
            added, self.added = self.added, []
            resumed, self.resumed = self.resumed, []
        for fd, callback in added:
            selector.register(fd, selectors.EVENT_READ, callback)
        for fd in resumed:
            if fd in self.paused:
                selector.register(fd, selectors.EVENT_READ, self.paused.pop(fd))


class Pump:
    """One daemon thread that runs the calls put to it, in order: output received by a thread
    that must not wait (an SSH host's frames, exits among them) is fed on from here."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: queue.SimpleQueue[tuple[Chunk, bytes] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def put(self, callback: Chunk, data: bytes) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name=self.name, daemon=True)
                self.thread.start()
        self.calls.put((callback, data))

    def close(self) -> None:
        """The thread ends once it has run every call put before."""
        self.calls.put(None)

    def run(self) -> None:
        while (item := self.calls.get()) is not None:
            call(*item)


def call(callback: Chunk, data: bytes) -> bool | None:
    """A callback's error is its rank's alone: logged, the thread goes on for the others."""
    try:
        return callback(data)
    except Exception:
        LOG.exception("feeding a rank's output failed")
        return None
