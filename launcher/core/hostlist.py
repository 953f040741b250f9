"""Slurm's host lists and count lists (pure): ``node[01-04,07]``, ``2(x3),1``.

The syntax, as Slurm defines it (``scontrol show hostnames`` expands the same way;
the tests compare the two over many generated lists):

* a list is tokens separated by commas outside brackets: ``a,b[1-2],c``;
* a token is text with bracket groups; a group holds comma-separated numbers and
  ranges ``lo-hi``; a range keeps the zero padding of its bounds (``[01-10]`` gives
  ``01`` ... ``10``); text may follow a group (``n[1-2]-ib``), and a token may have
  several groups (``rack[1-2]-node[01-02]``: the last group varies fastest);
* order is kept and nothing is de-duplicated.

A count list (``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_CPUS_PER_NODE``) is comma-separated
counts, each optionally repeated: ``2(x3),1`` is 2, 2, 2, 1.
"""

from __future__ import annotations

import re

from launcher.base.errors import HostfileError

MAX_EXPANDED = 1_000_000  # hosts one list may expand to: a typo must not eat the memory
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def split_top_level(text: str) -> list[str]:
    """``a,b[1,2],c`` -> ``["a", "b[1,2]", "c"]``: commas inside brackets do not split."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def expand_hostlist(text: str, source: str = "hostlist") -> list[str]:
    """Every host name of a Slurm host list, in order, repeats kept."""
    names: list[str] = []
    for token in split_top_level(text.strip()):
        token = token.strip()
        if not token:
            raise HostfileError(
                f"{source} {text!r}: empty item", "separate hosts with single commas"
            )
        names.extend(expand_token(token, source))
        if len(names) > MAX_EXPANDED:
            raise HostfileError(
                f"{source} {text!r}: more than {MAX_EXPANDED} hosts", "check the ranges"
            )
    return names


def expand_token(token: str, source: str = "hostlist") -> list[str]:
    """One token with zero or more bracket groups -> its names (last group fastest)."""
    parts: list[list[str]] = []  # alternatives for each piece of the token, in order
    rest = token
    while rest:
        opening = rest.find("[")
        closing = rest.find("]")
        if opening < 0:
            if closing >= 0:
                raise bad(token, source, "']' without '['")
            parts.append([rest])
            break
        if closing < opening:
            raise bad(token, source, "']' before '['" if closing >= 0 else "missing ']'")
        inner = rest[opening + 1 : closing]
        if "[" in inner:
            raise bad(token, source, "nested '['")
        parts.extend([[rest[:opening]], expand_group(inner, token, source)])
        rest = rest[closing + 1 :]
    names = [""]
    for choices in parts:
        names = [name + choice for name in names for choice in choices]
        if len(names) > MAX_EXPANDED:
            raise bad(token, source, f"more than {MAX_EXPANDED} hosts")
    return names


def expand_group(inner: str, token: str, source: str) -> list[str]:
    """The inside of one bracket group: ``01-04,07`` -> ``["01", "02", "03", "04", "07"]``."""
    if not inner:
        raise bad(token, source, "empty '[]'")
    values: list[str] = []
    for item in inner.split(","):
        found = _RANGE.fullmatch(item.strip())
        if not found:
            raise bad(token, source, f"{item!r} is not a number or a range like 1-4")
        low, high = found[1], found[2] if found[2] is not None else found[1]
        if int(high) < int(low):
            raise bad(token, source, f"range {item!r} goes down")
        if int(high) - int(low) >= MAX_EXPANDED:
            raise bad(token, source, f"range {item!r} has more than {MAX_EXPANDED} hosts")
        width = len(low) if low.startswith("0") and len(low) > 1 else 0
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return values


def bad(token: str, source: str, problem: str) -> HostfileError:
    return HostfileError(
        f"{source}: bad host range {token!r}: {problem}",
        "write ranges as Slurm does, e.g. 'node[01-04,07]'",
    )


def expand_counts(text: str, source: str = "count list") -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (Slurm's SLURM_TASKS_PER_NODE syntax)."""
    counts: list[int] = []
    for item in text.strip().split(","):
        found = _COUNT.fullmatch(item.strip())
        if not found:
            raise HostfileError(
                f"{source} {text!r}: bad item {item!r}", "write counts as Slurm does: 2(x3),1"
            )
        repeat = int(found[2]) if found[2] is not None else 1
        if repeat > MAX_EXPANDED or len(counts) + repeat > MAX_EXPANDED:
            raise HostfileError(f"{source} {text!r}: too many counts", "check the list")
        counts.extend([int(found[1])] * repeat)
    return counts
