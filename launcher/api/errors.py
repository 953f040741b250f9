"""The Python API's exceptions: a job that did not succeed, and the rank that failed first.

They are ``LauncherError``s like the command line's (a ``UsageError`` is the same class
``dtrain`` turns into ``dtrain: error: ...`` and exit code 2), and carry what ``dtrain run``
shows: the job's summary lines, its exit code and state, and for a rank, what its function
raised, with the traceback from the host it ran on.
"""

from __future__ import annotations

from collections.abc import Sequence

from launcher.base.errors import LauncherError


class JobFailed(LauncherError):
    """The job ended without every rank's result: how (``exit_code``, ``state``) and the
    summary ``dtrain run`` prints (``summary``)."""

    def __init__(
        self,
        message: str,
        *,
        job_id: str,
        exit_code: int,
        state: str,
        summary: Sequence[str] = (),
        hint: str | None = None,
    ) -> None:
        super().__init__(message, hint)
        self.job_id = job_id
        self.exit_code = exit_code
        self.state = state
        self.summary = tuple(summary)


class RankFailed(JobFailed):
    """A rank failed (the first one): where, why, and what its function raised (the type's
    name, the message and the traceback, as text from the rank's host); the other ranks were
    stopped, as ``dtrain run`` stops them."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        host: str,
        cause: str,
        exc_type: str | None = None,
        exc_message: str | None = None,
        remote_traceback: str | None = None,
        job_id: str,
        exit_code: int,
        state: str,
        summary: Sequence[str] = (),
        hint: str | None = None,
    ) -> None:
        super().__init__(
            message, job_id=job_id, exit_code=exit_code, state=state, summary=summary, hint=hint
        )
        self.rank = rank
        self.host = host
        self.cause = cause
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            where = f"rank {self.rank} on {self.host}"
            text += f"\n\nRemote traceback ({where}):\n{self.remote_traceback.rstrip()}"
        return text
