"""The interpreter's pace while ranks start (base layer): thread switching and the collector.

A launcher is one loop and many threads that mostly wait on I/O (the ranks' readers, the job
directory's writer, the SSH pumps).  While the loop starts thousands of ranks it is busy for
seconds, and two of CPython's defaults work against the other threads meanwhile:

* Threads switch every 5 ms (``sys.getswitchinterval``).  Each file operation of the job
  directory's writer lets the GIL go, and gets it back from the busy loop only when the
  interval is over: once per operation, so the writer fell seconds behind and the job's
  end waited for it (part of the seconds between the ranks' exit and ``run_job``'s return
  at 1,000 simulated hosts).  While ranks start, threads switch every ``START_SWITCH_S``.
* The cyclic collector runs a full collection each time the objects it tracks have grown by
  a quarter.  Starting 8,000 ranks makes some fifty long-lived objects for each (its run,
  readers, tails, states): six full collections of a growing heap of half a million
  objects, a fifth of the whole job's CPU time.  While ranks start (which makes no garbage
  cycles to speak of) the collector is held off; once they have started, what the job
  holds is moved out of its reach (``gc.freeze``) until the last job's end, so that the
  collections of a running job look only at what is new.

Settings are counted: several jobs may run at once in one process (a sweep, the Python
API), and the process's own settings come back when the last one is done with them.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

START_SWITCH_S = 0.0005  # the GIL's switch interval while ranks start (CPython's: 0.005)


class Interpreter:
    """The process's interpreter settings, while jobs run and their ranks start."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs = 0  # jobs running now
        self.frozen = False  # a job's objects are out of the collector's reach
        self.starts = 0  # starts of ranks under way now
        self.saved_switch_s = 0.0  # the switch interval before the first of them
        self.collecting = True  # the collector was on before the first of them

    @contextmanager
    def running_job(self) -> Iterator[None]:
        """While a job runs; at the last job's end, what was frozen is the collector's again."""
        with self.lock:
            self.jobs += 1
        try:
            yield
        finally:
            with self.lock:
                self.jobs -= 1
                if self.jobs == 0 and self.frozen:
                    gc.unfreeze()
                    self.frozen = False

    @contextmanager
    def starting_ranks(self) -> Iterator[None]:
        """While the loop starts ranks: threads switch every ``START_SWITCH_S`` and no cyclic
        collection runs."""
        with self.lock:
            if self.starts == 0:
                self.saved_switch_s = sys.getswitchinterval()
                sys.setswitchinterval(min(self.saved_switch_s, START_SWITCH_S))
                self.collecting = gc.isenabled()
                gc.disable()
            self.starts += 1
        try:
            yield
        finally:
            with self.lock:
                self.starts -= 1
                if self.starts == 0:
                    sys.setswitchinterval(self.saved_switch_s)
                    if self.collecting:
                        gc.enable()

    def freeze(self) -> None:
        """What the process holds now (a started job's runs, readers, states) is left out of
        the collections until the last job ends.  What an earlier freeze kept (the attempt
        before a restart, another job of a sweep) is collected first: what died since is
        freed now, not kept until the end."""
        with self.lock:
            if not self.jobs:
                return
            if self.frozen:
                gc.unfreeze()
                gc.collect()
            gc.freeze()
            self.frozen = True


INTERPRETER = Interpreter()  # the process's
