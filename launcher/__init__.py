"""dtrain: a launcher for distributed training (``dtrain``, ``python -m launcher``), and its
Python API: ``from launcher import launch, start`` (docs/python-api.md)."""

from __future__ import annotations

from launcher.base.interpreter import loading

with loading():  # (long-lived objects, no garbage: base/interpreter.py)
    from launcher.base import codecache

    codecache.install()  # before any module of dtrain defines a dataclass

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
