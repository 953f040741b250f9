"""The per-host agent: one SSH channel per host carries every rank of that host.

Started through ``watchdog.BOOTSTRAP`` (its source arrives on stdin), the
agent first runs the host probe (``probe.py``, also sent as text) and
reports it, then starts one watchdog per rank it is asked for, as local
children, and multiplexes their output and status back on its stdout.
Its stdin is the lifeline: when it closes, the agent closes every
watchdog's stdin, and each ends its rank as it would for a lost launcher.

Frames, both ways: ``!IBI`` header (run, kind, length), then the payload; a
run is one start of one rank (a restarted rank is a new run), numbered by
the launcher.  The launcher also sends a heartbeat: an agent that hears
nothing for ``SILENCE_S`` takes the launcher for dead (a crashed machine or a
cut network closes no channel) and drops the lifeline.
Stdlib only and self-contained, like the watchdog.
"""

import json
import os
import selectors
import struct
import subprocess
import sys
import time
from typing import Any

HEADER = struct.Struct("!IBI")
# agent -> launcher
STDOUT, STDERR, EXITED, PROBED, STARTED, FAILED, STDOUT_END, STDERR_END, STATUS = range(9)
# launcher -> agent
START, SIGNAL, HEARTBEAT = 100, 101, 102
NO_RUN = 0xFFFFFFFF
SILENCE_S = 45.0


def encode(rank: int, kind: int, payload: bytes) -> bytes:
    return HEADER.pack(rank, kind, len(payload)) + payload


class Agent:
    def __init__(self, config: dict) -> None:  # type: ignore[type-arg]
        self.config = config
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, subprocess.Popen] = {}  # type: ignore[type-arg]
        self.open_pipes: dict[int, int] = {}
        self.reported: set[int] = set()  # runs whose watchdog reported the program's status
        self.inbox = b""
        self.lifeline_open = True
        self.heard = time.monotonic()

    def send(self, rank: int, kind: int, payload: bytes) -> None:
        data = encode(rank, kind, payload)
        while data:
            written = os.write(1, data)
            data = data[written:]

    def start(self, rank: int, spec: dict) -> None:  # type: ignore[type-arg]
        status_read, status_write = os.pipe()  # the watchdog's report, out of the program's reach
        try:
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", self.config["bootstrap"]],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_write,),
            )
        except OSError:
            os.close(status_read)
            raise
        finally:
            os.close(status_write)
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        source = self.config["watchdog"].encode()
        body = json.dumps({**spec, "status_fd": status_write}).encode()
        child.stdin.write(b"%010d" % len(source) + source + b"%010d" % len(body) + body)
        child.stdin.flush()
        self.children[rank] = child
        self.open_pipes[rank] = 3
        status = os.fdopen(status_read, "rb", buffering=0)
        for pipe, kinds in (
            (child.stdout, (STDOUT, STDOUT_END)),
            (child.stderr, (STDERR, STDERR_END)),
            (status, (STATUS, None)),
        ):
            os.set_blocking(pipe.fileno(), False)
            self.selector.register(pipe, selectors.EVENT_READ, (rank, kinds))
        self.send(rank, STARTED, str(child.pid).encode())

    def handle_control(self, data: bytes) -> None:
        self.heard = time.monotonic()
        self.inbox += data
        while len(self.inbox) >= HEADER.size:
            rank, kind, length = HEADER.unpack_from(self.inbox)
            if len(self.inbox) < HEADER.size + length:
                return
            payload = self.inbox[HEADER.size : HEADER.size + length]
            self.inbox = self.inbox[HEADER.size + length :]
            if kind == START:
                try:
                    self.start(rank, json.loads(payload))
                except OSError as exc:
                    self.send(rank, FAILED, str(exc).encode())
            elif kind == SIGNAL and rank in self.children:
                child = self.children[rank]
                if child.poll() is None and child.stdin is not None:
                    try:
                        child.stdin.write(payload + b"\n")
                        child.stdin.flush()
                    except OSError:
                        pass

    def drop_lifeline(self) -> None:
        """The launcher is gone: every watchdog sees its stdin close and ends its rank."""
        self.lifeline_open = False
        self.selector.unregister(0)
        for child in self.children.values():
            if child.stdin is not None:
                try:
                    child.stdin.close()
                except OSError:
                    pass

    def pipe_ready(self, pipe: Any, rank: int, kinds: tuple[int, int | None]) -> None:
        try:
            data = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return
        if data:
            self.send(rank, kinds[0], data)
            if kinds[1] is None:
                self.reported.add(rank)
            return
        self.selector.unregister(pipe)
        if kinds[1] is not None:
            self.send(rank, kinds[1], b"")
        else:
            pipe.close()
            if rank not in self.reported:
                # The watchdog died without reporting (OOM killer, kill -9): end its group,
                # whose processes still hold the output pipes, so the rank's end is seen.
                self.children[rank].wait()
                try:
                    os.killpg(self.children[rank].pid, 9)
                except OSError:
                    pass
        self.open_pipes[rank] -= 1
        if self.open_pipes[rank] == 0:
            child = self.children[rank]
            self.send(rank, EXITED, str(child.wait()).encode())
            if child.stdin is not None:
                try:
                    child.stdin.close()
                except OSError:
                    pass

    def run(self) -> None:
        os.set_blocking(0, False)
        self.selector.register(0, selectors.EVENT_READ, None)
        while self.lifeline_open or any(self.open_pipes.values()):
            if self.lifeline_open and time.monotonic() - self.heard > SILENCE_S:
                self.drop_lifeline()
            for key, _ in self.selector.select(timeout=1.0):
                if key.data is None:
                    try:
                        data = os.read(0, 65536)
                    except BlockingIOError:
                        continue
                    if data:
                        self.handle_control(data)
                    else:
                        self.drop_lifeline()
                else:
                    rank, kinds = key.data
                    self.pipe_ready(key.fileobj, rank, kinds)


def main() -> None:
    read_exact = globals()["read_exact"]  # given by watchdog.BOOTSTRAP, which started us
    config = json.loads(read_exact(int(read_exact(10))))
    namespace: dict = {"__name__": "dtrain_probe"}  # type: ignore[type-arg]
    exec(compile(config["probe_source"], "dtrain-probe", "exec"), namespace)
    report = namespace["probe"](config["probe"])
    agent = Agent(config)
    agent.send(NO_RUN, PROBED, json.dumps(report).encode())
    agent.run()


if __name__ == "__dtrain_remote__":
    main()
