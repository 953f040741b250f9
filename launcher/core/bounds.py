"""The bounds of what a user may ask for (pure): counts, durations, names passed on.

A number a user types turns into work: ranks are processes, hosts are connections,
GPUs per rank are ids dealt out, seconds are waits handed to the operating system.
Each bound here is far beyond any real job and low enough that a typo
(``-np 100000000``, ``--grace 1e12``, ``h[1-1000][1-1000]``) is refused in
milliseconds instead of planning for minutes, eating the memory or overflowing
a wait.  ``validate_config`` applies them to a whole config, so the Python API and
``--detach``'s JSON get the same checks as the command line; the edge's option
types apply them too, so that a bad value is named as the option that gave it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from launcher.base.errors import PlanError, UsageError

# Every rank is a process dtrain starts, watches and lists in the plan (a dry run of 10,000
# ranks takes about 2 s), and the largest GPU clusters built have about 100,000 GPUs.
MAX_RANKS = 100_000
# Every host is an ssh connection or an srun step, and a list's hosts are parsed one by one
# (100,000 in about 2 s): beyond this a host list is a typo, however its ranges multiply.
MAX_HOSTS = 100_000
MAX_GPUS_PER_RANK = 1024  # more GPUs than one machine has
# A year: longer than any job, far below what the OS's waits take (threading.TIMEOUT_MAX,
# about 292 years; a larger timeout raises OverflowError in the middle of a teardown).
MAX_SECONDS = 365 * 24 * 3600.0
MAX_PORT = 65535
MAX_RESTARTS = 1_000_000  # no job restarts that often: a larger count is a typo
MAX_TRIALS = 100_000  # a sweep's trials: each is a job with a directory of its own
# ASCII digits only: str.isdigit() says yes to '²', which int() then refuses.
DIGITS = re.compile(r"[0-9]+")
# Interface names as distributions make them (eth0, enp3s0f1, ib0, bond0.100, br-1a2b): Linux
# allows 1-15 bytes without '/', ':' or white space; ';', '$' and the like it allows too, but
# only a typo or an injection would put them there.
INTERFACE = re.compile(r"[A-Za-z0-9_.-]{1,15}")


def check_count(flag: str, value: int | None, low: int, high: int) -> None:
    """``value`` (None: not given) lies in [low, high]; else one line naming ``flag``."""
    if value is None:
        return
    if value < low:
        raise UsageError(f"{flag} {value}: must be at least {low}", f"give {flag} {low} or more")
    if value > high:
        raise UsageError(f"{flag} {value}: more than {high:,}", f"give {flag} {high} or less")


def parse_count(flag: str, text: str, high: int) -> int | None:
    """``text`` as a positive count of at most ``high`` (None: not a count at all, so the
    caller can try its words, e.g. ``auto``); too large or zero: one line naming ``flag``."""
    text = text.strip()
    if not DIGITS.fullmatch(text):
        return None
    if len(text.lstrip("0")) > len(str(high)):  # before int(): a 5,000-digit number
        shown = text if len(text) <= 20 else text[:20] + "..."
        raise UsageError(f"{flag} {shown}: more than {high:,}", f"give {flag} {high} or less")
    check_count(flag, int(text), 1, high)
    return int(text)


def check_interfaces(flag: str, text: str | None) -> None:
    """``--network-interface``: one interface name, or several separated by commas (gloo and
    horovodrun take lists), each as Linux names interfaces."""
    if text is None:
        return
    for name in text.split(","):
        if not INTERFACE.fullmatch(name) or name in (".", ".."):
            shown = repr(name) if name else "an empty name"
            raise UsageError(
                f"{flag} {text!r}: {shown} is not a network interface name",
                "give names as 'ip link' shows them (1-15 letters, digits, '.', '-', '_'), "
                "several separated by commas, e.g. eth0 or ib0,ib1",
            )


def check_total(flag: str, counts: Iterable[int], high: int, what: str) -> None:
    """Counts that add up to one job (workers and ps tasks): at most ``high`` together."""
    total = sum(counts)
    if total > high:
        raise UsageError(
            f"{flag}: {total:,} {what} in all, more than {high:,}", f"give at most {high:,} {what}"
        )


def check_world_size(ranks: int) -> None:
    """A plan's size, known once the hosts are (every slot of ``-H h[1-3]:100000``, or
    ``--nproc-per-node`` on every host): at most MAX_RANKS, checked before any rank is made."""
    if ranks > MAX_RANKS:
        raise PlanError(
            f"{ranks:,} ranks: more than {MAX_RANKS:,}",
            "give -np, a smaller --nproc-per-node, or fewer slots",
        )
