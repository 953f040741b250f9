"""Rank placement: hosts + options -> ``Plan`` (pure: no I/O).

Placement follows mpirun: by default ranks fill a host's slots before moving
to the next host (``--map-by slot``); ``--map-by node`` deals them round-robin.
``--nproc-per-node`` (torchrun style) puts the same number on every host, or
with ``auto``/``gpu``/``cpu`` as many as each host has GPUs or cores.
``--bind-to core|socket`` pins each rank to its share of its host's CPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from launcher.base.errors import PlanError
from launcher.base.frozen import evolve
from launcher.core.bounds import check_world_size
from launcher.core.config import BindTo, MapBy, PerNode
from launcher.core.hosts import Host

Cpu = tuple[int, int]  # (cpu id, its package: the socket)


@dataclass(frozen=True)
class Rank:
    """One process of the job and where it runs."""

    rank: int
    host: Host
    local_rank: int
    node_rank: int
    local_world_size: int
    world_size: int
    gpus: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES, None: not bound
    cpus: tuple[int, ...] | None = None  # CPU affinity (--bind-to), None: not bound
    role: str = "worker"  # chief, worker, ps or evaluator in parameter-server jobs
    task_index: int = 0  # index among the ranks of the same role


@dataclass(frozen=True)
class Plan:
    """All ranks of a job, ordered by rank."""

    ranks: tuple[Rank, ...]
    # Placed before the hosts were counted (slots counted on a host, --nproc-per-node auto):
    # the survey goes to these hosts, and the job is planned again from what it found.
    provisional: bool = False

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def hosts(self) -> tuple[Host, ...]:
        """The hosts that received ranks, in node-rank order."""
        seen: dict[int, Host] = {}
        for rank in self.ranks:
            seen.setdefault(rank.node_rank, rank.host)
        return tuple(seen[i] for i in sorted(seen))


def count_ranks_per_host(
    hosts: Sequence[Host], np: int, oversubscribe: bool, map_by: MapBy = "slot"
) -> list[int]:
    """How many ranks each host takes: slots first, then extras round-robin up to max_slots.

    By slot, each host's slots fill before the next host's; by node, ranks are
    dealt one per host per round, so ``-np 2`` on ``a:2,b:2`` uses both hosts.
    """
    total_slots = sum(h.slots for h in hosts)
    if np > total_slots and not oversubscribe:
        raise PlanError(
            f"-np {np} is more than the {total_slots} slots of "
            + ", ".join(f"{h.name}:{h.slots}" for h in hosts),
            "lower -np, add slots to the hosts, or pass --oversubscribe",
        )
    counts = [0] * len(hosts)
    if map_by == "slot":
        remaining = np
        for i, host in enumerate(hosts):
            counts[i] = min(host.slots, remaining)
            remaining -= counts[i]
    else:
        remaining = deal(counts, np, [h.slots for h in hosts])
    remaining = deal(counts, remaining, [h.max_slots for h in hosts])
    if remaining:
        limit = sum(h.max_slots or 0 for h in hosts)
        raise PlanError(
            f"-np {np} is more than the {limit} max_slots of the hosts, even with --oversubscribe",
            "lower -np or raise max_slots in the hostfile",
        )
    return counts


def deal(counts: list[int], ranks: int, caps: Sequence[int | None]) -> int:
    """Add ``ranks`` to ``counts`` one per host per round, up to each cap; returns what is left."""
    while ranks:
        placed = 0
        for i, cap in enumerate(caps):
            if ranks and (cap is None or counts[i] < cap):
                counts[i] += 1
                ranks -= 1
                placed += 1
        if not placed:
            break
    return ranks


def plan_ranks(
    hosts: Sequence[Host],
    np: int | None = None,
    *,
    map_by: MapBy = "slot",
    oversubscribe: bool = False,
    nproc_per_node: int | Sequence[int] | None = None,
) -> Plan:
    """Place ``np`` ranks on ``hosts``; ``np=None`` means one per slot.  ``nproc_per_node``
    is a count for every host, or one count per host; with ``np`` too it is a cap (mpirun's
    ``-np N --map-by ppr:K:node``: N ranks, at most K on each host, slots aside)."""
    if not hosts:
        raise PlanError("no hosts to place ranks on", "pass -H HOST[:SLOTS] or --hostfile FILE")
    if nproc_per_node is not None:
        if isinstance(nproc_per_node, int):
            if nproc_per_node < 1:
                raise PlanError(f"--nproc-per-node {nproc_per_node}: must be at least 1")
            nproc_per_node = [nproc_per_node] * len(hosts)
        counts = list(nproc_per_node)
        if np is not None:
            counts = cap_ranks_per_host(counts, np, map_by)
        check_world_size(sum(counts))
    else:
        if np is None:
            np = sum(h.slots for h in hosts)
        if np < 1:
            raise PlanError(f"-np {np}: must be at least 1")
        check_world_size(np)
        counts = count_ranks_per_host(hosts, np, oversubscribe, map_by)
    order = assign_by_slot(counts) if map_by == "slot" else assign_by_node(counts)
    return place(hosts, order, [("worker", i) for i in range(len(order))])


def with_hosts(plan: Plan, hosts: Sequence[Host]) -> Plan:
    """``plan`` with each rank's host replaced by the same host (user and name) in ``hosts``."""
    by_name = {(h.user, h.name): h for h in hosts}
    ranks = tuple(
        r if host is r.host else evolve(r, host=host)  # (thousands of ranks: not replace)
        for r in plan.ranks
        for host in (by_name.get((r.host.user, r.host.name), r.host),)
    )
    return replace(plan, ranks=ranks)


