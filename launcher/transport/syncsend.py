"""``--sync``'s sending side: one host's copy over its open SSH connection, in a channel of
its own, to ``remote/syncrecv.py`` (shipped as text: the host needs only Python).

The receiver says which file contents it lacks; only those are sent, each once (a tree the
host already has costs one round trip).  Closing the channel (Ctrl-C, a lost connection)
ends the receiver, which removes what it had half written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from launcher import remote
from launcher.base.errors import HostConnectionError, UsageError
from launcher.core.command import build_remote_command
from launcher.core.synctree import SyncEntry
from launcher.remote.syncrecv import MARK
from launcher.transport.sshlib import paramiko

if TYPE_CHECKING:
    from launcher.transport.ssh import SshConnection

RECEIVER_SOURCE = remote.source("syncrecv")
DEFAULT_CACHE = "~/.cache/dtrain/sync"  # on each host, in the user's home
KEEP_TREES = 5  # trees kept per user and host: the ones used last (and any in use)
CHANGED_HINT = "wait until it is written, or list it in .gitignore"
SHOWN_LINES = 20  # lines of a login shell's chatter skipped at most before an answer


@dataclass(frozen=True)
class SyncResult:
    """One host's copy: where the tree is there, and what was sent to make it."""

    host: str
    tree: str
    files_sent: int
    bytes_sent: int


def sync_to_host(
    connection: SshConnection,
    python: str,
    key: str,
    entries: Sequence[SyncEntry],
    read_blob: Callable[[SyncEntry], Iterable[bytes]],
    timeout_s: float,
    cache: str = DEFAULT_CACHE,
) -> SyncResult:
    """Make the tree ``key`` exist on the host; the contents it lacks are read with
    ``read_blob`` and sent once each."""
    name = connection.host.name
    args = json.dumps({"root": cache, "keep": KEEP_TREES})
    command = build_remote_command(python, ["-I", "-S", "-c", RECEIVER_SOURCE, args])
    rows = [entry.as_row() for entry in entries]
    channel = connection.open_channel(command, timeout_s)
    try:
        channel.settimeout(timeout_s)
        channel.sendall(json.dumps({"key": key, "entries": rows}).encode() + b"\n")
        lines = channel.makefile("rb")
        by_blob = {e.blob: e for e in entries if e.kind == "file"}
        reply = read_answer(lines, channel, name, by_blob)
        sent_files = sent_bytes = 0
        if "missing" in reply:
            for blob in reply["missing"]:
                entry = by_blob[blob]
                for chunk in read_blob(entry):
                    channel.sendall(chunk)
                sent_files, sent_bytes = sent_files + 1, sent_bytes + entry.size
            channel.settimeout(max(timeout_s, 60.0))  # building a large tree takes a while
            reply = read_answer(lines, channel, name, by_blob)
        return SyncResult(name, str(reply["tree"]), sent_files, sent_bytes)
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise HostConnectionError(
            f"{name}: the copy of --sync stopped ({exc or type(exc).__name__})",
            "check the connection and the space in the host's home, then run again",
        ) from None
    finally:
        channel.close()


def read_answer(
    lines: Any, channel: Any, name: str, by_blob: Mapping[str, SyncEntry]
) -> dict[str, Any]:
    """The receiver's next answer (after what a login shell may print), or its error: its
    refusal as it says it (content unlike its digest: a file changed while it was sent)."""
    for _ in range(SHOWN_LINES):
        line = lines.readline()
        if not line:
            break
        text = line.decode("utf-8", "replace")
        if text.startswith(MARK):
            found: dict[str, Any] = json.loads(text[len(MARK) :])
            if "refused" not in found:
                return found
            changed = by_blob.get(str(found.get("blob")))
            if changed is not None:
                raise UsageError(f"{changed.path} changed while syncing: run again", CHANGED_HINT)
            raise HostConnectionError(f"{name}: {found['refused']}", found.get("hint") or None)
    channel.status_event.wait(5.0)  # its error comes with its end
    errors = bytearray()
    while channel.recv_stderr_ready():
        errors += channel.recv_stderr(65536)
    last = (errors.decode("utf-8", "replace").strip().splitlines() or ["no answer"])[-1]
    raise HostConnectionError(
        f"{name}: cannot sync there ({last})",
        "install python3 (3.9 or newer) on the host, and leave room in its home folder",
    )
