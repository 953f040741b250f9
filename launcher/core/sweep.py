"""``dtrain sweep``'s decisions (pure): the trials, where they go, what they measured.

Everything here takes its inputs as arguments and returns values: the search
space from ``--grid``/``--param`` text, the trials (grid points and seeded
random draws, placeholders filled, their variables), the slots a trial takes
and gives back, metric lines, and the results table's order.  The job layer
(``sweeprun.py``) runs the trials; tables of inputs and outputs test this.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from launcher.base.errors import UsageError
from launcher.core.bounds import MAX_TRIALS, check_total
from launcher.core.hosts import Host

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PLACEHOLDER = re.compile(r"\{(\{?)([A-Za-z_][A-Za-z0-9_]*)(\}?)\}")
DISTRIBUTION = re.compile(r"([A-Za-z_]+)\((.*)\)")
KINDS = ("choice", "uniform", "loguniform", "int")
METRIC_PREFIX = "metric:"
METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
MAX_METRIC_TEXT = 80  # a metric that is not a number is kept as text, this long at most
FLOAT_DIGITS = ".6g"  # a sampled float as the command and the variables see it

Value = float | str
Params = tuple[tuple[str, str], ...]  # (name, value as text), in the order given


@dataclass(frozen=True)
class Distribution:
    """One ``--param NAME=KIND(ARGS)``: how a random trial draws NAME."""

    kind: str  # choice, uniform, loguniform, int
    args: tuple[str, ...]  # choice: the values; the others: low and high as written

    def sample(self, rng: random.Random) -> str:
        if self.kind == "choice":
            return rng.choice(self.args)
        if self.kind == "int":
            return str(rng.randint(int(self.args[0]), int(self.args[1])))
        low, high = float(self.args[0]), float(self.args[1])
        if self.kind == "loguniform":
            return format(math.exp(rng.uniform(math.log(low), math.log(high))), FLOAT_DIGITS)
        return format(rng.uniform(low, high), FLOAT_DIGITS)


@dataclass(frozen=True)
class SearchSpace:
    """What the trials are drawn from: grid values, distributions, how many draws, the seed."""

    grid: tuple[tuple[str, tuple[str, ...]], ...] = ()
    params: tuple[tuple[str, Distribution], ...] = ()
    random_count: int = 0  # --random N: N draws (each combined with every grid point)
    seed: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.grid) + tuple(name for name, _ in self.params)


@dataclass(frozen=True)
class Trial:
    """One run of the command with its parameters."""

    index: int
    params: Params
    command: tuple[str, ...]


def parse_grid(texts: Sequence[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``--grid 'lr=0.1,0.01 batch=32,64'`` (repeatable) -> ((lr, (0.1, 0.01)), (batch, ...))."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for text in texts:
        try:
            items = shlex.split(text)
        except ValueError as exc:
            raise UsageError(
                f"--grid {text!r}: {exc}", "write e.g. --grid 'lr=0.1,0.01 batch=32,64'"
            ) from None
        if not items:
            raise UsageError("--grid '': no parameters", "write e.g. --grid 'lr=0.1,0.01'")
        for item in items:
            name, equals, values = item.partition("=")
            split = tuple(v.strip() for v in values.split(","))
            if equals:
                check_name(name, f"--grid {text!r}", "lr=0.1,0.01")
                check_not_distribution(text, name, values)
            if not equals or not all(split):
                raise UsageError(
                    f"--grid {text!r}: {item!r} needs NAME=VALUE[,VALUE...] with no empty value",
                    "write e.g. --grid 'lr=0.1,0.01'",
                )
            found.append((name, split))
    return tuple(found)


def check_not_distribution(text: str, name: str, values: str) -> None:
    """``--grid 'lr=uniform(0,1)'`` would be the trials 'uniform(0' and '1)'."""
    match = DISTRIBUTION.fullmatch(values)
    if match is not None and match[1] in (*KINDS, "range", "randint"):
        raise UsageError(
            f"--grid {text!r}: {match[1]}(...) is a distribution; --grid takes values",
            f"write --random N --param '{name}={values}', or list the values: {name}=a,b,c",
        )


def check_name(name: str, where: str, example: str) -> None:
    if not NAME.fullmatch(name):
        raise UsageError(
            f"{where}: {name!r} is not a parameter name (letters, digits, _; not first a digit)",
            f"write e.g. {example}",
        )


def parse_param(text: str) -> tuple[str, Distribution]:
    """``--param 'lr=loguniform(1e-4,1e-1)'`` -> ('lr', Distribution('loguniform', ...))."""
    name, equals, spec = text.partition("=")
    name = name.strip()
    check_name(name, f"--param {text!r}", "--param 'lr=loguniform(1e-4,1e-1)'")
    match = DISTRIBUTION.fullmatch(spec.strip())
    if not equals or match is None:
        raise UsageError(
            f"--param {text!r}: expected NAME=KIND(ARGS)",
            "KIND is choice(a,b,...), uniform(lo,hi), loguniform(lo,hi) or int(lo,hi)",
        )
    kind, args = match[1], tuple(a.strip() for a in match[2].split(","))
    if kind not in KINDS:
        raise UsageError(
            f"--param {text!r}: unknown distribution {kind!r}",
            "use choice(a,b,...), uniform(lo,hi), loguniform(lo,hi) or int(lo,hi)",
        )
    if kind == "choice":
        if not all(args):
            raise UsageError(
                f"--param {text!r}: choice() needs values, none empty", "write choice(a,b)"
            )
        return name, Distribution(kind, args)
    check_bounds(text, kind, args)
    return name, Distribution(kind, args)


def check_bounds(text: str, kind: str, args: tuple[str, ...]) -> None:
    """Two numbers, low below high (int: low at most high; loguniform: above zero)."""
    convert = int if kind == "int" else float
    try:
        low, high = (convert(a) for a in args) if len(args) == 2 else (None, None)
    except ValueError:
        low, high = None, None
    number = "integers" if kind == "int" else "numbers"
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        raise UsageError(
            f"--param {text!r}: {kind}() takes two {number}, low and high",
            f"write e.g. {kind}({'1,8' if kind == 'int' else '0.1,0.5'})",
        )
    if low > high or (low == high and kind != "int"):
        raise UsageError(f"--param {text!r}: low {args[0]} is above high {args[1]}", "swap them")
    if kind == "loguniform" and low <= 0:
        raise UsageError(
            f"--param {text!r}: loguniform() needs bounds above 0", "write e.g. (1e-4,1e-1)"
        )


def build_space(
    grid_texts: Sequence[str], param_texts: Sequence[str], random_count: int | None, seed: int
) -> SearchSpace:
    """The search space of the options, checked: every name once, --param only with --random."""
    grid = parse_grid(grid_texts)
    params = tuple(parse_param(text) for text in param_texts)
    if params and not random_count:
        raise UsageError("--param needs --random N", "add e.g. --random 20 (the number of draws)")
    if random_count and not params:
        raise UsageError("--random needs --param NAME=DIST", "add e.g. --param 'lr=uniform(0,1)'")
    if not grid and not params:
        raise UsageError(
            "no parameters to sweep",
            "give --grid 'lr=0.1,0.01', or --random N with --param NAME=DIST",
        )
    trials = math.prod(len(values) for _, values in grid) * (random_count or 1)
    flags = " and ".join(f for f, given in (("--grid", grid), ("--random", random_count)) if given)
    check_total(flags, [trials], MAX_TRIALS, "trials")  # before any is made
    space = SearchSpace(grid, params, random_count or 0, seed)
    seen: dict[str, str] = {}
    for name in space.names:
        key = variable_name(name)
        if key in seen:
            raise UsageError(
                f"parameter {name!r} given twice"
                + (f" (as {seen[key]!r})" if seen[key] != name else ""),
                "give each parameter once (names are case-blind in DTRAIN_PARAM_*)",
            )
        seen[key] = name
    return space


def expand_space(space: SearchSpace) -> list[Params]:
    """Every trial's parameters: the grid's cartesian product (the last name varies fastest),
    times ``random_count`` seeded draws of the distributions."""
    names = [name for name, _ in space.grid]
    points = [tuple(zip(names, values, strict=True)) for values in itertools.product(
        *(values for _, values in space.grid)
    )]  # fmt: skip
    if not space.params:
        return points
    rng = random.Random(space.seed)
    draws = [
        tuple((name, dist.sample(rng)) for name, dist in space.params)
        for _ in range(space.random_count)
    ]
    return [point + draw for draw in draws for point in points]


def placeholders(command: Sequence[str]) -> list[str]:
    """The ``{name}`` placeholders of the command, in order (``{{name}}`` is literal)."""
    return [m[2] for arg in command for m in PLACEHOLDER.finditer(arg) if not (m[1] and m[3])]


def fill_command(command: Sequence[str], params: Params) -> tuple[str, ...]:
    """The command with every ``{name}`` replaced by the trial's value; ``{{name}}`` gives
    ``{name}``; other braces are left alone."""
    values = dict(params)

    def fill(match: re.Match[str]) -> str:
        if match[1] and match[3]:
            return "{" + match[2] + "}"
        return match[1] + values[match[2]] + match[3]

    return tuple(PLACEHOLDER.sub(fill, arg) for arg in command)


def plan_trials(space: SearchSpace, command: Sequence[str]) -> list[Trial]:
    """The trials of the sweep; a placeholder that names no parameter is an error."""
    unknown = [name for name in placeholders(command) if name not in space.names]
    if unknown:
        raise UsageError(
            f"COMMAND: unknown placeholder {{{unknown[0]}}} (parameters: {', '.join(space.names)})",
            f"sweep {unknown[0]} with --grid or --param, or write {{{{{unknown[0]}}}}} for a "
            "literal brace",
        )
    return [
        Trial(index, params, fill_command(command, params))
        for index, params in enumerate(expand_space(space))
    ]


def unused_params(space: SearchSpace, command: Sequence[str]) -> list[str]:
    """Parameters no ``{name}`` of the command uses: the trials see them only as variables
    (a program may read them so, or the placeholder was forgotten: every trial alike)."""
    used = set(placeholders(command))
    return [name for name in space.names if name not in used]


def check_choices(
    objective: str | None, direction_given: bool, follow: int | None, trials: int
) -> None:
    """--maximize/--minimize only with --objective; --follow names one of the trials."""
    if direction_given and objective is None:
        raise UsageError(
            "--maximize/--minimize order the results by --objective, which is not given",
            "add --objective NAME (a metric the trials print), or drop it",
        )
    if follow is not None and follow >= trials:
        raise UsageError(
            f"--follow {follow}: the sweep's trials are 0 to {trials - 1}",
            "give a trial number from --dry-run's list",
        )


def variable_name(name: str) -> str:
    return "DTRAIN_PARAM_" + name.upper()


def trial_env(trial: Trial) -> dict[str, str]:
    """What every rank of the trial sees: DTRAIN_TRIAL and DTRAIN_PARAM_<NAME>."""
    return {"DTRAIN_TRIAL": str(trial.index), **{variable_name(k): v for k, v in trial.params}}


# Slots: which of the hosts' slots each running trial holds.
@dataclass(frozen=True)
class Placement:
    """A trial's slots: for each host (by index in the sweep's host list), slot numbers."""

    slots: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def count(self) -> int:
        return sum(len(numbers) for _, numbers in self.slots)


@dataclass
class SlotPool:
    """The hosts' slots and which are free; a trial takes ``count`` of them or waits."""

    hosts: Sequence[Host]
    busy: set[tuple[int, int]] = field(default_factory=set)  # (host index, slot number)

    @property
    def total(self) -> int:
        return sum(host.slots for host in self.hosts)

    def free_on(self, index: int) -> list[int]:
        return [n for n in range(self.hosts[index].slots) if (index, n) not in self.busy]

    def take(self, count: int) -> Placement | None:
        """``count`` free slots: all on one host, the least loaded that has them (trials
        spread over the hosts, as a sweep's user expects: one per host before two on one),
        else the least loaded hosts' free slots; None when fewer are free (the trial
        waits)."""
        free = {i: self.free_on(i) for i in range(len(self.hosts))}
        if sum(len(numbers) for numbers in free.values()) < count:
            return None
        order = sorted(free, key=lambda i: (self.load(i), -len(free[i]), i))
        whole = next((i for i in order if len(free[i]) >= count), None)
        if whole is not None:
            chosen = [(whole, tuple(free[whole][:count]))]
        else:
            chosen, left = [], count
            for i in order:
                if free[i] and left:
                    chosen.append((i, tuple(free[i][:left])))
                    left -= len(chosen[-1][1])
        placement = Placement(tuple(sorted(chosen)))  # its ranks in host order
        self.busy.update((i, n) for i, numbers in placement.slots for n in numbers)
        return placement

    def load(self, index: int) -> float:
        """How busy a host is: the share of its slots taken."""
        taken = sum(1 for host, _ in self.busy if host == index)
        return taken / max(self.hosts[index].slots, 1)

    def give_back(self, placement: Placement) -> None:
        self.busy.difference_update((i, n) for i, numbers in placement.slots for n in numbers)


