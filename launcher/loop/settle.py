"""Until nothing of an attempt's ranks runs (loop layer): their watchdogs' exits.

Each rank's watchdog ends what its program left (within the grace) and exits; a restart
starts only after that.  Nobody announces a watchdog's exit to anything the clock could
wait on, so it is looked for now and then, more rarely as the wait goes on, for every
rank at once: settling never waits on one rank (or one host) after another.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

from launcher.base.clock import Clock
from launcher.base.log import LOG
from launcher.loop.rankrun import RankRun

SETTLE_EXTRA_S = 2.0  # beyond the grace, for the watchdogs to exit once the ranks did
SETTLE_POLL_S = (0.001, 0.05)  # the first and the longest pause between looks at them


def settle_runs(runs: Sequence[RankRun], clock: Clock, grace_s: float) -> list[RankRun]:
    """Wait until nothing of ``runs`` runs; the runs whose watchdog was still there at the
    end (SIGKILLed all at once and waited for together, so that settling takes at most the
    grace and twice ``SETTLE_EXTRA_S``, however many are stuck)."""
    stuck = wait_gone(runs, clock, clock.now() + grace_s + SETTLE_EXTRA_S)
    for run in stuck:
        LOG.debug("rank %d: its watchdog is still there: SIGKILL", run.spec.rank)
        run.process.signal(signal.SIGKILL)  # the group too (the local fallback)
    wait_gone(stuck, clock, clock.now() + SETTLE_EXTRA_S)
    return stuck


def wait_gone(runs: Sequence[RankRun], clock: Clock, deadline: float) -> list[RankRun]:
    """Wait until nothing of ``runs`` runs, at most until ``deadline``; those left."""
    left, pause = list(runs), SETTLE_POLL_S[0]
    while True:
        left = [run for run in left if not run.process.gone(0.0)]
        now = clock.now()
        if not left or now >= deadline:
            return left
        clock.sleep(min(pause, deadline - now))
        pause = min(pause * 2, SETTLE_POLL_S[1])
