"""Ranks on this machine: each under a watchdog, in its own session, forked by one local agent."""

from __future__ import annotations

import marshal
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any

from launcher.base.errors import LauncherError
from launcher.core.command import LaunchSpec
from launcher.core.outcome import Stream
from launcher.transport import localagent
from launcher.transport.base import RankFeed
from launcher.transport.feeds import PipeReader
from launcher.transport.localagent import LocalAgent, Ticket
from launcher.transport.locality import is_local_address as is_local_address  # (its old home)

NVIDIA_SMI_TIMEOUT_S = 10.0
KILL_FALLBACK_S = 1.0  # SIGKILL the group ourselves if the watchdog has not done it


def build_child_env(base: Mapping[str, str], spec: LaunchSpec) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in spec.env_unset}
    env.update(spec.env)
    return env


class LocalProcess:
    """A rank on this machine: its watchdog (forked by the local agent) and its pipes.

    Its pid is the agent's answer to the request (``ticket``), read the first time it is
    needed: the launcher asks for every rank before it waits for the first answer."""

    def __init__(
        self,
        spec: LaunchSpec,
        agent: LocalAgent,
        ticket: Ticket,
        pipes: tuple[int, int, int, int],  # our ends: lifeline, stdout, stderr, status
        readers: tuple[PipeReader, PipeReader] | None = None,  # output, statuses: ``attach``
    ) -> None:
        self.spec = spec
        self.agent = agent
        self.ticket = ticket
        self.known_pid: int | None = None
        self.readers = readers
        lifeline, stdout, stderr, status = pipes
        self.files: dict[Stream, IO[bytes]] = {
            "stdout": os.fdopen(stdout, "rb", buffering=0),
            "stderr": os.fdopen(stderr, "rb", buffering=0),
        }
        self.lifeline = os.fdopen(lifeline, "wb", buffering=0)
        self.status_fd = status  # the watchdog's report: the program's status, out of band
        self.cause: str | None = None

    @property
    def pid(self) -> int:
        """The watchdog's pid (waits for the agent's answer the first time); a rank the agent
        could not start is a LauncherError here, its pipes closed."""
        if self.known_pid is None:
            try:
                self.known_pid = self.ticket.pid()
            except OSError as exc:
                for file in (*self.files.values(), self.lifeline):
                    file.close()
                os.close(self.status_fd)
                raise LauncherError(
                    f"cannot start rank {self.spec.rank} on localhost: {exc}",
                    "check the limits on processes and open files (ulimit -u, -n)",
                ) from None
        return self.known_pid

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
        return self.status_from(read_report(self.status_fd))

    def status_from(self, report: bytes) -> int:
        """The rank's status from its watchdog's report (see ``wait``)."""
        if report.lstrip(b"-").isdigit():
            code = int(report)
        else:  # the watchdog was killed (OOM killer, kill -9): end its group for it
            code = self.agent.wait_exit(self.pid, None) or -signal.SIGKILL
            signal_group(self.pid, signal.SIGKILL)
        # The watchdog still ends what the program left (it may still need our signals):
        # close its lifeline once it is done.
        self.agent.when_exited(self.pid, self.close_lifeline)
        return code

    def attach(self, feed: RankFeed) -> None:
        """The transport's two threads read the streams and the report (``RankFeed``)."""
        assert self.readers is not None, "attach needs the transport's readers"
        output, statuses = self.readers
        for stream, file in self.files.items():
            output.add(file.fileno(), self.chunks(stream, file, feed, output))
        report = bytearray()

        def on_report(data: bytes) -> None:
            if data:
                report.extend(data)
                return
            os.close(self.status_fd)
            if report.strip().lstrip(b"-").isdigit():
                feed.exited(self.status_from(bytes(report).strip()))
            else:  # waits for the agent to tell the watchdog's end: not on this thread
                threading.Thread(
                    target=lambda: feed.exited(self.status_from(b"")), daemon=True
                ).start()

        statuses.add(self.status_fd, on_report)

    @staticmethod
    def chunks(
        stream: Stream, file: IO[bytes], feed: RankFeed, reader: PipeReader
    ) -> Callable[[bytes], bool]:
        """The reader's callback for one stream: False pauses the pipe while the rank's
        share of the outlets is full (the reader goes on with the other ranks)."""
        fd = file.fileno()

        def on_chunk(data: bytes) -> bool:
            if not data:
                file.close()  # no fd outlives its stream
            return feed.feed(stream, data, lambda: reader.resume(fd))

        return on_chunk

    @property
    def returncode(self) -> int | None:
        """The watchdog's exit status once it exited (None: still there)."""
        return self.agent.exit_status(self.pid)

    def close_lifeline(self) -> None:
        """Once the watchdog exited: no fd outlives it."""
        try:
            self.lifeline.close()
        except OSError:
            pass

    def signal(self, signum: int) -> None:
        """Ask the watchdog to signal every process of the rank; SIGKILL is also enforced here."""
        if self.returncode is not None:
            return
        try:
            self.lifeline.write(f"{signum}\n".encode())
        except (OSError, ValueError):  # ValueError: closed as the rank exited meanwhile
            pass
        if signum == signal.SIGKILL:
            timer = threading.Timer(KILL_FALLBACK_S, self.kill_group)
            timer.daemon = True
            timer.start()

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        from launcher.remote import agent

        return agent.dump_stacks(self.pid, local_py_spy())

    def take_stats(self, timeout: float) -> dict[str, Any]:
        from launcher.remote import agent

        return agent.take_stats(self.pid)

    def gone(self, timeout: float) -> bool:
        return self.agent.wait_exit(self.pid, timeout) is not None

    def kill_group(self) -> None:
        if self.returncode is None:
            signal_group(self.pid, signal.SIGKILL)  # the watchdog leads the group


