"""Hostfiles and host lists -> ``Host`` records (pure: no I/O).

Formats accepted (see hostfiles/ for commented examples):

* Open MPI / DeepSpeed: ``node1 slots=4 max_slots=8``
* Horovod / MPICH: ``node1:4``
* a bare host on one line of a hostfile, or ``node1:*``: slots counted on the host when the
  job starts (its GPUs, else its CPUs; Open MPI counts its cores); a bare ``-H`` item is 1
* one host per line; a host listed again adds its slots, 1 for a bare line (``-H a:2,a`` is 3,
  as in Open MPI)
* ``max_slots`` alone sets the slots to it (``a max_slots=4`` is 4 slots, as in Open MPI)
* ``user@host``, IPv6 addresses in brackets (``[fe80::1]:4``)
* an optional ``gpus=0,1,2,3`` per host
* Slurm's host ranges: ``node[01-04,07]:8``, ``rack[1-2]-node[1-4] slots=4``

Both parsers share one entry parser (``_parse_entry``) and one merge step
(``_merge_entries``); they differ only in how they cut their input into entries
and in how an error names its place (``hosts:3: 'line'`` or ``-H 'item'``).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, replace
from typing import Literal

from launcher.base.errors import HostfileError
from launcher.core.hostlist import check_host_total, expand_hostlist, split_top_level


@dataclass(frozen=True)
class Host:
    """One machine and how many ranks it may take."""

    name: str  # hostname or address as written, brackets and user stripped
    slots: int = 1
    max_slots: int | None = None  # None: no cap when oversubscribing
    user: str | None = None
    gpus: tuple[str, ...] | None = None  # explicit GPU ids from the hostfile
    # Counted on the host when the job starts (its GPUs, else its CPUs): a bare hostfile line,
    # or ``host:*``.  ``slots`` is 1 until then.
    slots_on_host: bool = False

    @property
    def ssh_target(self) -> str:
        """``user@name`` as ssh expects it (no brackets, no slots)."""
        return f"{self.user}@{self.name}" if self.user else self.name


MAX_COUNT = 100_000  # more slots than any machine has; also keeps int() cheap
MAX_HOSTNAME_CHARS = 253  # DNS limits
MAX_LABEL_CHARS = 63

# ASCII classes spelled out: \w and \d would let in Unicode letters and digits.
# The first character may not be '-', so that a name never reads as an ssh option.
_HOSTNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?")
_GPU_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_DIGITS = re.compile(r"[0-9]+")
_KEYS = {"slots": "slots", "max_slots": "max_slots", "max-slots": "max_slots", "gpus": "gpus"}
_QUOTE_CHARS = 60


@dataclass(frozen=True)
class _Entry:
    """One parsed line or item, with what the merge step needs to know."""

    host: Host
    simple: bool  # a name and slots only: repeating it adds up
    where: str  # "hosts:3: 'line'" or "-H 'item'", for error messages


def parse_hostfile(
    text: str, source: str = "<hostfile>", *, bare_on_host: bool = True
) -> list[Host]:
    """Parse a hostfile; ``source`` names it in errors (``hosts:3: ...``).

    Each line is ``[user@]host[:slots] [key=value ...]`` with keys ``slots``,
    ``max_slots`` (or ``max-slots``) and ``gpus``; ``#`` starts a comment.  A host on one
    bare line has its slots counted on the host (Open MPI's rule) unless ``bare_on_host``
    is false (a discovery script's lines: 1 slot, and no ``host:*``).
    """
    counted: Counted = "bare" if bare_on_host else "never"
    entries = []
    # split on "\n" only, so line numbers match what an editor shows
    for number, line in enumerate(text.split("\n"), start=1):
        content = line.split("#", 1)[0].strip()
        if content:
            address, *options = content.split()
            where = f"{source}:{number}: {_quote(content)}"
            entries.extend(_parse_entries(address, options, where, counted))
            check_host_total(len(entries), source)
    if not entries:
        raise HostfileError(
            f"{source}: no hosts",
            "add one host per line, e.g. 'node1 slots=4'; hostfiles/ has examples",
        )
    return _merge_entries(entries)


def parse_host_list(spec: str, source: str = "-H") -> list[Host]:
    """Parse a comma-separated host list such as ``node1:4,node2:4`` or ``a,a,b``."""
    if not spec.strip():
        raise HostfileError(f"{source}: no hosts", "give hosts like 'node1:4,node2:4'")
    entries = []
    for index, raw_item in enumerate(split_top_level(spec), start=1):
        item = raw_item.strip()
        if not item:
            raise HostfileError(
                f"{source} {_quote(spec)}: item {index} is empty",
                "separate hosts with single commas, e.g. 'node1:4,node2:4'",
            )
        entries.extend(_parse_entries(item, [], f"{source} {_quote(item)}", "star"))
        check_host_total(len(entries), source)
    return _merge_entries(entries)


# Which entries have their slots counted on the host: "bare" (a hostfile's: a bare line, or
# ``host:*``), "star" (-H's: ``host:*`` only, a bare item is 1 slot as in Open MPI) or "never".
Counted = Literal["bare", "star", "never"]


def _parse_entries(address: str, options: list[str], where: str, counted: Counted) -> list[_Entry]:
    """One item, or one per host of a Slurm range (``node[01-04]:8``: four hosts of 8)."""
    user, at, rest = address.rpartition("@")
    if "[" not in rest or rest.startswith("["):  # no range (brackets first: IPv6)
        return [_parse_entry(address, options, where, counted)]
    last = rest.rfind("]")
    names, slots = rest[: last + 1], rest[last + 1 :]
    if slots and not slots.startswith(":"):
        names, slots = rest, ""
    return [
        _parse_entry(f"{user}{at}{name}{slots}", options, where, counted)
        for name in expand_hostlist(names, source=where)
    ]


def _parse_entry(address: str, options: list[str], where: str, counted: Counted) -> _Entry:
    """``[user@]host[:slots]`` plus ``key=value`` options -> one entry."""
    user, name, colon_slots = _split_address(address, where)
    shown = f"[{name}]" if ":" in name else name
    values = _parse_options(options, where, shown)
    if colon_slots == "*" and counted != "never":  # mpirun's "the host's cores": counted there
        return _counted_entry(Host(name=name, user=user, slots_on_host=True), values, where)
    if counted == "bare" and colon_slots is None and not values:
        host = Host(name=name, user=user, slots_on_host=True)
        return _Entry(host, simple=True, where=where)  # listed again: 1 slot a line
    if colon_slots is not None and "slots" in values:
        raise HostfileError(
            f"{where}: slots given twice, as {_quote(':' + colon_slots)} and as 'slots='",
            f"keep one of them, e.g. '{shown} slots=4'",
        )
    gpus = _parse_gpus(values["gpus"], where) if "gpus" in values else None
    max_slots = None
    if "max_slots" in values:
        max_slots = _parse_count("max_slots", values["max_slots"], where, f"{shown} max_slots=8")
    if colon_slots is not None:
        slots = _parse_count("slots", colon_slots, where, f"{shown}:4")
    elif "slots" in values:
        slots = _parse_count("slots", values["slots"], where, f"{shown} slots=4")
    else:  # one rank per listed GPU, else up to the limit (Open MPI's rule), else one
        slots = len(gpus) if gpus else max_slots or 1
    if max_slots is not None and max_slots < slots:
        raise HostfileError(
            f"{where}: max_slots ({max_slots}) is less than slots ({slots})",
            "raise max_slots to at least slots, or lower slots",
        )
    host = Host(name=name, slots=slots, max_slots=max_slots, user=user, gpus=gpus)
    return _Entry(host, simple=not (values.keys() - {"slots"}), where=where)


def _counted_entry(host: Host, values: dict[str, str], where: str) -> _Entry:
    """``host:*``: alone on its line (its count is the host's own), where that is allowed."""
    if values:
        raise HostfileError(
            f"{where}: ':*' (slots counted on the host) with {', '.join(values)}",
            f"write '{host.name}:*' alone, or give the numbers, e.g. '{host.name} slots=4'",
        )
    return _Entry(host, simple=False, where=where)


def _split_address(address: str, where: str) -> tuple[str | None, str, str | None]:
    """``[user@]host[:slots]`` -> (user, name, slots text or None); validates user and name."""
    user, at, rest = address.rpartition("@")
    if at and not _USER.fullmatch(user):
        problem = "empty user before '@'" if not user else f"invalid user name {_quote(user)}"
        raise HostfileError(
            f"{where}: {problem}", "write 'user@host' with letters, digits, '.', '_' or '-'"
        )
    if rest.startswith("["):
        name, bracket, after = rest[1:].partition("]")
        if not bracket:
            raise HostfileError(f"{where}: missing ']'", "write IPv6 addresses as '[fe80::1]:4'")
        if after and not after.startswith(":"):
            raise HostfileError(
                f"{where}: unexpected {_quote(after)} after ']'",
                "write IPv6 addresses as '[fe80::1]:4'",
            )
        _check_ipv6(name, where)
        return user or None, name, after[1:] if after else None
    if rest.count(":") > 1:
        raise HostfileError(
            f"{where}: more than one ':' in {_quote(rest)}",
            "put IPv6 addresses in brackets, e.g. '[fe80::1]:4'; otherwise write 'host:slots'",
        )
    name, colon, slots = rest.partition(":")
    _check_hostname(name, where)
    return user or None, name, slots if colon else None


def _check_hostname(name: str, where: str) -> None:
    if not name:
        raise HostfileError(f"{where}: no host name", "write e.g. 'node1' or 'user@node1:4'")
    if len(name) > MAX_HOSTNAME_CHARS:
        raise HostfileError(
            f"{where}: host name {_quote(name)} is longer than {MAX_HOSTNAME_CHARS} characters",
            "check the name (DNS names have at most 253 characters)",
        )
    if not _HOSTNAME.fullmatch(name):
        raise HostfileError(
            f"{where}: invalid host name {_quote(name)}",
            "use letters, digits, '.', '-' or '_'; put IPv6 addresses in brackets",
        )
    labels = name.removesuffix(".").split(".")  # one trailing dot (fully qualified) is allowed
    if any(not label or len(label) > MAX_LABEL_CHARS for label in labels):
        raise HostfileError(
            f"{where}: invalid host name {_quote(name)}: empty or over-long part between dots",
            "write e.g. 'node1' or 'node1.cluster.example'",
        )
    if re.fullmatch(r"[0-9.]+", name) and not _is_ip(name, ipaddress.IPv4Address):
        raise HostfileError(
            f"{where}: invalid IPv4 address {_quote(name)}",
            "write four numbers 0-255, e.g. '10.0.0.1'",
        )


def _check_ipv6(name: str, where: str) -> None:
    if not name:
        raise HostfileError(f"{where}: no address inside '[]'", "write e.g. '[fe80::1]:4'")
    if not (_IPV6.fullmatch(name) and _is_ip(name, ipaddress.IPv6Address)):
        raise HostfileError(
            f"{where}: invalid IPv6 address {_quote(name)}",
            "brackets are for IPv6 addresses only, e.g. '[fe80::1]:4'; write names without them",
        )


def _is_ip(text: str, kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def _parse_options(tokens: list[str], where: str, shown: str) -> dict[str, str]:
    """``key=value`` tokens -> {canonical key: value}, rejecting unknown and repeated keys."""
    values: dict[str, str] = {}
    for token in tokens:
        key, equals, value = token.partition("=")
        if not equals:
            raise HostfileError(
                f"{where}: expected key=value after the host, got {_quote(token)}",
                f"write options as key=value without spaces, e.g. '{shown} slots=4'",
            )
        canonical = _KEYS.get(key)
        if canonical is None:
            raise HostfileError(
                f"{where}: unknown key {_quote(key)}; allowed: {', '.join(_KEYS)}",
                f"write e.g. '{shown} slots=4 max_slots=8 gpus=0,1'",
            )
        if canonical in values:
            raise HostfileError(f"{where}: {canonical} given twice", "keep one of them")
        values[canonical] = value
    return values


def _parse_count(key: str, text: str, where: str, example: str) -> int:
    """A positive decimal integer: no sign, no fraction, ASCII digits only."""
    if not _DIGITS.fullmatch(text) or not text.strip("0"):
        raise HostfileError(f"{where}: {key} must be a positive integer", f"write e.g. '{example}'")
    if len(text.lstrip("0")) > len(str(MAX_COUNT)) or int(text) > MAX_COUNT:
        raise HostfileError(f"{where}: {key} is larger than {MAX_COUNT}", "give a smaller number")
    return int(text)


def _parse_gpus(text: str, where: str) -> tuple[str, ...]:
    """``0,1,2`` or ``GPU-<uuid>,...`` -> ids as written; no empty or repeated ids."""
    hint = "write GPU indexes or UUIDs separated by commas, e.g. 'gpus=0,1,2,3'"
    ids = tuple(text.split(","))
    seen: set[str] = set()
    for gpu in ids:
        if not gpu:
            raise HostfileError(f"{where}: empty GPU id in gpus={_quote(text)}", hint)
        if not _GPU_ID.fullmatch(gpu):
            raise HostfileError(f"{where}: invalid GPU id {_quote(gpu)}", hint)
        if gpu in seen:
            raise HostfileError(f"{where}: GPU id {_quote(gpu)} listed twice", "list each GPU once")
        seen.add(gpu)
    return ids


def _merge_entries(entries: list[_Entry]) -> list[Host]:
    """Add up the slots of a repeated host (as Open MPI does); a repeat with max_slots or gpus
    is refused, since those cannot add up.  Keeps first-appearance order."""
    first: dict[tuple[str | None, str], _Entry] = {}
    hosts: dict[tuple[str | None, str], Host] = {}
    for entry in entries:
        key = (entry.host.user, _identity(entry.host.name))
        if key not in first:
            first[key], hosts[key] = entry, entry.host
        elif entry.simple and first[key].simple:  # a bare line adds 1 (as in Open MPI)
            slots = hosts[key].slots + entry.host.slots
            hosts[key] = replace(hosts[key], slots=slots, slots_on_host=False)
        else:
            raise HostfileError(
                f"{entry.where}: host {_quote(entry.host.name)} is listed twice"
                f" (first at {first[key].where}), with max_slots, gpus or ':*'",
                "list the host once with all its slots, max_slots and gpus",
            )
    return list(hosts.values())


def _identity(name: str) -> str:
    """Names that reach the same machine: hostnames ignore case, IPv6 is canonical."""
    return str(ipaddress.IPv6Address(name)) if ":" in name else name.lower()


def _quote(text: str) -> str:
    """``repr`` of user text, cut short so one huge line cannot flood the terminal."""
    if len(text) > _QUOTE_CHARS:
        text = text[:_QUOTE_CHARS] + "..."
    return repr(text)


def check_host_name(name: str, where: str) -> None:
    """A host name, or an IPv4 or IPv6 address without brackets, checked as -H checks them
    (for names that come from elsewhere: --master-addr, SLURM_JOB_NODELIST)."""
    if ":" in name:
        _check_ipv6(name, where)
    else:
        _check_hostname(name, where)
