"""``--host-discovery-script`` while an attempt runs: a change of hosts stops the attempt.

The script runs every few seconds; when a host of the job leaves its list, or an elastic
job could grow, the attempt is stopped (the restart loop starts the job again on the
hosts given, not counted as a restart).  Its waits go through the attempt's clock.
"""

from __future__ import annotations

import threading
from collections.abc import Collection

from launcher.base.clock import Clock
from launcher.base.errors import LauncherError
from launcher.base.log import LOG
from launcher.core.config import PlacementConfig
from launcher.core.plan import Plan
from launcher.core.policy import discovery_change
from launcher.loop.supervisor import Supervisor
from launcher.run.survey import discover_hosts

DISCOVERY_POLL_S = 3.0  # how often --host-discovery-script runs while an attempt runs


def watch_discovery(
    supervisor: Supervisor,
    plan: Plan,
    placement: PlacementConfig,
    excluded: Collection[str],
    clock: Clock,
) -> threading.Event:
    """Run the discovery script now and then while the attempt runs, and stop the attempt
    (``supervisor.rescale``) when its hosts changed; set the event returned to stop
    watching.  Without a script: nothing runs."""
    done = threading.Event()
    script = placement.host_discovery_script
    if script is None:
        return done
    running: dict[str, int] = {}
    for rank in plan.ranks:
        running[rank.host.name] = running.get(rank.host.name, 0) + 1
    grow_to = placement.max_np or placement.np or sum(h.slots for h in plan.hosts) * 1000

    def watch() -> None:
        while not clock.wait(done, DISCOVERY_POLL_S):
            try:
                found = {h.name: h.slots for h in discover_hosts(script)}
            except LauncherError as exc:
                LOG.warning("%s (the hosts stay as they are)", exc.message)
                continue
            change = discovery_change(running, found, excluded, plan.world_size, grow_to)
            if change is not None:
                supervisor.rescale(change)
                return

    threading.Thread(target=watch, name="dtrain-discovery", daemon=True).start()
    return done