def cap_ranks_per_host(caps: Sequence[int], np: int, map_by: MapBy) -> list[int]:
    """``np`` ranks, at most ``caps[i]`` on host i: each host filled in turn (by slot), or one
    per host per round (by node)."""
    if np < 1:
        raise PlanError(f"-np {np}: must be at least 1")
    if np > sum(caps):
        each = caps[0] if len(set(caps)) == 1 else None
        fit = "as many as each may take" if each is None else f"{each} rank" + "s" * (each != 1)
        hosts = f"{len(caps)} host" + "s" * (len(caps) != 1)
        raise PlanError(
            f"-np {np}: only {sum(caps)} ranks fit ({fit} on each of {hosts})",
            "lower -np, raise --nproc-per-node or ppr:K, or add hosts",
        )
    counts = [0] * len(caps)
    if map_by == "slot":
        left = np
        for i, cap in enumerate(caps):
            counts[i] = min(cap, left)
            left -= counts[i]
    else:
        deal(counts, np, caps)
    return counts


def place(hosts: Sequence[Host], order: Sequence[int], roles: Sequence[tuple[str, int]]) -> Plan:
    """Ranks from the host index of each rank (in rank order) and its (role, task index)."""
    counts = [0] * len(hosts)
    for host_index in order:
        counts[host_index] += 1
    used = sorted({i for i in order})
    node_rank_of = {host_index: n for n, host_index in enumerate(used)}
    local_seen = [0] * len(hosts)
    ranks: list[Rank] = []
    for rank, (host_index, (role, index)) in enumerate(zip(order, roles, strict=True)):
        ranks.append(
            Rank(
                rank=rank,
                host=hosts[host_index],
                local_rank=local_seen[host_index],
                node_rank=node_rank_of[host_index],
                local_world_size=counts[host_index],
                world_size=len(order),
                role=role,
                task_index=index,
            )
        )
        local_seen[host_index] += 1
    return Plan(tuple(ranks))


