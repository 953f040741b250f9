"""Where the ranks go and what they run: the job layer's glue around the pure planner.

``plan_job`` reads the hosts (-H, --hostfile, the discovery script, the Slurm allocation,
or this machine), leaves out the hosts that failed in earlier attempts and places the
ranks (``core/plan.py``); the GPUs the survey found are bound here too.  It is the job
layer's and not a pure module's because it asks this machine for its GPUs and cores,
runs the discovery script and reads hostfiles.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from launcher import remote
from launcher.base.errors import PlanError
from launcher.core.config import JobConfig
from launcher.core.hosts import Host, parse_host_list
from launcher.core.plan import (
    Plan,
    bind_gpus,
    bind_ps_gpus,
    elastic_np,
    per_node_counts,
    plan_ps,
    plan_ranks,
    select_hosts,
)
from launcher.core.specs import ServerProgram, Site
from launcher.run.survey import Survey, allocation_hosts, discover_hosts, read_hosts
from launcher.transport.local import detect_local_gpus, is_local_address

MPI4PY_WARNING = (
    "dtrain: warning: this looks like an mpi4py program; without --mpi every rank is an MPI "
    "singleton of size 1 (add --mpi to run it through mpirun)"
)


def plan_job(
    config: JobConfig,
    environ: Mapping[str, str],
    site: Site | None = None,
    excluded: Collection[str] = (),
) -> Plan:
    """Where the ranks go: -H/--hostfile (or localhost, or the discovery script's hosts), less
    the ``excluded`` (failed) hosts, and the placement options.

    ``--nproc-per-node auto|gpu|cpu`` counts each host's GPUs or cores: this machine's at
    once, other hosts' from the survey's ``site`` (before it: one rank per host, so that
    the survey knows where to go).
    """
    if config.ps is not None:
        return plan_parameter_servers(config, environ)
    placement = config.placement
    per_node = placement.nproc_per_node
    default_slots = placement.np or (per_node if isinstance(per_node, int) else None)
    local_gpus = detect_local_gpus(environ) if placement.gpu_binding else ()
    if default_slots is None and not placement.hosts_given:
        # One rank per local GPU, as torchrun's --nproc-per-node gpu; else one.
        default_slots = len(local_gpus) or 1
    hosts = job_hosts(config, environ, default_slots)
    # Failed hosts go first: --nnodes N then takes the first N of the healthy ones (spares
    # listed after them stand in for a failed host).
    healthy = healthy_hosts(hosts, excluded)
    try:
        hosts = select_hosts(healthy, placement.nnodes, placement.include, placement.exclude)
    except PlanError as exc:
        if len(healthy) == len(hosts):
            raise
        left_out = ", ".join(sorted(h.name for h in hosts if h not in healthy))
        raise PlanError(f"{exc.message} (after leaving out {left_out}: failed)", exc.hint) from None
    np = placement.np
    if placement.elastic:
        np = elastic_np(hosts, placement.np, placement.min_np, placement.max_np)
    counts: int | list[int] | None = per_node if isinstance(per_node, int) else None
    if isinstance(per_node, str):
        here = {h.name: is_local_address(h.name) for h in hosts}
        gpus = {name: local_gpus for name, local in here.items() if local}
        cpus = {name: tuple((c, 0) for c in os.sched_getaffinity(0)) for name in gpus}
        if site is not None:
            gpus, cpus = {**site.gpus, **gpus}, {**site.cpus, **cpus}
        counts = per_node_counts(hosts, per_node, gpus, cpus)
        if site is None:  # other hosts: one rank each until the survey has counted
            counts = [n if here[h.name] else 1 for n, h in zip(counts, hosts, strict=True)]
    return plan_ranks(
        hosts,
        np,
        map_by=placement.map_by,
        oversubscribe=placement.oversubscribe,
        nproc_per_node=counts,
    )


def healthy_hosts(hosts: Sequence[Host], excluded: Collection[str]) -> list[Host]:
    """The hosts less those that failed in an earlier attempt."""
    left = [h for h in hosts if h.name not in excluded]
    if not left:
        raise PlanError(
            f"no host left: {', '.join(sorted(excluded))} failed",
            "check the hosts (dtrain check), or let them back with --blacklist-cooldown",
        )
    return left


def job_hosts(
    config: JobConfig, environ: Mapping[str, str], default_slots: int | None
) -> list[Host]:
    """The hosts: the discovery script's, -H/--hostfile, the Slurm allocation's, or localhost."""
    placement = config.placement
    if placement.host_discovery_script is not None:
        return discover_hosts(placement.host_discovery_script)
    allocation = allocation_hosts(config, environ)
    if allocation is not None:
        return list(allocation.hosts)
    return read_hosts(placement.host_lists, placement.hostfile, default_slots)


def plan_parameter_servers(config: JobConfig, environ: Mapping[str, str]) -> Plan:
    """``dtrain ps`` placement from -H/--hostfile and the optional role host lists."""
    ps, placement = config.ps, config.placement
    assert ps is not None
    hosts = job_hosts(config, environ, ps.workers)
    ps_hosts = parse_host_list(ps.ps_hosts, "--ps-hosts") if ps.ps_hosts else None
    worker_hosts = parse_host_list(ps.worker_hosts, "--worker-hosts") if ps.worker_hosts else None
    from_slurm = allocation_hosts(config, environ) is not None
    if worker_hosts is None and not placement.hosts_given and not from_slurm:
        hosts = [replace(hosts[0], slots=ps.workers)]
    return plan_ps(
        hosts,
        ps.workers,
        ps.ps_tasks,
        ps_hosts=ps_hosts,
        worker_hosts=worker_hosts,
        chief=ps.tf,
        evaluator=ps.evaluator,
        oversubscribe=placement.oversubscribe,
        # A standing cluster's coordinator is the user's, on this machine.
        chief_host=Host("localhost") if config.standing_cluster else None,
    )


def bind_job_gpus(plan: Plan, surveyed: Survey, config: JobConfig) -> Plan:
    """CUDA_VISIBLE_DEVICES per rank from the GPUs found on each host (ps tasks: none)."""
    placement = config.placement
    if not placement.gpu_binding:
        return plan
    gpus = surveyed.site.gpus
    if config.ps is not None:
        return bind_ps_gpus(plan, gpus, placement.gpus_per_rank, config.ps.ps_gpus)
    return bind_gpus(plan, gpus, placement.gpus_per_rank)


def describe_plan(plan: Plan) -> str:
    """``4 ranks: node1 x2, node2 x2`` for --verbose."""
    counts: dict[str, int] = {}
    for rank in plan.ranks:
        counts[rank.host.name] = counts.get(rank.host.name, 0) + 1
    return f"{plan.world_size} rank(s): " + ", ".join(f"{h} x{n}" for h, n in counts.items())


def describe_bindings(plan: Plan) -> list[str]:
    """``--report-bindings``: where each rank runs, on which CPUs and GPUs."""
    return [
        f"dtrain: rank {r.rank} on {r.host.name} (local rank {r.local_rank}): "
        f"cpus {','.join(map(str, r.cpus)) if r.cpus is not None else 'any'}, "
        f"gpus {','.join(r.gpus) or 'none' if r.gpus is not None else 'any'}"
        for r in plan.ranks
    ]


def builtin_server(config: JobConfig) -> ServerProgram | None:
    """``--builtin-servers`` (or no COMMAND): the TensorFlow server that ps and workers run."""
    if config.ps is None or not (config.ps.builtin_servers or config.standing_cluster):
        return None
    return ServerProgram(source=remote.source("tf_server"), local_python=sys.executable)


def names_mpi4py(argv: Sequence[str], cwd: str) -> bool:
    """Does the command look like an mpi4py program (so it needs --mpi)?  (It reads the
    script: the job layer's, not a pure module's.)"""
    if any("mpi4py" in arg for arg in argv[:3]):
        return True
    for arg in argv[:3]:
        if arg.endswith(".py"):
            try:
                with open(os.path.join(cwd, arg), "rb") as f:
                    return b"mpi4py" in f.read(256 * 1024)
            except OSError:
                return False
    return False
