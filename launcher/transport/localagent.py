"""The local agent: one ``python -I -S`` running ``watchdog.serve()`` that forks every local rank's
watchdog (light imports: it may start before the rest of dtrain is loaded).

A job that runs on this machine alone starts its agent early (``start_early``), as soon
as its options are read: the agent's own start-up (an interpreter, about 25 ms) then runs
while dtrain imports and plans, instead of before the first rank.  The agent carries the
launcher's environment, the job's ``-x`` variables and its ``DTRAIN_JOB_ID``, so the
watchdogs it forks show them in ``/proc`` (a job's processes are found by them).

Only C modules are used for the agent's socket (``_socket``, ``array``): ``socket`` and
``signal`` turn their constants into enums as they load (about 7 ms), and the agent starts
before they do (the job's modules load them after).
"""

from __future__ import annotations

import _socket
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from launcher import remote
from launcher.base.pids import process_alive

WATCHDOG = remote.path("watchdog")
# Imported, not run as a script: its bytecode is cached (a script is compiled at every start).
SERVE = f"import sys; sys.path[:0] = [{str(WATCHDOG.parent)!r}]; import watchdog; watchdog.serve()"
SIGKILL = 9  # (signal.SIGKILL; see above)
LOST_POLL_S = 0.05  # without the local agent, how often to look for a watchdog's end
AGENT_EXIT_S = 5.0  # the local agent exits at once when its socket closes; at most this
JOB_ID = "DTRAIN_JOB_ID"


