"""A click group whose commands other than the job's load when they are named.

``dtrain run`` is what starts a job, and a short job's start is mostly Python importing
dtrain: the modules of ``logs``, ``top``, ``hosts``, ``check``, ``sweep`` and ``export``
(and what they define, dozens of click options) are not loaded for it.  A command loads
when it is named on the command line, when ``--help`` lists the commands, or when anything
reads ``commands`` (every command then, as click's own group has them).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click


class LazyGroup(click.Group):
    """``click.Group`` with ``lazy``: command name -> ``"module:attribute"``, loaded on use."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        self.lazy = dict(lazy or {})
        super().__init__(*args, **kwargs)

    @property  # type: ignore[override]  # (click's is a plain attribute)
    def commands(self) -> dict[str, click.Command]:
        """Every command, the lazy ones loaded (what ``click.Group.commands`` holds)."""
        for name in list(self.lazy):
            self.load(name)
        return self.loaded

    @commands.setter
    def commands(self, value: dict[str, click.Command]) -> None:
        self.loaded = value

    def load(self, name: str) -> click.Command | None:
        """The command ``name``, its module imported the first time (None: no such one)."""
        where = self.lazy.pop(name, None)
        if where is not None:
            module, _, attribute = where.partition(":")
            command = getattr(importlib.import_module(module), attribute)
            self.loaded[name] = command
        return self.loaded.get(name)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        name = name or cmd.name
        if name is None:
            raise TypeError("Command has no name.")
        self.lazy.pop(name, None)
        self.loaded[name] = cmd

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self.load(cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.loaded, *self.lazy})

    def names(self) -> list[str]:
        """Every command's name, nothing loaded."""
        return [*self.loaded, *self.lazy]
