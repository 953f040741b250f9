"""Which hosts are this machine (effects): decided by address, every name resolved at most
once, all of them at once, against one deadline.

A host is this machine when an address it stands for is one we can bind to (this network
namespace's).  The address comes from, in this order:

* the name itself, when it is an address (``10.0.0.7``, ``::1``), ``localhost`` or this
  machine's host name: no resolver is asked;
* else the ``HostName`` the SSH config gives for it (what ssh would connect to): names that
  only the SSH config knows never go to DNS, where one dropped query costs the resolver's
  timeout (5 s by default), once per host when asked one after another;
* else the resolver, for every such name at once (``base.parallel``): a name without an
  answer within ``RESOLVE_DEADLINE_S`` of the start is taken for another machine (its own
  machine's names are answered locally, from /etc/hosts or nss-myhostname, at once), and
  its SSH connection says what is wrong with it.

A name is resolved once per process: a second question about it (the plan, the survey, a
restart's survey) takes the first answer, or waits for the lookup still under way.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from launcher.base.parallel import run_parallel

RESOLVE_DEADLINE_S = 1.0  # for all the names of one question together
RESOLVE_FANOUT = 64  # lookups under way at once
LOCAL_NAMES = frozenset({"localhost"})  # (RFC 6761: always this machine)

Resolver = Callable[[str], Sequence[str]]  # a name -> its addresses (OSError: none)
HostNames = Callable[[Collection[str]], Mapping[str, str]]  # names -> the SSH config's HostName


def resolve_name(name: str) -> list[str]:
    """The addresses ``name`` resolves to (the system's resolver: /etc/hosts, DNS...)."""
    # An ASCII name as bytes: a str would be encoded by the idna codec (loading it).
    host = name.encode() if name.isascii() else name
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except UnicodeError as exc:
        raise OSError(f"{name}: {exc}") from None
    return [str(sockaddr[0]) for _, _, _, _, sockaddr in infos]


def is_address(text: str) -> bool:
    """Is ``text`` an IPv4 or IPv6 address, as written (no lookup)?"""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, text)
        except (OSError, ValueError):
            continue
        return True
    return False


def is_own_address(address: str) -> bool:
    """Can we bind to ``address``: is it this machine's (this network namespace's)?"""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address.split("%")[0], 0))
    except OSError:
        return False
    return True


class Lookup:
    """One name's resolution: under way until ``done`` is set; ``addresses`` then."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.addresses: tuple[str, ...] = ()


class Locality:
    """Decides which names are this machine; the resolver, the address check and the deadline
    come in as arguments (tests pass a resolver that counts and blocks)."""

    def __init__(
        self,
        resolve: Resolver = resolve_name,
        owns: Callable[[str], bool] = is_own_address,
        deadline_s: float = RESOLVE_DEADLINE_S,
        fanout: int = RESOLVE_FANOUT,
        hostname: Callable[[], str] = socket.gethostname,
    ) -> None:
        self.resolve = resolve
        self.owns = owns
        self.deadline_s = deadline_s
        self.fanout = fanout
        self.hostname = hostname
        self.lock = threading.Lock()
        self.lookups: dict[str, Lookup] = {}  # every name asked about, answered or not yet

    def decide(self, names: Iterable[str], host_names: HostNames | None = None) -> dict[str, bool]:
        """Which of ``names`` are this machine.  ``host_names`` gives the SSH config's
        HostName of the names not settled by themselves: asked once, only if any is left
        (a job on this machine alone never reads the SSH config)."""
        names = list(dict.fromkeys(names))
        local = {name: self.plainly_local(name) for name in names}
        left = [name for name, is_local in local.items() if is_local is None]
        configured = dict(host_names(left)) if left and host_names is not None else {}
        targets = {name: configured.get(name) or name for name in left}
        for name, target in targets.items():
            if target != name:
                local[name] = self.plainly_local(target)
        unresolved = [t for n, t in targets.items() if local[n] is None]
        found = self.addresses(unresolved)
        for name, target in targets.items():
            if local[name] is None:
                local[name] = any(self.owns(a) for a in found.get(target, ()))
        return {name: bool(is_local) for name, is_local in local.items()}

    def is_local(self, name: str) -> bool:
        return self.decide([name])[name]

    def plainly_local(self, name: str) -> bool | None:
        """What the name says by itself, without a resolver (None: it does not say)."""
        if is_address(name):
            return self.owns(name)
        if name.lower() in LOCAL_NAMES or name == self.hostname():
            return True
        return None

    def addresses(self, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Each name's addresses, looked up in parallel (each name once per process); a name
        not answered within the deadline, or not resolved, has none."""
        if not names:
            return {}
        found = run_parallel(list(dict.fromkeys(names)), self.lookup, self.fanout, self.deadline_s)
        return {n: () if isinstance(a, BaseException) else a for n, a in found.items()}

    def lookup(self, name: str) -> tuple[str, ...]:
        """The name's addresses: resolved here if nobody asked before, else the earlier
        lookup's answer (waited for while it is under way)."""
        with self.lock:
            known = self.lookups.get(name)
            if known is None:
                known = self.lookups[name] = Lookup()
                ours = True
            else:
                ours = False
        if not ours:
            known.done.wait()
            return known.addresses
        try:
            known.addresses = tuple(self.resolve(name))
        except OSError:
            known.addresses = ()
        finally:
            known.done.set()
        return known.addresses


LOCALITY = Locality()  # this process's: what it resolved, it keeps


def is_local_address(name: str) -> bool:
    """True when ``name`` is an address of this machine, or resolves to one (by address,
    not by name: an address is ours when we can bind to it)."""
    return LOCALITY.is_local(name)


def local_names(names: Iterable[str], host_names: HostNames | None = None) -> dict[str, bool]:
    """``Locality.decide`` with this process's resolutions."""
    return LOCALITY.decide(names, host_names)
