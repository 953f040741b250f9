"""``--host-discovery-script`` while an attempt runs: a change of hosts stops the attempt.

The script runs every few seconds; when a host of the job leaves its list, or an elastic
job could grow, the attempt is stopped (the restart loop starts the job again on the
hosts given, not counted as a restart).  A host that failed stays out even when the script
lists it again (until ``--blacklist-cooldown``, as horovodrun): said once per host in an
attempt, since the script alone looks as if it should bring it back.  Its waits go through
the attempt's clock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable

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
    notice: Callable[[str], None],
) -> threading.Event:
    """Run the discovery script now and then while the attempt runs, and stop the attempt
    (``supervisor.rescale``) when its hosts changed; set the event returned to stop
    watching.  ``notice`` says (once per host) that a failed host listed again stays out.
    Without a script: nothing runs."""
    done = threading.Event()
    script = placement.host_discovery_script
    if script is None:
        return done
    running: dict[str, int] = {}
    for rank in plan.ranks:
        running[rank.host.name] = running.get(rank.host.name, 0) + 1
    grow_to = placement.max_np or placement.np or sum(h.slots for h in plan.hosts) * 1000
    told: set[str] = set()  # failed hosts already said to stay out

    def watch() -> None:
        while not clock.wait(done, DISCOVERY_POLL_S):
            try:
                found = {h.name: h.slots for h in discover_hosts(script)}
            except LauncherError as exc:
                LOG.warning("%s (the hosts stay as they are)", exc.message)
                continue
            for line in stays_out_notices(found, excluded, told, placement.blacklist_cooldown_s):
                notice(line)
            change = discovery_change(running, found, excluded, plan.world_size, grow_to)
            if change is not None:
                supervisor.rescale(change)
                return

    threading.Thread(target=watch, name="dtrain-discovery", daemon=True).start()
    return done


def stays_out_notices(
    listed: Iterable[str], excluded: Collection[str], told: set[str], cooldown_s: float | None
) -> list[str]:
    """The lines that say a failed host the script lists stays out, for the hosts not told
    of yet (``told`` gets them): the script alone never brings a failed host back."""
    lines = []
    for host in listed:
        if host in excluded and host not in told:
            told.add(host)
            why = f"{host} is listed again but stays out after its failure"
            lines.append(
                f"dtrain: {why}; --blacklist-cooldown lets it back"
                if cooldown_s is None
                else f"dtrain: {why} (--blacklist-cooldown {cooldown_s:g} s: it rejoins at "
                "the job's next start after that)"
            )
    return lines
