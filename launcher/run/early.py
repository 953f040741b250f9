"""A local job's agent, started before dtrain loads its job modules.

The edge calls this first thing for a job on this machine alone: the agent's start-up
(an interpreter, its imports) then runs while dtrain loads the rest of itself and plans.
It is the job layer's door to the local transport for that one purpose, kept in a module
of its own so that calling it loads nothing of the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from launcher.core.config import JobConfig


def job_variables(config: JobConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What ``-x`` and ``--env-file`` give every rank, resolved against ``environ``: once
    per job (the edge passes it on to the early agent and to ``run_job``)."""
    env = config.env
    if not env.exports and not env.env_files:
        return {}  # (nothing to load: a plain local job starts its agent sooner)
    from launcher.base.userfiles import TEXT_LIMIT, read_user_text
    from launcher.core.env import resolve_env_args

    files = [(path, read_user_text(path, "--env-file", TEXT_LIMIT)) for path in env.env_files]
    return resolve_env_args(env.exports, files, environ)


def start_agent_early(
    config: JobConfig, environ: dict[str, str], extra: Mapping[str, str]
) -> JobConfig:
    """A job on this machine alone: start its local agent now, so that the agent's start-up
    runs while dtrain loads the rest of itself and plans (the config comes back with the
    job id the agent carries); ``extra``: the job's variables (``job_variables``).  Any
    other job starts its agents as it needs them."""
    placement = config.placement
    if (
        config.dry_run
        or config.detach
        or config.mpi is not None
        or placement.host_lists
        or placement.hostfile
        or placement.host_discovery_script
        or placement.transport == "slurm"
        or "SLURM_JOB_ID" in environ
    ):
        return config
    from launcher.base.jobid import new_job_id
    from launcher.transport import localagent

    job_id = config.job_id or new_job_id()
    localagent.start_early({**environ, **extra, "DTRAIN_JOB_ID": job_id})
    return replace(config, job_id=job_id)


def close_early_agents() -> None:
    """Close the agents started early that no transport took (the job was refused before
    its ranks started): at once, not when dtrain exits, for a caller that goes on in this
    process (``main`` called in process kept one running per refused job)."""
    import sys

    localagent = sys.modules.get("launcher.transport.localagent")
    while localagent is not None and localagent.EARLY:
        localagent.EARLY.pop().close()