def plan_ps(
    hosts: Sequence[Host],
    workers: int,
    ps: int,
    *,
    ps_hosts: Sequence[Host] | None = None,
    worker_hosts: Sequence[Host] | None = None,
    chief: bool = True,
    evaluator: bool = False,
    oversubscribe: bool = False,
    chief_host: Host | None = None,
) -> Plan:
    """Place a parameter-server job: chief, workers, ps tasks (and an evaluator).

    Workers fill the slots of the worker hosts (as ``dtrain run`` places
    ranks); ps tasks hold variables on CPU and take no slot: they are spread
    over the ps hosts first, one per host, before any host gets a second.  The
    chief goes on the first worker host, the evaluator on the last.  Ranks are
    in TensorFlow's order (chief, workers, ps, evaluator), or with
    ``chief=False`` (torch.distributed.rpc) ps first, then workers.
    ``chief_host`` puts the chief there instead (a coordinator the user runs).
    """
    if workers < 1 or ps < 1:
        raise PlanError(
            f"--workers {workers} --ps {ps}: a parameter-server job needs at least one of each",
            "pass e.g. --workers 2 --ps 1",
        )
    worker_side = list(worker_hosts or hosts)
    ps_side = list(ps_hosts or hosts)
    if not worker_side or not ps_side:
        raise PlanError("no hosts to place tasks on", "pass -H HOST[:SLOTS] or --hostfile FILE")
    all_hosts: list[Host] = []
    for host in [*([chief_host] if chief_host else []), *worker_side, *ps_side]:
        if all(h.name != host.name for h in all_hosts):
            all_hosts.append(host)
    index = {h.name: i for i, h in enumerate(all_hosts)}
    counts = count_ranks_per_host(worker_side, workers, oversubscribe)
    worker_at = [index[worker_side[i].name] for i in assign_by_slot(counts)]
    chief_at = [index[(chief_host or worker_side[0]).name]] if chief else []
    load = {i: worker_at.count(i) + chief_at.count(i) for i in index.values()}
    # Spread: least loaded ps hosts first, one ps each before any host gets a second.
    ps_order = sorted(ps_side, key=lambda h: (load[index[h.name]], ps_side.index(h)))
    ps_at = [index[ps_order[i % len(ps_order)].name] for i in range(ps)]
    evaluator_at = [index[worker_side[-1].name]] if evaluator else []
    tasks = (
        [("chief", chief_at), ("worker", worker_at), ("ps", ps_at), ("evaluator", evaluator_at)]
        if chief
        else [("ps", ps_at), ("worker", worker_at), ("evaluator", evaluator_at)]
    )
    order = [host for _, hosts_of_role in tasks for host in hosts_of_role]
    roles = [(role, i) for role, hosts_of_role in tasks for i in range(len(hosts_of_role))]
    return place(all_hosts, order, roles)


def bind_ps_gpus(
    plan: Plan,
    inventory: Mapping[str, tuple[str, ...]],
    gpus_per_rank: int | None = None,
    ps_gpus: bool = False,
) -> Plan:
    """GPUs for workers and the evaluator, counted among those on each host; none for the
    chief and ps tasks (``CUDA_VISIBLE_DEVICES=""``) unless ``ps_gpus``, which leaves ps
    tasks unbound."""
    compute = [r for r in plan.ranks if r.role in ("worker", "evaluator")]
    per_host: dict[str, int] = {}
    for rank in compute:
        per_host[rank.host.name] = per_host.get(rank.host.name, 0) + 1
    seen: dict[str, int] = {}
    renumbered = {}
    for rank in compute:
        renumbered[rank.rank] = replace(
            rank, local_rank=seen.get(rank.host.name, 0), local_world_size=per_host[rank.host.name]
        )
        seen[rank.host.name] = seen.get(rank.host.name, 0) + 1
    bound = {
        r.rank: r
        for r in bind_gpus(Plan(tuple(renumbered.values())), inventory, gpus_per_rank).ranks
    }
    result = []
    for rank in plan.ranks:
        if rank.rank in bound:
            result.append(replace(rank, gpus=bound[rank.rank].gpus))
        elif rank.role == "ps" and ps_gpus:
            result.append(rank)
        else:
            result.append(replace(rank, gpus=()))
    return Plan(tuple(result))


def elastic_np(
    hosts: Sequence[Host], np: int | None, min_np: int | None, max_np: int | None
) -> int:
    """How many ranks an elastic job runs on these (healthy) hosts: as many as it wants (-np,
    else --max-np, else every slot) as fit in the slots, and never fewer than --min-np (without
    it: -np, when given)."""
    slots = sum(h.slots for h in hosts)
    wanted = np or max_np or slots
    if max_np is not None:
        wanted = min(wanted, max_np)
    floor = min_np if min_np is not None else np or 1
    if min(wanted, slots) < floor:
        raise PlanError(
            f"{slots} slot(s) on the hosts left ({', '.join(f'{h.name}:{h.slots}' for h in hosts)})"
            f": fewer than the {floor} ranks the job needs",
            "add hosts, or "
            + ("lower --min-np" if min_np is not None else "allow a smaller job with --min-np"),
        )
    return min(wanted, slots)


