"""Jobs: ids now; the job directory comes with ``dtrain logs``."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable


def new_job_id(clock: Callable[[], float] = time.time) -> str:
    """A sortable, unique id: ``20261122-035012-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(clock())) + "-" + secrets.token_hex(3)
