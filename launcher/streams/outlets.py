"""From the ranks' readers to the sinks, never through the supervisor's loop (streams layer).

Each sink (the job directory, the terminal view) is an ``Outlet``: a queue
bounded per rank and a writer thread of its own that hands the queue's items
to the sink in order.  Posting never waits: a reader that serves many ranks
(one thread reads every local rank's pipes, one feeds every remote rank's
chunks) must not stop for one of them.  Once a rank's share of a queue is full
(``Fanout.when_room`` says so), its reader stops reading that rank (its pipe
fills and the rank waits on its writes; over SSH its agent gets no credit)
until the writer has taken half of the share, and goes on with the other
ranks meanwhile: back-pressure slows that rank alone and loses nothing.  A
lossy outlet (``--lossy-view``) never holds a rank back: it drops the lines
that do not fit and counts them.  The supervisor's loop only posts rank
states.  A sink that raises (a broken pipe, a view's bug) is abandoned: the
job goes on without it, and nothing waits on it again.

Each batch is stamped with the time it was posted: a sink that holds lines for a while
(the collapsing view) times its window on when lines came, not on when its writer got to
them, which is seconds later while a terminal lags.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from launcher.core.outcome import LineBatch, OutputSink, RankState, Stream

if TYPE_CHECKING:
    from launcher.core.command import LaunchSpec

RANK_BUFFER_BYTES = 1 << 20  # per rank and outlet: what may wait for a slow sink
ENDED_VIEW_BYTES = 4 << 20  # per rank, once every rank ended: what a view may hold
FINISH_POLL_S = 0.1  # how often a finishing wait looks for a signal
LINE_OVERHEAD_BYTES = 64  # a line's cost beyond its text (list slot, bytes object)
RESUME_FRACTION = 0.5  # a rank held back is read again once its share is this empty
TAKE_ITEMS = 256  # a writer takes up to this many items from its queue at once...
TAKE_BYTES = 1 << 20  # ...and up to this many bytes of lines


def lines_size(lines: Sequence[bytes]) -> int:
    """What a batch of lines costs a queue: their bytes and each line's overhead."""
    if isinstance(lines, LineBatch):  # one bytes object however many lines it holds
        return len(lines.data) + LINE_OVERHEAD_BYTES
    return sum(map(len, lines)) + LINE_OVERHEAD_BYTES * len(lines)  # (C-level, per line)


@dataclass(frozen=True)
class Lines:
    spec: LaunchSpec
    stream: Stream
    lines: Sequence[bytes]
    size: int
    posted: float  # when they were queued (the queue's clock: ``time.monotonic``)


Item = Lines | RankState
Key = tuple[int, str | None]  # a rank's share of a queue: its number and label (mpirun's)


class Tick:
    """What ``take`` gives when its deadline passed with nothing queued: a timed sink's turn."""


TICK = Tick()


@runtime_checkable
class TimedSink(Protocol):
    """A sink that holds lines for a while (the collapsing view).  The writer gives it each
    batch with the time it was posted, asks it until when it holds lines (on the queue's
    clock), ticks it then if nothing came meanwhile, and flushes it at the end."""

    def show_at(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes], at: float) -> None:
        """The lines, posted at ``at``."""

    def next_due(self) -> float | None:
        """When held lines are due (None: none held)."""

    def tick(self, now: float | None = None) -> None:
        """Let out what is due at ``now``: nothing was posted before it that the sink has
        not had (None: its own clock's now)."""

    def flush(self) -> None:
        """Let out everything held."""


