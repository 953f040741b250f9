"""The restart loop: after a failed attempt, the whole job again (``--max-restarts``).

``policy.decide_restart`` says whether and after how long (the delay, or a backoff);
this loop waits that long, leaves out the hosts that failed (for ``--blacklist-cooldown``
if given), plans the next attempt on new rendezvous ports and runs it.  A change of
hosts from the discovery script starts the job again without counting a restart.  A
signal to dtrain at any moment, between attempts too, means no more attempts.  Every
wait and every "now" goes through the attempt's clock, so a test's fake clock runs
delays and cooldowns of minutes at once.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from launcher.base.errors import HostConnectionError, LauncherError
from launcher.core.config import JobConfig
from launcher.core.outcome import JobResult
from launcher.core.policy import RestartAfter, decide_restart, describe_status, hosts_left_out
from launcher.loop.supervisor import caught_signals
from launcher.run.attempt import Attempt, Finished, JobOutcome, attempt_end


def run_attempts(attempt: Attempt) -> JobOutcome:
    """The job's attempts: after a failure, the whole job again (``--max-restarts``) on new
    ports, once nothing of the failed attempt runs anywhere (the supervisor saw to that).
    From the end of the first attempt on, a signal to dtrain (Ctrl-C, SIGTERM, dtrain stop)
    at any moment, between attempts too, means no more attempts."""
    outcome = attempt.run()
    if not isinstance(outcome, Finished) or not attempt.config.several_attempts:
        return outcome
    signalled = threading.Event()
    with caught_signals(lambda signum: signalled.set(), enabled=True):
        return later_attempts(attempt, outcome, signalled)


def later_attempts(attempt: Attempt, outcome: Finished, signalled: threading.Event) -> JobOutcome:
    config, clock, ports = attempt.config, attempt.clock, set[int]()
    failed: dict[str, float] = {}  # host -> when it failed
    began = clock.now() - outcome.result.elapsed_s  # when the first attempt started
    while True:
        result = outcome.result
        ports.update([outcome.master_port] if outcome.master_port else [])
        failed.update({host: clock.now() for host in outcome.failed_hosts})
        limit = config.time_limit_s
        end = attempt_end(result, limit is not None and clock.now() - began >= limit)
        after = decide_restart(end, attempt.charged, config.max_restarts, config.restart_delay_s)
        if after is None:
            return outcome
        if signalled.is_set():  # (during the attempt's own end: the view, the record)
            attempt.record_end(outcome)
            return outcome
        after = announce_restart(attempt, outcome, after, failed)
        if clock.wait(signalled, after.delay_s):
            attempt.frontend.notice("dtrain: signalled while waiting: no restart")
            attempt.record_end(outcome)
            return outcome
        attempt = replace(
            attempt,
            number=attempt.number + 1,
            charged=after.attempt,
            avoid_ports=frozenset(ports),
            excluded=hosts_left_out(failed, clock.now(), config.placement.blacklist_cooldown_s),
            world_size=None if config.placement.elastic else result.world_size,
            cancelled=signalled,
            spent_s=clock.now() - began,
        )
        try:
            next_outcome = run_without_unreachable(attempt, failed)
        except LauncherError as exc:
            # The job ends as its last attempt did: that is the failure to report.
            attempt.frontend.notice(f"dtrain: cannot restart: {exc}")
            attempt.record_end(outcome)
            return outcome
        if not isinstance(next_outcome, Finished):
            return next_outcome
        outcome = next_outcome


def announce_restart(
    attempt: Attempt, outcome: Finished, after: RestartAfter, failed: dict[str, float]
) -> RestartAfter:
    """Say that the job starts again, after how long, and which failed hosts it leaves out;
    the restart, with its wait made long enough for a lost host's ranks to be gone."""
    config, result = attempt.config, outcome.result
    if outcome.lost_hosts:
        # A cut-off host's agent ends its ranks by itself after the host timeout and the
        # grace: the next attempt waits that long, so no rank of this one runs any more.
        # (A host whose ranks all died by a signal told us so: nothing to wait for.)
        after = replace(after, delay_s=max(after.delay_s, lost_host_wait_s(config)))
    attempt.frontend.notice(
        f"dtrain: {result.rescale}: starting again on its hosts (not counted as a restart)"
        if result.rescale
        else restart_notice(result, after, config.max_restarts, attempt.number)
    )
    # Announced: the failed hosts still left out when the next attempt starts (a cooldown
    # shorter than the wait lets them back).
    cooldown = config.placement.blacklist_cooldown_s
    starts_at = attempt.clock.now() + after.delay_s
    left_out = hosts_left_out(failed, starts_at, cooldown) & outcome.failed_hosts
    if left_out:
        back = f"; back after {cooldown:g} s" if cooldown is not None else ""
        hosts = ", ".join(sorted(left_out))
        attempt.frontend.notice(f"dtrain: leaving out {hosts} (failed{back})")
    return after


def lost_host_wait_s(config: JobConfig) -> float:
    """How long a lost host's agent may take to end its ranks by itself."""
    return config.ssh.host_timeout_s + config.grace_s


def run_without_unreachable(attempt: Attempt, failed: dict[str, float]) -> JobOutcome:
    """A restart: hosts that cannot be reached now are failed hosts too (left out, with the
    cooldown), and the attempt is planned again without them, while any are left."""
    cooldown, clock = attempt.config.placement.blacklist_cooldown_s, attempt.clock
    while True:
        try:
            return attempt.run()
        except HostConnectionError as exc:
            signalled = attempt.cancelled is not None and attempt.cancelled.is_set()
            if signalled or not exc.hosts or exc.hosts <= attempt.excluded:
                raise
            attempt.frontend.notice(
                f"dtrain: leaving out {', '.join(sorted(exc.hosts))} (unreachable: {exc.message})"
            )
            failed.update({host: clock.now() for host in exc.hosts})
            attempt = replace(attempt, excluded=hosts_left_out(failed, clock.now(), cooldown))


def restart_notice(result: JobResult, after: RestartAfter, max_restarts: int, attempt: int) -> str:
    failure = result.failure
    what = f"exit code {result.exit_code}"
    if failure is not None:  # "rank 2 on h3: the connection to h3 was lost", as the summaries
        what = f"rank {failure.rank} on {failure.host}: "
        what += failure.cause or describe_status(failure.status)
    return (
        f"dtrain: attempt {attempt} failed ({what}); restart {after.attempt} of "
        f"{max_restarts} in {after.delay_s:g} s"
    )
