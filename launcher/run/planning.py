"""Where the ranks go and what they run: the job layer's glue around the pure planner.

``plan_job`` reads the hosts (-H, --hostfile, the discovery script, the Slurm allocation,
or this machine), leaves out the hosts that failed in earlier attempts, counts the slots
of the hosts that count them there (a bare hostfile line, ``host:*``: this machine's at
once, the others' from the survey) and places the ranks (``core/plan.py``); the GPUs the
survey found are bound here too.  It is the job layer's and not a pure module's because it
asks this machine for its GPUs and cores, runs the discovery script and reads hostfiles.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from launcher import remote
from launcher.base.errors import PlanError
from launcher.base.log import LOG
from launcher.core.config import JobConfig
from launcher.core.hosts import Host, parse_host_list
from launcher.core.plan import (
    Cpu,
    Plan,
    bind_gpus,
    bind_ps_gpus,
    count_host_slots,
    elastic_np,
    per_node_counts,
    plan_ps,
    plan_ranks,
    select_hosts,
    with_hosts,
)
from launcher.core.specs import ServerProgram, Site
from launcher.run.namedfiles import read_head
from launcher.run.survey import Survey, allocation_hosts, discover_hosts, read_hosts
from launcher.transport.local import detect_local_gpus
from launcher.transport.locality import local_names

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

    ``--nproc-per-node auto|gpu|cpu`` and the hosts that count their slots there (a bare
    hostfile line, ``host:*``) count each host's GPUs or cores: this machine's at once,
    other hosts' from the survey's ``site``.  Before it, the plan is ``provisional``: one
    slot on each such host, oversubscribed, so that the survey goes to every host the job
    may use (counted, a host has as many slots or more: it never needs one more host).
    """
    if config.ps is not None:
        return plan_parameter_servers(config, environ, site)
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
    by_node = isinstance(per_node, str)
    here = local_names(h.name for h in hosts if by_node or h.slots_on_host)  # (in parallel)
    gpus, cpus = host_facts(here, local_gpus, site)
    hosts = count_host_slots(hosts, gpus, cpus, by_gpus=placement.gpu_binding)
    waiting = any(h.slots_on_host for h in hosts)  # slots the survey counts
    np = placement.np
    if placement.elastic and not waiting:
        np = elastic_np(hosts, placement.np, placement.min_np, placement.max_np)
    counts: int | list[int] | None = per_node if isinstance(per_node, int) else None
    if isinstance(per_node, str):  # (other hosts: one rank each until the survey has counted)
        counts = per_node_counts(hosts, per_node, gpus, cpus)
    placed = hosts
    if waiting and not placement.oversubscribe:  # ranks beyond the slots: uncounted hosts'
        placed = [h if h.slots_on_host else replace(h, max_slots=h.slots) for h in hosts]
    plan = plan_ranks(
        placed,
        np,
        map_by=placement.map_by,
        oversubscribe=placement.oversubscribe or waiting,
        nproc_per_node=counts,
    )
    uncounted = by_node and any(h.name not in cpus for h in plan.hosts)  # (not looked at yet)
    provisional = uncounted or any(h.slots_on_host for h in plan.hosts)
    return replace(with_hosts(plan, hosts), provisional=provisional)


def host_facts(
    here: Mapping[str, bool], local_gpus: tuple[str, ...], site: Site | None
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[Cpu, ...]]]:
    """The GPUs and CPUs of each host in ``here`` (name -> is this machine) known so far:
    this machine's at once, the others' once the survey has looked (``site``)."""
    gpus = {name: local_gpus for name, local in here.items() if local}
    cpus = {name: tuple((c, 0) for c in os.sched_getaffinity(0)) for name in gpus}
    if site is not None:
        gpus, cpus = {**site.gpus, **gpus}, {**site.cpus, **cpus}
    return gpus, cpus


