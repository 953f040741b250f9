"""dtrain sweep's pure decisions as tables: grids, distributions, draws, placeholders, slots,
metric lines, the results' order."""

from __future__ import annotations

import math
import random

import pytest

from launcher.base.errors import UsageError
from launcher.core.hosts import Host, parse_hostfile
from launcher.core.sweep import (
    Distribution,
    Placement,
    SearchSpace,
    SlotPool,
    Trial,
    TrialRow,
    build_space,
    check_choices,
    expand_space,
    fill_command,
    parse_grid,
    parse_metric_json,
    parse_metric_line,
    parse_param,
    placeholders,
    plan_trials,
    render_hostfile,
    sort_rows,
    trial_env,
    trials_to_rerun,
    unused_params,
)


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (
            ["lr=0.1,0.03,0.01 batch=32,64"],
            (("lr", ("0.1", "0.03", "0.01")), ("batch", ("32", "64"))),
        ),
        (["lr=0.1", "opt=adam,sgd"], (("lr", ("0.1",)), ("opt", ("adam", "sgd")))),
        (["  a=1 ,  "], None),  # an empty value
        (["opt='adam w',sgd"], (("opt", ("adam w", "sgd")),)),
        (["act=relu(),tanh()"], (("act", ("relu()", "tanh()")),)),  # values that look like calls
        (["_x2=-1,1e-3"], (("_x2", ("-1", "1e-3")),)),
    ],
)  # fmt: skip
def test_grids(texts: list[str], expected: object) -> None:
    if expected is None:
        with pytest.raises(UsageError):
            parse_grid(texts)
    else:
        assert parse_grid(texts) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr", "'lr' needs NAME=VALUE"),
        ("lr=", "'lr=' needs NAME=VALUE"),
        ("lr=0.1,,0.2", "no empty value"),
        ("1lr=0.1", "'1lr' is not a parameter name"),
        ("l-r=0.1", "'l-r' is not a parameter name"),
        ("lr='0.1", "No closing quotation"),
        ("", "no parameters"),
        ("lr=uniform(0,1)", "uniform(...) is a distribution; --grid takes values"),
        ("n=range(1,5)", "range(...) is a distribution"),
    ],
)
def test_bad_grids_say_what(text: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_grid([text])
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("lr=loguniform(1e-4,1e-1)", ("lr", Distribution("loguniform", ("1e-4", "1e-1")))),
        ("dropout=uniform(0, 0.5)", ("dropout", Distribution("uniform", ("0", "0.5")))),
        ("layers=int(1,4)", ("layers", Distribution("int", ("1", "4")))),
        ("layers=int(3,3)", ("layers", Distribution("int", ("3", "3")))),
        ("opt=choice(adam,sgd,rms)", ("opt", Distribution("choice", ("adam", "sgd", "rms")))),
        ("opt=choice(adam)", ("opt", Distribution("choice", ("adam",)))),
    ],
)  # fmt: skip
def test_distributions(text: str, expected: tuple[str, Distribution]) -> None:
    assert parse_param(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lr=normal(0,1)", "unknown distribution 'normal'"),
        ("lr=uniform(0,1", "expected NAME=KIND(ARGS)"),
        ("lr", "expected NAME=KIND(ARGS)"),
        ("lr=uniform(1)", "uniform() takes two numbers"),
        ("lr=uniform(a,b)", "uniform() takes two numbers"),
        ("lr=uniform(1,0)", "low 1 is above high 0"),
        ("lr=uniform(1,1)", "low 1 is above high 1"),
        ("lr=loguniform(0,1)", "loguniform() needs bounds above 0"),
        ("lr=uniform(0,inf)", "uniform() takes two numbers"),
        ("n=int(1.5,3)", "int() takes two integers"),
        ("n=int(4,3)", "low 4 is above high 3"),
        ("opt=choice(a,,b)", "choice() needs values"),
        ("9=int(1,2)", "'9' is not a parameter name"),
    ],
)
def test_bad_distributions_say_what(text: str, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        parse_param(text)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("grid", "params", "count", "message"),
    [
        ([], ["lr=uniform(0,1)"], None, "--param needs --random N"),
        ([], [], 5, "--random needs --param"),
        ([], [], None, "no parameters to sweep"),
        (["lr=1,2"], ["lr=uniform(0,1)"], 3, "parameter 'lr' given twice"),
        (["lr=1,2", "LR=3"], [], None, "parameter 'LR' given twice (as 'lr')"),
    ],
)
def test_bad_spaces(grid: list[str], params: list[str], count: int | None, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        build_space(grid, params, count, seed=1)
    assert message in str(caught.value)


def test_grid_is_the_cartesian_product_last_name_fastest() -> None:
    space = build_space(["lr=0.1,0.01 batch=32,64", "opt=adam"], [], None, seed=0)
    assert expand_space(space) == [
        (("lr", "0.1"), ("batch", "32"), ("opt", "adam")),
        (("lr", "0.1"), ("batch", "64"), ("opt", "adam")),
        (("lr", "0.01"), ("batch", "32"), ("opt", "adam")),
        (("lr", "0.01"), ("batch", "64"), ("opt", "adam")),
    ]


RANDOM_PARAMS = [
    "lr=loguniform(1e-4,1e-1)",
    "dropout=uniform(0,0.5)",
    "layers=int(1,3)",
    "opt=choice(adam,sgd)",
]


def test_random_draws_are_seeded_and_within_their_bounds() -> None:
    space = build_space([], RANDOM_PARAMS, 400, seed=1)
    draws = expand_space(space)
    assert draws == expand_space(build_space([], RANDOM_PARAMS, 400, seed=1))
    assert draws != expand_space(build_space([], RANDOM_PARAMS, 400, seed=2))
    assert len(draws) == 400
    values = {name: [dict(d)[name] for d in draws] for name in ("lr", "dropout", "layers", "opt")}
    assert all(1e-4 <= float(v) <= 1e-1 for v in values["lr"])
    assert all(0 <= float(v) <= 0.5 for v in values["dropout"])
    assert set(values["layers"]) == {"1", "2", "3"}  # int() includes both bounds
    assert set(values["opt"]) == {"adam", "sgd"}
    # loguniform: about as many draws in each decade
    decades = [math.floor(math.log10(float(v))) for v in values["lr"]]
    assert all(80 < decades.count(d) < 190 for d in (-4, -3, -2)), decades


def test_random_draws_combine_with_the_grid() -> None:
    space = build_space(["model=a,b"], ["lr=uniform(0,1)"], 3, seed=7)
    draws = expand_space(space)
    assert [dict(d)["model"] for d in draws] == ["a", "b"] * 3
    assert len({dict(d)["lr"] for d in draws}) == 3  # each draw with every grid point
    assert dict(draws[0])["lr"] == dict(draws[1])["lr"]


def test_a_drawn_float_is_written_with_six_digits() -> None:
    value = Distribution("uniform", ("0", "1")).sample(random.Random(3))
    assert value == format(float(value), ".6g") and len(value.replace("0.", "")) <= 6


@pytest.mark.parametrize(
    ("command", "params", "filled"),
    [
        (["train.py", "--lr", "{lr}"], {"lr": "0.1"}, ("train.py", "--lr", "0.1")),
        (["t.py", "--lr={lr}", "--b={b}{b}"], {"lr": "1", "b": "2"}, ("t.py", "--lr=1", "--b=22")),
        (["-c", "echo {lr} {{lr}} {} {0} { a }"], {"lr": "3"}, ("-c", "echo 3 {lr} {} {0} { a }")),
        (["run", "--opt", "{opt}"], {"opt": "adam w"}, ("run", "--opt", "adam w")),
    ],
)  # fmt: skip
def test_placeholders_are_filled(
    command: list[str], params: dict[str, str], filled: tuple[str, ...]
) -> None:
    assert fill_command(command, tuple(params.items())) == filled


def test_placeholders_listed_and_unknown_ones_refused() -> None:
    assert placeholders(["a{x}", "{{y}}", "{z}{x}"]) == ["x", "z", "x"]
    space = build_space(["lr=0.1"], [], None, seed=0)
    with pytest.raises(UsageError) as caught:
        plan_trials(space, ["train.py", "--lr", "{lr}", "--batch", "{batch}"])
    assert str(caught.value).startswith("COMMAND: unknown placeholder {batch} (parameters: lr)")
    assert plan_trials(space, ["t.py", "{lr}"]) == [Trial(0, (("lr", "0.1"),), ("t.py", "0.1"))]


@pytest.mark.parametrize(
    ("command", "unused"),
    [
        (["t.py", "--lr", "{lr}", "{b}"], []),
        (["t.py", "--lr={lr}"], ["b"]),
        (["t.py", "{{lr}}", "{{b}}"], ["lr", "b"]),  # literal braces use nothing
        (["t.py"], ["lr", "b"]),  # the program reads $DTRAIN_PARAM_LR, say
    ],
)
def test_parameters_the_command_does_not_use(command: list[str], unused: list[str]) -> None:
    assert unused_params(build_space(["lr=0.1 b=1"], [], None, seed=0), command) == unused


@pytest.mark.parametrize(
    ("objective", "direction", "follow", "trials", "message"),
    [
        ("acc", True, 3, 4, None),
        (None, False, None, 1, None),
        (None, True, None, 4, "--maximize/--minimize order the results by --objective"),
        ("acc", False, 4, 4, "--follow 4: the sweep's trials are 0 to 3"),
    ],
)
def test_view_choices_checked(
    objective: str | None, direction: bool, follow: int | None, trials: int, message: str | None
) -> None:
    if message is None:
        check_choices(objective, direction, follow, trials)
        return
    with pytest.raises(UsageError) as caught:
        check_choices(objective, direction, follow, trials)
    assert str(caught.value).startswith(message)


def test_trial_variables() -> None:
    trial = Trial(4, (("lr", "0.1"), ("Batch_size", "32")), ("t.py",))
    assert trial_env(trial) == {
        "DTRAIN_TRIAL": "4",
        "DTRAIN_PARAM_LR": "0.1",
        "DTRAIN_PARAM_BATCH_SIZE": "32",
    }


def take_all(pool: SlotPool, counts: list[int]) -> list[Placement | None]:
    return [pool.take(count) for count in counts]


@pytest.mark.parametrize(
    ("slots", "counts", "expected"),
    [
        # one rank each: the least loaded host first; a trial that finds none waits (None)
        ([2, 1], [1, 1, 1, 1], [((0, (0,)),), ((1, (0,)),), ((0, (1,)),), None]),
        # -H h7:4,h8:4: four one-rank trials, two on each host
        ([4, 4], [1, 1, 1, 1], [((0, (0,)),), ((1, (0,)),), ((0, (1,)),), ((1, (1,)),)]),
        # two ranks: a host that holds both first, else spread over hosts
        ([1, 1, 2], [2, 2, 1], [((2, (0, 1)),), ((0, (0,)), (1, (0,))), None]),
        ([2, 2], [2, 2, 2], [((0, (0, 1)),), ((1, (0, 1)),), None]),
        ([1], [2], [None]),
    ],
)
def test_slots_taken(slots: list[int], counts: list[int], expected: list[object]) -> None:
    pool = SlotPool([Host(f"h{i}", slots=n) for i, n in enumerate(slots)])
    placed = take_all(pool, counts)
    assert [p.slots if p else None for p in placed] == expected


def test_slots_given_back_are_taken_again() -> None:
    pool = SlotPool([Host("a", slots=2), Host("b", slots=1)])
    _, second, third = take_all(pool, [1, 1, 1])
    assert pool.take(1) is None
    assert second is not None and third is not None
    pool.give_back(second)
    assert pool.take(2) is None  # one slot free: a two-rank trial still waits
    again = pool.take(1)
    assert again == second
    pool.give_back(third)
    pool.give_back(again)
    assert pool.take(2) == Placement(((0, (1,)), (1, (0,))))


def test_a_trial_hostfile_has_its_slots_and_their_gpus() -> None:
    hosts = [
        Host("node1", slots=4, gpus=("0", "1", "2", "3")),
        Host("n2", 2, user="bob"),
        Host("::1", 2),
    ]
    placement = Placement(((0, (2, 3)), (1, (1,)), (2, (0, 1))))
    text = render_hostfile(hosts, placement, {2: ("4", "5", "6", "7")}, None)
    assert text == "node1 slots=2 gpus=2,3\nbob@n2 slots=1\n[::1] slots=2 gpus=4,5\n"
    assert parse_hostfile(text) == [
        Host("node1", slots=2, gpus=("2", "3")),
        Host("n2", slots=1, user="bob"),
        Host("::1", slots=2, gpus=("4", "5")),
    ]
    two_each = render_hostfile(hosts[:1], Placement(((0, (1,)),)), {}, 2)
    assert two_each == "node1 slots=1 gpus=2,3\n"  # --gpus-per-rank 2: slot 1 has GPUs 2 and 3


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("metric: val_acc=0.93 loss=0.21", {"val_acc": 0.93, "loss": 0.21}),
        ("  metric: step=3, acc=1e-3,opt=adam", {"step": 3.0, "acc": 0.001, "opt": "adam"}),
        ("metric:val/acc=0.5 bad= =1 x", {"val/acc": 0.5}),
        ("metric: loss=nan", {"loss": "nan"}),
        ("epoch 3 metric: acc=0.5", {}),
        ("metrics: acc=0.5", {}),
        ("", {}),
    ],
)
def test_metric_lines(line: str, expected: dict[str, object]) -> None:
    assert parse_metric_line(line) == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"val_acc": 0.9, "epoch": 3, "tag": "ok"}', {"val_acc": 0.9, "epoch": 3.0, "tag": "ok"}),
        ('{"ok": true, "nested": {"a": 1}, "list": [1], "n": null, "x": 1}', {"x": 1.0}),
        ("[1, 2]", {}),
        ("not json", {}),
        ('{"bad name": 1}', {}),
    ],
)  # fmt: skip
def test_metric_json_lines(line: str, expected: dict[str, object]) -> None:
    assert parse_metric_json(line) == expected


