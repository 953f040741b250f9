"""``dtrain check --network`` as values: who sends to whom, the units of a rate, and the rule
that names slow hosts and pairs (pure: the figures in, the verdict out).

Each host sends to one peer and receives from another at a time (rounds of a ring shift),
so no NIC carries two measurements in one direction at once.  A host's figure in each
direction is its best pair: a slow peer drags one pair down, a slow host every pair it is
in.  The median is taken over every host's two figures, so one slow host out of three
does not move it.  A host is named when a direction of it is below the bar (half that
median, or ``--min-bandwidth``), a pair when it is below the bar and neither end explains
it; with fewer than three hosts there is no median to trust, and only a floor names.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from launcher.base.errors import UsageError

MOST_ROUNDS = 3  # enough to tell a slow host (every pair) from a slow pair (one)
FEWEST_FOR_MEDIAN = 3
RATE_TEXT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)(/s)?\s*")
PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
BINARY_PREFIXES = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
RATE_HINT = "write bits per second as 1Gbit or 500Mbit, bytes per second as 100MB or 1.5GB"


def ring_rounds(count: int, most: int = MOST_ROUNDS) -> list[list[tuple[int, int]]]:
    """``(sender, receiver)`` indexes, round by round: in round k host i sends to host
    (i+k) mod count; min(count-1, most) rounds."""
    return [[(i, (i + k) % count) for i in range(count)] for k in range(1, min(count, most + 1))]


def one_each_way(pairs: Sequence[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """``(sender, receiver)`` pairs in rounds where a host sends at most once and receives at
    most once (the transfers made again), in their order, each in the first round it fits."""
    rounds: list[list[tuple[str, str]]] = []
    for sender, receiver in pairs:
        for shift in rounds:
            if all(sender != s and receiver != r for s, r in shift):
                shift.append((sender, receiver))
                break
        else:
            rounds.append([(sender, receiver)])
    return rounds


def parse_rate(text: str) -> float:
    """``1Gbit``, ``500Mbit/s``, ``10Gbps`` (bits), ``100MB``, ``1.5GB/s``, ``800MiB`` (bytes)
    -> bytes per second.  Decimal prefixes (M = 10**6) unless binary (Mi); a bare ``b`` (100Mb)
    is refused: bits or bytes is the whole question."""
    found = RATE_TEXT.fullmatch(text)
    if found is None:
        raise UsageError(f"--min-bandwidth {text!r}: not a rate", RATE_HINT)
    number, unit = float(found.group(1)), found.group(2)
    lower = unit.lower()
    if lower.endswith(("bit", "bps")):
        prefix, divisor = lower[:-3], 8.0
    elif unit.endswith("B"):
        prefix, divisor = lower[:-1], 1.0
    else:
        raise UsageError(f"--min-bandwidth {text!r}: {unit!r} is not a unit of rate", RATE_HINT)
    factor = PREFIXES.get(prefix) or BINARY_PREFIXES.get(prefix)
    if factor is None:
        raise UsageError(f"--min-bandwidth {text!r}: {unit!r} is not a unit of rate", RATE_HINT)
    rate = number * factor / divisor
    if not math.isfinite(rate) or rate <= 0:
        raise UsageError(f"--min-bandwidth {text!r}: must be more than 0", RATE_HINT)
    return rate


def format_rate(bytes_per_s: float) -> str:
    """``6.1 MB/s``, ``1.25 GB/s`` (decimal, as network figures are given)."""
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= size:
            value = bytes_per_s / size
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


@dataclass(frozen=True)
class PairFigure:
    """One measured pair: ``sender`` to ``receiver``, or why it could not be measured."""

    sender: str
    receiver: str
    bytes_per_s: float | None = None
    rtt_ms: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class HostSeen:
    """A host of the check: where it listened, or why it took no part."""

    name: str
    address: str | None = None
    interface: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class HostFigure:
    name: str
    address: str | None
    interface: str | None
    out_bytes_per_s: float | None  # its best send
    in_bytes_per_s: float | None  # its best receive
    rtt_ms: float | None  # the median round trip of its pairs
    error: str | None
    slow: tuple[str, ...] = ()  # "in", "out": the directions below the bar


@dataclass(frozen=True)
class NetVerdict:
    hosts: tuple[HostFigure, ...]
    pairs: tuple[PairFigure, ...]
    median_bytes_per_s: float | None
    bar_bytes_per_s: float | None  # below it a host or pair is named; None: none is
    bar: str  # "half the median", "--min-bandwidth 1 Gbit/s", or why nothing is named
    named: tuple[str, ...] = field(default=())  # one line per slow host or pair
    slow_pairs: tuple[PairFigure, ...] = field(default=())  # slow, and no slow host explains it
    failures: tuple[str, ...] = field(default=())  # hosts and pairs that could not be measured

    @property
    def ok(self) -> bool:
        return not self.named and not self.failures


def best(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def judge(
    hosts: Sequence[HostSeen], pairs: Sequence[PairFigure], floor: float | None = None
) -> NetVerdict:
    """The verdict on the figures (``floor``: --min-bandwidth, bytes per second)."""
    figures = [host_figure(host, pairs) for host in hosts]
    measured = [f for f in figures if f.error is None]
    directions = [v for f in measured for v in (f.out_bytes_per_s, f.in_bytes_per_s) if v]
    median = statistics.median(directions) if directions else None
    if floor is not None:
        bar, why = floor, f"--min-bandwidth {format_rate(floor)}"
    elif median is not None and len(measured) >= FEWEST_FOR_MEDIAN:
        bar, why = median / 2, "half the median"
    else:
        bar, why = None, f"nothing named: a median needs {FEWEST_FOR_MEDIAN} hosts measured"
    figures = [mark_slow(f, bar) for f in figures]
    slow = {f.name: f.slow for f in figures}
    named = [host_line(f, median, why) for f in figures if f.slow]
    slow_pairs = [
        pair
        for pair in pairs
        if bar is not None
        and pair.bytes_per_s is not None
        and pair.bytes_per_s < bar
        and "out" not in slow.get(pair.sender, ())
        and "in" not in slow.get(pair.receiver, ())
    ]
    for pair in slow_pairs:
        named.append(
            f"dtrain: {pair.sender} -> {pair.receiver} is slow: {rate_of(pair)}"
            + (f", median {format_rate(median)}" if median else "")
            + f" (below {why})"
        )
    return NetVerdict(
        hosts=tuple(figures),
        pairs=tuple(pairs),
        median_bytes_per_s=median,
        bar_bytes_per_s=bar,
        bar=why,
        named=tuple(named),
        slow_pairs=tuple(slow_pairs),
        failures=tuple(failure_lines(hosts, pairs)),
    )


def rate_of(pair: PairFigure) -> str:
    return "-" if pair.bytes_per_s is None else format_rate(pair.bytes_per_s)


def host_figure(host: HostSeen, pairs: Sequence[PairFigure]) -> HostFigure:
    mine = [p for p in pairs if host.name in (p.sender, p.receiver)]
    trips = [p.rtt_ms for p in mine if p.rtt_ms is not None]
    return HostFigure(
        name=host.name,
        address=host.address,
        interface=host.interface,
        out_bytes_per_s=best([p.bytes_per_s for p in mine if p.sender == host.name]),
        in_bytes_per_s=best([p.bytes_per_s for p in mine if p.receiver == host.name]),
        rtt_ms=statistics.median(trips) if trips else None,
        error=host.error,
    )


def mark_slow(figure: HostFigure, bar: float | None) -> HostFigure:
    if bar is None or figure.error is not None:
        return figure
    directions = (("in", figure.in_bytes_per_s), ("out", figure.out_bytes_per_s))
    slow = tuple(name for name, rate in directions if rate is not None and rate < bar)
    return HostFigure(**{**figure.__dict__, "slow": slow})


def host_line(figure: HostFigure, median: float | None, why: str) -> str:
    def rate(value: float | None) -> str:
        return "-" if value is None else format_rate(value)

    shown = f"{rate(figure.in_bytes_per_s)} in, {rate(figure.out_bytes_per_s)} out"
    middle = f", median {format_rate(median)}" if median else ""
    return f"dtrain: {figure.name} is slow: {shown}{middle} (below {why})"


def failure_lines(hosts: Sequence[HostSeen], pairs: Sequence[PairFigure]) -> list[str]:
    """A host that took no part, and a pair between two that did which could not be measured
    (a firewall, a wrong route): the pairs of a failed host are its failure, not theirs."""
    failed = {h.name for h in hosts if h.error is not None}
    lines = [f"dtrain: {h.name}: {h.error}" for h in hosts if h.error is not None]
    for pair in pairs:
        if pair.error and not {pair.sender, pair.receiver} & failed:
            lines.append(f"dtrain: {pair.sender} -> {pair.receiver}: {pair.error}")
    return lines


def better(first: PairFigure, again: PairFigure) -> PairFigure:
    """Of two measurements of a pair, the faster (a measured one over an error)."""
    if again.bytes_per_s is None:
        return first
    if first.bytes_per_s is None or again.bytes_per_s > first.bytes_per_s:
        return PairFigure(first.sender, first.receiver, again.bytes_per_s, first.rtt_ms)
    return first


def pair_from(
    sender: str,
    receiver: str,
    trip: Mapping[str, object] | None,
    sent: Mapping[str, object] | None,
    got: Mapping[str, object] | None,
) -> PairFigure:
    """A pair from what its sender said of its round trips (``rtt_ms``) and of its transfer,
    and its receiver of what arrived (``bytes`` in ``seconds``); each may carry an ``error``
    or be missing (no answer in time)."""
    rtt = (trip or {}).get("rtt_ms")
    rtt_ms = float(rtt) if isinstance(rtt, int | float) else None
    said = [(trip, "round trips"), (sent, "transfer"), (got, "transfer")]
    for answer, what in said:
        if answer is None:
            return PairFigure(sender, receiver, None, rtt_ms, f"no answer about its {what} in time")
        if answer.get("error"):
            return PairFigure(sender, receiver, None, rtt_ms, str(answer["error"]))
    count, seconds = (got or {}).get("bytes"), (got or {}).get("seconds")
    if not isinstance(count, int) or not isinstance(seconds, int | float) or seconds <= 0:
        return PairFigure(sender, receiver, None, rtt_ms, "too little arrived to measure")
    return PairFigure(sender, receiver, count / seconds, rtt_ms)


@dataclass(frozen=True)
class AllreduceOutcome:
    """The allreduce over every host: ``done`` with its figures, ``skipped`` (no torch
    there, or --no-allreduce) or ``failed``, with why."""

    state: str
    reason: str | None = None
    backend: str | None = None
    hosts: int | None = None
    bytes: int | None = None
    seconds: float | None = None
    algbw_bytes_per_s: float | None = None
    busbw_bytes_per_s: float | None = None


@dataclass(frozen=True)
class NetReport:
    verdict: NetVerdict
    allreduce: AllreduceOutcome
    bulk_s: float  # each pair's transfer, about
    refused: Mapping[str, int] = field(default_factory=dict)  # connections without the token

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.allreduce.state != "failed"
