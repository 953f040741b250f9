"""Ranks on other machines, over SSH with paramiko (imported only when a host is remote).

One connection per host, opened in parallel before any rank starts, and on
it one channel running dtrain's agent (``launcher/remote/agent.py``, sent as text):
it probes the host, then starts each rank of the host under a watchdog and
multiplexes their output back.  When the channel ends, or the launcher
stops sending heartbeats, every watchdog ends its rank; signals travel as
frames (SSH itself cannot deliver them).
"""

from __future__ import annotations

import errno
import getpass
import json
import logging
import queue
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher import remote
from launcher.base.errors import HostConnectionError
from launcher.base.log import LOG
from launcher.base.parallel import run_parallel
from launcher.core.command import LaunchSpec, build_remote_command
from launcher.core.hosts import Host
from launcher.core.outcome import STREAMS
from launcher.remote import agent, watchdog
from launcher.transport.base import RankFeed, Stream
from launcher.transport.feeds import Pump
from launcher.transport.sshlib import paramiko

# paramiko logs its own tracebacks on failed connections; dtrain reports them in one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

KEEPALIVE_S = 15
GLOBAL_KNOWN_HOSTS = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"  # ssh's defaults
DEFAULT_FANOUT = 32
HEARTBEAT_S = 5.0  # at most; both ends beat at least 4 times per host timeout
DEFAULT_HOST_TIMEOUT_S = 30.0  # an agent silent this long is a lost host
MAX_PREAMBLE_BYTES = 1 << 20  # what a login shell may print before the agent's frames
TCP_USER_TIMEOUT_MS = 30_000  # a host that stops acknowledging is given up after this
WATCHDOG_SOURCE = remote.source("watchdog")
PROBE_SOURCE = remote.source("probe")
AGENT_SOURCE = remote.source("agent").encode()


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
    path = Path(settings.config_file or "~/.ssh/config").expanduser()
    if settings.config_file and not path.is_file():
        raise HostConnectionError(
            f"--ssh-config {settings.config_file}: no such file", "check the path"
        )
    if not path.is_file():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except (OSError, paramiko.SSHException, ValueError) as exc:
        raise HostConnectionError(
            f"{path}: cannot read the ssh config: {exc}", "fix the file"
        ) from None


def resolve_target(host: Host, settings: SshSettings, config: paramiko.SSHConfig) -> SshTarget:
    """Apply ~/.ssh/config (HostName, Port, User, IdentityFile, ProxyJump...) to a host."""
    entry: dict[str, Any] = dict(config.lookup(host.name))
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


