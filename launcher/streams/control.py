"""A running job answers questions: ``control.sock`` in its job directory (streams layer).

The launcher of a running job listens on a Unix socket in the job directory (which is
0700: only its user can reach it).  A request is one JSON line (``{"op": "stacks"}``),
the answer one JSON document; ``dtrain stacks`` asks from another terminal, and the
launcher gathers what it knows over the channels it already holds (local watchdogs,
the hosts' agents), with no new SSH connection.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from launcher.base.errors import UsageError
from launcher.streams.jobdir import ACTIVE, CONTROL_SOCKET, JobDir

MAX_REQUEST_BYTES = 1 << 16
CLIENT_TIMEOUT_S = 10.0  # a client silent this long (sending or reading) is dropped
CLOSE_WAIT_S = 5.0  # for the accepting thread to end once the socket is shut
Handler = Callable[[Mapping[str, Any]], Mapping[str, Any]]


class ControlServer:
    """Answers requests on ``path`` until closed: each client on a thread of its own, dropped
    once silent for ``client_timeout_s`` (a client that connects and says nothing, or reads
    nothing, holds up no other; ``dtrain stacks`` and ``dtrain top`` may ask at once)."""

    def __init__(
        self, path: Path, handler: Handler, client_timeout_s: float = CLIENT_TIMEOUT_S
    ) -> None:
        self.path = path
        self.handler = handler
        self.client_timeout_s = client_timeout_s
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            path.unlink(missing_ok=True)
            self.server.bind(str(path))
            os.chmod(path, 0o600)
            self.server.listen(4)
        except OSError:
            self.server.close()
            raise
        self.thread = threading.Thread(target=self.serve, name="dtrain-control-accept", daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self.serve_client, args=(client,), name="dtrain-control", daemon=True
            ).start()

    def serve_client(self, client: socket.socket) -> None:
        with client:
            client.settimeout(self.client_timeout_s)  # (the handler's own time is not bound)
            try:
                self.answer(client)
            except (OSError, ValueError):
                pass  # a client that went away, fell silent (a timeout) or sent garbage

    def answer(self, client: socket.socket) -> None:
        data = b""
        while b"\n" not in data and len(data) < MAX_REQUEST_BYTES:
            chunk = client.recv(4096)
            if not chunk:
                break
            data += chunk
        request = json.loads(data.split(b"\n", 1)[0])
        try:
            reply: Mapping[str, Any] = self.handler(request)
        except Exception as exc:  # the job goes on; the asker hears why
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        client.sendall(json.dumps(reply).encode())

    def close(self) -> None:
        try:  # wakes the accepting thread (a close alone does not, on Linux): it ends
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()
        self.thread.join(CLOSE_WAIT_S)
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass


def ask(job_path: Path, request: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request to a running job's launcher; a UsageError when it cannot be asked."""
    path = job_path / CONTROL_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout_s)
        try:
            client.connect(str(path))
            client.sendall(json.dumps(dict(request)).encode() + b"\n")
            client.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := client.recv(1 << 16):
                data += chunk
        except (FileNotFoundError, ConnectionRefusedError):
            raise not_answering(job_path) from None
        except OSError as exc:
            raise UsageError(f"job {job_path.name} did not answer: {exc}") from None
    reply = json.loads(data)
    if "error" in reply:
        raise UsageError(f"job {job_path.name}: {reply['error']}")
    return dict(reply)


def not_answering(job_path: Path) -> UsageError:
    """Why a job does not answer: it ended (as its record says), or it cannot be asked."""
    state = JobDir(job_path).state()
    if state not in ACTIVE:
        return UsageError(
            f"job {job_path.name} has ended ({state}): its ranks are gone",
            f"dtrain logs {job_path.name} shows what they said",
        )
    return UsageError(
        f"job {job_path.name} does not answer (no {CONTROL_SOCKET}: started by an older dtrain, "
        "or its directory's path is too long for a socket)",
        "see dtrain jobs --running",
    )
