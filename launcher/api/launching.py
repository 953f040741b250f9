"""``launch(fn, ...)``: ``fn`` on every rank, through the same path as ``dtrain run``.

The options become ``dtrain run``'s config (``options.py``), the call travels in the ranks'
environment (``payload.py``), and ``run/job.run_job`` runs the job in this process, with
this process's stdout as its terminal (``view/callerview.py``): the same planning, survey,
transports, job directory, restarts and teardown.  Ctrl-C (a notebook's "interrupt
kernel") is the supervisor's to handle while the ranks run, as in ``dtrain run``, and its
signal handlers are the caller's again once ``launch`` returns; in a thread other than the
main one none is installed.  The ranks' results are read back from the job directory.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from launcher.api.errors import JobFailed, RankFailed
from launcher.api.options import build_config
from launcher.api.payload import Packed, RankError, pack_call, read_result
from launcher.api.typedoptions import Options
from launcher.base.jobid import new_job_id
from launcher.core.config import JobConfig, validate_config
from launcher.core.outcome import JobResult
from launcher.core.policy import describe_status
from launcher.core.results import ERROR, PAYLOAD_VARIABLE, RUNNER
from launcher.streams.jobdir import JobDir
from launcher.streams.joblist import jobs_root

if TYPE_CHECKING:  # (launch()'s keywords typed; typing has Unpack from Python 3.11)
    from typing_extensions import Unpack
elif sys.version_info >= (3, 11):
    from typing import Unpack


@dataclass(frozen=True)
class Result:
    """A finished job: every rank's return value (``values[i]``, ``rank(i)``), the job's id
    (for ``dtrain logs``) and how it ended."""

    job_id: str
    values: tuple[Any, ...]
    exit_code: int
    state: str
    elapsed_s: float
    job_dir: str

    def rank(self, index: int) -> Any:
        """What rank ``index``'s function returned."""
        return self.values[index]


@dataclass(frozen=True)
class Prepared:
    """A call ready to run: the job's config (checked), the packed call, the environment."""

    config: JobConfig
    packed: Packed
    environ: Mapping[str, str]

    @property
    def job_id(self) -> str:
        return self.config.job_id or ""

    @property
    def job_path(self) -> Path:
        return jobs_root(self.config.job_dir, self.environ) / self.job_id