def render_hostfile(
    hosts: Sequence[Host],
    placement: Placement,
    gpus: Mapping[int, tuple[str, ...]],
    gpus_per_rank: int | None,
) -> str:
    """The trial's hostfile: its hosts with the slots it holds, and, where a host's GPUs are
    known (``gpus``: by host index), the GPUs of those slots, so that trials side by side on
    one host never share a GPU."""
    lines = []
    per_slot = gpus_per_rank or 1
    for index, numbers in placement.slots:
        host = hosts[index]
        name = f"[{host.name}]" if ":" in host.name else host.name
        line = f"{host.user + '@' if host.user else ''}{name} slots={len(numbers)}"
        known = host.gpus if host.gpus is not None else gpus.get(index)
        if known:
            mine = [g for n in numbers for g in known[n * per_slot : (n + 1) * per_slot]]
            line += f" gpus={','.join(mine)}" if mine else ""
        lines.append(line)
    return "\n".join(lines) + "\n"


def describe_placement(hosts: Sequence[Host], placement: Placement) -> str:
    """``node1:2,node2:1``: where a trial runs."""
    return ",".join(f"{hosts[i].name}:{len(numbers)}" for i, numbers in placement.slots)


# Metrics: name=value pairs on "metric:" lines, or JSON objects in $DTRAIN_METRICS_FILE.
def parse_value(text: str) -> Value:
    try:
        number = float(text)
    except ValueError:
        return text[:MAX_METRIC_TEXT]
    return number if math.isfinite(number) else text


