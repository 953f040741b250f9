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
from typing import IO, Any

from launcher import remote
from launcher.command import LaunchSpec
from launcher.errors import LauncherError
from launcher.remote import agent
from launcher.transport.base import Stream

WATCHDOG = remote.path("watchdog")
NVIDIA_SMI_TIMEOUT_S = 10.0
KILL_FALLBACK_S = 1.0  # SIGKILL the group ourselves if the watchdog has not done it


def build_child_env(base: Mapping[str, str], spec: LaunchSpec) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in spec.env_unset}
    env.update(spec.env)
    return env


class LocalProcess:
    """A rank on this machine: the watchdog process and its pipes."""

    def __init__(self, spec: LaunchSpec, popen: subprocess.Popen[bytes], status_fd: int) -> None:
        self.spec = spec
        self.popen = popen
        self.pid = popen.pid
        assert popen.stdout is not None and popen.stderr is not None and popen.stdin is not None
        self.files: dict[Stream, IO[bytes]] = {"stdout": popen.stdout, "stderr": popen.stderr}
        self.lifeline = popen.stdin
        self.status_fd = status_fd  # the watchdog's report: the program's status, out of band
        self.cause: str | None = None

    def read(self, stream: Stream, size: int) -> bytes:
        file = self.files[stream]
        if file.closed:
            return b""
        data = os.read(file.fileno(), size)
        if not data:
            file.close()  # no fd outlives its stream
        return data

    def wait(self) -> int:
        """The status the watchdog reports the moment the program exits (before it ends the
        program's leftovers); the watchdog's own exit if it died without reporting."""
        report = read_report(self.status_fd)
        if report.lstrip(b"-").isdigit():
            code = int(report)
        else:  # the watchdog was killed (OOM killer, kill -9): end its group for it
            code = self.popen.wait()
            signal_group(self.pid, signal.SIGKILL)
        # The watchdog still ends what the program left (it may still need our signals):
        # reap it, and close its lifeline, once it is done, in the background.
        threading.Thread(target=self.reap, daemon=True).start()
        return code

    def reap(self) -> None:
        """Wait for the watchdog (no zombie), then close its lifeline (no fd outlives it)."""
        self.popen.wait()
        try:
            self.lifeline.close()
        except OSError:
            pass

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

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        return agent.dump_stacks(self.pid, local_py_spy())

    def take_stats(self, timeout: float) -> dict[str, Any]:
        return agent.take_stats(self.pid)

    def gone(self, timeout: float) -> bool:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill_group(self) -> None:
        if self.popen.poll() is None:
            signal_group(self.pid, signal.SIGKILL)  # the watchdog leads the group


def local_mpi_stacks(job_id: str) -> dict[str, Any]:
    """The Python stacks of an ``--mpi`` job's ranks on this machine (rank as text -> dump)."""
    found: dict[str, Any] = agent.dump_mpi_stacks(job_id, local_py_spy())
    return found


def kill_local_mpi_leftovers(job_id: str) -> list[int]:
    """SIGKILL what mpirun left of an ``--mpi`` job on this machine; the pids killed."""
    killed: list[int] = agent.kill_job_processes(job_id)["killed"]
    return killed


def local_py_spy() -> str | None:
    """py-spy here: beside dtrain's interpreter (a dependency), else on PATH."""
    return agent.find_py_spy(None)


def signal_group(pgid: int, signum: int) -> None:
    """Signal a rank's process group, even when its leader (the watchdog) is gone."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def read_report(fd: int) -> bytes:
    """Read a status pipe to its end (the writer closes it), then close it."""
    data = b""
    try:
        while chunk := os.read(fd, 64):
            data += chunk
    except OSError:
        pass
    finally:
        os.close(fd)
    return data.strip()


class LocalTransport:
    """Starts ranks as ``python -I -S watchdog.py GRACE STATUS_FD -- argv`` on this machine."""

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
        status_read, status_write = os.pipe()
        argv = [self.python, "-I", "-S", str(WATCHDOG), str(self.grace_s), str(status_write)]
        try:
            popen = subprocess.Popen(
                [*argv, "--", *spec.argv],
                stdin=subprocess.PIPE,  # the watchdog's lifeline: EOF when we die
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=build_child_env(self.environ, spec),
                cwd=spec.cwd,
                start_new_session=True,
                pass_fds=(status_write,),
            )
        except OSError as exc:
            os.close(status_read)
            raise LauncherError(
                f"cannot start rank {spec.rank} on localhost: {exc}",
                "check the limits on processes and open files (ulimit -u, -n)",
            ) from None
        finally:
            os.close(status_write)  # the watchdog's copy is the only writer
        return LocalProcess(spec, popen, status_read)

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
