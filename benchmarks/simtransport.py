"""A transport for benchmarks only: simulated hosts that answer like real ones.

``SimTransport`` implements ``launcher.transport.base.Transport``.  A started rank
(``SimProcess``) becomes "running" after its host's start latency (a base plus
uniform jitter, like an agent's answer over SSH), prints ``lines`` lines of output
on stdout, and exits with ``status`` after ``run_s``; or runs until signalled, and
then exits after the signal latency (SIGTERM: ``-15`` unless it ignores SIGTERM,
SIGKILL: always ``-9``).  One scheduler thread fires every timed event, so the
simulation adds no thread per rank: every thread and every CPU second in the
process beyond that thread is dtrain's own (the supervisor, the rank readers and
waiters, the outlets, the job directory).

``sim_survey`` stands in for the survey: every host is remote, with free ports and
an address, as a real survey would have found them.
"""

from __future__ import annotations

import heapq
import itertools
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig
from launcher.core.outcome import STREAMS, Stream
from launcher.core.plan import Plan
from launcher.core.specs import Site
from launcher.run.survey import Survey
from launcher.transport.base import RankFeed
from launcher.transport.feeds import Pump


@dataclass(frozen=True)
class SimHosts:
    """How the simulated hosts behave."""

    start_latency_s: float = 0.005  # from start() to the rank running (the agent's answer)
    jitter_s: float = 0.005  # uniform, added to every latency
    signal_latency_s: float = 0.002  # from a signal to the rank's exit
    lines: int = 10  # printed by every rank
    line: bytes = b"step 0 loss 1.2345 lr 0.001 (a simulated rank's line of output)"
    run_s: float | None = 0.2  # None: run until signalled
    status: int = 0
    fail_rank: int | None = None  # this rank exits with 1 after ``fail_after_s``
    fail_after_s: float = 0.5
    ignores_term: bool = False
    seed: int = 1


class Scheduler:
    """One thread that calls each callback at its time.

    The thread is woken only by an event due before the one it waits for: thousands of
    starts each schedule an event later than the first, and waking the thread for each
    made it take the GIL (and its lock) from the launcher's loop thousands of times, a
    cost of the simulation counted as dtrain's."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.counter = itertools.count()
        self.ready = threading.Condition(threading.Lock())
        self.stopped = False
        self.wakes = 0  # how often ``at`` woke the thread (the tests count them)
        self.thread = threading.Thread(target=self.run, name="sim-scheduler", daemon=True)
        self.thread.start()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        with self.ready:
            first = not self.events or when < self.events[0][0]
            heapq.heappush(self.events, (when, next(self.counter), callback))
            if first:  # (else the thread wakes for an earlier event, and then sees this one)
                self.wakes += 1
                self.ready.notify()

    def run(self) -> None:
        while True:
            with self.ready:
                while not self.stopped and (
                    not self.events or self.events[0][0] > time.monotonic()
                ):
                    wait = self.events[0][0] - time.monotonic() if self.events else None
                    self.ready.wait(wait)
                if self.stopped:
                    return
                _, _, callback = heapq.heappop(self.events)
            callback()

    def stop(self) -> None:
        with self.ready:
            self.stopped = True
            self.ready.notify()


class SimProcess:
    """One rank on a simulated host (the ``Process`` protocol)."""

    def __init__(self, spec: LaunchSpec, hosts: SimHosts, sim: SimTransport, pid: int) -> None:
        self.spec = spec
        self.hosts = hosts
        self.sim = sim
        self.pid = 0  # known once its host answered, as over SSH
        self.assigned_pid = pid
        self.cause: str | None = None
        self.started = threading.Event()  # the supervisor's "Started" (a remote rank's pid)
        self.ended = threading.Event()
        self.lock = threading.Lock()
        self.output: list[bytes] = []
        self.output_ready = threading.Condition(self.lock)
        self.status: int | None = None
        self.signals: list[int] = []
        self.running = False
        self.fed: RankFeed | None = None  # attached: output and exits go there
        self.told: set[str] = set()

    def attach(self, feed: RankFeed) -> None:
        """Output to ``feed`` through the transport's pump, the start and the exit straight
        from the scheduler's thread (as over SSH)."""
        with self.lock:
            self.fed = feed
            for data in self.output:
                self.sim.pump.put(partial(feed.feed, "stdout"), data)
            self.output.clear()
            if self.status is not None:
                self.end_streams(feed)
        self.tell()

    def end_streams(self, feed: RankFeed) -> None:
        for stream in STREAMS:
            self.sim.pump.put(partial(feed.feed, stream), b"")

    def tell(self) -> None:
        feed = self.fed
        if feed is None:
            return
        with self.lock:
            began = self.started.is_set() and "began" not in self.told
            exited = self.status is not None and "exited" not in self.told
            self.told.update(["began"] * began + ["exited"] * exited)
        if began:
            feed.began()
        if exited:
            assert self.status is not None
            feed.exited(self.status)

    def begin(self) -> None:
        """The host answered: the rank runs and prints its lines."""
        with self.lock:
            if self.status is not None:
                return
            self.pid = self.assigned_pid
            self.running = True
            line = self.hosts.line + b" rank %d\n" % self.spec.rank
            feed = self.fed
            if feed is None:
                self.output.append(line * self.hosts.lines)
            else:
                self.sim.pump.put(partial(feed.feed, "stdout"), line * self.hosts.lines)
            self.output_ready.notify_all()
        self.started.set()
        self.tell()
        self.sim.count_started()
        hosts = self.hosts
        if hosts.fail_rank == self.spec.rank:
            self.sim.later(hosts.fail_after_s, lambda: self.end(1))
        elif hosts.run_s is not None:
            self.sim.later(hosts.run_s, lambda: self.end(hosts.status))

    def end(self, status: int) -> None:
        with self.lock:
            if self.status is not None:
                return
            self.status = status
            if self.fed is not None:
                self.end_streams(self.fed)
            self.output_ready.notify_all()
        self.started.set()
        self.ended.set()
        self.tell()
        self.sim.count_ended(self.spec.rank, status)

    def read(self, stream: Stream, size: int) -> bytes:
        with self.lock:
            while True:
                if stream == "stdout" and self.output:
                    return self.output.pop(0)
                if self.status is not None:
                    return b""
                self.output_ready.wait()

    def wait(self) -> int:
        self.ended.wait()
        assert self.status is not None
        return self.status

    def signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum == signal.SIGKILL or not self.hosts.ignores_term:
            self.sim.later(self.hosts.signal_latency_s, lambda: self.end(-signum))

    def dump_stacks(self, timeout: float) -> dict[str, Any]:
        return {"error": "a simulated rank has no stacks"}

    def take_stats(self, timeout: float) -> dict[str, Any]:
        return {"error": "a simulated rank uses nothing"}

    def gone(self, timeout: float) -> bool:
        return self.ended.wait(timeout)