def parse_metric_line(text: str) -> dict[str, Value]:
    """``metric: val_acc=0.93 loss=0.21`` (spaces or commas between pairs) -> the pairs; a
    line that is not a metric line gives nothing."""
    body = text.strip()
    if not body.startswith(METRIC_PREFIX):
        return {}
    found: dict[str, Value] = {}
    for item in re.split(r"[\s,]+", body[len(METRIC_PREFIX) :]):
        name, equals, value = item.partition("=")
        if equals and value and METRIC_NAME.fullmatch(name):
            found[name] = parse_value(value)
    return found


def parse_metric_json(text: str) -> dict[str, Value]:
    """One JSON line of ``$DTRAIN_METRICS_FILE``: its numbers and strings (others ignored)."""
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    found: dict[str, Value] = {}
    for name, value in record.items():
        if isinstance(value, bool) or not METRIC_NAME.fullmatch(str(name)):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            found[str(name)] = float(value)
        elif isinstance(value, str):
            found[str(name)] = value[:MAX_METRIC_TEXT]
    return found


# The results table.
@dataclass(frozen=True)
class TrialRow:
    """One trial as the table shows it."""

    trial: int
    params: Params
    state: str  # pending, running, succeeded, failed, stopped
    exit_code: int | None = None
    duration_s: float | None = None
    metrics: Mapping[str, Value] = field(default_factory=dict)
    job: str | None = None  # its latest job (dtrain logs JOB)
    hosts: str | None = None  # where it runs or ran
    tries: int = 0