def prepare(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    options: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> Prepared:
    """Check everything that can be checked before anything starts: the call can travel, the
    options make a valid config.  Raises ``UsageError`` as ``dtrain run`` would."""
    if not isinstance(args, list | tuple):
        raise TypeError(f"args must be a tuple of the function's arguments, not {args!r}")
    packed = pack_call(fn, args, kwargs)
    config = build_config(options, (RUNNER, packed.name), packed.variables)
    config = validate_config(replace(config, job_id=config.job_id or new_job_id()))
    return Prepared(config, packed, dict(os.environ if environ is None else environ))


def launch(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    np: int | None = None,
    hosts: str | Sequence[str] | None = None,
    hostfile: str | os.PathLike[str] | None = None,
    **options: Unpack[Options],
) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank, as ``dtrain run`` runs a program, and
    return a ``Result`` with what each rank returned.  ``options``: ``dtrain run``'s, named by
    the long flag with ``_`` for ``-`` (``max_restarts=2``), ``env`` for ``-x``;
    ``quiet=True`` keeps the ranks' lines in the job directory only.  A rank that fails
    raises ``RankFailed``; a bad option ``UsageError``, before anything starts.  With
    ``dry_run=True``: the plan (a record per rank), and nothing starts."""
    given = {"np": np, "hosts": hosts, "hostfile": hostfile, **options}
    prepared = prepare(fn, args, kwargs, given)
    from launcher.run.attempt import DryRun

    outcome = run_prepared(prepared, sys.stdout, sys.stderr)
    if isinstance(outcome, DryRun):
        return [shortened(entry) for entry in outcome.entries]
    return collect(prepared, outcome.result, sys.stderr)


def shortened(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A dry run's record of a rank, the pickled call's pieces shown by their size."""
    env = entry.get("env")
    if not isinstance(env, Mapping):
        return dict(entry)
    piece = f"{PAYLOAD_VARIABLE}_"
    return {
        **entry,
        "env": {
            name: f"<{len(value)} characters>" if name.startswith(piece) else value
            for name, value in env.items()
        },
    }


def run_prepared(prepared: Prepared, out: TextIO, err: TextIO) -> Any:
    """The job, run here (``run_job``, as ``dtrain run`` calls it): its outcome."""
    from launcher.run.job import run_job
    from launcher.view.callerview import CallerFrontend

    if prepared.config.verbose:
        from launcher.cli.main import show_what_dtrain_does

        show_what_dtrain_does(err)
    frontend = CallerFrontend(prepared.config.view, out, err)
    return run_job(prepared.config, prepared.environ, frontend, checked=True)  # (prepare's)


def collect(prepared: Prepared, result: JobResult, err: TextIO) -> Result:
    """Every rank's value; or the exception that says how the job failed.  An interrupt
    (SIGINT) is raised again as ``KeyboardInterrupt`` once the ranks are gone."""
    from launcher.view.reports import format_failure

    job = JobDir(prepared.job_path)
    state = job.state()
    if result.exit_code == 0:
        values = [rank_value(prepared, rank, state) for rank in range(result.world_size)]
        return Result(
            prepared.job_id, tuple(values), 0, state, result.elapsed_s, str(prepared.job_path)
        )
    summary = format_failure(result)
    if result.interrupt == signal.SIGINT and result.failure is None:
        say(err, summary)
        raise KeyboardInterrupt
    raise failure_of(prepared, result, state, summary)


def rank_value(prepared: Prepared, rank: int, state: str) -> Any:
    sent = read_result(prepared.job_path, rank, prepared.packed.token)
    if sent is None or sent[0] == ERROR:
        raise JobFailed(
            f"rank {rank} ended without sending back a result",
            job_id=prepared.job_id,
            exit_code=0,
            state=state,
            hint="did the function call sys.exit() or os._exit()? see: "
            f"dtrain logs {prepared.job_id}",
        )
    return sent[1]


def failure_of(
    prepared: Prepared, result: JobResult, state: str, summary: Sequence[str]
) -> JobFailed:
    """The exception for a failed job: the first failed rank's, with what it raised."""
    job_id, code = prepared.job_id, result.exit_code
    failure = result.failure
    if failure is None:
        last = last_message(summary) or f"job {job_id} {state}"
        return JobFailed(last, job_id=job_id, exit_code=code, state=state, summary=summary)
    sent = read_result(prepared.job_path, failure.rank, prepared.packed.token)
    cause = failure.cause or describe_status(failure.status)
    where = f"rank {failure.rank} on {failure.host}"
    raised = sent[1] if sent is not None and isinstance(sent[1], RankError) else None
    return RankFailed(
        f"{where} failed ({cause})"
        if raised is None
        else f"{where} raised {raised.type}: {raised.message}",
        rank=failure.rank,
        host=failure.host,
        cause=cause,
        exc_type=None if raised is None else raised.type,
        exc_message=None if raised is None else raised.message,
        remote_traceback=None if raised is None else raised.traceback,
        job_id=job_id,
        exit_code=code,
        state=state,
        summary=summary,
        hint=None
        if raised is not None
        else runner_hint(failure.last_lines) or f"see: dtrain logs {job_id}",
    )


def last_message(summary: Sequence[str]) -> str | None:
    """The summary's last ``dtrain: ...`` message on one line (``fit`` broke it to fit the
    terminal, going on under an indent)."""
    from launcher.view.reports import INDENT

    parts: list[str] = []
    for line in reversed(summary):
        if line.startswith(INDENT):
            parts.insert(0, line.strip())
            continue
        return " ".join([line.removeprefix("dtrain: "), *parts])
    return None


def runner_hint(last_lines: Iterable[str]) -> str | None:
    """A rank whose Python has no dtrain cannot run the function: say how to fix it."""
    if any("No module named 'launcher" in line for line in last_lines):
        return (
            "the ranks run python -m launcher.remote.fnrunner: install dtrain for the hosts' "
            "python (pip install dtrain), or name one that has it with python=PATH"
        )
    return None


def say(err: TextIO, lines: Iterable[str]) -> None:
    try:
        for line in lines:
            err.write(line + "\n")
        err.flush()
    except (OSError, ValueError):
        pass  # the caller's stderr is gone: the job directory has the summary
