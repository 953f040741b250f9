"""A program on a host that talks in JSON lines (``dtrain check --network``'s netcheck): the
launcher writes on its stdin, it answers on its stdout; over a channel of an open SSH
connection, or as a process here for a local host.

Its stdin carries everything it is told (a token included: never its argv); what it says
arrives on one queue shared by every host's program, as ``(host, message)``, and its end as
``(host, None)`` after a last ``(host, {"ended": why})``.  Closing its stdin is how it is
told to stop: the program ends when its stdin does, so a launcher that dies, or a channel
that closes, leaves nothing behind.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any

from launcher.base.errors import HostConnectionError
from launcher.core.command import build_remote_command
from launcher.transport.sshlib import paramiko

if TYPE_CHECKING:
    from launcher.transport.ssh import SshConnection

Event = tuple[str, "dict[str, Any] | None"]
LOCAL_EXIT_S = 2.0  # how long a local program may take to end once its stdin closes


class LineProgram:
    """One host's program: ``send`` a message, ``close`` its stdin (it ends)."""

    def __init__(self, host: str, write: Callable[[bytes], None], close: Callable[[], None]):
        self.host = host
        self._write = write
        self._close = close
        self._lock = threading.Lock()
        self.closed = False

    def send(self, message: Mapping[str, Any]) -> bool:
        """False where the program is gone (its end is, or will be, on the queue)."""
        with self._lock:
            if self.closed:
                return False
            try:
                self._write((json.dumps(dict(message)) + "\n").encode())
                return True
            except (OSError, EOFError, paramiko.SSHException):
                return False

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._close()


def relay(host: str, lines: Iterable[bytes], ended: Callable[[], str], events: Any) -> None:
    """The program's lines onto ``events`` until its stdout ends, then why it ended."""
    try:
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # (not ours: a line some login script printed)
            if isinstance(message, dict):
                events.put((host, message))
    except (OSError, EOFError, paramiko.SSHException):
        pass
    events.put((host, {"ended": ended()}))
    events.put((host, None))


def start_over_ssh(
    connection: SshConnection,
    python: str,
    source: str,
    first: Mapping[str, Any],
    events: queue.Queue[Event],
    timeout_s: float,
) -> LineProgram:
    """``python -I -c source`` on the connection's host, told ``first`` on its stdin."""
    command = build_remote_command(python, ["-I", "-c", source])
    try:
        channel = connection.open_channel(command, timeout_s)
    except (OSError, paramiko.SSHException) as exc:
        raise HostConnectionError(
            f"{connection.host.name}: cannot start a program: {exc}"
        ) from None
    host = connection.host.name

    def ended() -> str:
        channel.settimeout(LOCAL_EXIT_S)
        err = b""
        try:
            while True:
                chunk = channel.recv_stderr(65536)
                if not chunk:
                    break
                err += chunk
        except (OSError, paramiko.SSHException):
            pass
        lines = err.decode("utf-8", "replace").strip().splitlines()
        if lines:
            return lines[-1]
        if not channel.status_event.wait(LOCAL_EXIT_S):
            return "its channel closed"
        status = channel.exit_status  # (-1: no status came, as for a signal)
        return "killed by a signal" if status == -1 else f"exit status {status}"

    def close() -> None:
        try:
            channel.shutdown_write()  # its stdin ends: it closes its listener and exits
        except (OSError, EOFError, paramiko.SSHException):
            pass

    program = LineProgram(host, channel.sendall, close)
    program.send(first)
    stdout = channel.makefile("rb")
    threading.Thread(
        target=relay, args=(host, stdout, ended, events), name="dtrain-netcheck", daemon=True
    ).start()
    return program


def start_here(
    host: str, python: str, source: str, first: Mapping[str, Any], events: queue.Queue[Event]
) -> LineProgram:
    """The same program as a process of this machine (a local host of the list)."""
    process = subprocess.Popen(
        [python, "-I", "-c", source],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # Ctrl-C is the launcher's to handle: it closes our stdin
    )
    stdin: IO[bytes] = process.stdin  # type: ignore[assignment]

    def write(data: bytes) -> None:
        stdin.write(data)
        stdin.flush()

    def ended() -> str:
        try:
            process.wait(LOCAL_EXIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert process.stderr is not None
        lines = process.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return lines[-1] if lines else f"exit status {process.returncode}"

    def close() -> None:
        try:
            stdin.close()
        except OSError:
            pass

    program = LineProgram(host, write, close)
    program.send(first)
    assert process.stdout is not None
    threading.Thread(
        target=relay,
        args=(host, process.stdout, ended, events),
        name="dtrain-netcheck",
        daemon=True,
    ).start()
    return program
