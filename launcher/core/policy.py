"""What to do when something happens to the job: ``decide(state, event)`` (pure).

The supervisor feeds every event through ``decide`` and carries out the
action it returns (DESIGN.md rule 3).  The rules:

* all ranks exited 0 -> done, exit 0;
* the first rank to exit non-zero (or die from a signal) fails the job: stop
  the others and exit with its code (128 + N for signal N); "first" by the time
  it exited, not by when the news arrived;
* the first SIGINT/SIGTERM to dtrain stops the job gracefully, a second one
  kills at once; the exit code is 128 + that signal;
* a time limit (``--hang-timeout``, ``--start-timeout``, ``--timeout``) stops the job
  like a failure; the exit code is 124, as timeout(1)'s.

Parameter-server jobs (``roles`` set) follow the task roles instead:

* the chief's exit ends the job: the others are stopped and dtrain exits with
  the chief's code (a failing chief is the failure reported);
* a ps task exiting, whatever its code, fails the job (ps tasks never end by
  themselves);
* a worker that fails is restarted in place while its restart budget lasts;
  otherwise the chief carries on without it; an evaluator may come and go.
"""

from __future__ import annotations

import signal
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from launcher.base.frozen import evolve


@dataclass(frozen=True)
class RankExited:
    """A rank's program exited (its status as the watchdog reported it)."""

    rank: int
    status: int  # exit code, or -N for death by signal N
    time: float = 0.0  # when it exited (the launcher's clock): the first failure is the earliest


@dataclass(frozen=True)
class Interrupted:
    """dtrain got SIGINT or SIGTERM."""

    signum: int


@dataclass(frozen=True)
class GraceExpired:
    """The grace after SIGTERM is over: what still runs is killed."""


@dataclass(frozen=True)
class TimedOut:
    """--hang-timeout, --start-timeout or --timeout ran out: stop the job, exit 124."""

    reason: str


TIMEOUT_EXIT = 124  # as timeout(1)


@dataclass(frozen=True)
class HostsChanged:
    """--host-discovery-script gave other hosts while the job ran (one left, or more slots
    for an elastic job): stop this attempt; the job starts again on the hosts given."""

    reason: str


RESCALE_EXIT = 1  # an attempt stopped for a host change (the job goes on in the next one)

Event = RankExited | Interrupted | GraceExpired | TimedOut | HostsChanged


@dataclass(frozen=True)
class Continue:
    """Nothing to do."""


@dataclass(frozen=True)
class StopAll:
    """SIGTERM every running rank; SIGKILL after the grace period."""


@dataclass(frozen=True)
class KillAll:
    """SIGKILL every running rank now."""


@dataclass(frozen=True)
class Finish:
    """The job is over, with this exit code."""

    exit_code: int


@dataclass(frozen=True)
class Restart:
    """Start this rank again, with the same spec."""

    rank: int


Action = Continue | StopAll | KillAll | Finish | Restart
CONTINUE = Continue()  # (one for every event that changes nothing: thousands of exits)


@dataclass(frozen=True)
class Failure:
    """The rank whose failure fails the job: its status, and when it exited."""

    rank: int
    status: int
    time: float = 0.0


@dataclass(frozen=True)
class JobState:
    """What ``decide`` knows of the job so far."""

    running: int  # ranks still running (each rank's exit comes once: a count, not a set)
    failure: Failure | None = None  # the first rank that failed
    interrupt: int | None = None  # the signal that stopped dtrain
    stopping: bool = False
    killing: bool = False
    roles: Mapping[int, str] = field(default_factory=dict)  # set: parameter-server rules
    restarts_left: Mapping[int, int] = field(default_factory=dict)
    chief_status: int | None = None
    timeout: str | None = None  # why a time limit stopped the job
    rescale: str | None = None  # why the discovery script's hosts stopped this attempt

    @property
    def exit_code(self) -> int:
        if self.failure is not None:
            return exit_code_of(self.failure.status)
        if self.chief_status is not None:
            return exit_code_of(self.chief_status)
        if self.timeout is not None:
            return TIMEOUT_EXIT
        if self.rescale is not None and self.interrupt is None:
            return RESCALE_EXIT
        if self.interrupt is not None:
            return 128 + self.interrupt
        return 0


