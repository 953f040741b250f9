"""Options named as keywords: the one table the Python API's keyword arguments and the
project file's keys share (the edge).

A keyword is an option's long flag with ``_`` for ``-`` (``--max-restarts`` ->
``max_restarts``, ``-np``/``--np`` -> ``np``, ``--no-collapse`` -> ``no_collapse``), with
two names of their own: ``hosts`` for ``-H`` and ``env`` for ``-x``.  The table is read
from the click command's parameters, so an option added to a command has its keyword at
once, in ``launch()`` and in ``dtrain.toml`` alike.  ``option_arguments`` turns a keyword
and its value into the arguments the command line would have had; the command's own
parser then checks and converts them, so both edges get the command line's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click

from launcher.base.errors import UsageError

ALIASES = {"hosts": "host", "env": "x"}  # the keywords of -H and -x (its flag has no long form)


@dataclass(frozen=True)
class Flag:
    """One keyword: the option it sets, its flag, and (a --no- flag) the flag of False."""

    param: click.Option
    flag: str
    opposite: str | None = None


def option_flags(command: click.Command) -> dict[str, Flag]:
    """Every keyword ``command``'s visible options take, by name."""
    flags: dict[str, Flag] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        long = [o for o in param.opts if o.startswith("--")]
        negative = [o for o in param.secondary_opts if o.startswith("--")]
        for flag in long:
            flags[flag[2:].replace("-", "_")] = Flag(param, flag, negative[0] if negative else None)
        for flag in negative:
            flags[flag[2:].replace("-", "_")] = Flag(param, flag, long[0] if long else None)
        if param.name == "exports":  # -x has no long form: env= is its name here
            flags["x"] = Flag(param, "-x")
    for alias, name in ALIASES.items():
        if name in flags:
            flags[alias] = flags.pop(name)
    return flags


def option_arguments(name: str, value: Any, flag: Flag) -> list[str]:
    """One keyword as the command line's arguments."""
    param = flag.param
    if param.is_flag:
        if not isinstance(value, bool):
            raise UsageError(f"{name}={value!r}: a flag takes True or False", f"write {name}=True")
        if value:
            return [flag.flag]
        return [flag.opposite] if flag.opposite else []
    if name == "env":
        return [arg for item in env_items(value) for arg in ("-x", item)]
    if param.nargs == 2:  # --mca NAME VALUE
        pairs = value.items() if isinstance(value, Mapping) else value
        return [arg for pair in pairs for arg in (flag.flag, *map(str, pair))]
    if param.multiple and isinstance(value, list | tuple):
        if not value and name == "hosts":  # (as -H '' on a command line: no hosts, refused)
            return [flag.flag, ""]
        return [arg for item in value for arg in (flag.flag, str(item))]
    return [flag.flag, str(value)]


def env_items(value: Any) -> list[str]:
    """``env=``: a mapping of values, or names (one, or several) copied from here."""
    if isinstance(value, Mapping):
        for key, item in value.items():  # (None or True would reach the ranks as "None")
            if not isinstance(item, str | int | float) or isinstance(item, bool):
                raise UsageError(
                    f"env={{{key!r}: {item!r}}}: a variable's value is text",
                    f"write env={{{key!r}: '...'}}, or leave {key} out",
                )
        return [f"{key}={item}" for key, item in value.items()]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple | set | frozenset):
        return [str(item) for item in value]
    raise UsageError(
        f"env={value!r}: not variables",
        "give a dict (env={'NCCL_DEBUG': 'INFO'}) or names to copy (env=['WANDB_API_KEY'])",
    )