def row(trial: int, state: str = "succeeded", **metrics: float | str) -> TrialRow:
    return TrialRow(trial=trial, params=(), state=state, metrics=metrics)


ROWS = [
    row(0, acc=0.5),
    row(1, "failed", acc=0.99),
    row(2, acc=0.7),
    row(3),
    row(4, acc="n/a"),
    row(5, acc=0.6),
]


@pytest.mark.parametrize(
    ("objective", "maximize", "order"),
    [
        (None, False, [0, 1, 2, 3, 4, 5]),
        ("acc", True, [2, 5, 0, 1, 3, 4]),  # failed, missing and text values last, by trial
        ("acc", False, [0, 5, 2, 1, 3, 4]),
        ("loss", False, [0, 1, 2, 3, 4, 5]),
    ],
)
def test_results_order(objective: str | None, maximize: bool, order: list[int]) -> None:
    assert [r.trial for r in sort_rows(ROWS, objective, maximize)] == order


@pytest.mark.parametrize(
    ("failed_too", "expected"),
    [(False, [2, 3, 4]), (True, [1, 2, 3, 4])],
)
def test_resume_reruns_what_did_not_finish(failed_too: bool, expected: list[int]) -> None:
    states = {0: "succeeded", 1: "failed", 2: "stopped", 3: "pending", 4: "running"}
    assert trials_to_rerun(states, failed_too) == expected


def test_space_names_in_order() -> None:
    space = SearchSpace(grid=(("a", ("1",)),), params=(("b", Distribution("int", ("1", "2"))),))
    assert space.names == ("a", "b")