def exit_code_of(status: int) -> int:
    """A wait status as a shell would report it: 128 + N for signal N."""
    return 128 - status if status < 0 else status


def describe_status(status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"killed by {name}"
    return f"exit code {status}"


def start_state(
    ranks: Collection[int],
    roles: Mapping[int, str] | None = None,
    worker_restarts: int = 0,
) -> JobState:
    roles = dict(roles or {})
    budget = {r: worker_restarts for r, role in roles.items() if role == "worker"}
    return JobState(running=len(ranks), roles=roles, restarts_left=budget)


def decide(state: JobState, event: Event) -> tuple[JobState, Action]:
    if isinstance(event, TimedOut | HostsChanged):
        if state.stopping:
            return state, Continue()
        if isinstance(event, TimedOut):
            state = replace(state, timeout=event.reason, stopping=True)
        else:
            state = replace(state, rescale=event.reason, stopping=True)
        return state, (StopAll() if state.running else Finish(state.exit_code))
    if isinstance(event, RankExited) and state.roles and not state.stopping:
        return decide_by_role(state, event)
    if isinstance(event, RankExited):
        return decide_exit(state, event)
    if isinstance(event, Interrupted):
        if state.stopping:  # (a signal while stopping for a failure: remembered, no restart)
            state = replace(state, interrupt=state.interrupt or event.signum)
            if state.killing:
                return state, Continue()
            return replace(state, killing=True), KillAll()
        state = replace(state, interrupt=event.signum, stopping=True)
        return state, (StopAll() if state.running else Finish(state.exit_code))
    # GraceExpired
    if state.running and not state.killing:
        return replace(state, killing=True), KillAll()
    return state, Continue()


def decide_exit(state: JobState, event: RankExited) -> tuple[JobState, Action]:
    """A rank exited (no roles, or the job is stopping).  At the end of a job of thousands
    of ranks, their exits come by the thousand: the state is copied with ``evolve``."""
    state = evolve(state, running=state.running - 1)
    if event.status != 0:
        failure = Failure(event.rank, event.status, event.time)
        if state.failure is None and not state.stopping:
            state = evolve(state, failure=failure, stopping=True)
            return state, (Finish(state.exit_code) if not state.running else StopAll())
        if state.failure is not None and event.time < state.failure.time:
            # Its news came later, but it failed first (before anything was stopped for the
            # failure we knew of): it is the job's first failure.
            state = evolve(state, failure=failure)
    if not state.running:
        return state, Finish(state.exit_code)
    return state, CONTINUE


def decide_by_role(state: JobState, event: RankExited) -> tuple[JobState, Action]:
    """A rank of a parameter-server job exited while the job runs."""
    role = state.roles.get(event.rank, "worker")
    left = state.restarts_left.get(event.rank, 0)
    if role == "worker" and event.status != 0 and left > 0:
        budget = {**state.restarts_left, event.rank: left - 1}
        return replace(state, restarts_left=budget), Restart(event.rank)
    state = replace(state, running=state.running - 1)
    if role == "chief":
        failure = Failure(event.rank, event.status) if event.status != 0 else None
        state = replace(state, chief_status=event.status, failure=failure, stopping=True)
    elif role == "ps":
        # A ps task never ends by itself: even a clean exit fails the job (code 1 then).
        status = event.status or 1
        state = replace(state, failure=Failure(event.rank, status), stopping=True)
    if state.stopping:
        return state, (StopAll() if state.running else Finish(state.exit_code))
    if not state.running:
        return state, Finish(state.exit_code)
    return state, Continue()


# -- whole-job restarts (--max-restarts) ------------------------------------


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended, as the failed-host rule needs it."""

    host: str
    status: int | None  # None: never reported
    lost: bool  # its host's connection or agent was lost
    stopped: bool  # dtrain signalled it (the job was stopping)


def hosts_left_out(
    failed: Mapping[str, float], now: float, cooldown_s: float | None
) -> frozenset[str]:
    """The failed hosts (host -> when it failed) still left out at ``now``: all of them, or
    with ``--blacklist-cooldown`` those that failed less than that long ago."""
    return frozenset(
        host for host, when in failed.items() if cooldown_s is None or now - when < cooldown_s
    )


def failed_hosts(ends: Sequence[RankEnd]) -> frozenset[str]:
    """Hosts to leave out of later attempts: lost ones, and those all of whose ranks (two or
    more) died by a signal that dtrain did not send, which points at the machine (the OOM
    killer, a GPU fault) rather than the program.  A host's only rank dying tells nothing
    of the machine: it is not left out for that."""
    # Only the hosts with a rank that points at the machine are grouped (none, in most jobs).
    suspects = {
        end.host
        for end in ends
        if end.lost or (end.status is not None and end.status < 0 and not end.stopped)
    }
    by_host: dict[str, list[RankEnd]] = {}
    for end in ends:
        if end.host in suspects:
            by_host.setdefault(end.host, []).append(end)
    return frozenset(
        host
        for host, ranks in by_host.items()
        if any(r.lost for r in ranks)
        or (
            len(ranks) > 1
            and all(r.status is not None and r.status < 0 and not r.stopped for r in ranks)
        )
    )


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt of the job ended, as the restart decision needs it."""

    exit_code: int
    interrupted: bool  # dtrain was signalled (Ctrl-C, SIGTERM, dtrain stop): never restart
    failed_rank: int | None = None
    out_of_time: bool = False  # the job's --timeout (for all attempts) has run out
    hosts_changed: bool = False  # stopped for the discovery script's hosts: not a failure


@dataclass(frozen=True)
class RestartAfter:
    """Start the next attempt after ``delay_s``."""

    attempt: int  # the number of the attempt to start (the first is 0)
    delay_s: float


FIRST_DELAY_S = 1.0  # the default backoff: 1 s, 2 s, 4 s ... up to MAX_DELAY_S
MAX_DELAY_S = 30.0


def discovery_change(
    running: Mapping[str, int],
    discovered: Mapping[str, int],
    excluded: Collection[str],
    world_size: int,
    grow_to: int | None,
) -> str | None:
    """What the discovery script's latest hosts (host -> slots) change for a running attempt
    (``running``: host -> its ranks): a host that left the list (its ranks must go), or, for
    an elastic job (``grow_to``: its largest size), more ranks that would fit now.  None:
    nothing to do."""
    gone = [host for host in running if host not in discovered]
    if gone:
        return f"{', '.join(gone)} left the --host-discovery-script's hosts"
    fewer = [host for host, ranks in running.items() if discovered[host] < ranks]
    if fewer:
        return "the --host-discovery-script gives fewer slots on " + ", ".join(
            f"{host} ({discovered[host]} for {running[host]} ranks)" for host in fewer
        )
    if grow_to is not None:
        slots = sum(n for host, n in discovered.items() if host not in excluded)
        if world_size < min(grow_to, slots):
            new = [h for h in discovered if h not in running and h not in excluded]
            added = f" ({', '.join(new)})" if new else ""
            return (
                f"the --host-discovery-script gives more slots{added}: "
                f"{min(grow_to, slots)} ranks fit, {world_size} run"
            )
    return None


def decide_restart(
    end: AttemptEnd, attempt: int, max_restarts: int, delay_s: float | None = None
) -> RestartAfter | None:
    """After attempt ``attempt`` (0-based) ended: the next attempt, or None (the job ends with
    this attempt's exit code).  A success or a signal to dtrain ends the job; a failure
    restarts while fewer than ``max_restarts`` restarts were made, after ``delay_s`` (given)
    or a backoff doubling from 1 s up to 30 s.  No restart once the job's --timeout ran out
    (a hang or a late start, which fail an attempt, do restart)."""
    if end.interrupted or end.out_of_time:
        return None
    if end.hosts_changed:  # not a failure: again at once, and not counted as a restart
        return RestartAfter(attempt, 0.0)
    if end.exit_code == 0 or attempt >= max_restarts:
        return None
    # (the exponent capped: 1.0 * 2**1024 is no float, and attempt 1024 may come)
    backoff = min(FIRST_DELAY_S * 2 ** min(attempt, 16), MAX_DELAY_S)
    delay = delay_s if delay_s is not None else backoff
    return RestartAfter(attempt + 1, delay)
