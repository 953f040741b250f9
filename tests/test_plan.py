"""Placement: whole plans compared against tables."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.base.errors import PlanError
from launcher.core.command import build_launch_specs
from launcher.core.hosts import Host
from launcher.core.plan import (
    BindTo,
    Plan,
    Rank,
    bind_cpus,
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

A, B, C = Host("a", 2), Host("b", 2), Host("c", 1)


def layout(plan: Plan) -> list[tuple[int, str, int, int, int]]:
    """(rank, host, local_rank, node_rank, local_world_size) per rank."""
    return [
        (r.rank, r.host.name, r.local_rank, r.node_rank, r.local_world_size) for r in plan.ranks
    ]


@pytest.mark.parametrize(
    ("hosts", "np", "kwargs", "expected"),
    [
        (
            [A, B],
            4,
            {},
            [(0, "a", 0, 0, 2), (1, "a", 1, 0, 2), (2, "b", 0, 1, 2), (3, "b", 1, 1, 2)],
        ),
        (
            [A, B],
            None,
            {},
            [(0, "a", 0, 0, 2), (1, "a", 1, 0, 2), (2, "b", 0, 1, 2), (3, "b", 1, 1, 2)],
        ),
        ([A, B], 3, {}, [(0, "a", 0, 0, 2), (1, "a", 1, 0, 2), (2, "b", 0, 1, 1)]),
        ([A, B], 2, {}, [(0, "a", 0, 0, 2), (1, "a", 1, 0, 2)]),
        (
            [A, B],
            4,
            {"map_by": "node"},
            [(0, "a", 0, 0, 2), (1, "b", 0, 1, 2), (2, "a", 1, 0, 2), (3, "b", 1, 1, 2)],
        ),
        (
            [A, B, C],
            5,
            {"map_by": "node"},
            [
                (0, "a", 0, 0, 2),
                (1, "b", 0, 1, 2),
                (2, "c", 0, 2, 1),
                (3, "a", 1, 0, 2),
                (4, "b", 1, 1, 2),
            ],
        ),
        (
            [A, B],
            2,
            {"map_by": "node"},
            [(0, "a", 0, 0, 1), (1, "b", 0, 1, 1)],
        ),
        (
            [A, C],
            5,
            {"oversubscribe": True},
            [
                (0, "a", 0, 0, 3),
                (1, "a", 1, 0, 3),
                (2, "a", 2, 0, 3),
                (3, "c", 0, 1, 2),
                (4, "c", 1, 1, 2),
            ],
        ),
        (
            [A, B],
            None,
            {"nproc_per_node": 3},
            [
                (0, "a", 0, 0, 3),
                (1, "a", 1, 0, 3),
                (2, "a", 2, 0, 3),
                (3, "b", 0, 1, 3),
                (4, "b", 1, 1, 3),
                (5, "b", 2, 1, 3),
            ],
        ),
    ],
)
def test_placement(
    hosts: list[Host],
    np: int | None,
    kwargs: dict[str, object],
    expected: list[tuple[int, str, int, int, int]],
) -> None:
    plan = plan_ranks(hosts, np, **kwargs)  # type: ignore[arg-type]
    assert layout(plan) == expected
    assert all(r.world_size == len(expected) for r in plan.ranks)


def test_unused_hosts_get_no_node_rank() -> None:
    plan = plan_ranks([A, B, C], 2)
    assert plan.hosts == (A,)
    assert plan.world_size == 2


def test_whole_rank_value() -> None:
    assert plan_ranks([C], 1).ranks == (
        Rank(rank=0, host=C, local_rank=0, node_rank=0, local_world_size=1, world_size=1),
    )


@pytest.mark.parametrize(
    ("hosts", "np", "kwargs", "message"),
    [
        ([A, B], 5, {}, "-np 5 is more than the 4 slots of a:2, b:2"),
        ([Host("a", 2, max_slots=3)], 4, {"oversubscribe": True}, "max_slots"),
        ([A], 0, {}, "-np 0: must be at least 1"),
        (
            [A, B],
            5,
            {"nproc_per_node": 2},
            "-np 5: only 4 ranks fit .2 ranks on each of 2 hosts.",
        ),
        ([A], 0, {"nproc_per_node": 2}, "-np 0: must be at least 1"),
        ([A], None, {"nproc_per_node": 0}, "--nproc-per-node 0"),
        ([], 1, {}, "no hosts"),
    ],
)
def test_placement_errors(
    hosts: list[Host], np: int | None, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(PlanError, match=message.replace("-", r"\-")) as info:
        plan_ranks(hosts, np, **kwargs)  # type: ignore[arg-type]
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    ("np", "kwargs", "expected"),
    [
        # mpirun's -np N --map-by ppr:K:node: N ranks, at most K a host, hosts in turn
        (2, {"nproc_per_node": 1}, [(0, "a", 0, 0, 1), (1, "b", 0, 1, 1)]),
        (3, {"nproc_per_node": 2}, [(0, "a", 0, 0, 2), (1, "a", 1, 0, 2), (2, "b", 0, 1, 1)]),
        (1, {"nproc_per_node": 3}, [(0, "a", 0, 0, 1)]),  # slots aside, as ppr
        (
            3,
            {"nproc_per_node": 2, "map_by": "node"},
            [(0, "a", 0, 0, 2), (1, "b", 0, 1, 1), (2, "a", 1, 0, 2)],
        ),
        (2, {"nproc_per_node": [0, 2]}, [(0, "b", 0, 0, 2), (1, "b", 1, 0, 2)]),
    ],
)
def test_np_with_ranks_per_node_caps_each_host(
    np: int, kwargs: dict[str, object], expected: list[tuple[int, str, int, int, int]]
) -> None:
    assert layout(plan_ranks([A, B], np, **kwargs)) == expected  # type: ignore[arg-type]


def test_slots_counted_on_the_host_are_its_gpus_else_its_cpus() -> None:
    counted = Host("a", slots_on_host=True)
    hosts = [counted, Host("b", 3), Host("c", slots_on_host=True), Host("d", slots_on_host=True)]
    gpus = {"a": ("0", "1"), "d": ()}
    cpus = {"a": ((0, 0),) * 8, "d": ((0, 0), (1, 0), (2, 0))}  # c: not looked at yet
    assert count_host_slots(hosts, gpus, cpus) == [
        Host("a", 2),
        Host("b", 3),
        Host("c", slots_on_host=True),
        Host("d", 3),
    ]
    assert count_host_slots(hosts, gpus, cpus, by_gpus=False)[0] == Host("a", 8)


def test_by_slot_with_fewer_ranks_leaves_later_hosts_empty() -> None:
    assert [r.host.name for r in plan_ranks([A, B], 2).ranks] == ["a", "a"]


def test_oversubscribe_respects_max_slots() -> None:
    plan = plan_ranks([Host("a", 1, max_slots=2), Host("b", 1)], 5, oversubscribe=True)
    assert [r.host.name for r in plan.ranks] == ["a", "a", "b", "b", "b"]


def gpus_of(plan: Plan) -> list[tuple[str, ...] | None]:
    return [r.gpus for r in plan.ranks]


@pytest.mark.parametrize(
    ("hosts", "np", "inventory", "per_rank", "expected"),
    [
        ([Host("a", 4)], 4, {"a": ("0", "1", "2", "3")}, None, [("0",), ("1",), ("2",), ("3",)]),
        ([Host("a", 2)], 2, {"a": ("0", "1", "2", "3")}, 2, [("0", "1"), ("2", "3")]),
        ([Host("a", 2)], 2, {}, None, [None, None]),
        ([Host("a", 2)], 2, {}, 1, [("0",), ("1",)]),
        ([Host("a", 2, gpus=("3", "5"))], 2, {"a": ("0", "1")}, None, [("3",), ("5",)]),
        ([Host("a", 1), Host("b", 1)], 2, {"a": ("GPU-x",)}, None, [("GPU-x",), None]),
    ],
)
def test_gpu_binding(
    hosts: list[Host],
    np: int,
    inventory: dict[str, tuple[str, ...]],
    per_rank: int | None,
    expected: list[tuple[str, ...] | None],
) -> None:
    assert gpus_of(bind_gpus(plan_ranks(hosts, np), inventory, per_rank)) == expected


def test_too_few_gpus_is_an_error() -> None:
    with pytest.raises(PlanError, match="host a has 2 GPU"):
        bind_gpus(plan_ranks([Host("a", 3)], 3), {"a": ("0", "1")})
    with pytest.raises(PlanError, match="--gpus-per-rank 0"):
        bind_gpus(plan_ranks([Host("a", 1)], 1), {}, 0)


def test_gpus_per_rank_on_a_host_without_gpus_is_an_error() -> None:
    """No CUDA_VISIBLE_DEVICES=0,1 for GPUs that do not exist: the survey looked and found
    none; GPUs the hostfile names are taken as given."""
    plan = plan_ranks([Host("a", 2)], 2)
    with pytest.raises(PlanError) as caught:
        bind_gpus(plan, {"a": ()}, 1)
    assert caught.value.message == "--gpus-per-rank 1: no GPU found on a"
    assert (
        caught.value.hint
        == "name its GPUs in the hostfile ('a gpus=0,1'), or leave out --gpus-per-rank"
    )
    named = plan_ranks([Host("a", 2, gpus=("4", "5"))], 2)
    assert gpus_of(bind_gpus(named, {"a": ()}, 1)) == [("4",), ("5",)]


def roles_of(plan: Plan) -> list[tuple[int, str, int, str]]:
    return [(r.rank, r.role, r.task_index, r.host.name) for r in plan.ranks]


def test_ps_placement_spreads_ps_first_and_fills_worker_slots() -> None:
    plan = plan_ps([Host("a", 2), Host("b", 2)], workers=3, ps=2)
    assert roles_of(plan) == [
        (0, "chief", 0, "a"),
        (1, "worker", 0, "a"),
        (2, "worker", 1, "a"),
        (3, "worker", 2, "b"),
        (4, "ps", 0, "b"),  # the least loaded host first
        (5, "ps", 1, "a"),
    ]


def test_ps_placement_with_pinned_roles_evaluator_and_torch_order() -> None:
    plan = plan_ps(
        [Host("x")],
        workers=2,
        ps=1,
        ps_hosts=[Host("p")],
        worker_hosts=[Host("w", 2)],
        evaluator=True,
    )
    assert roles_of(plan) == [
        (0, "chief", 0, "w"),
        (1, "worker", 0, "w"),
        (2, "worker", 1, "w"),
        (3, "ps", 0, "p"),
        (4, "evaluator", 0, "w"),
    ]
    torch_plan = plan_ps([Host("a", 2)], workers=2, ps=1, chief=False)
    assert roles_of(torch_plan) == [(0, "ps", 0, "a"), (1, "worker", 0, "a"), (2, "worker", 1, "a")]


def test_ps_gpu_binding_counts_only_compute_tasks() -> None:
    plan = plan_ps([Host("a", 2)], workers=2, ps=1)
    bound = bind_ps_gpus(plan, {"a": ("0", "1")})
    assert gpus_of(bound) == [(), ("0",), ("1",), ()]
    assert gpus_of(bind_ps_gpus(plan, {"a": ("0", "1")}, ps_gpus=True)) == [
        (),
        ("0",),
        ("1",),
        None,
    ]
    with pytest.raises(PlanError, match="at least one of each"):
        plan_ps([Host("a")], workers=0, ps=1)


# -- peers' placement: --nproc-per-node auto|gpu|cpu, --nnodes, --include/--exclude, --bind-to


def test_per_node_counts_by_gpus_else_cores() -> None:
    hosts = [Host("a"), Host("b", gpus=("0", "1", "2")), Host("c")]
    gpus = {"a": ("0", "1"), "c": ()}
    cpus = {"a": ((0, 0),) * 8, "b": ((0, 0),) * 4, "c": tuple((i, 0) for i in range(6))}
    assert per_node_counts(hosts, "auto", gpus, cpus) == [2, 3, 6]
    assert per_node_counts(hosts, "cpu", gpus, cpus) == [8, 4, 6]
    with pytest.raises(PlanError, match="--nproc-per-node gpu: no GPU found on c"):
        per_node_counts(hosts, "gpu", gpus, cpus)
    # not looked at yet (before the survey, in a dry run): one, not "no GPU found"
    assert per_node_counts([Host("d"), Host("b", gpus=("0", "1"))], "gpu", {}, {}) == [1, 2]
    assert per_node_counts([Host("d")], "cpu", {"d": ("0",)}, {}) == [1]
    plan = plan_ranks(hosts, nproc_per_node=[2, 3, 1])
    assert [(r.host.name, r.local_rank, r.local_world_size) for r in plan.ranks] == [
        ("a", 0, 2),
        ("a", 1, 2),
        ("b", 0, 3),
        ("b", 1, 3),
        ("b", 2, 3),
        ("c", 0, 1),
    ]


@pytest.mark.parametrize(
    ("nnodes", "include", "exclude", "expected"),
    [
        (None, None, None, [("a", 2, None), ("b", 2, None), ("c", 4, ("0", "1", "2", "3"))]),
        (2, None, None, [("a", 2, None), ("b", 2, None)]),
        (None, "a@c", None, [("a", 2, None), ("c", 4, ("0", "1", "2", "3"))]),
        (None, "c:1,3@a", None, [("a", 2, None), ("c", 2, ("1", "3"))]),
        (None, "b:1", None, [("b", 1, ("1",))]),  # no gpus=: DeepSpeed's 0..slots-1
        (None, None, "b", [("a", 2, None), ("c", 4, ("0", "1", "2", "3"))]),
        (None, None, "c:0@a", [("b", 2, None), ("c", 3, ("1", "2", "3"))]),
        (1, None, "a", [("b", 2, None)]),  # filters first, then the first N
    ],
)
def test_host_selection(
    nnodes: int | None, include: str | None, exclude: str | None, expected: list[object]
) -> None:
    hosts = [Host("a", 2), Host("b", 2), Host("c", 4, gpus=("0", "1", "2", "3"))]
    chosen = select_hosts(hosts, nnodes, include, exclude)
    assert [(h.name, h.slots, h.gpus) for h in chosen] == expected


@pytest.mark.parametrize(
    ("nnodes", "include", "exclude", "message"),
    [
        (4, None, None, "--nnodes 4: only 3 host(s) given (a, b, c)"),
        (None, "a@d", None, "--include 'a@d': 'd' is not one of the hosts (a, b, c)"),
        (None, "c:7", None, "--include 'c:7': host c has no GPU '7' (it has 0,1,2,3)"),
        (None, "b:", None, "host b has no GPU ''"),
        (None, None, "a@b@c", "--exclude 'a@b@c' leaves no host"),
        (None, "a", "b", "--include and --exclude both given"),
    ],
)
def test_host_selection_errors(
    nnodes: int | None, include: str | None, exclude: str | None, message: str
) -> None:
    hosts = [Host("a", 2), Host("b", 2), Host("c", 4, gpus=("0", "1", "2", "3"))]
    with pytest.raises(PlanError) as caught:
        select_hosts(hosts, nnodes, include, exclude)
    assert message in caught.value.message


def test_included_gpus_bind_the_ranks() -> None:
    hosts = select_hosts([Host("a", 4)], None, "a:1,3", None)
    plan = bind_gpus(plan_ranks(hosts), {})
    assert [r.gpus for r in plan.ranks] == [("1",), ("3",)]


TWO_SOCKETS = {"a": tuple((cpu, cpu // 4) for cpu in range(8))}  # cpus 0-3 socket 0, 4-7 socket 1


@pytest.mark.parametrize(
    ("ranks", "bind_to", "expected"),
    [
        (2, "core", [(0, 1, 2, 3), (4, 5, 6, 7)]),
        (3, "core", [(0, 1), (2, 3, 4), (5, 6, 7)]),
        (8, "core", [(c,) for c in range(8)]),
        (10, "core", [(c % 8,) for c in range(10)]),  # more ranks than CPUs: one each, round robin
        (4, "socket", [(0, 1, 2, 3)] * 2 + [(4, 5, 6, 7)] * 2),
        (2, "none", [None, None]),
    ],
)
def test_cpu_binding(ranks: int, bind_to: BindTo, expected: list[object]) -> None:
    plan = bind_cpus(plan_ranks([Host("a", ranks)]), TWO_SOCKETS, bind_to)
    assert [r.cpus for r in plan.ranks] == expected


def test_cpu_binding_leaves_hosts_of_unknown_cpus_alone() -> None:
    plan = bind_cpus(plan_ranks([Host("a", 1), Host("b", 1)]), TWO_SOCKETS, "core")
    assert [r.cpus for r in plan.ranks] == [tuple(range(8)), None]


@pytest.mark.parametrize(
    ("slots", "np", "min_np", "max_np", "expected"),
    [
        ([4, 4], None, None, None, 8),
        ([4], 8, 4, None, 4),  # shrunk to what fits, not below --min-np
        ([4, 4], 6, 4, None, 6),
        ([4, 4, 4], None, 4, 8, 8),  # grows back up to --max-np
        ([2, 4], None, 4, 8, 6),
        ([4], None, None, 8, 4),
    ],
)
def test_elastic_world_size(
    slots: list[int], np: int | None, min_np: int | None, max_np: int | None, expected: int
) -> None:
    hosts = [Host(f"h{i}", n) for i, n in enumerate(slots)]
    assert elastic_np(hosts, np, min_np, max_np) == expected


def test_elastic_world_size_below_the_minimum() -> None:
    with pytest.raises(
        PlanError, match=r"2 slot\(s\) on the hosts left \(h0:2\): fewer than the 4"
    ) as caught:
        elastic_np([Host("h0", 2)], 8, 4, None)
    assert caught.value.hint == "add hosts, or lower --min-np"  # (not: add the --min-np given)
    with pytest.raises(PlanError, match="fewer than the 8 ranks") as caught:
        elastic_np([Host("h0", 4)], 8, None, None)  # no --min-np: the whole job or nothing
    assert caught.value.hint == "add hosts, or allow a smaller job with --min-np"


def test_with_hosts_moves_each_rank_to_its_counted_host_and_keeps_the_rest() -> None:
    plan = bind_gpus(plan_ranks([Host("a", 2), B], np=4), {"a": ("0", "1"), "b": ("0", "1")})
    counted_a = Host("a", 2, gpus=("0", "1"), max_slots=2)  # (what a survey hands back)
    moved = with_hosts(plan, [counted_a])
    for before, after in zip(plan.ranks, moved.ranks, strict=True):
        want = counted_a if before.host.name == "a" else before.host
        assert after == dataclasses.replace(before, host=want)  # every other field kept
        assert after.host is want
    with pytest.raises(dataclasses.FrozenInstanceError):
        moved.ranks[0].host = B  # type: ignore[misc]
    assert moved.ranks[2] is plan.ranks[2]  # a rank whose host stays is not copied


def test_specs_run_in_their_hosts_folders() -> None:
    plan = plan_ranks([A, B], np=3)
    specs = build_launch_specs(
        plan, ["train.py"], lambda r: {}, cwd="/here", workdirs={"b": "/sync/b"}
    )
    assert [(s.host.name, s.cwd) for s in specs] == [
        ("a", "/here"),
        ("a", "/here"),
        ("b", "/sync/b"),
    ]
    assert all(s.argv == ("train.py",) for s in specs)
