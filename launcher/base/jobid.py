"""Job ids (pure; the clock comes in): light, so a local job's agent can start before the
rest of dtrain is loaded (``run/early.start_agent_early``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def new_job_id(clock: Callable[[], float] = time.time) -> str:
    """A sortable, unique id: ``20261122-035012-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(clock())) + "-" + os.urandom(3).hex()
