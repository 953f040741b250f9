"""Whether a process still runs, asked by its pid (the one check dtrain makes)."""

from __future__ import annotations

import os

PROC = "/proc"


def process_alive(pid: int) -> bool:
    """``pid`` names a process that has not ended, ours or another user's.

    A zombie has ended: only its exit status waits for a parent to reap it, and in a
    container (or once its parent is gone) no one may.  Where there is no ``/proc``
    (macOS), a process that exists counts as running.
    """
    if pid <= 0:  # 0 and -1 would ask about a process group, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process (a launcher on a shared job directory): it exists
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:  # reaped since os.kill, unless there is no /proc at all
        return not os.path.isdir(f"{PROC}/self")
    except OSError:
        return True
    # The state follows the command name in parentheses, which may itself hold ")".
    fields = stat.rsplit(b")", 1)[-1].split()
    return not fields or fields[0] != b"Z"
