"""The Python API (an edge beside ``cli/``): ``launch`` a function on every rank and get each
rank's return value, or ``start`` it and get a handle.

The options are ``dtrain run``'s, built into the same ``JobConfig`` by the same parser and
checks, and the job runs through the same job layer: see docs/python-api.md.
"""

from __future__ import annotations

from launcher.api.errors import JobFailed, RankFailed
from launcher.api.handle import Job, start
from launcher.api.launching import Result, launch
from launcher.base.errors import UsageError

__all__ = ["Job", "JobFailed", "RankFailed", "Result", "UsageError", "launch", "start"]