class SimTransport:
    """Ranks on simulated hosts; counts what it was asked and what happened, with times."""

    def __init__(self, hosts: SimHosts) -> None:
        self.hosts = hosts
        self.rng = random.Random(hosts.seed)
        self.scheduler = Scheduler()
        self.pump = Pump("sim-output")  # dtrain's: feeds every rank's output, as over SSH
        self.processes: dict[int, SimProcess] = {}
        self.lock = threading.Lock()
        self.first_start: float | None = None
        self.last_start_call: float | None = None
        self.all_running: float | None = None
        self.first_failure: float | None = None
        self.all_ended: float | None = None
        self.running = 0
        self.ended = 0
        self.closed = False

    def start(self, spec: LaunchSpec) -> SimProcess:
        now = time.monotonic()
        if self.first_start is None:
            self.first_start = now
        process = SimProcess(spec, self.hosts, self, 100_000 + spec.rank)
        self.processes[spec.rank] = process
        self.later(self.hosts.start_latency_s, process.begin)
        self.last_start_call = time.monotonic()
        return process

    def later(self, delay_s: float, callback: Callable[[], None]) -> None:
        jitter = self.rng.uniform(0, self.hosts.jitter_s)
        self.scheduler.at(time.monotonic() + delay_s + jitter, callback)

    def count_started(self) -> None:
        with self.lock:
            self.running += 1
            if self.running == self.expected:
                self.all_running = time.monotonic()

    def count_ended(self, rank: int, status: int) -> None:
        with self.lock:
            self.ended += 1
            if status > 0 and self.first_failure is None:
                self.first_failure = time.monotonic()
            if self.ended == self.expected:
                self.all_ended = time.monotonic()

    expected = 0  # set by the driver: how many ranks the job has

    def close(self) -> None:
        self.closed = True
        self.scheduler.stop()
        self.pump.close()


def sim_survey(plan: Plan, config: JobConfig, environ: Mapping[str, str], workdir: str) -> Survey:
    """Every host as a survey would find a remote one: free ports, an address, no GPU."""
    names = [h.name for h in plan.hosts]
    return Survey(
        Site(
            local={name: False for name in names},
            ports={name: list(range(29400, 29416)) for name in names},
            addresses={
                name: f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"
                for i, name in enumerate(names)
            },
            pythons={name: "/usr/bin/python3" for name in names},
        )
    )