class UnknownHostKeyError(paramiko.SSHException):
    def __init__(self, hostname: str) -> None:
        super().__init__(hostname)
        self.hostname = hostname


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown keys are refused, or (trust on first use) recorded in known_hosts."""

    def __init__(self, target: SshTarget) -> None:
        self.target = target

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if not self.target.accept_new:
            raise UnknownHostKeyError(hostname)
        client.get_host_keys().add(hostname, key.get_name(), key)
        path = Path(self.target.known_hosts[0] if self.target.known_hosts else "~/.ssh/known_hosts")
        path = path.expanduser()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path, "a", encoding="ascii") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


@dataclass
class SshConnection:
    host: Host
    target: SshTarget
    client: paramiko.SSHClient
    jump: SshConnection | None = None
    peer_address: str = ""
    local_address: str = ""

    def agent_failed(self, last: str) -> HostConnectionError:
        """The error for an agent that ended before its probe report (``last``: its stderr's
        last line)."""
        return HostConnectionError(
            f"{self.host.name}: cannot run Python there ({last})",
            "install python3 (3.9 or newer) on the host, or make dtrain's interpreter path "
            "exist there",
        )

    def open_channel(self, command: str, timeout_s: float) -> paramiko.Channel:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise HostConnectionError(f"{self.host.name}: the SSH connection was lost")
        channel = transport.open_session(timeout=timeout_s)
        channel.exec_command(command)
        return channel

    def run(self, command: str, timeout_s: float, stdin: bytes = b"") -> tuple[int, str, str]:
        """Run a short command; (exit status, stdout, stderr)."""
        channel = self.open_channel(command, timeout_s)
        channel.settimeout(timeout_s)
        if stdin:
            channel.sendall(stdin)
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        try:
            while not (
                channel.exit_status_ready()
                and not channel.recv_ready()
                and not channel.recv_stderr_ready()
            ):
                if channel.recv_ready():
                    out += channel.recv(65536)
                elif channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                else:
                    chunk = channel.recv(65536)
                    if not chunk:
                        break
                    out += chunk
            err += drain(channel.recv_stderr, channel.recv_stderr_ready)
        except TimeoutError:
            raise HostConnectionError(
                f"{self.host.name}: no answer from a command within {timeout_s:g}s",
                "check the host's load, or raise --ssh-timeout",
            ) from None
        if not channel.status_event.wait(timeout_s):  # recv_exit_status() would wait forever
            channel.close()
            raise HostConnectionError(
                f"{self.host.name}: a command's output ended but its exit status did not come "
                f"within {timeout_s:g}s",
                "check the host's load, or raise --ssh-timeout",
            )
        status = channel.exit_status
        channel.close()
        return status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")

    def round_trip_s(self, samples: int = 5) -> float:
        """The SSH round trip: the fastest of a few global requests the server answers at once."""
        transport = self.client.get_transport()
        assert transport is not None
        best = float("inf")
        for _ in range(samples):
            started = time.monotonic()
            transport.global_request("keepalive@dtrain", wait=True)
            best = min(best, time.monotonic() - started)
        return best

    def clock_offset_s(self, timeout_s: float, samples: int = 6) -> float:
        """The host's clock minus ours, NTP style: `date` answers on an open channel,
        and the exchange with the shortest round trip gives the estimate."""
        channel = self.open_channel("while read -r _; do date +%s.%N; done", timeout_s)
        channel.settimeout(timeout_s)
        best = (float("inf"), float("nan"))
        buffer = b""
        try:
            for sample in range(samples):
                sent = time.time()
                channel.sendall(b"x\n")
                while b"\n" not in buffer:
                    chunk = channel.recv(4096)
                    if not chunk:
                        return best[1]
                    buffer += chunk
                received = time.time()
                line, buffer = buffer.split(b"\n", 1)
                if sample and received - sent < best[0]:  # the first one also paid for start-up
                    best = (received - sent, float(line) - (sent + received) / 2)
        except (TimeoutError, ValueError, OSError):
            pass
        finally:
            channel.close()
        return best[1]

    def close(self) -> None:
        self.client.close()
        if self.jump is not None:
            self.jump.close()


def drain(read: Callable[[int], bytes], ready: Callable[[], bool]) -> bytes:
    data = bytearray()
    while ready():
        data += read(65536)
    return bytes(data)


def connect(
    host: Host,
    settings: SshSettings,
    config: paramiko.SSHConfig,
    via: SshConnection | None = None,
) -> SshConnection:
    """Connect and authenticate, or raise one HostConnectionError naming the host and cause.

    ``via``: reach the host through this connection (a jump host), whatever its config says;
    the new connection owns it from then on.
    """
    target = resolve_target(host, settings, config)
    where = f"{host.name}" if target.hostname == host.name else f"{host.name} ({target.hostname})"
    deadline = time.monotonic() + settings.timeout_s
    attempt = 0
    while True:
        began = time.monotonic()
        try:
            client, jump = connect_once(target, settings, config, via)
            break
        except (paramiko.SSHException, OSError, EOFError) as exc:
            attempt += 1
            wait = min(RETRY_BASE_S * 2 ** (attempt - 1), RETRY_MAX_S) * random.uniform(0.5, 1.5)
            if (
                via is not None  # through a jump host: that one connection is given
                or attempt == CONNECT_TRIES
                or not dropped_early(exc)
                or time.monotonic() - began > settings.timeout_s / 2  # it waited: overloaded
                or time.monotonic() + wait > deadline
            ):
                if via is not None:
                    via.close()
                raise connect_error(exc, target, where, settings) from None
            LOG.debug("%s: hung up before its greeting (%s); again in %.1f s", where, exc, wait)
            time.sleep(wait)
    transport = client.get_transport()
    assert transport is not None
    tune_socket(transport)
    peer, local = address_pair(transport)
    LOG.debug("connected to %s (%s) as %s", where, peer, target.user)
    return SshConnection(
        host, target, client, jump, peer_address=peer or target.hostname, local_address=local
    )


CONNECT_TRIES = 5  # a connection dropped before sshd's greeting is tried again...
RETRY_BASE_S = 0.2  # ...after 0.2, 0.4, 0.8, 1.6 s (each +-50%, within --ssh-timeout)
RETRY_MAX_S = 2.0


def connect_once(
    target: SshTarget,
    settings: SshSettings,
    config: paramiko.SSHConfig,
    via: SshConnection | None,
) -> tuple[paramiko.SSHClient, SshConnection | None]:
    """One try: the client and the jump host's connection it goes through (if any)."""
    jump: SshConnection | None = via
    try:
        if via is not None:
            sock: Any = tunnel(via, target, settings)
        else:
            jump, sock = open_proxy(target, settings, config)
        client = paramiko.SSHClient()
        for path in (*target.global_known_hosts, *target.known_hosts):
            if Path(path).is_file():
                client.load_system_host_keys(path)
        client.set_missing_host_key_policy(HostKeyPolicy(target))
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=list(target.identities) or None,  # type: ignore[arg-type]  # a list works
            timeout=settings.timeout_s,
            banner_timeout=settings.timeout_s,
            auth_timeout=settings.timeout_s,
            channel_timeout=settings.timeout_s,
            sock=sock,
        )
    except BaseException:
        if jump is not None and jump is not via:
            jump.close()
        raise
    return client, jump


