"""The one error tree of dtrain (DESIGN.md rule 5).

Every error a user can cause is a ``LauncherError`` carrying a one-line
message (what and where) and a hint (how to fix).  Only the edge (``launcher/cli/``) prints
them; everything below it raises.
"""

from __future__ import annotations


class LauncherError(Exception):
    """Base of every error dtrain reports to its user."""

    exit_code: int = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} ({self.hint})"
        return self.message


class UsageError(LauncherError):
    """A mistake in the command line or its inputs: exit code 2."""

    exit_code = 2


class HostfileError(UsageError):
    """A hostfile or host list that cannot be parsed."""


class PlanError(UsageError):
    """A placement that cannot be made (too many ranks, too few GPUs...)."""


class EnvError(UsageError):
    """A bad ``-x`` or ``--env-file`` entry."""


class HostConnectionError(LauncherError):
    """A host that cannot be reached or used before the job starts."""

    exit_code = 1
    hosts: frozenset[str] = frozenset()  # the hosts that could not be reached, where known
