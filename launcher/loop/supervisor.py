"""The only loop (DESIGN.md): start every rank, apply the policy, tear down.

Each rank's ``RankRun`` turns its streams and exit into messages on one
inbox; the loop in ``Supervisor.run`` (the main thread) takes them one by
one, shows lines through the injected sink, feeds exits and signals to
``policy.decide`` and carries out the action.  Teardown (SIGTERM to every
process group, the grace period, then SIGKILL) runs from ``finally`` too, so
no rank outlives the launcher whatever happened in between.  Every wait goes
through the injected clock.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from launcher.base.clock import Clock, SystemClock
from launcher.base.frozen import evolve
from launcher.base.interpreter import INTERPRETER
from launcher.base.log import LOG
from launcher.core.command import LaunchSpec
from launcher.core.config import rank_set
from launcher.core.outcome import JobResult, OutputSink, RankReport, RankState, build_rank_report
from launcher.core.policy import (
    Continue,
    Event,
    Finish,
    GraceExpired,
    HostsChanged,
    Interrupted,
    JobState,
    KillAll,
    RankEnd,
    RankExited,
    Restart,
    StopAll,
    TimedOut,
    decide,
    describe_status,
    failed_hosts,
    start_state,
)
from launcher.loop.asks import HangReporter, StackDumps, dump_stacks, rank_stats
from launcher.loop.drain import DrainCut, bounds, drain_streams, judge_output
from launcher.loop.rankrun import Exit, Message, RankRun, Signalled, Started, StreamEnd
from launcher.loop.settle import settle_runs
from launcher.streams.outlets import Fanout, Outlet
from launcher.transport.base import Process, Transport

__all__ = ["Supervisor", "caught_signals"]

KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for exits we may never see
HANG_STACKS_S = 25.0  # how long taking the stacks of a hung job may take
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POST_STATES = 1024  # rank states handed to the outlets at once, at most (a burst of exits)


@contextmanager
def caught_signals(on_signal: Callable[[int], None], enabled: bool = True) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP call ``on_signal`` (main thread only); restored on exit."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        on_signal(signum)

    previous = {s: signal.signal(s, handler) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@dataclass(frozen=True)
class TimeLimits:
    """--hang-timeout (with what to do), --start-timeout, --timeout; None: no limit."""

    hang_s: float | None = None
    fail_on_hang: bool = True  # --on-hang fail (else dump and go on)
    start_s: float | None = None
    total_s: float | None = None  # this attempt's share of --timeout
    timeout_s: float | None = None  # --timeout as given (for the whole job, all attempts)
    on_hang: HangReporter | None = None  # the job layer's report of a hang

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.hang_s, self.start_s, self.total_s))


RESTART_COUNTS = ("DTRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


@dataclass(frozen=True)
class StacksTaken:
    """The stacks of a hung job, taken off the loop (they may take ``HANG_STACKS_S``)."""

    dumps: StackDumps


class Supervisor:
    def __init__(
        self,
        specs: Sequence[LaunchSpec],
        transport: Transport,
        sink: OutputSink | Fanout,
        *,
        grace_s: float = 5.0,
        clock: Clock | None = None,
        output_dir: Path | None = None,
        handle_signals: bool = True,
        roles: Mapping[int, str] | None = None,
        worker_restarts: int = 0,
        limits: TimeLimits | None = None,
        on_stopping: Callable[[str], None] | None = None,
        append_output: bool = False,
        stacks: Callable[[float], dict[int, tuple[str, dict[str, Any]]]] | None = None,
    ) -> None:
        self.specs = list(specs)
        self.stacks = stacks  # --mpi: the ranks' stacks, where mpirun started them
        self.transport = transport
        # Lines go from the ranks' readers to the outlets' writers; the loop posts states only.
        # A bare sink is a journal: run() returns once it has everything.
        self.output = sink if isinstance(sink, Fanout) else Fanout([Outlet(sink)])
        self.grace_s = grace_s
        self.clock: Clock = clock or SystemClock()
        self.output_dir = output_dir
        self.handle_signals = handle_signals
        self.roles = roles
        self.worker_restarts = worker_restarts
        self.limits = limits or TimeLimits()
        self.on_stopping = on_stopping  # told what a signal to dtrain does (the Ctrl-C hint)
        self.append_output = append_output  # a restart: --output-dir keeps the earlier attempts
        self.began = self.clock.now()
        self.quiet_since: float | None = None  # a hang already reported: silence counts anew
        self.dumping = False  # a hang's stacks are being taken (on a thread of their own)
        # The ranks' messages, and a change of hosts from the discovery script's thread.
        self.events: queue.SimpleQueue[Message | HostsChanged | StacksTaken] = queue.SimpleQueue()
        self.runs: dict[int, RankRun] = {}  # the current run of each rank
        self.retired: list[RankRun] = []  # earlier runs of restarted ranks
        self.open_streams = 0  # of every run, retired ones included
        self.stop_requested = False
        self.killed = False
        self.stopped: set[int] = set()  # ranks this supervisor had to signal
        self.signalled_at: dict[int, float] = {}  # ...when first (wall clock, as exit times)
        self.sigkilled: set[int] = set()  # ...and those it had to SIGKILL
        self.unsettled: set[int] = set()  # ranks whose watchdog had not exited at the end
        self.kill_cause: str | None = None  # why SIGKILL: the grace ran out, a second signal
        self.drain_cut: DrainCut | None = None  # streams the drain stopped waiting for
        self.unposted: list[RankState] = []  # states for the outlets, handed on in batches

    # -- the loop ---------------------------------------------------------

    def run(self) -> JobResult:
        started = self.clock.now()
        state = start_state(frozenset())
        with caught_signals(self.on_signal, self.handle_signals), INTERPRETER.running_job():
            try:
                with INTERPRETER.starting_ranks():  # (``interpreter.py`` says why)
                    self.start_all()
                    INTERPRETER.freeze()  # (before the collector is back: it never sees them)
                state = start_state(frozenset(self.runs), self.roles, self.worker_restarts)
                state = self.loop(state)
                self.drain()
            finally:
                self.teardown()
                self.settle()
                self.transport.close()
                self.post_states()
                self.output.finish_journals()  # the views are the job's to finish
        return self.result(state, started)

    def result(self, state: JobState, started: float) -> JobResult:
        """The attempt's result, once every rank has ended (one pass over thousands of ranks
        for each figure: the job's end is recorded only after this)."""
        stopped = self.stopped_by_us()
        ends = [
            RankEnd(r.spec.host.name, r.status, r.process.cause is not None, rank in stopped)
            for rank, r in self.runs.items()
        ]
        if self.drain_cut is not None and self.drain_cut.signum is not None:
            state = replace(state, interrupt=state.interrupt or self.drain_cut.signum)
        incomplete, exit_code = judge_output(self.every_run(), self.drain_cut, state.exit_code)
        return JobResult(
            exit_code=exit_code,
            world_size=len(self.specs),
            elapsed_s=self.clock.now() - started,
            failure=self.report(state.failure.rank) if state.failure else None,
            interrupt=state.interrupt,
            statuses={r: run.status for r, run in self.runs.items()},
            stopped=len(stopped),
            sigkilled=len(self.sigkilled & stopped),
            kill_cause=self.kill_cause,
            timeout=state.timeout,
            rescale=state.rescale,
            failed_hosts=failed_hosts(ends),
            lost_hosts=frozenset(end.host for end in ends if end.lost),
            incomplete=incomplete,
        )

    def on_signal(self, signum: int) -> None:
        self.stop_requested = True
        self.events.put(Signalled(signum))

    def rescale(self, reason: str) -> None:
        """From any thread: the discovery script's hosts changed; stop this attempt."""
        self.events.put(HostsChanged(reason))

    def loop(self, state: JobState) -> JobState:
        deadline: float | None = None  # grace or kill deadline, when stopping
        while True:
            watch = None if state.stopping else self.next_check()
            wake = min((t for t in (deadline, watch) if t is not None), default=None)
            event = self.next_event(wake)
            if isinstance(event, StacksTaken):
                event = self.hang_found(event.dumps, state)
                if event is None:
                    continue
            if event is None and deadline is not None and self.clock.now() >= deadline:
                if state.killing:
                    return state  # SIGKILLed ranks that never reported back: give up on them
                event = GraceExpired()
            elif event is None:
                event = self.check_limits()
                if event is None:
                    continue
            state, action = decide(state, event)
            if isinstance(event, RankExited) and isinstance(action, Continue):
                self.tell_left_behind(event, state)
            if isinstance(action, Finish):
                return state
            if isinstance(action, Restart):
                self.restart(action.rank)
            elif isinstance(action, StopAll):
                if isinstance(event, Interrupted) and self.on_stopping is not None:
                    self.on_stopping(
                        f"dtrain: stopping {self.running} rank(s) (grace {self.grace_s:g} s); "
                        "Ctrl-C again to kill now"
                    )
                LOG.debug(
                    "stopping the ranks: SIGTERM to %d, SIGKILL in %g s", self.running, self.grace_s
                )
                self.signal_running(signal.SIGTERM)
                deadline = self.clock.now() + self.grace_s
            elif isinstance(action, KillAll):
                if isinstance(event, Interrupted):  # a second Ctrl-C: kill, and show no more
                    self.kill_cause = "at the second signal"
                    self.output.give_up_views()
                else:
                    self.kill_cause = f"after the {self.grace_s:g} s grace"
                LOG.debug("SIGKILL to %d rank(s) %s", self.running, self.kill_cause)
                self.signal_running(signal.SIGKILL)
                deadline = self.clock.now() + KILL_WAIT_S

    def tell_left_behind(self, event: RankExited, state: JobState) -> None:
        """A parameter-server job goes on without a failed worker (or evaluator): say so."""
        if not state.roles or state.stopping or event.status == 0 or self.on_stopping is None:
            return
        spec = self.runs[event.rank].spec
        spent = (
            f", no restart left (--restart-workers {self.worker_restarts})"
            if self.worker_restarts and spec.role == "worker"
            else ""
        )
        self.on_stopping(
            f"dtrain: rank {event.rank} ({spec.role}) on {spec.host.name} failed "
            f"({describe_status(event.status)}){spent}: the job goes on without it"
        )

    def next_check(self) -> float | None:
        """When a time limit may next run out (None: none is set)."""
        limits = self.limits
        times = []
        if limits.total_s is not None:
            times.append(self.began + limits.total_s)
        if limits.start_s is not None and not all(r.started for r in self.runs.values()):
            times.append(self.began + limits.start_s)
        if limits.hang_s is not None and not self.dumping:
            times.append(self.last_heard() + limits.hang_s)
        return min(times, default=None)

    def last_heard(self) -> float:
        """When any running rank last printed (or the job started, or a hang was reported)."""
        now = self.clock.now()  # a rank that dtrain's own outlets hold back is not silent
        running = [run.heard(now) for run in self.runs.values() if run.running]
        return max([self.began, *running, *([self.quiet_since] if self.quiet_since else [])])

    def check_limits(self) -> Event | None:
        """A time limit that ran out, as the policy's event; a hang starts taking the stacks
        (``hang_found`` goes on once they came: the loop never waits on them)."""
        now, limits = self.clock.now(), self.limits
        if limits.total_s is not None and now - self.began >= limits.total_s:
            given = limits.timeout_s if limits.timeout_s is not None else limits.total_s
            running = [r for r, run in self.runs.items() if run.running]
            hosts = sorted({self.runs[r].spec.host.name for r in running})
            still = f" (rank(s) {rank_set(running)} on {', '.join(hosts)} still running)"
            return TimedOut(
                f"the job ran longer than --timeout {given:g} s{still if running else ''}"
            )
        late = [r for r, run in self.runs.items() if not run.started]
        if limits.start_s is not None and late and now - self.began >= limits.start_s:
            hosts = sorted({self.runs[r].spec.host.name for r in late})
            return TimedOut(
                f"rank(s) {rank_set(late)} on {', '.join(hosts)} had not started after "
                f"{limits.start_s:g} s (--start-timeout)"
            )
        hung = limits.hang_s is not None and now - self.last_heard() >= limits.hang_s
        if hung and not self.dumping:
            LOG.debug("no output for %g s: taking every rank's stack", limits.hang_s)
            self.dumping = True
            threading.Thread(
                target=self.take_hang_stacks, name="dtrain-stacks", daemon=True
            ).start()
        return None

    def take_hang_stacks(self) -> None:
        """On its own thread: every rank's stacks, posted to the loop's inbox."""
        try:
            dumps = self.dump_stacks(HANG_STACKS_S)
        except Exception as exc:  # the hang is still reported, without the stacks
            LOG.debug("cannot take the stacks: %r", exc)
            dumps = {}
        self.events.put(StacksTaken(dumps))

    def hang_found(self, dumps: StackDumps, state: JobState) -> Event | None:
        """The stacks of a hang came: shown, then the hang's end of the job (unless --on-hang
        dump, or the job is ending already: a Ctrl-C or an exit came meanwhile)."""
        self.dumping = False
        self.quiet_since = self.clock.now()  # the next hang is a new silence
        limits = self.limits
        if state.stopping or limits.hang_s is None:
            return None
        where = limits.on_hang(dumps) if limits.on_hang else ""
        if limits.fail_on_hang:
            return TimedOut(
                f"no output from any rank for {limits.hang_s:g} s (--hang-timeout){where}"
            )
        return None

    def next_event(self, deadline: float | None) -> Event | StacksTaken | None:
        """Handle queued output until an event for the policy arrives (None: the deadline,
        once nothing that came before it is left: thousands of exits queued while the loop
        was busy are exits, not ranks that outlived the grace, to be SIGKILLed)."""
        while True:
            if self.unposted and (self.events.empty() or len(self.unposted) >= POST_STATES):
                self.post_states()  # a burst of starts or exits handled: its states at once
            timeout = None if deadline is None else deadline - self.clock.now()
            message: Message | HostsChanged | StacksTaken | None
            if timeout is not None and timeout <= 0:
                try:
                    message = self.events.get_nowait()
                except queue.Empty:
                    return None
            else:
                message = self.clock.take(self.events, timeout)
            if message is None:
                continue  # the clock may wake early: the deadline decides
            event = self.handle(message)
            if event is not None:
                return event

    def handle(self, message: Message | HostsChanged | StacksTaken) -> Event | StacksTaken | None:
        """Count closed streams; exits and signals become policy events."""
        if isinstance(message, Signalled):
            LOG.debug("got %s", signal.Signals(message.signum).name)
            return Interrupted(message.signum)
        if isinstance(message, HostsChanged | StacksTaken):
            return message
        run = message.run
        if isinstance(message, StreamEnd):
            run.open_streams -= 1
            self.open_streams -= 1
            return None
        if isinstance(message, Started):
            run.started = True
            run.state = evolve(run.state, pid=run.process.pid)
            LOG.debug(
                "rank %d started on %s (pid %s)", run.spec.rank, run.spec.host.name, run.process.pid
            )
            self.unposted.append(run.state)
            return None
        self.record_exit(message)
        LOG.debug("rank %d on %s exited with %s", run.spec.rank, run.spec.host.name, message.status)
        self.unposted.append(run.state)
        return RankExited(run.spec.rank, message.status, message.time)

    def record_exit(self, message: Exit) -> None:
        run = message.run
        run.status = message.status
        # A remote rank's pid is known once its agent started it: record it now.  (One new
        # state per exit: thousands of ranks may end at once.)
        stopped = self.ended_by_us(run.spec.rank, message.status, message.time)
        run.state = evolve(
            run.state,
            status=message.status,
            ended=message.time,
            pid=run.process.pid,
            stopped=stopped,
        )

    def drain(self) -> None:
        """Let the readers hand on every line the ranks wrote: until every stream ended,
        within bounds (``drain.drain_streams``).  Every rank has exited (or was given up on
        after SIGKILL): a terminal view may now hold more of their lines than a running
        job's (``Fanout.let_views_lag``), so that a paused terminal does not keep what is
        still in flight from the job directory, nor lose it."""
        self.output.let_views_lag()  # readers no longer held back by a paused terminal
        quiet_s, cap_s = bounds(self.grace_s, self.stop_requested or self.killed)
        self.drain_cut = drain_streams(
            self.clock, self.events, self.handle, self.every_run, quiet_s, cap_s
        )

    def post_states(self) -> None:
        """Hand the outlets the rank states not handed on yet, in one batch."""
        states, self.unposted = self.unposted, []
        if states:
            self.output.post_states(states)

    def every_run(self) -> list[RankRun]:
        return [*self.retired, *self.runs.values()]

    # -- starting and stopping ranks ---------------------------------------

    def start_all(self) -> None:
        """Every rank asked for before any is tracked: a transport may start one while the
        next is asked for (the local agent forks a watchdog while the launcher prepares the
        next rank).  A rank that cannot start fails the job, once every rank asked for is
        tracked, so that the teardown ends them all."""
        launched: list[tuple[LaunchSpec, Process]] = []
        error: BaseException | None = None
        for spec in self.specs:
            if self.stop_requested:
                break  # Ctrl-C during start-up: start no more ranks
            try:
                launched.append((spec, self.transport.start(spec)))
            except BaseException as exc:
                error = exc
                break
        for spec, process in launched:
            try:
                self.track(spec, process)
            except BaseException as exc:
                error = error or exc
        self.post_states()
        if error is not None:
            raise error

    def start(self, spec: LaunchSpec, restarts: int = 0) -> None:
        self.track(spec, self.transport.start(spec), restarts)

    def track(self, spec: LaunchSpec, process: Process, restarts: int = 0) -> None:
        """A started rank: its state, its streams read, its exit awaited."""
        state = RankState(
            spec.rank, spec.host.name, spec.role, process.pid, self.clock.wall(), restarts=restarts
        )
        run = RankRun(
            spec, process, state, self.events.put, self.output, self.clock.wall, self.clock.now
        )
        self.runs[spec.rank] = run
        self.open_streams += run.open_streams
        if run.started:  # else its pid comes with Started (a remote rank's agent says it)
            LOG.debug("rank %d started on %s (pid %s)", spec.rank, spec.host.name, process.pid)
        self.unposted.append(state)
        run.watch(self.output_dir, append=self.append_output)

    def restart(self, rank: int) -> None:
        """Start a rank again in place: same spec, same environment but one more restart in
        its restart counts (DTRAIN_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT)."""
        old = self.runs[rank]
        self.retired.append(old)
        env = dict(old.spec.env)
        for name in RESTART_COUNTS:
            if env.get(name, "").isdigit():
                env[name] = str(int(env[name]) + 1)
        self.start(replace(old.spec, env=env), restarts=old.state.restarts + 1)

    @property
    def running(self) -> int:
        return sum(1 for run in self.runs.values() if run.running)

    def signal_running(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            self.killed = True
        for rank, run in self.runs.items():
            if run.running:  # the time before the signal: its end may be stamped at once
                self.signalled_at.setdefault(rank, self.clock.wall())
                run.process.signal(signum)
                self.stopped.add(rank)
                if signum == signal.SIGKILL:
                    self.sigkilled.add(rank)

    def teardown(self) -> None:
        """SIGTERM, grace, SIGKILL for whatever still runs (after an error in the loop).

        Only exits are recorded here, and a signal to dtrain cuts the grace short.
        """
        if self.killed or not any(run.running for run in self.runs.values()):
            return
        try:
            self.signal_running(signal.SIGTERM)
            end = self.clock.now() + self.grace_s
            while self.clock.now() < end and any(run.running for run in self.runs.values()):
                message = self.clock.take(self.events, end - self.clock.now())
                if isinstance(message, Signalled):
                    break
                if isinstance(message, Exit):
                    self.record_exit(message)
        finally:
            self.signal_running(signal.SIGKILL)

    def dump_stacks(self, timeout_s: float) -> StackDumps:
        """Every running rank's Python stacks (py-spy, where each rank runs), in parallel."""
        if self.stacks is not None:
            return self.stacks(timeout_s)
        return dump_stacks(self.runs, timeout_s)

    def stats(self, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Every rank's figures for ``dtrain top`` (``asks.rank_stats``)."""
        return rank_stats(self.runs, self.clock.now(), timeout_s)

    def ended_by_us(self, rank: int, status: int | None, ended: float | None = None) -> bool:
        """Did dtrain's own signal end this rank (``ended``: when, if not recorded yet)?  Not
        when its exit was known before dtrain signalled it, nor when it exited with a failure
        of its own (a code other than 0 or 128 + the signal) while dtrain was stopping the
        job, nor by a SIGKILL that dtrain did not send (it had only sent SIGTERM): the OOM
        killer, a dying machine."""
        if rank not in self.stopped:
            return False
        ended = self.runs[rank].state.ended if ended is None else ended
        if ended is not None and ended < self.signalled_at.get(rank, ended):
            return False  # it had ended already: the signal found nothing
        sent = {signal.SIGTERM} | ({signal.SIGKILL} if rank in self.sigkilled else set())
        if status is not None and status > 0:
            return status - 128 in sent  # a handler's exit after the signal, as a shell's
        return not (status == -signal.SIGKILL and rank not in self.sigkilled)

    def stopped_by_us(self) -> set[int]:
        """The ranks dtrain stopped (the summary's count): not those that ended by themselves
        while it was stopping the job."""
        return {rank for rank in self.stopped if self.ended_by_us(rank, self.runs[rank].status)}

    def settle(self) -> None:
        """Wait until nothing of any rank runs (``settle.settle_runs``); the ranks whose
        watchdog had to be SIGKILLed are remembered."""
        stuck = settle_runs(self.every_run(), self.clock, self.grace_s)
        self.unsettled.update(run.spec.rank for run in stuck)

    def report(self, rank: int) -> RankReport:
        run = self.runs[rank]
        status = run.status if run.status is not None else -signal.SIGKILL
        return build_rank_report(run.spec, status, run.tails, run.process.cause)
