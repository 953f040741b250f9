"""One-shot programs on a host over an open SSH connection, each in a channel of its own:
the host probe (``remote/probe.py``: ``dtrain check``) and its ``HostReport``, and one of
the agent's functions run once (``agent_call``: ``--mpi`` leftovers and stacks)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from launcher import remote
from launcher.base.errors import HostConnectionError
from launcher.core.command import build_remote_command
from launcher.transport.sshlib import paramiko

if TYPE_CHECKING:
    from launcher.transport.ssh import SshConnection

PROBE_SOURCE = remote.source("probe")
AGENT_SOURCE = remote.source("agent").encode()


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
    script: str | None = None  # python SCRIPT's script, where asked and found
    master_port_refusal: str | None = None  # why the --master-port asked about is unusable
    gpu_details: Mapping[str, Any] | None = None  # dtrain check's: driver, CUDA, ECC, processes


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
        script=data.get("script"),
        master_port_refusal=data.get("master_port_refusal"),
        gpu_details=data.get("gpu_details"),
    )


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