def sort_rows(rows: Sequence[TrialRow], objective: str | None, maximize: bool) -> list[TrialRow]:
    """Best first by ``objective`` (among trials that succeeded with a number for it), then the
    others by trial number; without an objective, by trial number."""

    def key(row: TrialRow) -> tuple[int, float, int]:
        value = row.metrics.get(objective) if objective else None
        if row.state == "succeeded" and isinstance(value, float):
            return (0, -value if maximize else value, row.trial)
        return (1, 0.0, row.trial)

    return sorted(rows, key=key)


def metric_names(rows: Sequence[TrialRow]) -> list[str]:
    """Every metric any trial reported, in the order first seen."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row.metrics))
    return list(names)


def rows_as_json(rows: Sequence[TrialRow]) -> list[dict[str, object]]:
    return [
        {
            "trial": row.trial,
            "params": dict(row.params),
            "state": row.state,
            "exit_code": row.exit_code,
            "duration_s": None if row.duration_s is None else round(row.duration_s, 3),
            "metrics": dict(row.metrics),
            "job": row.job,
            "hosts": row.hosts,
            "tries": row.tries,
        }
        for row in rows
    ]


def format_value(value: Value | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, ".4g")
    return value


FINISHED = ("succeeded", "failed")  # ran to their own end: --resume leaves them


def trials_to_rerun(states: Mapping[int, str], failed_too: bool) -> list[int]:
    """The trials a ``--resume`` runs: those that did not finish (never started, stopped,
    lost with their sweep), and with ``failed_too`` the failed ones."""
    done = ("succeeded",) if failed_too else FINISHED
    return sorted(index for index, state in states.items() if state not in done)