class OutputQueue:
    """FIFO of lines and states; lines are bounded per rank (``limit_bytes`` each)."""

    def __init__(
        self,
        limit_bytes: int = RANK_BUFFER_BYTES,
        lossy: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit_bytes = limit_bytes  # (more, and lossy, once every rank ended: ``let_lag``)
        self.lossy = lossy
        self.clock = clock  # stamps the batches; deadlines of ``take`` are on it too
        self.ready = threading.Condition()
        self.items: deque[Item] = deque()
        self.pending: dict[Key, int] = {}  # bytes queued per rank
        self.waiting: dict[Key, list[Callable[[], None]]] = {}  # readers held back, per rank
        self.dropped = 0  # lines a lossy queue let go since the last report
        self.closed = False  # no more items will come
        self.done = False  # the writer took the last item: later lines are not queued
        self.abandoned = False  # the sink is gone: take nothing more
        self.sleeping = 0  # writers waiting for an item (only they need to be woken)

    def put_lines(
        self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes], size: int | None = None
    ) -> bool:
        """Queue a rank's lines, without waiting: its reader asks ``when_room`` after (a
        lossy queue drops what does not fit, and counts it).  False: the writer is done
        (closed and emptied), the lines were not taken.  ``size``: ``lines_size(lines)``,
        where the caller has it already."""
        if size is None:
            size = lines_size(lines)
        key = (spec.rank, spec.label)
        with self.ready:
            if self.abandoned:
                return True
            if self.done:
                return False
            if self.lossy and self.is_full(key, size):
                self.dropped += len(lines)
                return True
            # Stamped under the lock: the stamps grow in the queue's order.
            self.items.append(Lines(spec, stream, lines, size, self.clock()))
            self.pending[key] = self.pending.get(key, 0) + size
            if self.sleeping:  # (a writer at work takes it without being woken)
                self.ready.notify_all()
            return True

    def is_full(self, key: Key, size: int) -> bool:
        """No room for ``size`` more bytes of this rank (a lossy queue's test: a batch
        larger than the limit still passes alone)."""
        queued = self.pending.get(key, 0)
        return queued > 0 and queued + size > self.limit_bytes

    def when_room(self, key: Key, on_room: Callable[[], None]) -> bool:
        """True: this rank's share has room (``on_room`` is not kept).  False: it is full;
        ``on_room`` is called once, from the writer's thread, when half of it is free again
        (or when the queue no longer holds anyone back: more room, done, abandoned)."""
        with self.ready:
            if self.lossy or self.done or self.abandoned:
                return True
            if self.pending.get(key, 0) < self.limit_bytes:
                return True
            self.waiting.setdefault(key, []).append(on_room)
            return False

    def freed(self, key: Key | None = None) -> list[Callable[[], None]]:
        """Under the lock: the callbacks of ranks that have room again (of ``key`` only, or
        of all), taken from the waiting list; to be called once the lock is released."""
        keys = list(self.waiting) if key is None else [key] if key in self.waiting else []
        every = self.done or self.abandoned or self.lossy
        callbacks: list[Callable[[], None]] = []
        for each in keys:
            if every or self.pending.get(each, 0) <= self.limit_bytes * RESUME_FRACTION:
                callbacks.extend(self.waiting.pop(each))
        return callbacks

    def put_state(self, state: RankState) -> None:
        """Queue a rank's state: never waits (states are few: one per start and exit)."""
        self.put_states([state])

    def put_states(self, states: Sequence[RankState]) -> None:
        """Queue several states at once: thousands of ranks start or end together, and each
        time the lock is taken the writer and the readers, which take it too, may have to
        give way first."""
        with self.ready:
            if not self.abandoned:
                self.items.extend(states)
                self.ready.notify_all()

    def take(self, deadline: float | None = None) -> tuple[Item | Tick | None, int]:
        """The next item (None once closed and empty; ``TICK`` when ``deadline``, a time on
        the queue's clock, passed first), and the lines dropped before it.  A tick says that
        nothing was posted before ``deadline`` that was not taken."""
        taken, dropped = self.take_batch(deadline, limit=1)
        return (taken[0] if isinstance(taken, list) else taken), dropped

    def take_batch(
        self, deadline: float | None = None, limit: int = TAKE_ITEMS
    ) -> tuple[list[Item] | Tick | None, int]:
        """``take``, for up to ``limit`` items (and ``TAKE_BYTES`` of lines) at once: one
        lock round trip for many batches, where thousands of ranks or a fast one keep the
        writer busy.  What is taken leaves the rank's share at once (its reader may go on):
        the writer holds at most this much beyond the queue's bound."""
        with self.ready:
            while not self.items and not self.closed and not self.abandoned:
                left = None if deadline is None else deadline - self.clock()
                if left is not None and left <= 0:
                    dropped, self.dropped = self.dropped, 0
                    return TICK, dropped
                self.sleeping += 1
                try:
                    self.ready.wait(left)
                finally:
                    self.sleeping -= 1
            dropped, self.dropped = self.dropped, 0
            taken: list[Item] | None = None
            if not self.items or self.abandoned:
                self.done = True  # decided under the lock: nothing more is queued after this
                self.ready.notify_all()
                resumed = self.freed()
            else:
                taken, resumed = self.pop_batch(limit)
        for on_room in resumed:  # a reader stopped for this rank goes on with it
            on_room()
        return taken, dropped

    def pop_batch(self, limit: int) -> tuple[list[Item], list[Callable[[], None]]]:
        """Under the lock: the first items (at least one), and the callbacks of the ranks
        they made room for."""
        taken: list[Item] = []
        size = 0
        held: set[Key] = set()  # ranks whose readers wait for room
        pending = self.pending
        while self.items and len(taken) < limit and size < TAKE_BYTES:
            item = self.items.popleft()
            taken.append(item)
            if isinstance(item, Lines):
                key = (item.spec.rank, item.spec.label)
                pending[key] -= item.size
                size += item.size
                if key in self.waiting:
                    held.add(key)
        return taken, [on_room for key in held for on_room in self.freed(key)]

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()

    def let_lag(self) -> None:
        """Every rank has ended: hold no reader back any more (those held back go on), so
        that the job directory gets what is still in flight now.  The view holds up to
        ``ENDED_VIEW_BYTES`` of each rank for a slow or paused terminal, and past that drops
        and counts, as ``--lossy-view`` does: an escaped process writing on into a paused
        terminal cannot grow dtrain's memory (the job directory keeps every line)."""
        with self.ready:
            self.limit_bytes = max(self.limit_bytes, ENDED_VIEW_BYTES)
            self.lossy = True
            resumed = self.freed()
        for on_room in resumed:
            on_room()

    def abandon(self) -> None:
        """Drop everything and never hold a reader back again: the sink failed or is given
        up."""
        with self.ready:
            self.abandoned = True
            self.items.clear()
            self.pending.clear()
            self.ready.notify_all()
            resumed = self.freed()
        for on_room in resumed:
            on_room()


