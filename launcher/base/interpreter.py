"""The interpreter's pace while dtrain loads and ranks start (base layer): thread switching
and the cyclic collector.  The start-up GC protocol, all of it here:

* Loading (``loading``): importing makes long-lived objects and no garbage, and the
  collector would look at them again and again meanwhile (and at every full collection
  after).  ``import launcher`` loads the code cache with the collector off; the ``dtrain``
  command loads click and its commands (``cli/entry.py``), then the job's modules
  (``cli/main.start_loaded_job``), with it off and then frozen (``gc.freeze``): about a
  twentieth of a short local job's launcher.  ``thaw`` (``cli/main.start_job``, on every
  way out) or the last job's end gives it back.  A program that imports dtrain (the API)
  loads it as any module.
* While ranks start (``Interpreter.starting_ranks``): a launcher is one loop and many
  threads that mostly wait on I/O (the ranks' readers, the job directory's writer, the SSH
  pumps).  While the loop starts thousands of ranks it is busy for seconds, and two of
  CPython's defaults work against the other threads meanwhile.  Threads switch every 5 ms
  (``sys.getswitchinterval``): each file operation of the job directory's writer lets the
  GIL go and got it back from the busy loop only when the interval was over, so the writer
  fell seconds behind and the job's end waited for it (at 1,000 simulated hosts); they
  switch every ``START_SWITCH_S`` instead.  And the collector runs a full collection each
  time its objects have grown by a quarter: starting 8,000 ranks makes some fifty
  long-lived objects for each (six full collections of half a million objects, a fifth of
  the job's CPU time), and no garbage cycles to speak of, so it is held off.
* Once they have started (``Interpreter.freeze``), what the job holds is moved out of the
  collector's reach until the last job's end (``Interpreter.running_job``), so that the
  collections of a running job look only at what is new.

Settings are counted: several jobs may run at once in one process (a sweep, the Python
API), and the process's own settings come back when the last one is done with them.
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
