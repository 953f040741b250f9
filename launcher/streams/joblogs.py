"""A job's rank logs read back: whole lines merged by time, ``dtrain logs``' filters (streams)."""

from __future__ import annotations

import heapq
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from launcher.base.errors import UsageError
from launcher.core.command import LaunchSpec
from launcher.core.outcome import Stream
from launcher.streams.jobdir import ACTIVE, RANK_LOGS, JobDir, attempts_of

LOG_POLL_S = 0.2  # how often ``dtrain logs -f`` looks for new lines


@dataclass(frozen=True)
class LogLine:
    time: float
    rank: int
    stream: Stream
    text: bytes


def parse_log_line(rank: int, raw: bytes) -> LogLine | None:
    stamp, _, rest = raw.partition(b" ")
    code, _, text = rest.partition(b" ")
    try:
        return LogLine(float(stamp), rank, "stderr" if code == b"e" else "stdout", text)
    except ValueError:
        return None


class LogReader:
    """Reads a job's rank logs incrementally: whole lines only, from where it stopped."""

    def __init__(self, job: JobDir, ranks: set[int] | None = None) -> None:
        self.job = job
        self.ranks = ranks
        self.offsets: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}

    def rank_files(self) -> dict[int, Path]:
        found = {}
        for path in self.job.path.glob(RANK_LOGS):
            try:
                rank = int(path.name.split(".")[1])
            except (IndexError, ValueError):
                continue
            if self.ranks is None or rank in self.ranks:
                found[rank] = path
        return found

    def read_new(self) -> list[LogLine]:
        """New lines of every rank, merged by time (each rank's file is in time order)."""
        per_rank: list[Iterator[LogLine]] = []
        for rank, path in sorted(self.rank_files().items()):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(rank, 0))
                data = self.partial.pop(rank, b"") + f.read()
                self.offsets[rank] = f.tell()
            *whole, rest = data.split(b"\n")
            if rest:
                self.partial[rank] = rest
            lines = [line for line in (parse_log_line(rank, raw) for raw in whole) if line]
            per_rank.append(iter(lines))
        return list(heapq.merge(*per_rank, key=lambda line: line.time))


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h``, ``1d`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise UsageError(f"--since {text!r}: not a duration", "write e.g. 30s, 10m, 2h or 1d")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


@dataclass(frozen=True)
class LogQuery:
    """``dtrain logs``'s filters: ranks, a role, the last N seconds, a regular expression."""

    ranks: frozenset[int] | None = None
    role: str | None = None
    since_s: float | None = None
    pattern: str | None = None
    attempt: int | None = None  # only this attempt's lines (--max-restarts)


def attempt_window(job: JobDir, number: int) -> tuple[float, float]:
    """When attempt ``number`` ran: from its start to the next one's (or forever)."""
    entries = attempts_of(job)
    if not entries and number == 0:
        return (0.0, float("inf"))  # a job without restarts is its attempt 0
    if not 0 <= number < len(entries):
        raise UsageError(
            f"--attempt {number}: job {job.id} has attempts 0 to {max(len(entries) - 1, 0)}",
            "see dtrain logs without --attempt",
        )
    start = float(entries[number].get("started", 0.0))
    later = entries[number + 1].get("started") if number + 1 < len(entries) else None
    return (start, float(later) if later is not None else float("inf"))


def attempt_events(job: JobDir) -> list[tuple[float, str]]:
    """What a restarted job's launcher said between its attempts, as (time, line): each
    failed attempt that was followed by another, and each restart, so ``dtrain logs`` tells
    the story of a detached job (the last attempt's end is the job's, said after the lines)."""
    from launcher.core.policy import describe_status

    events: list[tuple[float, str]] = []
    entries = attempts_of(job)
    for number, entry in enumerate(entries):
        if number > 0 and isinstance(entry.get("started"), int | float):
            hosts = ", ".join(str(h) for h in entry.get("hosts", []))
            events.append(
                (
                    float(entry["started"]),
                    f"dtrain: restart {number}: {entry.get('world_size', '?')} ranks on {hosts}",
                )
            )
        ended, failure = entry.get("ended"), entry.get("failure")
        again = number + 1 < len(entries) or job.state() == "restarting"
        if again and isinstance(ended, int | float) and entry.get("exit_code"):
            what = f"exit code {entry['exit_code']}"
            if isinstance(failure, dict) and isinstance(failure.get("rank"), int):
                status = failure.get("status")
                cause = failure.get("cause") or (
                    describe_status(status) if isinstance(status, int) else "failed"
                )
                what = f"rank {failure['rank']} on {failure.get('host', '?')}: {cause}"
            events.append((float(ended), f"dtrain: attempt {number} failed ({what})"))
    return sorted(events)


def select_lines(
    job: JobDir,
    specs: Mapping[int, LaunchSpec],
    query: LogQuery,
    follow: bool,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[LogLine]:
    """The job's log lines that ``query`` selects, merged by time; with ``follow``, new
    ones until the job ends."""
    wanted = set(query.ranks) if query.ranks is not None else None
    if query.role is not None:
        by_role = {r for r, spec in specs.items() if spec.role == query.role}
        wanted = by_role if wanted is None else wanted & by_role
    try:
        matcher = re.compile(query.pattern.encode()) if query.pattern else None
    except re.error as exc:
        raise UsageError(
            f"--grep {query.pattern!r}: {exc}", "give a Python regular expression"
        ) from None
    cutoff = clock() - query.since_s if query.since_s is not None else None
    window = attempt_window(job, query.attempt) if query.attempt is not None else None
    reader = LogReader(job, wanted)
    while True:
        running = job.state() in ACTIVE
        for line in reader.read_new():
            if cutoff is not None and line.time < cutoff:
                continue
            if window is not None and not window[0] <= line.time < window[1]:
                continue
            if matcher is None or matcher.search(line.text):
                yield line
        if not (follow and running):
            return
        sleep(LOG_POLL_S)