class Spawned:
    """A child started by ``posix_spawn`` in a session of its own, stdin ``stdin``, stdout
    /dev/null: what the agent needs of ``subprocess.Popen`` (whose module, and its fork and
    exec, cost the start of a short job more)."""

    def __init__(self, argv: list[str], stdin: int, env: Mapping[str, str]) -> None:
        self.pid = os.posix_spawn(
            argv[0],
            argv,
            dict(env),
            file_actions=[
                (os.POSIX_SPAWN_DUP2, stdin, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
            ],
            setsid=True,
        )
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit status once it exited (reaped here), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone, status unknown
                self.returncode = -SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit status; None if it still runs after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.poll() is None:
            self.sleep_until_exit(timeout)
        delay = 0.0005
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def sleep_until_exit(self, timeout: float | None) -> None:
        """Sleep until it exits (woken the moment it does: a pidfd), at most ``timeout``
        seconds; at once where there is no pidfd (``wait`` then looks now and then)."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # an older kernel; or reaped by someone else
            return
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll(None if timeout is None else max(0, int(timeout * 1000)))
        finally:
            os.close(pidfd)

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, SIGKILL)
            except ProcessLookupError:
                pass


class Ticket:
    """A request to the local agent: the watchdog's pid once the agent answered it."""

    def __init__(self) -> None:
        self.answered = threading.Event()
        self.text = b""

    def answer(self, text: bytes) -> None:
        self.text = text
        self.answered.set()

    def pid(self) -> int:
        """The watchdog's pid (waits for the answer); OSError if it could not start."""
        self.answered.wait()
        if self.text.startswith(b"!"):  # it could not fork
            raise OSError(self.text[1:].decode(errors="replace").strip())
        if not self.text.isdigit():
            raise ConnectionError("dtrain's local agent is gone")
        return int(self.text)


class LocalAgent:
    """``watchdog.serve()`` in ``python -I -S``: one process that forks every local rank's watchdog.

    The ranks' pipes are made here and handed over on a Unix socket; the agent answers each
    request with the watchdog's pid, and tells when a watchdog exits (it reaps them).  If the
    agent itself is gone, a watchdog's end is seen as its pid leaving ``/proc``.
    """

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            # (in its own session: a Ctrl-C at the terminal is the launcher's to handle)
            self.popen = Spawned([python, "-I", "-S", "-c", SERVE], theirs.fileno(), env)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.python = python
        self.job_id = env.get(JOB_ID)
        self.lock = threading.Lock()  # one request at a time
        self.tickets: deque[Ticket] = deque()  # requests sent, answered in order
        self.exits: dict[int, int] = {}
        self.on_exit: dict[int, Callable[[], None]] = {}  # pid -> call once it exited
        self.changed = threading.Condition()
        self.lost = False  # the agent is gone: no more exit reports
        threading.Thread(target=self.listen, name="dtrain-local-agent", daemon=True).start()

    def request(self, body: bytes, fds: list[int]) -> Ticket:
        """Ask for a watchdog with these pipe ends (sent, not closed; they may be closed once
        this returns); its pid comes with the ticket's answer.  Several requests may be on
        their way: the agent forks one watchdog while the launcher sends the next."""
        ticket = Ticket()
        with self.lock:
            if self.lost:
                raise ConnectionError("dtrain's local agent is gone")
            with self.changed:
                self.tickets.append(ticket)
            try:
                send_fds(self.sock, b"%010d" % len(body), fds)
                self.sock.sendall(body)
            except OSError:
                with self.changed:
                    self.tickets.remove(ticket)
                raise
        return ticket

    def spawn(self, body: bytes, fds: list[int]) -> int:
        """A watchdog with these pipe ends: its pid, once the agent answered."""
        return self.request(body, fds).pid()

    def listen(self) -> None:
        """Answers to requests go to ``spawn``; exit reports are kept for ``wait_exit``."""
        buffered = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                if line.startswith(b"x "):
                    _, pid, status = line.split()
                    with self.changed:
                        self.exits[int(pid)] = int(status)
                        self.changed.notify_all()
                        call = self.on_exit.pop(int(pid), None)
                    if call is not None:
                        call()
                else:
                    with self.changed:
                        ticket = self.tickets.popleft() if self.tickets else None
                    if ticket is not None:
                        ticket.answer(line)
        with self.changed:
            self.lost = True
            self.changed.notify_all()
            waiting, self.on_exit = self.on_exit, {}
            unanswered, self.tickets = list(self.tickets), deque()
        for ticket in unanswered:  # requests in flight get no answer
            ticket.answer(b"")
        for watchdog, at_exit in waiting.items():  # nobody tells now: watched by their pids
            self.call_at_exit(watchdog, at_exit)

    def when_exited(self, pid: int, call: Callable[[], None]) -> None:
        """``call()`` once the watchdog ``pid`` exited (at once if it has)."""
        with self.changed:
            if pid not in self.exits and not self.lost:
                self.on_exit[pid] = call
                return
        self.call_at_exit(pid, call)

    def call_at_exit(self, pid: int, call: Callable[[], None]) -> None:
        if self.exit_status(pid) is not None:
            call()
            return

        def wait() -> None:
            self.wait_exit(pid, None)
            call()

        threading.Thread(target=wait, name="dtrain-local-reap", daemon=True).start()

    def exit_status(self, pid: int) -> int | None:
        with self.changed:
            if pid in self.exits:
                return self.exits[pid]
            if self.lost and not process_alive(pid):
                return -SIGKILL  # reaped by another (the agent is gone): status unknown
            return None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        """The watchdog's exit status once it exited; None after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while (status := self.exit_status(pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                # Without the agent nobody tells: look again now and then.
                self.changed.wait(min(left or LOST_POLL_S, LOST_POLL_S) if self.lost else left)
            return status

    def close(self) -> None:
        """Close the socket: the agent exits (the watchdogs live on, on their lifelines)."""
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.popen.wait(AGENT_EXIT_S) is None:
            self.popen.kill()
            self.popen.wait()


def send_fds(sock: _socket.socket, data: bytes, fds: list[int]) -> None:
    """``socket.send_fds`` on a plain ``_socket.socket``: ``data`` with the descriptors."""
    import array

    ancillary = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):  # (the descriptors went with the first bytes)
        sock.sendall(data[sent:])


EARLY: list[LocalAgent] = []  # started by ``start_early``, not yet taken by a transport


def start_early(env: Mapping[str, str], python: str = sys.executable) -> None:
    """Start the agent of the job whose ``DTRAIN_JOB_ID`` ``env`` carries, before its ranks
    are known; its transport takes it (``take``), or it exits with dtrain (its socket
    closes).  Best effort: an agent that cannot start now is started again when needed."""
    try:
        EARLY.append(LocalAgent(python, env))
    except OSError:
        pass


def take(env: Mapping[str, str], python: str) -> LocalAgent:
    """The agent for a job's first local rank (``env``: its environment): the one started
    early for this job if there is one, else a new one carrying ``env``."""
    while EARLY:
        agent = EARLY.pop()
        if agent.job_id == env.get(JOB_ID) and agent.python == python and not agent.lost:
            return agent
        agent.close()  # another job's, or gone
    return LocalAgent(python, env)
