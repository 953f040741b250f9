"""The edge's option declarations: click's options made of ``core/options.py``'s table.

``table_options("run")`` gives a command every option the table says it has, each named as
the config field it sets; ``optionvalues.config_from_options`` turns the parsed values into
a ``JobConfig`` by those names, so a flag's journey starts in the table: ``-x exports``
fills ``EnvConfig.exports``.  The types here are click's faces of the table's kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import click

from launcher.core.bounds import MAX_PORT, MAX_SECONDS
from launcher.core.options import FLAGS, OPTIONS, Option, options_of, parse

F = TypeVar("F", bound=Callable[..., Any])


class Decorator(Protocol):
    def __call__(self, command: F, /) -> F: ...


def option(declarations: str, help: str, **settings: Any) -> Decorator:
    """``click.option`` with its flags (and the config field it sets) in one string."""
    return click.option(*declarations.split(), help=help, **settings)


def stacked(*decorators: Decorator) -> Decorator:
    """One decorator applying several, in the order given (the first is listed first)."""

    def apply(command: F) -> F:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
# A job command's options end at COMMAND: what follows is the command's own.
JOB_COMMAND: dict[str, Any] = {**CONTEXT, "allow_interspersed_args": False}
COMMAND = click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
COUNT = {"metavar": "N", "show_default": True}


class Checked(click.ParamType):  # type: ignore[type-arg]  # (generic from click 8.2)
    """A table row's click type: click describes it in --help, the table converts and checks
    the value (``core/options.parse``: one line naming the flag, as the API's keywords get)."""

    row: Option

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return parse(self.row, value)


class CheckedInt(Checked, click.types.IntParamType):
    pass


class CheckedRange(Checked, click.IntRange):
    pass


class CheckedSeconds(Checked, click.FloatRange):
    """A duration: a finite number of seconds from its row's lowest to its highest (a year
    unless less is given; not shown in --help then, which keeps saying 'x>=0.1')."""


class CheckedShare(Checked, click.FloatRange):
    pass


class CheckedSize(Checked):
    name = "size"


class CheckedChoice(Checked, click.Choice):  # type: ignore[type-arg]
    pass


def click_type(row: Option) -> Any:
    """The click type of a row's kind (None: a string)."""
    checked: Checked
    if row.kind == "seconds":
        high = row.highest
        checked = CheckedSeconds(row.low or 0, None if high == MAX_SECONDS else high)
    elif row.kind == "int" and row.low is None and row.high is None:
        checked = CheckedInt()
    elif row.kind == "int":
        # (--help shows the lowest value; the highest only of a port: the others are typo
        # guards far beyond any job, checked all the same, as a duration's year is)
        low = None if row.low is None else int(row.low)
        checked = CheckedRange(low, MAX_PORT if row.high == MAX_PORT else None)
    elif row.kind == "choice":
        checked = CheckedChoice(row.choices, case_sensitive=not row.ignore_case)
    elif row.kind in ("share", "size"):
        share = CheckedShare(0, 1, min_open=True, max_open=True) if row.kind == "share" else None
        checked = share or CheckedSize()
    else:
        return None
    checked.row = row
    return checked


def seconds(flag: str, low: float, high: float | None = None) -> Any:
    """The type of a duration outside the table (``dtrain logs --collapse-window``), checked
    as the table's are."""
    return click_type(Option(flag, "seconds", low=low, high=high))


def click_option(row: Option) -> Decorator:
    """One row as click's option."""
    settings: dict[str, Any] = {}
    if row.kind == "flag":
        settings["is_flag"] = True
    elif row.kind == "off":
        settings.update(flag_value=False, default=True)
    elif row.kind == "toggle":
        settings["default"] = None
    if row.kind not in FLAGS:
        settings.update(multiple=row.kind in ("list", "pairs"), type=click_type(row))
        if row.kind == "pairs":
            settings["nargs"] = 2
        if row.default is not None:
            settings.update(default=row.default, show_default=True)
        settings["metavar"] = row.metavar or ("SECONDS" if row.kind == "seconds" else None)
    return click.option(*row.decl.split(), help=row.help, **settings)


def table_options(command: str) -> Decorator:
    """Every option of ``command`` in the table, in its order."""
    return stacked(*(click_option(row) for row in options_of(command)))


JOB_DIR_OPTION = click_option(next(row for row in OPTIONS if row.field == "job_dir"))
