"""Lines that some ranks said, waiting for the others (pure): the heap behind
``collapse.Collapser``'s bounded waits, by position.

An entry stands for a span of one block's lines (a run that the same ranks said, or part
of one); it moves on as its lines are let out or stop waiting, so a run waits and comes
out in one step, not line by line.  A line's position never changes once another rank
joined it, so an entry's key stays true.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from launcher.streams.heldlines import Block

Waiting = tuple[float, int, Block, int, int]  # position, ticket, block, lines first:end


class Waits:
    """The spans of held lines that wait for other ranks, first by position first."""

    def __init__(self) -> None:
        self.heap: list[Waiting] = []
        self.tickets = itertools.count()  # orders waits at one position

    def __bool__(self) -> bool:
        return bool(self.heap)

    def add(self, block: Block, first: int, end: int) -> None:
        """Lines ``first:end`` of the block wait."""
        heapq.heappush(self.heap, (block.at(first), next(self.tickets), block, first, end))

    def add_shared(self, block: Block, world_size: int) -> None:
        """Its lines not let out that some ranks said but not all wait."""
        for first, stop, said in block.spans(block.shown, len(block.lines)):
            if 1 < len(said) < world_size:
                self.add(block, first, stop)

    def first_let_out(self) -> bool:
        """Was the first waiting line let out (by what let out the lines around it)?"""
        return bool(self.heap) and self.heap[0][2].shown > self.heap[0][3]

    def settle(self) -> bool:
        """The first entry moved on past its lines let out (entries of lines all let out
        go); False: none waits."""
        heap = self.heap
        while heap and heap[0][2].shown > heap[0][3]:
            _, ticket, block, _, end = heap[0]
            if block.shown < end:
                heapq.heapreplace(heap, (block.at(block.shown), ticket, block, block.shown, end))
            else:
                heapq.heappop(heap)
        return bool(heap)

    def first(self) -> tuple[float, Block] | None:
        """Where the first waiting line stands, and its block."""
        return (self.heap[0][0], self.heap[0][2]) if self.settle() else None

    def held_back(self, cut: float, awaits: Callable[[Block, tuple[int, ...]], bool]) -> float:
        """Where the lines up to ``cut`` stop: just before the first one still waiting
        (``awaits``: do the block's lines that these ranks said still wait?); the waits
        before it, let out or over, go."""
        heap = self.heap
        while self.settle():
            position, ticket, block, first, end = heap[0]
            if position > cut:
                break
            run = block.run_at(first)
            if awaits(block, block.saids[run]):
                return math.nextafter(position, -math.inf)
            # Its run waits no longer: those of its lines up to the cut go (the others are
            # looked at again once the cut passes them).
            first = max(first + 1, min(block.run_end(run), block.count_upto(cut)))
            if first < end:
                heapq.heapreplace(heap, (block.at(first), ticket, block, first, end))
            else:
                heapq.heappop(heap)
        return cut

    def clear(self) -> None:
        self.heap.clear()
