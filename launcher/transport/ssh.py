"""SSH connections to hosts, with paramiko (imported only when a host is remote): connecting
(ProxyJump, ProxyCommand, retries of a dropped greeting), host keys (known_hosts, trust on
first use), one-line errors with a way out, socket tuning, the open-files limit, and
``connect_all``: one connection per host, opened in parallel before any rank starts.

What runs over a connection lives beside it: the agent link (``agentlink``: the agent
that starts and watches the host's ranks) and the one-shot commands (``remotecalls``).
"""

from __future__ import annotations

import errno
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.base.errors import HostConnectionError
from launcher.base.log import LOG
from launcher.base.parallel import run_parallel
from launcher.core.hosts import Host
from launcher.transport.sshconfig import SshSettings, SshTarget, jump_host, resolve_target
from launcher.transport.sshlib import paramiko

# paramiko logs its own tracebacks on failed connections; dtrain reports them in one line.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

KEEPALIVE_S = 15
TCP_USER_TIMEOUT_MS = 30_000  # a host that stops acknowledging is given up after this
CLOCK_PATIENCE_S = 10.0  # dtrain check: how long one `date` answer may take, at least


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

    def clock_offset_s(self, timeout_s: float, samples: int = 6) -> float | None:
        """The host's clock minus ours, NTP style: `date` answers on an open channel,
        and the exchange with the shortest round trip gives the estimate; None where no
        exchange but the first (which also starts the shell) came back in time.  Each
        answer may take ``CLOCK_PATIENCE_S`` at least: a busy host answers late, not never."""
        channel = self.open_channel("while read -r _; do date +%s.%N; done", timeout_s)
        channel.settimeout(max(timeout_s, CLOCK_PATIENCE_S))
        best: tuple[float, float | None] = (float("inf"), None)
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
    seen = f" ({peer})" if peer and peer != target.hostname else ""  # where says the name's
    LOG.debug("connected to %s%s as %s", where, seen, target.user)
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
        trust_known_keys(client, target)
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


class KnownHosts:
    """known_hosts files, each read once while it stays the same (size and mtime): paramiko
    reads a whole file for every connection and compares each line with those before it,
    which at 64 hosts listed in one file took 0.6 s of the launcher's 1.8 s of CPU."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: dict[str, tuple[tuple[int, int], paramiko.HostKeys]] = {}

    def keys_of(self, path: str, name: str) -> dict[str, paramiko.PKey]:
        """The keys ``path`` lists for ``name`` (ssh's ``host`` or ``[host]:port``), by type."""
        try:
            stat = Path(path).stat()
        except OSError:
            return {}
        version = (stat.st_mtime_ns, stat.st_size)
        with self.lock:  # one thread reads a file; the others wait for it, not read it too
            known = self.files.get(path)
            if known is None or known[0] != version:
                keys = paramiko.HostKeys()
                try:
                    keys.load(path)
                except (OSError, UnicodeDecodeError):
                    return {}  # unreadable: as if it listed nothing (paramiko's own way)
                known = self.files[path] = (version, keys)
        found = known[1].lookup(name)
        return dict(found) if found is not None else {}


KNOWN_HOSTS = KnownHosts()


def trust_known_keys(client: paramiko.SSHClient, target: SshTarget) -> None:
    """Give the client the target's keys from the system's and the user's known_hosts (of
    each key type the first one found, as when paramiko loads both files itself)."""
    name = target.hostname if target.port == 22 else f"[{target.hostname}]:{target.port}"
    keys: dict[str, paramiko.PKey] = {}
    for path in (*target.global_known_hosts, *target.known_hosts):
        if Path(path).is_file():
            for key_type, key in KNOWN_HOSTS.keys_of(path, name).items():
                keys.setdefault(key_type, key)
    for key_type, key in keys.items():
        client.get_host_keys().add(name, key_type, key)


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
    if unreachable(exc):
        return HostConnectionError(
            f"{where}: unreachable: no route to it (nothing answers at its address)",
            "check that the host is up and its address, or the network between",
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


def unreachable(exc: BaseException) -> bool:
    """No route to the host (down, on this host's own network: nothing answers its
    address), not a refusal: paramiko's NoValidConnectionsError wraps either."""
    causes = getattr(exc, "errors", None) or {None: exc}
    found = [getattr(cause, "errno", None) for cause in causes.values()]
    return bool(found) and all(e in (errno.EHOSTUNREACH, errno.ENETUNREACH) for e in found)


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
