"""The options table (``core/options.py``): one row per option, and what is made of it."""

from __future__ import annotations

from collections import Counter
from dataclasses import MISSING, fields

import click
import pytest

from launcher.cli.main import cli
from launcher.core.config import (
    EnvConfig,
    JobConfig,
    PlacementConfig,
    PsConfig,
    SshConfig,
    ViewConfig,
)
from launcher.core.options import OPTIONS, SECTIONS, options_of
from launcher.core.synctree import parse_size

COMMANDS = ("run", "ps", "sweep", "hosts", "check")
# Options a command declares beside the table: its own, not a job's.
OWN = {
    "hosts": {"as_json"},
    "check": {
        "as_json",
        "network",
        "network_timeout_s",
        "no_allreduce",
        "min_bandwidth",
        "interface",
    },
}


def command(name: str) -> click.Command:
    found = cli.get_command(click.Context(cli), name)
    assert found is not None
    return found


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_has_the_tables_options_and_each_once(name: str) -> None:
    rows = options_of(name)
    assert not [f for f, n in Counter(row.field for row in rows).items() if n > 1]
    shown = {
        str(p.name)
        for p in command(name).params
        if isinstance(p, click.Option) and not p.hidden and p.name != "help"
    }
    assert shown - OWN.get(name, set()) == {row.field for row in rows}


def config_defaults() -> dict[str, object]:
    """Every config field's default, by name (the ones a row sets)."""
    kinds = (JobConfig, PlacementConfig, EnvConfig, SshConfig, ViewConfig, PsConfig)
    return {f.name: f.default for kind in kinds for f in fields(kind) if f.default is not MISSING}


@pytest.mark.parametrize("row", [r for r in OPTIONS if r.default is not None], ids=str)
def test_a_rows_default_is_the_configs(row: object) -> None:
    """The table's default (shown by --help) is what a config made without it holds."""
    from launcher.core.options import Option

    assert isinstance(row, Option)
    defaults = config_defaults()
    if row.field not in defaults:
        pytest.skip(f"{row.field} is not a config field")
    default = parse_size(row.default) if row.kind == "size" else row.default
    assert defaults[row.field] == default


def test_every_section_is_a_heading_and_every_row_has_help() -> None:
    for heading, rows in SECTIONS.items():
        assert heading and rows
        for row in rows:
            assert row.help.endswith((".", "...")), row.decl
            assert row.flag.startswith("-"), row.decl
            if row.kind in ("choice",):
                assert row.default in row.choices, row.decl
