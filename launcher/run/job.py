"""A job from its config to its result (the job layer's entry): ``run_job``.

``run_job`` is what ``dtrain run`` and ``dtrain ps`` call: it validates the config,
resolves what every attempt shares (the Slurm allocation, ``-x`` and ``--env-file``,
the job id, the job directory's checkpoint folder) and hands the first ``Attempt``
(``run/attempt.py``: plan, survey, specs, supervisor) to the restart loop
(``run/restarts.py``).  The survey, the transports, the terminal (``Frontend``) and
the clock come in as arguments, so the whole path runs in tests on a fake transport
without a process, and on a fake clock without waiting.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from launcher.base.clock import Clock, SystemClock
from launcher.base.interpreter import INTERPRETER
from launcher.base.jobid import new_job_id
from launcher.core.config import JobConfig, validate_config
from launcher.run.attempt import Attempt, Frontend, JobOutcome, OpenTransport, SurveyHosts
from launcher.run.early import job_variables
from launcher.run.namedfiles import check_ssh_files
from launcher.run.restarts import run_attempts
from launcher.run.survey import (
    Survey,
    allocation_hosts,
    hostfile_shorthand,
    shorthand_notice,
    slurm_allocation,
    survey_hosts,
)
from launcher.streams.jobdir import prepare_output_dir
from launcher.streams.joblist import jobs_root
from launcher.transport.base import RoutedTransport, Transport
from launcher.transport.local import LocalTransport, find_program


def open_transport(
    survey: Survey | None, config: JobConfig, environ: Mapping[str, str]
) -> Transport:
    """Local ranks under local watchdogs; remote ones through the agents the survey started."""
    local = LocalTransport(environ, grace_s=config.grace_s)
    if survey is None or not survey.agents:
        return local
    from launcher.transport.agentlink import SshTransport

    remote_hosts = survey.site.remote_hosts
    ssh = SshTransport(survey.hand_over(), grace_s=config.grace_s, path_prefix=environ.get("PATH"))
    return RoutedTransport(local, ssh, remote_hosts=remote_hosts)


def run_job(
    config: JobConfig,
    environ: Mapping[str, str],
    frontend: Frontend,
    *,
    survey: SurveyHosts = survey_hosts,
    transports: OpenTransport = open_transport,
    clock: Clock | None = None,
    extra: Mapping[str, str] | None = None,
    checked: bool = False,
) -> JobOutcome:
    """Validate, resolve what the whole job shares, then run its attempts; ``checked``: the
    edge validated the config already, ``extra``: it resolved the job's variables already
    (``early.job_variables``): each is done once per job."""
    config = with_hostfile_shorthand(config, frontend)
    if not checked:
        config = validate_config(config)
    allocation = allocation_hosts(config, environ)
    if allocation is not None:
        how = "through srun" if slurm_allocation(config, environ) else "over ssh"
        frontend.notice(f"dtrain: {allocation.describe()}; ranks start {how}")
    note = interpreter_note(config.command, environ)
    if note:
        frontend.notice(note)
    extra = job_variables(config, environ) if extra is None else extra
    check_ssh_files(config.ssh)
    job_id = config.job_id or new_job_id()
    attempt = Attempt(
        config=config,
        environ=environ,
        frontend=frontend,
        job_id=job_id,
        extra=extra,
        workdir=config.env.workdir or os.getcwd(),
        output_dir=None if config.dry_run else prepare_output_dir(config.view.output_dir),
        survey=survey,
        transports=transports,
        clock=clock or SystemClock(),
        checkpoint_dir=config.checkpoint_dir
        or str(jobs_root(config.job_dir, environ) / job_id / "checkpoints"),
    )
    # What the started ranks hold stays out of the collector's reach (``base/interpreter.py``)
    # until the job's end is recorded and run_job returns: a full collection of it comes
    # only after many more allocations, not before the summary is printed (and never in the
    # command line, which exits).
    with INTERPRETER.running_job():
        return run_attempts(attempt)


def with_hostfile_shorthand(config: JobConfig, frontend: Frontend) -> JobConfig:
    """``-H hosts`` naming a file here reads it as the hostfile (as DeepSpeed's -H does)."""
    path = hostfile_shorthand(config.placement.host_lists)
    if path is None:
        return config
    frontend.notice(shorthand_notice(path))
    return replace(config, placement=replace(config.placement, host_lists=(), hostfile=path))


def interpreter_note(command: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """``python ...`` from a virtual environment that is not first on PATH: the ranks get
    PATH's python, not the environment's (a classic surprise): say which."""
    if not command or command[0] not in ("python", "python3") or sys.prefix == sys.base_prefix:
        return None
    found = find_program(command[0], environ.get("PATH"))
    ours = Path(sys.executable).parent
    if found is None or Path(found).parent.resolve() == ours.resolve():
        return None
    return (
        f"dtrain: note: the ranks' {command[0]} is {found} (first on PATH), not the one of "
        f"the virtual environment dtrain runs from ({ours}); activate it, or run the script "
        "without 'python' to use dtrain's"
    )