def dropped_early(exc: BaseException) -> bool:
    """The server hung up before it greeted us: what sshd does past its ``MaxStartups``
    (a burst of connections from a launcher to hosts behind one bastion, or a busy host),
    and worth another try; not a refusal, a timeout, a key or a login failure."""
    if isinstance(exc, EOFError | ConnectionResetError | ConnectionAbortedError):
        return True
    text = str(exc).lower()
    return (
        isinstance(exc, paramiko.SSHException)
        and not isinstance(exc, paramiko.AuthenticationException | paramiko.BadHostKeyException)
        and ("error reading ssh protocol banner" in text or "no existing session" in text)
    )


def open_proxy(
    target: SshTarget, settings: SshSettings, config: paramiko.SSHConfig
) -> tuple[SshConnection | None, Any]:
    """The last jump host's connection and a channel through it to the target (ProxyJump
    ``a,b``: a first, b through a, the target through b), or a ProxyCommand."""
    if target.proxy_jump and target.proxy_jump.lower() != "none":
        hops = [jump_host(hop, settings) for hop in target.proxy_jump.split(",")]
        first, first_settings = hops[0]
        jump = connect(first, first_settings, config)
        try:
            for hop, hop_settings in hops[1:]:
                jump = connect(hop, hop_settings, config, via=jump)
            return jump, tunnel(jump, target, settings)
        except BaseException:
            jump.close()  # the whole chain: each connection closes the one it went through
            raise
    if target.proxy_command:
        return None, paramiko.ProxyCommand(target.proxy_command)
    return None, None


def jump_host(text: str, settings: SshSettings) -> tuple[Host, SshSettings]:
    """``[user@]host[:port]`` of a ProxyJump list."""
    user, _, address = text.strip().rpartition("@")
    name, port = split_host_port(address)
    return Host(name, user=user or None), replace(settings, port=port) if port else settings


def tunnel(jump: SshConnection, target: SshTarget, settings: SshSettings) -> paramiko.Channel:
    """A TCP channel through ``jump`` to the target's SSH port."""
    transport = jump.client.get_transport()
    if transport is None or not transport.is_active():
        raise HostConnectionError(f"{jump.host.name}: the SSH connection was lost")
    try:
        return transport.open_channel(
            "direct-tcpip",
            (target.hostname, target.port),
            ("127.0.0.1", 0),
            timeout=settings.timeout_s,
        )
    except paramiko.SSHException as exc:  # refused (ChannelException), or no answer in time
        raise HostConnectionError(
            f"{target.alias}: the jump host {jump.host.name} cannot reach "
            f"{target.hostname}:{target.port} ({getattr(exc, 'text', None) or exc})",
            f"check the name and port, and that {jump.host.name} can reach it (ProxyJump)",
        ) from None


