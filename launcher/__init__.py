"""dtrain: a launcher for distributed training (``dtrain``, ``python -m launcher``), and its
Python API: ``from launcher import launch, start`` (docs/python-api.md)."""

from __future__ import annotations

import gc

# What this loads (dataclasses, inspect, pathlib, typing: long-lived objects, no garbage)
# loads with the cyclic collector off, which would otherwise look at all of it again at
# every collection meanwhile; then the collector is as it was (cli/entry.py does the same
# for the command line).
_collecting = gc.isenabled()
gc.disable()
try:
    from launcher.base import codecache

    codecache.install()  # before any module of dtrain defines a dataclass
finally:
    if _collecting:
        gc.enable()
    del _collecting

TYPE_CHECKING = False  # (typing is not imported: every rank's runner imports this package)
if TYPE_CHECKING:
    from launcher.api import Job, JobFailed, RankFailed, Result, UsageError, launch, start

__all__ = ["Job", "JobFailed", "RankFailed", "Result", "UsageError", "launch", "start"]
API = frozenset(__all__)


def __getattr__(name: str) -> object:
    """The API's names, loaded when first asked for: ``import launcher`` (and every rank's
    runner, and ``dtrain`` itself) stays light."""
    if name in API:
        import launcher.api

        return getattr(launcher.api, name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")