def local_py_spy() -> str | None:
    """py-spy here: beside dtrain's interpreter (a dependency), else on PATH."""
    from launcher.remote import agent

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
    """Starts ranks on this machine, each under a watchdog forked by one local agent."""

    def __init__(
        self,
        environ: Mapping[str, str],
        grace_s: float,
        python: str = sys.executable,
    ) -> None:
        self.environ = dict(environ)
        self.grace_s = grace_s
        self.python = python
        self.agent: LocalAgent | None = None
        # One thread reads every rank's output, one every rank's status (``attach``).
        self.readers = (PipeReader("dtrain-local-output"), PipeReader("dtrain-local-exits"))

    def start(self, spec: LaunchSpec) -> LocalProcess:
        env = build_child_env(self.environ, spec)
        body = marshal.dumps(  # the agent runs this same interpreter (``watchdog.serve``)
            {"argv": list(spec.argv), "env": env, "cwd": spec.cwd, "grace_s": self.grace_s}
        )
        lifeline, stdout, stderr, status = os.pipe(), os.pipe(), os.pipe(), os.pipe()
        theirs = [lifeline[0], stdout[1], stderr[1], status[1]]
        ours = (lifeline[1], stdout[0], stderr[0], status[0])
        try:
            agent, ticket = self.spawn(env, body, theirs)
        except OSError as exc:
            for fd in ours:
                os.close(fd)
            raise LauncherError(
                f"cannot start rank {spec.rank} on localhost: {exc}",
                "check the limits on processes and open files (ulimit -u, -n)",
            ) from None
        finally:
            for fd in theirs:
                os.close(fd)  # sent (the agent holds them now): the watchdog's are the only ones
        return LocalProcess(spec, agent, ticket, ours, self.readers)

    def spawn(
        self, env: Mapping[str, str], body: bytes, fds: list[int]
    ) -> tuple[LocalAgent, Ticket]:
        """The watchdog's agent and the request for it.  A new agent if there is none, or if
        the last one is gone (its watchdogs go on, and their ends are still seen); no second
        try once a request was sent (a watchdog may have started: a rank runs once)."""
        if self.agent is not None and self.agent.popen.poll() is not None:
            self.agent.lost = True  # it died (its socket's end may not be read yet)
        if self.agent is not None and self.agent.lost:
            self.agent.close()  # reaped
            self.agent = None
        if self.agent is None:
            self.agent = localagent.take(env, self.python)
        return self.agent, self.agent.request(body, fds)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        for reader in self.readers:
            reader.close()


def find_free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on this machine right now (the probe's way)."""
    from launcher.remote.probe import free_ports

    return free_ports(count)


def find_program(name: str, path: str | None) -> str | None:
    """``shutil.which`` on POSIX (whose module loads bz2 and lzma: a short job's start):
    ``name`` itself if it holds a slash, else the first executable file of that name on
    ``path`` (``os.defpath`` when None)."""
    if "/" in name:
        return name if os.path.isfile(name) and os.access(name, os.X_OK) else None
    for folder in (os.defpath if path is None else path).split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def detect_local_gpus(environ: Mapping[str, str]) -> tuple[str, ...]:
    """GPU ids usable here: ``CUDA_VISIBLE_DEVICES`` if set, else what nvidia-smi lists."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = tuple(v.strip() for v in visible.split(",") if v.strip())
        return () if ids[:1] == ("-1",) else ids
    smi = find_program("nvidia-smi", environ.get("PATH"))
    if smi is None:
        return ()
    import subprocess

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
