"""The interpreter's pace while dtrain loads and ranks start (base layer): the start-up GC
protocol and thread switching, all of it here.  Settings are counted: several jobs may run
in one process (a sweep, the Python API); the process's own come back after the last.

* ``loading``: imports make long-lived objects and no garbage, which the collector would
  look at again and again.  ``import launcher`` loads the code cache with it off; the
  ``dtrain`` command loads click and its commands (``cli/entry.py``), then the job's
  modules (``cli/main.start_loaded_job``), with it off and then frozen (``gc.freeze``)
  until ``thaw`` or the last job's end: a twentieth of a short local job's launcher.
* ``Interpreter.starting_ranks``: while the loop starts thousands of ranks (busy for
  seconds), the other threads (readers, the job directory's writer, SSH pumps) get the GIL
  every ``START_SWITCH_S``, not CPython's 5 ms (the writer fell seconds behind at 1,000
  simulated hosts), and the collector is held off (8,000 ranks make some fifty long-lived
  objects each: six full collections of half a million objects, a fifth of the job's CPU).
* ``Interpreter.freeze``: once they have started, what the job holds is out of the
  collector's reach until the last job's end (``running_job``).
"""

from __future__ import annotations

import gc
import sys
from _thread import allocate_lock  # (threading's Lock, without loading threading)
from collections.abc import Iterator
from contextlib import contextmanager

START_SWITCH_S = 0.0005  # the GIL's switch interval while ranks start (CPython's: 0.005)


class Interpreter:
    """The process's interpreter settings, while jobs run and their ranks start."""

    def __init__(self) -> None:
        self.lock = allocate_lock()
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


@contextmanager
def loading(freeze: bool = False) -> Iterator[None]:
    """While modules load, no cyclic collection; with ``freeze``, what the process holds
    then is left out of the collections (until ``thaw``); then the collector is as it was."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if collecting:
            gc.enable()


def thaw() -> None:
    """What ``loading`` froze is the collector's again."""
    gc.unfreeze()
