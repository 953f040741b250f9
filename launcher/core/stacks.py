"""Every rank's Python stack, grouped (pure): identical stacks print once with their ranks.

The classic hang: seven ranks wait in ``all_reduce``, one is elsewhere.  Ranks are
grouped by their main thread's frames (function, file, line), whatever other threads
they have (data loaders, NCCL's watchdog); the largest group prints first and every
smaller group is marked, so the rank that differs stands out.
Ranks whose stack could not be taken (no py-spy on the host, the rank exited)
print with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.core.config import rank_set

Frame = tuple[str, str, int]  # function, file, line


@dataclass(frozen=True)
class StackGroup:
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    frames: tuple[Frame, ...]  # the main thread's, innermost first
    threads: tuple[int, ...]  # the thread counts of these ranks' programs (distinct, ascending)
    error: str | None = None  # no stack: why


def main_frames(threads: Sequence[Mapping[str, Any]]) -> tuple[tuple[Frame, ...], int]:
    """The main thread's frames (py-spy --json), and how many threads there are."""
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), None)
    main = main or (threads[0] if threads else {})
    frames = tuple(
        (str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0))
        for f in main.get("frames", ())
    )
    return frames, len(threads)


def group_stacks(results: Mapping[int, tuple[str, Mapping[str, Any]]]) -> list[StackGroup]:
    """rank -> (host, dump) into groups: largest first, then by the lowest rank."""
    keyed: dict[tuple[Any, ...], tuple[list[int], list[str], set[int]]] = {}
    for rank in sorted(results):
        host, dump = results[rank]
        threads = 0
        if "threads" in dump:
            frames, threads = main_frames(dump["threads"])
            key: tuple[Any, ...] = ("stack", frames)
        else:
            key = ("error", str(dump.get("error", "no stack")))
        ranks, hosts, counts = keyed.setdefault(key, ([], [], set()))
        ranks.append(rank)
        counts.add(threads)
        if host not in hosts:
            hosts.append(host)
    groups = [
        StackGroup(tuple(r), tuple(h), key[1], tuple(sorted(c)))
        if key[0] == "stack"
        else StackGroup(tuple(r), tuple(h), (), (), error=key[1])
        for key, (r, h, c) in keyed.items()
    ]
    return sorted(groups, key=lambda g: (g.error is not None, -len(g.ranks), g.ranks[0]))


def format_stacks(groups: Sequence[StackGroup], world_size: int) -> list[str]:
    """The groups as text: ``ranks 0-6 on node1, node2 (MainThread):`` then the frames."""
    lines: list[str] = []
    stacked = [g for g in groups if g.error is None]
    for group in groups:
        who = (
            f"rank {group.ranks[0]}" if len(group.ranks) == 1 else f"ranks {rank_set(group.ranks)}"
        )
        where = f"{who} of {world_size} on {', '.join(group.hosts)}"
        if group.error is not None:
            lines.append(f"{where}: no stack: {group.error}")
            continue
        smaller = len(stacked) > 1 and len(group.ranks) < len(stacked[0].ranks)
        odd = "   <-- differs from the others" if smaller else ""
        counts = group.threads
        threads = (
            ""
            if not counts or counts[-1] <= 1
            else f", {counts[0]} threads"
            if len(counts) == 1
            else f", {counts[0]}-{counts[-1]} threads"
        )
        lines.append(f"{where} (main thread{threads}):{odd}")
        lines.extend(f"    {name} ({path}:{line})" for name, path, line in group.frames)
        lines.append("")
    return lines