def per_node_counts(
    hosts: Sequence[Host],
    per_node: PerNode,
    gpus: Mapping[str, tuple[str, ...]],
    cpus: Mapping[str, Sequence[Cpu]],
) -> list[int]:
    """torchrun's ``--nproc-per-node auto|gpu|cpu`` on each host: one rank per GPU (``auto``:
    else one per core), from the hostfile's ``gpus=`` or what was found there; a host not
    looked at yet (not in ``cpus``: before the survey, in a dry run) one, until it is."""
    counts = []
    for host in hosts:
        found = host.gpus if host.gpus is not None else gpus.get(host.name, ())
        cores = len(cpus.get(host.name, ())) or 1
        if host.name not in cpus and (per_node == "cpu" or not found):
            counts.append(1)
            continue
        if per_node == "gpu" and not found:
            raise PlanError(
                f"--nproc-per-node gpu: no GPU found on {host.name}",
                "use --nproc-per-node auto (one per core without GPUs), cpu, or a number",
            )
        counts.append(cores if per_node == "cpu" else len(found) or cores)
    return counts


def count_host_slots(
    hosts: Sequence[Host],
    gpus: Mapping[str, Sequence[str]],
    cpus: Mapping[str, Sequence[Cpu]],
    by_gpus: bool = True,
) -> list[Host]:
    """The slots of the hosts that count them on the host (a bare hostfile line, ``host:*``),
    where the survey has looked (a name in ``cpus``): one per GPU found there (``by_gpus``;
    its hostfile ``gpus=`` cannot be given with them), else one per CPU.  Others as they are."""
    counted = []
    for host in hosts:
        if host.slots_on_host and host.name in cpus:
            found = len(gpus.get(host.name, ())) if by_gpus else 0
            slots = found or len(cpus[host.name]) or 1
            host = replace(host, slots=slots, slots_on_host=False)
        counted.append(host)
    return counted


def select_hosts(
    hosts: Sequence[Host], nnodes: int | None, include: str | None, exclude: str | None
) -> list[Host]:
    """DeepSpeed's ``--include``/``--exclude`` filters, then torchrun's ``--nnodes N`` (the
    first N hosts; fewer is an error)."""
    if include is not None and exclude is not None:
        raise PlanError("--include and --exclude both given", "use one of them")
    chosen = list(hosts)
    if include is not None:
        chosen = filter_hosts(chosen, include, "--include", keep=True)
    elif exclude is not None:
        chosen = filter_hosts(chosen, exclude, "--exclude", keep=False)
    if nnodes is not None:
        if nnodes < 1:
            raise PlanError(f"--nnodes {nnodes}: must be at least 1")
        if len(chosen) < nnodes:
            raise PlanError(
                f"--nnodes {nnodes}: only {len(chosen)} host(s) given "
                f"({', '.join(h.name for h in chosen)})",
                f"list {nnodes} hosts with -H or --hostfile, or lower --nnodes",
            )
        chosen = chosen[:nnodes]
    return chosen


def filter_hosts(hosts: Sequence[Host], text: str, flag: str, keep: bool) -> list[Host]:
    """``host1@host2:0,1``: whole hosts, or some GPUs of a host (its ``gpus=``, else
    0..slots-1, DeepSpeed's reading of slots); the host's slots become its GPUs left."""
    wanted: dict[str, tuple[str, ...] | None] = {}
    by_name = {h.name: h for h in hosts}
    for item in text.split("@"):
        name, colon, ids = item.strip().partition(":")
        if name not in by_name:
            raise PlanError(
                f"{flag} {text!r}: {name!r} is not one of the hosts "
                f"({', '.join(by_name) or 'none'})",
                "name hosts as the hostfile does, e.g. --include node1@node2:0,1",
            )
        gpus = tuple(g.strip() for g in ids.split(",")) if colon else None
        known = known_gpus(by_name[name], gpus if keep else None)
        if known is None and gpus is not None:
            raise PlanError(
                f"{flag} {text!r}: the GPUs of {name} are not known (its slots are counted there)",
                f"give them in the hostfile, e.g. '{name} gpus=0,1,2,3' or '{name} slots=4'",
            )
        known = known or ()
        unknown = [g for g in gpus or () if g not in known]
        if unknown or gpus == ("",):
            raise PlanError(
                f"{flag} {text!r}: host {name} has no GPU {(unknown or [''])[0]!r} "
                f"(it has {','.join(known)})",
                "list GPU ids after the host, e.g. node2:0,1",
            )
        wanted[name] = gpus
    chosen = []
    for host in hosts:
        known = known_gpus(host, wanted.get(host.name) if keep else None) or ()
        if host.name not in wanted:
            chosen.extend([] if keep else [host])
            continue
        gpus = wanted[host.name]
        if gpus is None:
            chosen.extend([host] if keep else [])
            continue
        left = gpus if keep else tuple(g for g in known if g not in gpus)
        if left:
            chosen.append(
                replace(host, gpus=left, slots=len(left), max_slots=None, slots_on_host=False)
            )
    if not chosen:
        raise PlanError(f"{flag} {text!r} leaves no host", "keep at least one host")
    return chosen