class Outlet:
    """One sink behind its own queue and writer thread."""

    def __init__(
        self,
        sink: OutputSink,
        *,
        name: str = "view",
        lossy: bool = False,
        patience_s: float | None = None,
        limit_bytes: int = RANK_BUFFER_BYTES,
        on_drop: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.name = name
        self.queue = OutputQueue(limit_bytes, lossy, clock)
        self.on_drop = on_drop
        self.patience_s = patience_s  # after Ctrl-C/SIGTERM, how long to wait for the writer
        self.error: BaseException | None = None
        self.late = threading.Lock()  # lines that come after the queue closed
        self.thread = threading.Thread(target=self.write, name=f"dtrain-{name}", daemon=True)
        self.thread.start()

    def post_lines(
        self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes], size: int | None = None
    ) -> None:
        """Queue the lines.  Once the writer is done, a journal still gets them, written here
        after everything queued before (a rank's reader may outlive the job's end: the drain
        stopped waiting for it); a view's are dropped (the job finished the view)."""
        if self.queue.put_lines(spec, stream, lines, size) or self.is_view:
            return
        self.thread.join()  # the writer ends once it has written what was queued
        with self.late:
            if self.error is not None:
                return
            try:
                self.sink.show(spec, stream, lines)
            except BaseException as exc:  # as in the writer: the job goes on without it
                self.error = exc

    def write(self) -> None:
        # A sink that holds lines for a while gets each batch with its posting time, a tick
        # when what it holds is due and nothing came meanwhile, and a flush at the end (not
        # when abandoned: then nothing more is shown).
        timed = self.sink if isinstance(self.sink, TimedSink) else None
        while True:
            deadline = timed.next_due() if timed is not None else None
            taken, dropped = self.queue.take_batch(deadline)
            try:
                if dropped and self.on_drop is not None:
                    self.on_drop(dropped)
                if taken is None:
                    if timed is not None and not self.queue.abandoned:
                        timed.flush()
                    return
                if isinstance(taken, Tick):
                    assert timed is not None  # only a timed sink gives take a deadline
                    timed.tick(deadline)
                else:
                    self.hand_on(taken, timed)
            except BaseException as exc:  # the sink failed: the job goes on without it
                self.error = exc
                self.queue.abandon()
                return

    def hand_on(self, items: list[Item], timed: TimedSink | None) -> None:
        """Give the sink each item taken, in order."""
        sink = self.sink
        for item in items:
            if self.queue.abandoned:
                return  # (given up on meanwhile: nothing more is shown)
            if isinstance(item, Lines):
                if timed is not None:
                    timed.show_at(item.spec, item.stream, item.lines, item.posted)
                else:
                    sink.show(item.spec, item.stream, item.lines)
            else:
                sink.update(item)

    def finish(self, timeout_s: float | None, stop: threading.Event | None = None) -> bool:
        """Let the writer empty the queue: at most ``timeout_s``, and once ``stop`` is set (a
        signal to dtrain) at most its patience more.  False: given up on."""
        self.queue.close()
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        stopping = False
        while self.thread.is_alive():
            now = time.monotonic()
            if stop is not None and stop.is_set() and not stopping:
                stopping = True
                deadline = min(deadline, now + (self.patience_s or 0.0))
            if now >= deadline:
                self.queue.abandon()
                return False
            self.thread.join(min(FINISH_POLL_S, deadline - now))
        return True

    @property
    def is_view(self) -> bool:
        """A view may be given up on (it has a patience); a journal never is."""
        return self.patience_s is not None

    @property
    def failed(self) -> bool:
        """The sink raised something other than a closed pipe (which ends a view quietly)."""
        return self.error is not None and not isinstance(self.error, BrokenPipeError)


