"""How dtrain reaches a host over SSH, before any socket: dtrain's ssh options
(``SshSettings``) and ``~/.ssh/config`` resolved into an ``SshTarget`` (HostName, Port,
User, IdentityFile, ProxyJump, known_hosts files), and ProxyJump's host lists."""

from __future__ import annotations

import getpass
import os
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from launcher.base.errors import HostConnectionError
from launcher.base.userfiles import TEXT_LIMIT, read_user_text
from launcher.core.hosts import Host
from launcher.transport.sshlib import paramiko

GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"  # ssh's defaults
DEFAULT_FANOUT = 32


@dataclass(frozen=True)
class SshSettings:
    """How dtrain reaches hosts: the ssh command-line options a user would give."""

    config_file: str | None = None  # None: ~/.ssh/config when it exists
    port: int | None = None
    identity: str | None = None
    timeout_s: float = 10.0
    accept_new_host_keys: bool = False
    fanout: int = DEFAULT_FANOUT


@dataclass(frozen=True)
class SshTarget:
    """A host as ssh would reach it, after ~/.ssh/config."""

    alias: str
    hostname: str
    port: int
    user: str
    identities: tuple[str, ...] = ()
    proxy_jump: str | None = None
    proxy_command: str | None = None
    known_hosts: tuple[str, ...] = ()  # the user's (UserKnownHostsFile): new keys go to the first
    global_known_hosts: tuple[str, ...] = ()  # the system's (GlobalKnownHostsFile), read only
    accept_new: bool = False


def load_ssh_config(settings: SshSettings) -> paramiko.SSHConfig:
    """``--ssh-config FILE`` (``/dev/null``: none, as ``ssh -F /dev/null``), else
    ``~/.ssh/config`` where there is one; each read as a file the user names (a regular file
    of at most 1 MiB: ``base/userfiles.py``)."""
    if settings.config_file:
        path = Path(settings.config_file).expanduser()
        text = read_user_text(str(path), "--ssh-config", TEXT_LIMIT, null_ok=True)
    else:
        path = Path("~/.ssh/config").expanduser()
        if not os.path.lexists(path):
            return paramiko.SSHConfig()
        text = read_user_text(str(path), "the ssh config", TEXT_LIMIT)
    try:
        return paramiko.SSHConfig.from_text(text)
    except (paramiko.SSHException, ValueError) as exc:
        raise HostConnectionError(
            f"{path}: cannot read the ssh config: {exc}", "fix the file"
        ) from None


# What paramiko's SSHConfig.lookup said for each name, per config: a lookup walks every Host
# block twice, each time asking the password database for the local user, so 64 hosts listed
# in one config took 120-250 ms of CPU, and the survey (locality) and connect_all both ask.
LOOKUPS: weakref.WeakKeyDictionary[paramiko.SSHConfig, dict[str, dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)
LOOKUPS_LOCK = threading.Lock()


def config_entry(config: paramiko.SSHConfig, name: str) -> dict[str, Any]:
    """``config.lookup(name)``, once per config and name (a copy: callers may change it)."""
    with LOOKUPS_LOCK:
        known = LOOKUPS.setdefault(config, {})
        entry = known.get(name)
    if entry is None:
        entry = dict(config.lookup(name))
        with LOOKUPS_LOCK:
            known[name] = entry
    return {k: list(v) if isinstance(v, list) else v for k, v in entry.items()}


def resolve_target(host: Host, settings: SshSettings, config: paramiko.SSHConfig) -> SshTarget:
    """Apply ~/.ssh/config (HostName, Port, User, IdentityFile, ProxyJump...) to a host."""
    entry = config_entry(config, host.name)
    identities = [settings.identity] if settings.identity else []
    identities += [str(Path(p).expanduser()) for p in entry.get("identityfile", [])]
    known = entry.get("userknownhostsfile", "~/.ssh/known_hosts ~/.ssh/known_hosts2")
    system = entry.get("globalknownhostsfile", GLOBAL_KNOWN_HOSTS)
    strict = str(entry.get("stricthostkeychecking", "")).lower()
    return SshTarget(
        alias=host.name,
        hostname=entry.get("hostname", host.name),
        port=settings.port or config_port(entry.get("port", "22"), host.name),
        user=host.user or entry.get("user") or getpass.getuser(),
        identities=tuple(identities),
        proxy_jump=entry.get("proxyjump"),
        proxy_command=entry.get("proxycommand"),
        known_hosts=tuple(str(Path(p).expanduser()) for p in known.split()),
        global_known_hosts=tuple(system.split()),
        accept_new=settings.accept_new_host_keys or strict in ("accept-new", "no", "off"),
    )


def config_port(text: str, host: str) -> int:
    if not str(text).isdigit() or not 0 < int(text) < 65536:
        raise HostConnectionError(
            f"{host}: Port {text!r} in the ssh config is not a port number",
            "fix the Port line of that host in the ssh config",
        )
    return int(text)


def split_host_port(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port`` or ``[v6]:port`` as in ssh's ProxyJump."""
    if text.startswith("["):
        address, _, rest = text[1:].partition("]")
        return address, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    name, _, port = text.partition(":")
    return name, int(port) if port.isdigit() else None


def jump_host(text: str, settings: SshSettings) -> tuple[Host, SshSettings]:
    """``[user@]host[:port]`` of a ProxyJump list."""
    user, _, address = text.strip().rpartition("@")
    name, port = split_host_port(address)
    return Host(name, user=user or None), replace(settings, port=port) if port else settings