def known_gpus(host: Host, kept: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """A host's GPU ids for --include/--exclude: its ``gpus=``, else 0..slots-1 (DeepSpeed's
    reading of slots); a host counting its slots there: the ids ``kept`` (trusted), else
    unknown (None)."""
    if host.gpus:
        return host.gpus
    if host.slots_on_host:
        return kept
    return tuple(str(i) for i in range(host.slots))


def bind_cpus(plan: Plan, topology: Mapping[str, Sequence[Cpu]], bind_to: BindTo) -> Plan:
    """mpirun's ``--bind-to``: ``core`` gives local rank i of n its share of the host's CPUs
    (cpus // n each; with more ranks than CPUs, one CPU each, round robin); ``socket`` gives it
    every CPU of the socket its share falls on.  Hosts whose CPUs are unknown stay unbound."""
    if bind_to == "none":
        return plan
    bound = []
    for rank in plan.ranks:
        cpus = list(topology.get(rank.host.name, ()))
        if not cpus:
            bound.append(rank)
            continue
        n, count = rank.local_world_size, len(cpus)
        if count >= n:
            share = cpus[rank.local_rank * count // n : (rank.local_rank + 1) * count // n]
        else:
            share = [cpus[rank.local_rank % count]]
        if bind_to == "socket":
            socket = share[0][1]
            share = [cpu for cpu in cpus if cpu[1] == socket]
        bound.append(replace(rank, cpus=tuple(cpu for cpu, _ in share)))
    return Plan(tuple(bound))


def assign_by_slot(counts: Sequence[int]) -> list[int]:
    """Host index of each rank when every host is filled before the next."""
    return [i for i, c in enumerate(counts) for _ in range(c)]


def assign_by_node(counts: Sequence[int]) -> list[int]:
    """Host index of each rank when ranks are dealt round-robin over hosts."""
    left = list(counts)
    order: list[int] = []
    while any(left):
        for i, c in enumerate(left):
            if c:
                order.append(i)
                left[i] -= 1
    return order


def bind_gpus(
    plan: Plan,
    inventory: Mapping[str, tuple[str, ...]],
    gpus_per_rank: int | None = None,
) -> Plan:
    """Give each rank its GPUs: local rank i gets GPUs [i*K, (i+1)*K) of its host.

    A host's GPUs are its hostfile ``gpus=`` if given, else ``inventory[name]``
    (what nvidia-smi found there).  With no GPUs known and no
    ``gpus_per_rank`` asked for, ranks are left unbound.  ``gpus_per_rank`` on a host
    where none was found is an error; on a host not looked at (a dry run's other hosts),
    its GPUs are taken to be 0, 1, ...
    """
    if gpus_per_rank is not None and gpus_per_rank < 1:
        raise PlanError(f"--gpus-per-rank {gpus_per_rank}: must be at least 1")
    bound: list[Rank] = []
    for rank in plan.ranks:
        host = rank.host
        known = host.gpus if host.gpus is not None else inventory.get(host.name, ())
        if not known and gpus_per_rank is None:
            bound.append(rank)
            continue
        per_rank = gpus_per_rank or 1
        needed = per_rank * rank.local_world_size
        if not known and host.name in inventory:
            raise PlanError(
                f"--gpus-per-rank {per_rank}: no GPU found on {host.name}",
                f"name its GPUs in the hostfile ('{host.name} gpus=0,1'), "
                "or leave out --gpus-per-rank",
            )
        if not known:  # not looked at (a dry run reaches no other host): as if 0, 1, ...
            known = tuple(str(i) for i in range(needed))
        if needed > len(known):
            raise PlanError(
                f"host {host.name} has {len(known)} GPU(s) ({','.join(known)}) but its "
                f"{rank.local_world_size} rank(s) need {per_rank} each",
                "lower -np or --gpus-per-rank, or pass --no-gpu-binding to share GPUs",
            )
        start = rank.local_rank * per_rank
        bound.append(replace(rank, gpus=tuple(known[start : start + per_rank])))
    return Plan(tuple(bound))