def count_local_slots(hosts: Sequence[Host], environ: Mapping[str, str]) -> list[Host]:
    """The slots of the hosts that count them there and are this machine, counted now (for
    ``dtrain hosts``: the others are counted when a job starts there)."""
    here = local_names(h.name for h in hosts if h.slots_on_host)
    gpus, cpus = host_facts(here, detect_local_gpus(environ) if any(here.values()) else (), None)
    return count_host_slots(hosts, gpus, cpus)


def plan_surveyed(
    plan: Plan,
    config: JobConfig,
    environ: Mapping[str, str],
    surveyed: Survey,
    excluded: Collection[str] = (),
) -> Plan:
    """The plan again from the hosts the survey counted, where it waited for them (the
    hosts it reached that then get no rank are let go); else ``plan`` as it is."""
    if not plan.provisional:
        return plan
    counted = plan_job(config, environ, surveyed.site, excluded)
    surveyed.keep_hosts({h.name for h in counted.hosts})
    LOG.debug("plan by the hosts' GPUs and cores: %s", describe_plan(counted))
    return counted


def dry_run_notes(plan: Plan, config: JobConfig) -> list[str]:
    """What a dry run, which reaches no other host, cannot count: those hosts' slots."""
    waiting = [h.name for h in plan.hosts if h.slots_on_host]
    notes = []
    if waiting:
        notes.append(
            f"dtrain: note: the slots of {', '.join(waiting)} are counted there when the job "
            "starts (its GPUs, else its CPUs); this dry run, which reaches no other host, "
            "counts one slot for each (more where -np needs them)"
        )
    if plan.provisional and isinstance(config.placement.nproc_per_node, str):
        notes.append(
            f"dtrain: note: --nproc-per-node {config.placement.nproc_per_node} is counted on "
            "each other host when the job starts; this dry run gives each one rank"
        )
    return notes


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


def plan_parameter_servers(
    config: JobConfig, environ: Mapping[str, str], site: Site | None = None
) -> Plan:
    """``dtrain ps`` placement from -H/--hostfile and the optional role host lists (hosts that
    count their slots there: as ``plan_job`` counts them)."""
    ps, placement = config.ps, config.placement
    assert ps is not None
    hosts = counted_hosts(job_hosts(config, environ, ps.workers), config, environ, site)
    ps_hosts = parse_host_list(ps.ps_hosts, "--ps-hosts") if ps.ps_hosts else None
    worker_hosts = parse_host_list(ps.worker_hosts, "--worker-hosts") if ps.worker_hosts else None
    if worker_hosts is not None:
        worker_hosts = counted_hosts(worker_hosts, config, environ, site)
    waiting = any(h.slots_on_host for h in [*hosts, *(worker_hosts or ())])
    from_slurm = allocation_hosts(config, environ) is not None
    if worker_hosts is None and not placement.hosts_given and not from_slurm:
        hosts = [replace(hosts[0], slots=ps.workers)]
    plan = plan_ps(
        hosts,
        ps.workers,
        ps.ps_tasks,
        ps_hosts=ps_hosts,
        worker_hosts=worker_hosts,
        chief=ps.tf,
        evaluator=ps.evaluator,
        oversubscribe=placement.oversubscribe or waiting,
        # A standing cluster's coordinator is the user's, on this machine.
        chief_host=Host("localhost") if config.standing_cluster else None,
    )
    return replace(plan, provisional=any(h.slots_on_host for h in plan.hosts))


def counted_hosts(
    hosts: Sequence[Host], config: JobConfig, environ: Mapping[str, str], site: Site | None
) -> list[Host]:
    """``hosts`` with the slots of those that count them there counted, where known yet."""
    if not any(h.slots_on_host for h in hosts):
        return list(hosts)
    here = local_names(h.name for h in hosts if h.slots_on_host)
    binding = config.placement.gpu_binding
    gpus, cpus = host_facts(here, detect_local_gpus(environ) if binding else (), site)
    return count_host_slots(hosts, gpus, cpus, by_gpus=binding)


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
            head = read_head(os.path.join(cwd, arg), 256 * 1024)
            return head is not None and b"mpi4py" in head
    return False
