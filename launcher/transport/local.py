"""Ranks on this machine: each under the watchdog, in its own session."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import IO

from launcher import remote
from launcher.command import LaunchSpec
from launcher.errors import LauncherError
from launcher.transport.base import StatusFilter, Stream

WATCHDOG = remote.path("watchdog")
NVIDIA_SMI_TIMEOUT_S = 10.0
EXIT_POLL_S = 0.05
STATUS_WAIT_S = 5.0  # after the watchdog exited, how long its status may take to arrive
KILL_FALLBACK_S = 1.0  # SIGKILL the group ourselves if the watchdog has not done it


def build_child_env(base: Mapping[str, str], spec: LaunchSpec) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in spec.env_unset}
    env.update(spec.env)
    return env


class LocalProcess:
    """A rank on this machine: the watchdog process and its pipes."""

    def __init__(self, spec: LaunchSpec, popen: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self.popen = popen
        self.pid = popen.pid
        assert popen.stdout is not None and popen.stderr is not None and popen.stdin is not None
        self.files: dict[Stream, IO[bytes]] = {"stdout": popen.stdout, "stderr": popen.stderr}
        self.lifeline = popen.stdin
        self.stderr = StatusFilter(lambda size: self.read_raw("stderr", size))

    def read(self, stream: Stream, size: int) -> bytes:
        if stream == "stderr":
            return self.stderr.read(size)
        return self.read_raw(stream, size)

    def read_raw(self, stream: Stream, size: int) -> bytes:
        file = self.files[stream]
        if file.closed:
            return b""
        data = os.read(file.fileno(), size)
        if not data:
            file.close()  # no fd outlives its stream
        return data

    def wait(self) -> int:
        while not self.stderr.settled.wait(EXIT_POLL_S):
            if self.popen.poll() is not None:
                self.stderr.settled.wait(STATUS_WAIT_S)
                break
        code = self.stderr.status if self.stderr.status is not None else self.popen.wait()
        if self.popen.poll() is not None:
            try:
                self.lifeline.close()  # the watchdog is gone: no fd outlives it
            except OSError:
                pass
        return code

    def signal(self, signum: int) -> None:
        """Ask the watchdog to signal every process of the rank; SIGKILL is also enforced here."""
        if self.popen.poll() is not None:
            return
        try:
            self.lifeline.write(f"{signum}\n".encode())
            self.lifeline.flush()
        except (OSError, ValueError):  # ValueError: closed as the rank exited meanwhile
            pass
        if signum == signal.SIGKILL:
            timer = threading.Timer(KILL_FALLBACK_S, self.kill_group)
            timer.daemon = True
            timer.start()

    def kill_group(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # the watchdog leads the group
            except (ProcessLookupError, PermissionError):
                pass


class LocalTransport:
    """Starts ranks as ``python -I -S watchdog.py GRACE -- argv`` on this machine."""

    def __init__(
        self,
        environ: Mapping[str, str],
        grace_s: float,
        python: str = sys.executable,
    ) -> None:
        self.environ = dict(environ)
        self.grace_s = grace_s
        self.python = python

    def start(self, spec: LaunchSpec) -> LocalProcess:
        argv = [self.python, "-I", "-S", str(WATCHDOG), str(self.grace_s), "--", *spec.argv]
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,  # the watchdog's lifeline: EOF when we die
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=build_child_env(self.environ, spec),
                cwd=spec.cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise LauncherError(
                f"cannot start rank {spec.rank} on localhost: {exc}",
                "check the limits on processes and open files (ulimit -u, -n)",
            ) from None
        return LocalProcess(spec, popen)

    def close(self) -> None:
        pass


def find_free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on this machine right now (the probe's way)."""
    from launcher.remote.probe import free_ports

    return free_ports(count)


def is_local_address(name: str) -> bool:
    """True when ``name`` resolves to an address of this machine (this network namespace).

    Decided by address, not by name: an address is ours when we can bind to it.
    """
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((sockaddr[0], 0))
            except OSError:
                continue
            return True
    return False


def detect_local_gpus(environ: Mapping[str, str]) -> tuple[str, ...]:
    """GPU ids usable here: ``CUDA_VISIBLE_DEVICES`` if set, else what nvidia-smi lists."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = tuple(v.strip() for v in visible.split(",") if v.strip())
        return () if ids[:1] == ("-1",) else ids
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return ()
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ()
    if out.returncode != 0:
        return ()
    return tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
