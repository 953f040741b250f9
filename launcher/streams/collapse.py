"""Identical lines from several ranks, shown once: ``[0-7] text`` (pure; the time comes in).

With 8 ranks every library warning arrives 8 times.  ``Collapser`` groups lines
that have the same stream and text, arriving within a window (0.5 s by
default), and lets each group out once, tagged with the set of ranks that said
it.  Rules:

* lines that differ only in a log prefix's time, pid or thread id are the same
  (glog's ``[W1123 08:38:17.186481407 socket.cpp:207]``, absl's
  ``I0000 00:00:1795423122.942183   23605 port.cc:153]``, a logging timestamp);
  the group shows the first rank's text.  Lines that differ anywhere else (a rank
  number, a loss) are never merged;
* every rank's lines come out in the order it wrote them: a line may join a
  group only if that group is newer than the rank's previous line's group;
* a group comes out when its window closes (or at once when every rank has
  joined it); groups come out in the order they were made, and the time a group
  shows never goes back (a group that must come after a newer one shows that one's);
* a line that two ranks or more said (ranks that start a little apart print the
  same warning a little apart) waits longer for the others while one of them is
  still expected to say it: a rank that has not, and has said fewer lines on that
  stream than they had by then (it has not come to that point of its run yet).
  It waits at most ``HOLD_S`` after the latest rank said it (or a line that came in
  one batch with it), and ``HOLD_MAX_S`` after the first; lines that stand after it
  wait with it.  A line one rank said waits its window only: most such lines are
  that rank's alone (rank 0's log);
* a flood that nothing shares is not held: once more than ``FLOOD_LINES`` lines of two
  ranks or more came since a line was last shared, what is held comes out and the
  next lines go straight out as they come (each rank's in its order), until a window
  brings fewer than ``FLOOD_LINES`` lines (the flood is over) or ``FLOOD_PASS_S`` passed;
  then collapsing starts again.  A line counts as shared when another rank said it,
  even too long ago to join.  Looking up every line of such a flood would cost more
  than it could save (+60% wall time in ``benchmarks/collapse_cost.py``), and a flood
  comes out early anyway.

Expanding what comes out (each group into one line per rank) gives back exactly
each rank's lines in order: the property the tests check on random interleavings.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Sequence

from launcher.streams.heldlines import (
    HOLD_MAX_S,
    HOLD_S,
    Block,
    Collapsed,
    Track,
    common_run,
    known_lines,
    next_position,
    spacing,
)
from launcher.streams.sametext import PREFIX_HEADS, keys_of, same_text
from launcher.streams.waits import Waits

__all__ = [  # (Collapsed and the hold bounds live in heldlines: their users import them here)
    "DEFAULT_WINDOW_S",
    "FLOOD_LINES",
    "FLOOD_PASS_S",
    "HOLD_MAX_S",
    "HOLD_S",
    "MAX_HELD",
    "Collapsed",
    "Collapser",
    "expand",
]

DEFAULT_WINDOW_S = 0.5
# Lines held at most: a flood comes out early rather than piling up.  Ranks that start a
# little apart print the same lines that many lines apart (at 1 M lines/s, 8 ranks started
# over 0.4 s on 2 busy cores were 50-65 k lines apart); a held line costs ~175 bytes (80 of
# text), so this costs what 50 k lines did when who said them was kept per line.
MAX_HELD = 100_000
FLOOD_LINES = 50_000  # lines of a flood that nothing shares, held before it passes
BULK_MOVE_SPAN = 16  # blocks in pending per moved block up to which a move rebuilds the span
FLOOD_PASS_S = 1.0  # how long a flood that nothing shares goes straight out before a new look


class Collapser:
    """Feed it lines as they come; it gives back what to show, and when.

    Every held line has a position; what comes out comes out in the order of positions,
    and each rank's lines on a stream stand in the order it wrote them.  A line joins
    another rank's same held line when that keeps the order: when the held line stands
    after the rank's newest line, or after its newest shared line once its own lines since
    (which no other rank depends on) are moved in front of it.  Lines join a run at a time:
    where a rank's batch goes on as another rank's held block goes on, the whole run joins
    in one step (slices compared, not a look-up per line: see ``heldlines``).  A batch that
    no held line matches is held whole as one ``Block`` at the end, with C-speed work per
    line only (its keys into a dict).  That work still takes a third of the launcher's time
    in a flood of distinct lines (the collapse-cost benchmark), so a flood that nothing
    shares skips it: its lines pass straight out (see the module's rules).  Lines that some
    ranks said may wait for the others (``waiting``, by position): what the windows closed
    comes out only up to the first line still waiting.
    """

    def __init__(
        self, world_size: int, window_s: float = DEFAULT_WINDOW_S, max_held: int = MAX_HELD
    ) -> None:
        self.world_size = world_size
        self.window_s = window_s
        self.max_held = max_held
        # (held before passing a flood that nothing shares: fewer than may be held, as
        # looking up the lines of such a flood is most of what it costs)
        self.flood_lines = min(max_held, FLOOD_LINES)
        self.pending: list[Block] = []  # by position
        self.arrivals: deque[Block] = deque()  # by time: whose window closes next
        self.held = 0  # lines in ``pending``
        # stream -> key -> the newest block holding that key, in two generations (young,
        # old): when the young one has had max_held keys put in, it becomes the old one and
        # the old one goes, emitted blocks with it (a block still held is always in one).
        self.open: dict[str, tuple[dict[bytes, Block], dict[bytes, Block]]] = {}
        self.put = 0  # keys put in the young generations since they were made
        self.tracks: dict[tuple[int, str], Track] = {}
        self.speakers: dict[str, dict[int, Track]] = {}  # stream -> rank -> its track
        self.top = 0.0  # the next position at the end
        # Lines some ranks said, waiting for the others, by position: those of blocks whose
        # window closed, and those that a second rank said after that (held back by another).
        self.waiting = Waits()
        self.cut = -math.inf  # the windows closed let out lines up to here (unless waiting)
        self.shown_time = -math.inf  # the time of the latest group let out
        # A flood that nothing shares: lines taken so far, and at the last shared line; the
        # ranks that spoke since (rank -> ``added`` after its latest lines).
        self.added = 0
        self.shared_at = 0
        self.spoke: dict[int, int] = {}
        # Passing such a flood straight out: until when at most, and the lines passed since
        # ``counted_since`` (fewer than flood_lines in a window: the flood is over).
        self.passing_until: float | None = None
        self.counted_since = 0.0
        self.counted = 0

    def add(self, rank: int, stream: str, text: bytes, now: float) -> list[Collapsed]:
        """One line of one rank: see ``add_lines``."""
        return self.add_lines(rank, stream, [text], now)

    def add_lines(
        self, rank: int, stream: str, batch: Sequence[bytes], now: float
    ) -> list[Collapsed]:
        """A batch of one rank's lines; returns what is due now (a group every rank has
        joined, windows closed, or the oldest lines when too many are held)."""
        count = len(batch)
        track = self.tracks.get((rank, stream)) or self.new_track(rank, stream)
        track.count += count
        if self.passing_until is not None and self.is_passing(self.passing_until, count, now):
            # (a batch that is not a list goes on as it came: a view may write it whole)
            lines = tuple(batch) if isinstance(batch, list) else batch
            return [Collapsed((rank,), stream, lines, max(now, self.shown_time))]
        self.added += count
        self.spoke[rank] = self.added
        if stream not in self.open:
            self.open[stream] = ({}, {})
        data = getattr(batch, "data", None)  # a batch that has its lines' bytes joined
        if isinstance(data, bytes) and count > 1:
            joined, offset = self.join_batch(rank, stream, data, count, now, track)
            if joined == count:
                return self.due(now)
            lines = data[offset:].split(b"\n") if joined else list(batch)
        else:
            lines = batch if isinstance(batch, list) else list(batch)
        self.join_lines(rank, stream, lines, keys_of(lines), now, track)
        return self.due(now)

    def join_batch(
        self, rank: int, stream: str, data: bytes, count: int, now: float, track: Track
    ) -> tuple[int, int]:
        """The first lines of a batch (``data``: its lines joined by newlines) that go on as
        other ranks' held blocks go on, joined a block at a time and compared as bytes: no
        line split, no key made (bytes alike are keys alike; the keys of lines a log prefix
        may start differ from their bytes: those go the usual way).  Returns how many lines
        joined, and where the rest starts in ``data``."""
        young, old = self.open[stream]
        joined = offset = 0
        while joined < count:
            newline = data.find(b"\n", offset)
            first = data[offset:newline] if newline >= 0 else data[offset:]
            if first[:1] in PREFIX_HEADS:
                break
            block = young.get(first) or old.get(first)
            if block is None or block.rank == rank or block.done:
                break
            i = block.line_of(first, max(block.shown, block.count_upto(track.last)))
            position = block.at(i)
            if (
                i < block.shown
                or rank in block.said_by(i)
                or (position <= track.last and not self.make_room(position, track, 0))
            ):
                break
            lines = min(count - joined, len(block.lines) - i)
            same = b"\n".join(block.lines[i : i + lines])
            end = offset + len(same)
            if not data.startswith(same, offset) or data[end : end + 1] not in (b"\n", b""):
                break  # (where they part, the usual way finds)
            self.shared_at = self.added
            self.join(rank, block, i, i + lines, track, now)
            joined, offset = joined + lines, end + 1
        return joined, offset

    def new_track(self, rank: int, stream: str) -> Track:
        track = self.tracks[rank, stream] = Track()
        self.speakers.setdefault(stream, {})[rank] = track
        return track

    def join_lines(
        self,
        rank: int,
        stream: str,
        lines: list[bytes],
        keys: list[bytes],
        now: float,
        track: Track,
    ) -> None:
        """Run by run: lines that go on as another rank's held block goes on join it where
        they can, in one step; the lines that do not are held as blocks of their own, in
        front of the next run that joins (or at the end).  A key is looked up where a run
        may start; where none does, the next line that a held block has is found by a scan
        of the rest (at C speed, once per batch: a dict look-up per line of a flood cost
        more than all the rest of this)."""
        young, old = self.open[stream]
        count = len(keys)
        start = at = 0  # lines from ``start`` wait for a place; ``at``: the next to look at
        known: list[int] | None = None  # from a scan: the lines that a held block has
        while at < count:
            key = keys[at]
            block = young.get(key) or old.get(key)
            if block is None:
                if known is None:
                    known = known_lines(keys, at + 1, young, old)
                hit = bisect.bisect_left(known, at + 1)
                at = known[hit] if hit < len(known) else count
                continue
            if block.rank == rank:
                at += 1
                continue
            self.shared_at = self.added  # another rank said it (even if too long ago to join)
            # (a line that it can join without a move: after its newest line, not let out)
            i = block.line_of(key, max(block.shown, block.count_upto(track.last)))
            if block.done or i < block.shown:  # let out already: so is the run that follows
                run = common_run(keys, at, block.keys, i)
                at += run if block.done else min(run, block.shown - i)
                continue
            position = block.at(i)
            if rank in block.said_by(i) or (
                (start < at or position <= track.last)
                and not self.make_room(position, track, at - start)
            ):  # (a line after the rank's newest, with none waiting, joins at once)
                at += 1
                continue
            if start < at:
                self.place(rank, stream, lines[start:at], keys[start:at], now, position)
            end = i + common_run(keys, at, block.keys, i)
            self.join(rank, block, i, end, track, now)
            at = start = at + end - i
        if start < count:
            rest = lines[start:] if start else lines
            rest_keys = rest if keys is lines else keys[start:]
            self.hold_at_end(rank, stream, rest, rest_keys, now, track)

    def make_room(self, position: float, track: Track, waiting: int) -> bool:
        """Can the rank's next line stand at ``position``, with ``waiting`` lines of it not
        yet held in front?  When its newest line stands after it, its free blocks move in
        front first, if they fit after its newest shared line."""
        if position > track.last:
            return spacing(track.last, position, waiting) is not None
        track.free = [b for b in track.free if not b.done]  # those let out stay where they were
        if position <= track.anchor or not track.free:
            return False
        count = sum(len(b.lines) for b in track.free)
        room = spacing(track.anchor, position, count + waiting)
        if room is None:
            return False
        at, step = room
        at = self.move(track.free, track, at, step)
        track.last, track.free = at - step, []
        return True

    def move(self, blocks: list[Block], track: Track, at: float, step: float) -> float:
        """The rank's free blocks (in order) to stand from ``at`` on, ``step`` apart: each
        taken out of ``pending`` and put back in order.  Free blocks stand after the rank's
        newest shared line and up to its newest line, and move in between: only that span
        of ``pending`` changes.  Where it holds few other blocks it is rebuilt in one go
        (a list search per block cost a scan of ``pending`` each: quadratic time for a rank
        that flushes after every line, a block per line); else each block is found by its
        position (what a few blocks in a long span cost least).  Returns where the next
        line after them would stand."""
        pending = self.pending
        lo = bisect.bisect_right(pending, track.anchor, key=next_position)
        hi = bisect.bisect_right(pending, track.last, key=next_position)
        if hi - lo <= BULK_MOVE_SPAN * len(blocks):
            moving = set(map(id, blocks))
            span = [b for b in pending[lo:hi] if id(b) not in moving]
            for block in blocks:
                block.serial, block.step = at, step
                at = block.at(len(block.lines))
            span += blocks
            span.sort(key=next_position)  # two sorted runs: one merge
            pending[lo:hi] = span
            return at
        for block in blocks:
            self.unpend(block)
            block.serial, block.step = at, step
            at = block.at(len(block.lines))
            bisect.insort(pending, block, key=next_position)
        return at

    def unpend(self, block: Block) -> None:
        """Take a block out of ``pending``, found by its position."""
        pending, position = self.pending, next_position(block)
        i = bisect.bisect_left(pending, position, key=next_position)
        while (
            i < len(pending)
            and pending[i] is not block
            and pending[i].at(pending[i].shown) == position
        ):
            i += 1  # blocks at the same position: a few at most
        if i < len(pending) and pending[i] is block:
            del pending[i]
        else:  # not where its position says: never seen, but a scan still finds it
            pending.remove(block)

    def join(self, rank: int, block: Block, start: int, end: int, track: Track, now: float) -> None:
        """The rank said the block's lines ``start:end`` (none of which it had said), after
        its newest line."""
        fresh = block.add_rank(start, end, rank)
        if fresh and self.world_size > 2 and block.at(fresh[0][0]) <= self.cut:
            upto = block.count_upto(self.cut)  # these are held back already: they wait now
            for first, stop in fresh:
                if first < upto:
                    self.waiting.add(block, first, min(stop, upto))
        block.heard = now
        if block.reach < track.count:
            block.reach = track.count
        self.shared_at = self.added
        track.last = track.anchor = block.at(end - 1)
        if track.free:
            track.free = []  # its lines so far stand before a shared one now
        last = block.at(len(block.lines) - 1)
        owner = self.tracks[block.rank, block.stream]
        if owner.anchor < last:
            owner.anchor = last
            if owner.free:
                owner.free = [b for b in owner.free if b.serial > block.serial]

    def place(
        self,
        rank: int,
        stream: str,
        lines: list[bytes],
        keys: list[bytes],
        now: float,
        before: float,
    ) -> None:
        """Lines of a rank held between its newest line and ``before``, where its next line
        joins another rank's (``make_room`` said they fit)."""
        track = self.tracks[rank, stream]
        room = spacing(track.last, before, len(lines))
        assert room is not None  # make_room checked it
        block = Block(rank, stream, lines, keys, now, *room, reach=track.count)
        self.hold(block)
        track.last = block.at(len(lines) - 1)
        young = self.open[stream][0]
        for key in keys:  # a block further on is the better one to join: keep it
            if key not in young or young[key].done:
                young[key] = block
        self.put += len(keys)

    def hold_at_end(
        self,
        rank: int,
        stream: str,
        lines: list[bytes],
        keys: list[bytes],
        now: float,
        track: Track,
    ) -> None:
        block = Block(
            rank, stream, lines, keys, now, max(self.top, track.last + 1), reach=track.count
        )
        self.top = block.at(len(lines) - 1) + 1
        track.last = self.top - 1
        if track.free and track.free[0].done:  # let out: no longer free, and no longer kept
            track.free = [b for b in track.free if not b.done]
        track.free.append(block)
        self.hold(block)
        if self.put >= self.max_held:  # a new generation (every stream's: they share ``put``)
            self.open = {name: ({}, young) for name, (young, _) in self.open.items()}
            self.put = 0
        self.open[stream][0].update(zip(keys, itertools.repeat(block)))
        self.put += len(keys)

    def hold(self, block: Block) -> None:
        if not self.pending or next_position(self.pending[-1]) < block.serial:
            self.pending.append(block)
        else:
            bisect.insort(self.pending, block, key=next_position)
        self.arrivals.append(block)
        self.held += len(block.lines)

    def due(self, now: float) -> list[Collapsed]:
        """What is due, in the order of positions: every line up to the last line of each
        block whose window closed, up to the first line still waiting for other ranks;
        the oldest too while more than ``max_held`` lines wait (a flood comes out early),
        or all of them when nothing of the flood is shared (it passes from now on); then
        the next lines that every rank has said."""
        cut = self.cut
        arrivals = self.arrivals
        while arrivals and (arrivals[0].done or arrivals[0].first + self.window_s <= now):
            block = arrivals.popleft()
            if not block.done:
                cut = max(cut, block.at(len(block.lines) - 1))
                if self.world_size > 2 and block.shared:
                    # Its lines some ranks said may wait for the others.  (Only now: most
                    # shared lines are said by every rank within the window.)
                    self.waiting.add_shared(block, self.world_size)
        self.cut = cut
        out = self.emit_upto(self.held_back(cut, now))
        if self.held > self.flood_lines and self.is_unshared_flood():
            self.passing_until = now + FLOOD_PASS_S
            self.counted_since, self.counted = now, 0
            out += self.flush()
            self.open, self.put = {}, 0  # every block is let out: nothing to look up
            return out
        while self.held > self.max_held:
            head = self.pending[0]
            out += self.emit_upto(head.at(len(head.lines) - 1))
        out += self.emit_said_by_all()
        while self.waiting.first_let_out():
            # What held back the lines whose window closed was let out (every rank said it,
            # or a flood): they follow now.
            out += self.emit_upto(self.held_back(self.cut, now)) + self.emit_said_by_all()
        return out

    def held_back(self, cut: float, now: float) -> float:
        """Where the lines up to ``cut`` stop: just before the first one still waiting for
        other ranks."""
        if not self.waiting:
            return cut
        return self.waiting.held_back(cut, lambda block, said: self.awaits(block, said, now))

    def awaits(self, block: Block, said: tuple[int, ...], now: float) -> bool:
        """Is a rank that has not said the block's lines that ``said`` said still expected to,
        within the bound?  One is while it has said fewer lines on the stream than the ranks
        that said them had by then (it has not come to that point of its run yet; a rank
        silent on the stream neither)."""
        if len(said) >= self.world_size or now >= block.waits_until():
            return False
        speakers = self.speakers[block.stream]
        if len(speakers) < self.world_size:
            return True
        return any(t.count < block.reach for rank, t in speakers.items() if rank not in said)

    def is_unshared_flood(self) -> bool:
        """More than ``flood_lines`` lines since a line was last shared, of two ranks or more
        (a rank alone may just be ahead of the others that will say the same)."""
        if self.added - self.shared_at <= self.flood_lines:
            return False
        speakers = sum(1 for at in self.spoke.values() if at > self.shared_at)
        return speakers >= min(2, self.world_size)

    def is_passing(self, until: float, count: int, now: float) -> bool:
        """Do ``count`` lines that come at ``now`` pass straight out?  Not from ``until``
        on, nor once a window brought no more than flood_lines lines: then collapsing starts
        again, afresh (the flood must show again that nothing of it is shared)."""
        if now - self.counted_since >= self.window_s:
            ended = self.counted <= self.flood_lines
            self.counted_since, self.counted = now, 0
        else:
            ended = False
        if ended or now >= until:
            self.passing_until = None
            self.shared_at = self.added
            self.spoke.clear()
            return False
        self.counted += count
        return True

    def emit_upto(self, cut: float) -> list[Collapsed]:
        """Every held line standing at ``cut`` or before, in the order of positions (blocks
        whose positions interleave come out line by line)."""
        out: list[Collapsed] = []
        pending = self.pending
        while pending and pending[0].at(pending[0].shown) <= cut:
            head = pending.pop(0)
            limit = min(cut, next_position(pending[0]) if pending else math.inf)
            out += self.let_out(head, head.lines_upto(limit))
        return out

    def emit_said_by_all(self) -> list[Collapsed]:
        """The first held lines that every rank has said: out now, not at the window."""
        out: list[Collapsed] = []
        pending = self.pending
        while pending:
            head = pending[0]
            end = head.said_by_all_upto(self.world_size)
            if end > head.shown and len(pending) > 1:
                end = min(end, head.count_upto(next_position(pending[1])))
            if end <= head.shown:
                break
            out += self.let_out(pending.pop(0), end)
        return out

    def let_out(self, block: Block, end: int) -> list[Collapsed]:
        """The block's lines up to ``end`` (it was taken out of ``pending``: what is left of
        it goes back in at its next line's position)."""
        self.shown_time = max(self.shown_time, block.first)
        out = block.items(block.shown, end, self.shown_time)
        self.held -= end - block.shown
        block.shown = end
        if end == len(block.lines):
            block.done = True
        else:
            bisect.insort(self.pending, block, key=next_position)
        return out

    def flush(self) -> list[Collapsed]:
        """Everything still held (the job ended)."""
        out = self.emit_upto(math.inf)
        self.arrivals.clear()
        self.waiting.clear()
        self.cut = -math.inf
        return out

    def next_due(self) -> float | None:
        """When the oldest block's window closes, or the line that holds back those whose
        window closed stops waiting (None: nothing held)."""
        while self.arrivals and self.arrivals[0].done:
            self.arrivals.popleft()
        due = self.arrivals[0].first + self.window_s if self.arrivals else None
        waiting = self.waiting.first()
        if waiting is not None and waiting[0] <= self.cut:
            until = waiting[1].waits_until()
            due = until if due is None else min(due, until)
        return due


def expand(items: Sequence[Collapsed]) -> dict[int, list[tuple[str, bytes]]]:
    """Each rank's lines back from collapsed output (its own text where it had one of its own
    is the first rank's: the same up to the log prefix)."""
    lines: dict[int, list[tuple[str, bytes]]] = {}
    for item in items:
        for rank in item.ranks:
            lines.setdefault(rank, []).extend((item.stream, same_text(t)) for t in item.lines)
    return lines