def connect_error(
    exc: BaseException, target: SshTarget, where: str, settings: SshSettings
) -> HostConnectionError:
    """What went wrong while connecting, in one line with a way out."""
    user_file = target.known_hosts[0] if target.known_hosts else "~/.ssh/known_hosts"
    if isinstance(exc, UnknownHostKeyError):
        files = (*target.known_hosts, *target.global_known_hosts)
        return HostConnectionError(
            f"{where}: host key unknown ({exc.hostname} is not in "
            f"{', '.join(files) or 'known_hosts'})",
            f"check it, then 'ssh-keyscan -p {target.port} {target.hostname} "
            f">> {user_file}', or pass --accept-new-host-keys to trust and record it",
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostConnectionError(
            f"{where}: host key CHANGED: it does not match {user_file} (a reinstalled host, "
            "or someone in between)",
            f"if the change is expected, 'ssh-keygen -f {user_file} -R {target.hostname}' "
            "and connect again",
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return HostConnectionError(
            f"{where}: authentication failed for user {target.user}: {exc}",
            "check the key (--ssh-identity, IdentityFile in ~/.ssh/config, ssh-agent) "
            "and the host's authorized_keys",
        )
    if isinstance(exc, socket.gaierror):
        return HostConnectionError(
            f"{where}: cannot resolve the host name",
            "check the name or its HostName in ~/.ssh/config",
        )
    if isinstance(exc, TimeoutError):
        return HostConnectionError(
            f"{where}: no answer on port {target.port} within {settings.timeout_s:g}s",
            "check that the host is up and reachable, or raise --ssh-timeout",
        )
    if isinstance(exc, OSError) and exc.errno == errno.EMFILE:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return HostConnectionError(
            f"{where}: dtrain ran out of open files (ulimit -n is {soft}, hard limit {hard}): "
            "one connection per host",
            "raise the hard limit (ulimit -Hn, /etc/security/limits.conf) or use fewer hosts",
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError | ConnectionRefusedError):
        return HostConnectionError(
            f"{where}: connection refused on port {target.port}",
            "check that sshd runs there and the port (--ssh-port, Port in ~/.ssh/config)",
        )
    text = str(exc) or type(exc).__name__
    for needle, (meaning, hint) in LIBRARY_MESSAGES.items():
        if needle in text.lower():
            return HostConnectionError(f"{where}: {meaning} (paramiko: {text})", hint)
    return HostConnectionError(
        f"{where}: SSH failed: {text}", f"try 'ssh -p {target.port} {target.hostname} true'"
    )


# paramiko's own words, in a user's: what went wrong, and what to try.
LIBRARY_MESSAGES = {
    "error reading ssh protocol banner": (
        "no SSH greeting from the server (not sshd on that port, sshd overloaded, or "
        "MaxStartups reached)",
        "check the port (--ssh-port), or retry with a larger --ssh-timeout",
    ),
    "no existing session": (
        "the SSH session ended before login (no SSH server on that port, or it hung up)",
        "check the port (--ssh-port) and sshd's logs on the host (MaxStartups, AllowUsers)",
    ),
    "incompatible ssh": (
        "the server speaks no SSH version paramiko knows",
        "check that sshd (OpenSSH 7 or newer) listens on that port",
    ),
    "connection reset by peer": (
        "the server reset the connection",
        "check sshd's logs there, or a firewall between",
    ),
}


def tune_socket(transport: paramiko.Transport) -> None:
    """Keepalives, no Nagle, and a bounded wait for a host that stops answering."""
    transport.set_keepalive(KEEPALIVE_S)
    if isinstance(transport.sock, socket.socket):
        # Small control messages (signals) must not wait for Nagle and delayed ACKs (40 ms),
        # and a host that dies must not hold the job for TCP's 15 minutes of retries.
        transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            transport.sock.setsockopt(
                socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS
            )


def address_pair(transport: paramiko.Transport) -> tuple[str, str]:
    """(peer address, our address) of a direct TCP connection; empty through a proxy."""
    sock = transport.sock
    if isinstance(sock, socket.socket):
        return str(sock.getpeername()[0]), str(sock.getsockname()[0])
    return "", ""


FDS_PER_HOST = 3  # the connection's socket, a jump host's, a spare
FDS_MARGIN = 512  # the job directory's logs (256 open at most), local ranks' pipes, dtrain's


def ensure_open_files(needed: int) -> None:
    """Raise this process's soft limit on open files (``ulimit -n``) to ``needed`` if it is
    lower, as far as the hard limit allows: a thousand hosts are a thousand sockets, past the
    common default of 1,024.  (What cannot be raised shows up as EMFILE, said plainly.)"""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    wanted = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    if wanted > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        LOG.debug("open files: soft limit %d -> %d (hard %s)", soft, wanted, hard)


def connect_all(
    hosts: Sequence[Host], settings: SshSettings, config: paramiko.SSHConfig
) -> dict[str, SshConnection]:
    """Connect to every host in parallel; all or nothing."""
    if not hosts:
        return {}
    ensure_open_files(len(hosts) * FDS_PER_HOST + FDS_MARGIN)
    by_name = {h.name: h for h in hosts}
    found = run_parallel(
        list(by_name), lambda n: connect(by_name[n], settings, config), settings.fanout
    )
    connections: dict[str, SshConnection] = {}
    errors: dict[str, HostConnectionError] = {}
    for name, result in found.items():
        if isinstance(result, HostConnectionError):
            errors[name] = result
        elif isinstance(result, BaseException):
            for connection in (c for c in found.values() if isinstance(c, SshConnection)):
                connection.close()
            raise result
        else:
            connections[name] = result
    if errors:
        for connection in connections.values():
            connection.close()
        first = next(iter(errors.values()))
        more = f" (and {len(errors) - 1} more host(s) failed)" if len(errors) > 1 else ""
        error = HostConnectionError(first.message + more, first.hint)
        error.hosts = frozenset(errors)  # a restart leaves these out
        raise error
    return connections


@dataclass(frozen=True)
class HostReport:
    """What ``probe.py`` found on a host."""

    hostname: str
    python: str
    python_version: str
    cwd_ok: bool
    ports: tuple[int, ...]
    gpus: tuple[dict[str, str], ...]
    time: float
    program: str | None = None
    cpus: tuple[tuple[int, int], ...] = ()  # (cpu, socket) it may run on
    versions: Mapping[str, str | None] = field(default_factory=dict)
    route: Mapping[str, str] | None = None  # {"address", "interface"} towards route_to


def probe_host(
    connection: SshConnection,
    python: str,
    args: Mapping[str, object],
    timeout_s: float,
) -> HostReport:
    command = build_remote_command(python, ["-I", "-c", PROBE_SOURCE, json.dumps(dict(args))])
    status, out, err = connection.run(command, timeout_s)
    name = connection.host.name
    if status != 0:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise HostConnectionError(
            f"{name}: cannot run Python there ({last})",
            "install python3 on the host, or make the same interpreter path exist there",
        )
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise HostConnectionError(
            f"{name}: unexpected answer from the host probe: {out[:200]!r}"
        ) from None
    return report_from(data)


def report_from(data: Mapping[str, Any]) -> HostReport:
    return HostReport(
        hostname=data["hostname"],
        python=data["python"],
        python_version=data["python_version"],
        cwd_ok=data["cwd_ok"],
        ports=tuple(data["ports"]),
        gpus=tuple(data["gpus"]),
        time=data["time"],
        program=data.get("program"),
        cpus=tuple((int(c), int(s)) for c, s in data.get("cpus", ())),
        versions=data.get("versions", {}),
        route=data.get("route"),
    )


class HostAgent:
    """The launcher's end of one host's agent (``remote/agent.py``): one channel, every rank.

    Like mpirun's one daemon per host: the login shell and Python start once
    per host, not once per rank, and the probe shares the same channel.
    """

    def __init__(
        self,
        connection: SshConnection,
        channel: paramiko.Channel,
        silence_s: float = DEFAULT_HOST_TIMEOUT_S,
    ) -> None:
        self.connection = connection
        self.channel = channel
        self.silence_s = silence_s  # an agent silent this long is lost (frozen, cut off)
        self.heard = time.monotonic()  # the last frame from the agent
        self.lost_cause: str | None = None
        self.ended: str | None = None  # why the channel ended, once it has (EOF, a lost host)
        self.lock = threading.Lock()
        self.processes: dict[int, AgentProcess] = {}  # by run id
        self.pump = Pump("dtrain-ssh-output")  # feeds attached ranks' output (one transport's)
        self.buffer = bytearray()  # received, not yet taken: from self.offset on
        self.offset = 0
        self.runs = 0

    @classmethod
    def open(
        cls,
        connection: SshConnection,
        python: str,
        probe_args: Mapping[str, object],
        timeout_s: float,
        silence_s: float = DEFAULT_HOST_TIMEOUT_S,
    ) -> tuple[HostAgent, HostReport]:
        """Start the agent, wait for its probe report, then serve the ranks."""
        name = connection.host.name
        command = build_remote_command(python, ["-I", "-S", "-c", watchdog.BOOTSTRAP])
        config = {
            "probe": dict(probe_args),
            "probe_source": PROBE_SOURCE,
            "watchdog": WATCHDOG_SOURCE,
            # Beat often enough that a healthy agent is never silent for the host timeout,
            # and give the launcher up after the same silence.
            "heartbeat_s": min(agent.HEARTBEAT_S, silence_s / 4),
            "silence_s": silence_s,
            "py_spy": agent.find_py_spy(None),  # the same path there, if it exists
        }
        channel = None
        try:
            channel = connection.open_channel(command, timeout_s)
            channel.sendall(
                watchdog.frame(AGENT_SOURCE) + watchdog.frame(json.dumps(config).encode())
            )
            channel.settimeout(timeout_s)
            host = cls(connection, channel, silence_s)
            host.skip_to_start()
            _, kind, payload = host.next_frame()
        except TimeoutError:
            raise HostConnectionError(
                f"{name}: no answer from the host probe within {timeout_s:g}s",
                "check the host's load, or raise --ssh-timeout",
            ) from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if channel is None:
                raise HostConnectionError(f"{name}: cannot open an SSH channel: {exc}") from None
            err = drain(channel.recv_stderr, channel.recv_stderr_ready).decode("utf-8", "replace")
            last = (err.strip().splitlines() or ["the channel closed"])[-1]
            raise connection.agent_failed(last) from None
        if kind != agent.PROBED:
            raise HostConnectionError(f"{name}: unexpected answer from the host agent ({kind})")
        channel.settimeout(None)
        threading.Thread(target=host.demultiplex, daemon=True).start()
        threading.Thread(target=host.beat, daemon=True).start()
        return host, report_from(json.loads(payload))

    def skip_to_start(self) -> None:
        """Skip what the login shell printed before the agent started (rc files' banners)."""
        while True:
            start = self.buffer.find(agent.START_MARK)
            if start >= 0:
                del self.buffer[: start + len(agent.START_MARK)]
                return
            if len(self.buffer) > MAX_PREAMBLE_BYTES:
                shown = self.buffer[:200].decode("utf-8", "replace").strip()
                raise HostConnectionError(
                    f"{self.connection.host.name}: the login shell printed more than "
                    f"{MAX_PREAMBLE_BYTES} bytes before dtrain's agent started: {shown!r}",
                    "make the shell's rc files (~/.bashrc...) quiet for non-interactive shells",
                )
            chunk = self.channel.recv(1 << 16)
            if not chunk:
                raise EOFError
            self.buffer += chunk

    def beat(self) -> None:
        """Tell the agent the launcher lives, and give the host up when its agent falls
        silent (its heartbeats come every agent.HEARTBEAT_S), until the channel closes."""
        while not self.channel.closed:
            silent_s = time.monotonic() - self.heard
            if silent_s > self.silence_s:
                self.lost_cause = (
                    f"no word from the agent on {self.connection.host.name} for "
                    f"{self.silence_s:g} s: the host is frozen or cut off"
                )
                self.channel.close()  # the demultiplexer ends every rank of the host as lost
                return
            try:
                self.send(agent.NO_RUN, agent.HEARTBEAT, b"")
            except (OSError, paramiko.SSHException):
                return
            time.sleep(min(HEARTBEAT_S, self.silence_s / 4))

    def next_frame(self) -> tuple[int, int, bytes]:
        """The next frame from the agent; EOFError when the channel ends."""
        size = agent.HEADER.size
        while True:
            available = len(self.buffer) - self.offset
            if available >= size:
                rank, kind, length = agent.HEADER.unpack_from(self.buffer, self.offset)
                if available >= size + length:
                    start = self.offset + size
                    payload = bytes(self.buffer[start : start + length])
                    self.offset = start + length
                    self.heard = time.monotonic()
                    if self.offset * 2 >= len(self.buffer):  # amortized: each byte moves once
                        del self.buffer[: self.offset]
                        self.offset = 0
                    return rank, kind, payload
            chunk = self.channel.recv(1 << 18)
            if not chunk:
                raise EOFError
            self.buffer += chunk

    def demultiplex(self) -> None:
        """Route the agent's frames to the ranks' streams and exits, until the channel ends."""
        try:
            while True:
                run, kind, payload = self.next_frame()
                process = self.processes.get(run)
                if process is not None:
                    process.receive(kind, payload)
        except (EOFError, OSError, paramiko.SSHException):
            pass
        cause = (
            self.lost_cause
            or getattr(self.connection, "lost_cause", None)  # srun: the step ended
            or f"the connection to {self.connection.host.name} was lost"
        )
        self.ended = cause
        for process in self.processes.values():
            process.lost(cause)

    def send(self, rank: int, kind: int, payload: bytes) -> None:
        with self.lock:
            self.channel.sendall(agent.encode(rank, kind, payload))

    def start(self, spec: LaunchSpec, grace_s: float, path_prefix: str | None) -> AgentProcess:
        self.runs += 1
        process = AgentProcess(spec, self, self.runs)
        self.processes[self.runs] = process
        remote_spec = {
            "argv": list(spec.argv),
            "env": dict(spec.env),
            "unset": list(spec.env_unset),
            "cwd": spec.cwd,
            "path_prefix": path_prefix,
            "grace_s": grace_s,
        }
        try:
            self.send(process.run, agent.START, json.dumps(remote_spec).encode())
        except (paramiko.SSHException, OSError) as exc:
            raise HostConnectionError(
                f"{spec.host.name}: cannot start rank {spec.rank}: {exc}"
            ) from None
        return process

    def close(self) -> None:
        self.channel.close()


class AgentProcess:
    """A remote rank, as its host's agent reports it."""

    def __init__(self, spec: LaunchSpec, host: HostAgent, run: int) -> None:
        self.spec = spec
        self.host = host
        self.run = run
        self.pid = 0
        self.queues: dict[Stream, queue.SimpleQueue[bytes]] = {
            "stdout": queue.SimpleQueue(),
            "stderr": queue.SimpleQueue(),
        }
        self.ended: set[Stream] = set()
        self.taken = 0  # output bytes read since credit was last returned to the agent
        self.taken_lock = threading.Lock()
        self.report = b""  # the watchdog's report of the program's status (STATUS frames)
        self.status: int | None = None
        self.settled = threading.Event()  # the status is known, or the rank is gone without one
        self.exited = threading.Event()
        self.started = threading.Event()  # the agent said the rank's pid (or the rank ended)
        self.code: int | None = None
        self.killed = False
        self.lost_cause: str | None = None  # the host was lost before the rank ended
        self.answers: dict[int, dict[str, Any]] = {}  # the agent's answers, by kind
        self.answered = {kind: threading.Event() for kind in agent.ANSWERS.values()}
        self.fed: RankFeed | None = None  # attached: output and exits go there, not to queues
        self.told: set[str] = set()  # what the feed was told: "began", "exited"
        self.feed_lock = threading.Lock()

    def attach(self, feed: RankFeed) -> None:
        """Output goes to ``feed`` through the transport's pump (what came before first);
        the start and the status straight from the host's demultiplexer."""
        with self.feed_lock:
            for stream, chunks in self.queues.items():
                while True:
                    try:
                        data = chunks.get_nowait()
                    except queue.Empty:
                        break
                    self.host.pump.put(self.deliverer(stream, feed), data)
            self.fed = feed
            self.tell()

    def deliverer(self, stream: Stream, feed: RankFeed) -> Callable[[bytes], None]:
        def deliver(data: bytes) -> None:  # on the pump's thread
            if stream in self.ended:
                return  # a second end (``finish`` ends every stream)
            if not data:
                self.ended.add(stream)
            feed.feed(stream, data)
            if data:
                self.give_credit(len(data))

        return deliver

    def put(self, stream: Stream, data: bytes) -> None:
        """A chunk (b"": the end) of a stream: queued for ``read``, or fed on."""
        with self.feed_lock:
            if self.fed is None:
                self.queues[stream].put(data)
            else:
                self.host.pump.put(self.deliverer(stream, self.fed), data)

    def tell(self) -> None:
        """Tell the feed the start and the status, once each (as ``wait`` would return it)."""
        feed = self.fed
        if feed is None:
            return
        if "began" not in self.told and self.started.is_set():
            self.told.add("began")
            feed.began()
        if "exited" not in self.told and self.settled.is_set():
            status = self.status if self.status is not None else self.code
            if status is not None:
                self.told.add("exited")
                feed.exited(status)

    @property
    def cause(self) -> str | None:
        """Why the rank ended, where its status does not say: the host was lost, or (over
        srun) Slurm ended the job and its signal reached the rank first."""
        if self.lost_cause is not None or self.killed or self.status is None:
            return self.lost_cause
        if self.status < 0 and self.status != -signal.SIGINT:
            connection = self.host.connection
            ended = getattr(connection, "allocation_ended", None)
            if ended is not None and ended():
                try:
                    name = signal.Signals(-self.status).name
                except ValueError:
                    name = f"signal {-self.status}"
                step = getattr(connection, "lost_cause", "Slurm ended the job")
                self.lost_cause = f"killed by {name}: {step}"
        return self.lost_cause

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        return self.ask(agent.DUMP_STACKS, timeout)

    def take_stats(self, timeout: float) -> dict[str, Any]:
        return self.ask(agent.TAKE_STATS, timeout)

    def ask(self, question: int, timeout: float) -> dict[str, Any]:
        """One question about this rank to its host's agent, and its answer."""
        answer = agent.ANSWERS[question]
        self.answered[answer].clear()
        try:
            self.host.send(self.run, question, b"")
        except (OSError, paramiko.SSHException) as exc:
            return {"error": f"cannot reach {self.spec.host.name}: {exc}"}
        if not self.answered[answer].wait(timeout) or answer not in self.answers:
            return {"error": f"no answer from {self.spec.host.name} within {timeout:g} s"}
        return self.answers.pop(answer)

    def receive(self, kind: int, payload: bytes) -> None:
        if kind in (agent.STDOUT, agent.STDERR):
            self.put("stdout" if kind == agent.STDOUT else "stderr", payload)
        elif kind in (agent.STDOUT_END, agent.STDERR_END):
            self.put("stdout" if kind == agent.STDOUT_END else "stderr", b"")
        elif kind == agent.STATUS:
            self.report += payload
            if self.report.endswith(b"\n") and self.report.strip().lstrip(b"-").isdigit():
                self.status = int(self.report)
                self.settled.set()
                with self.feed_lock:
                    self.tell()
        elif kind == agent.STARTED:
            self.pid = int(payload)
            self.started.set()
            with self.feed_lock:
                self.tell()
        elif kind == agent.FAILED:
            self.put("stderr", b"dtrain: cannot start the rank: " + payload + b"\n")
            self.finish(127)
        elif kind == agent.EXITED:
            self.finish(int(payload))
        elif kind in self.answered:
            self.answers[kind] = json.loads(payload)
            self.answered[kind].set()

    def finish(self, code: int) -> None:
        for stream in STREAMS:
            if stream not in self.ended:
                self.put(stream, b"")  # harmless if the stream had ended already
        self.code = code
        self.exited.set()
        self.settled.set()
        self.started.set()
        with self.feed_lock:
            self.tell()

    def lost(self, cause: str) -> None:
        """The connection to the host ended (or was given up) before the rank did."""
        if not self.exited.is_set():
            if not self.killed:
                self.lost_cause = cause
            self.finish(-signal.SIGKILL if self.killed else 255)

    def read(self, stream: Stream, size: int) -> bytes:
        if stream in self.ended:
            return b""
        data = self.queues[stream].get()
        if not data:
            self.ended.add(stream)
        else:
            self.give_credit(len(data))
        return data

    def give_credit(self, size: int) -> None:
        """Let the agent send what was taken again (a quarter window at a time)."""
        with self.taken_lock:
            self.taken += size
            if self.taken < agent.WINDOW_BYTES // 4:
                return
            credit, self.taken = self.taken, 0
        try:
            self.host.send(self.run, agent.CREDIT, str(credit).encode())
        except (OSError, paramiko.SSHException):
            pass

    def wait(self) -> int:
        # The status comes the moment the program exits (before its leftovers are ended):
        # it, not the agent's later EXITED, decides which rank failed first.
        self.settled.wait()
        if self.status is not None:
            return self.status
        self.exited.wait()
        assert self.code is not None
        return self.code

    def gone(self, timeout: float) -> bool:
        # EXITED comes once the watchdog exited, after ending what the program left.
        return self.exited.wait(timeout)

    def signal(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            self.killed = True
        if self.exited.is_set():
            return
        try:
            self.host.send(self.run, agent.SIGNAL, str(signum).encode())
        except (OSError, paramiko.SSHException):
            pass


class SshTransport:
    """Starts ranks through each host's agent; closing it drops the connections (and the ranks)."""

    def __init__(
        self,
        agents: Mapping[str, HostAgent],
        grace_s: float,
        path_prefix: str | None,
    ) -> None:
        self.agents = dict(agents)
        self.grace_s = grace_s
        self.path_prefix = path_prefix
        self.pump = Pump("dtrain-ssh-output")  # one thread feeds every host's ranks' output
        for host in self.agents.values():
            host.pump = self.pump

    def start(self, spec: LaunchSpec) -> AgentProcess:
        return self.agents[spec.host.name].start(spec, self.grace_s, self.path_prefix)

    def close(self) -> None:
        for host in self.agents.values():
            host.close()
            host.connection.close()
        self.pump.close()


def dump_mpi_stacks(connection: SshConnection, job_id: str, timeout_s: float) -> dict[str, Any]:
    """The Python stacks of an ``--mpi`` job's ranks on a remote host (mpirun started them,
    not an agent)."""
    call = f"dump_mpi_stacks({job_id!r}, {agent.find_py_spy(None)!r})"
    return agent_call(connection, call, timeout_s)


def kill_mpi_leftovers(connection: SshConnection, job_id: str, timeout_s: float) -> dict[str, Any]:
    """SIGKILL what mpirun left of an ``--mpi`` job on a remote host (pids in ``killed``)."""
    return agent_call(connection, f"kill_job_processes({job_id!r})", timeout_s)


def agent_call(connection: SshConnection, call: str, timeout_s: float) -> dict[str, Any]:
    """One of the agent's functions run once on a remote host, over the open connection (the
    agent's own code, fed to its Python): its JSON answer, or ``error``."""
    program = AGENT_SOURCE + f"\nprint(json.dumps({call}))\n".encode()
    command = build_remote_command(sys.executable, ["-I", "-S", "-"])
    try:
        code, out, err = connection.run(command, timeout_s, stdin=program)
        if code != 0:
            return {"error": (err.strip().splitlines() or [f"exit status {code}"])[-1]}
        found: dict[str, Any] = json.loads(out)
        return found
    except (OSError, paramiko.SSHException, ValueError, HostConnectionError) as exc:
        return {"error": f"cannot ask {connection.host.name}: {exc}"}