class Fanout:
    """Every outlet of a job; readers post lines, the loop posts states, none of them write."""

    def __init__(self, outlets: Sequence[Outlet]) -> None:
        self.outlets = list(outlets)

    def post_lines(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        """Queue a rank's lines in every outlet (never waits: ask ``when_room`` after)."""
        size = lines_size(lines)  # (once for all outlets: a pass over every line)
        for outlet in self.outlets:
            outlet.post_lines(spec, stream, lines, size)

    def when_room(self, spec: LaunchSpec, on_room: Callable[[], None]) -> bool:
        """True: every outlet has room for more of this rank.  False: one is full; its
        reader stops reading the rank until ``on_room`` is called (once, from a writer's
        thread, when every outlet has room again)."""
        key = (spec.rank, spec.label)

        def again() -> None:  # the full outlet has room: every outlet is asked again
            if self.when_room(spec, on_room):
                on_room()

        return all(outlet.queue.when_room(key, again) for outlet in self.outlets)

    def post_state(self, state: RankState) -> None:
        for outlet in self.outlets:
            outlet.queue.put_state(state)

    def post_states(self, states: Sequence[RankState]) -> None:
        for outlet in self.outlets:
            outlet.queue.put_states(states)

    def let_views_lag(self) -> None:
        """Every rank has exited: what is still in flight (a pipe's worth, an agent's window)
        is read at once, so that the job directory gets it all now, while a slow or paused
        terminal shows it later (the views hold up to ``ENDED_VIEW_BYTES`` of each rank,
        and say how many lines they dropped past that)."""
        for outlet in self.outlets:
            if outlet.is_view:
                outlet.queue.let_lag()

    def finish_journals(self) -> None:
        """Let every journal (the job directory) write all it has, however long it takes."""
        for outlet in self.outlets:
            if not outlet.is_view:
                outlet.finish(None)

    def finish_views(self, interrupted: bool, stop: threading.Event | None = None) -> bool:
        """Let every view show what it has: as long as it takes, but after Ctrl-C or SIGTERM
        (before, or ``stop`` during the wait) at most its patience: a paused terminal must
        not keep a stopped job alive.  False: a view was given up on."""
        done = True
        for outlet in self.outlets:
            if outlet.is_view:
                done &= outlet.finish(outlet.patience_s if interrupted else None, stop)
        return done

    def give_up_views(self) -> None:
        """Ctrl-C twice: drop what the views still hold, so nothing waits on them."""
        for outlet in self.outlets:
            if outlet.is_view:
                outlet.queue.abandon()
