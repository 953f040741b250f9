"""Placement: whole plans compared against tables."""

from __future__ import annotations

import pytest

from launcher.errors import PlanError
from launcher.hosts import Host
from launcher.plan import Plan, Rank, bind_gpus, bind_ps_gpus, plan_ps, plan_ranks

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
        ([A], 2, {"nproc_per_node": 2}, "-np and --nproc-per-node both given"),
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
