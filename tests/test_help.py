"""Grouped --help of dtrain run, ps and sweep: every option under a heading, 80 columns."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from launcher.cli.help import (
    GROUP_OF,
    OPTION_GROUPS,
    ORDER,
    UNGROUPED,
    GroupedCommand,
    grouped_name,
)
from launcher.cli.main import cli
from tests.conftest import child_env, run_dtrain

GROUPED = {
    "run": "docs/running.md",
    "ps": "docs/parameter-servers.md",
    "sweep": "docs/sweeps.md",
}


def shown_options(command: click.Command) -> list[str]:
    """The options ``--help`` lists (not hidden ones, not COMMAND), by their group names."""
    ctx = click.Context(command, info_name=command.name, **command.context_settings)
    return [
        grouped_name(p, ctx)
        for p in command.get_params(ctx)
        if not isinstance(p, click.Argument) and p.get_help_record(ctx) is not None
    ]


def help_text(name: str) -> str:
    result = CliRunner().invoke(cli, [name, "--help"], terminal_width=80)
    assert result.exit_code == 0, result.output
    return result.output


def option_terms(text: str) -> list[str]:
    """The option column of each option line (``-H, --host HOST[:SLOTS],...``), below the
    first group's heading (the description above may start a line with a flag too)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if re.fullmatch(r"[A-Z][A-Za-z ]*:", line))
    return [line.strip().split("  ")[0] for line in lines[first:] if line.startswith("  -")]


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_every_option_shown_has_a_group(name: str) -> None:
    command = cli.commands[name]
    assert isinstance(command, GroupedCommand)
    ungrouped = [name for name in shown_options(command) if name not in GROUP_OF]
    assert not ungrouped, f"dtrain {name}: give these a group in cli/help.py: {ungrouped}"


def test_every_grouped_name_is_an_option_and_in_one_group() -> None:
    names = " ".join(names for _, names in OPTION_GROUPS).split()
    assert len(names) == len(set(names)) == len(ORDER)
    options = {option for name in GROUPED for option in shown_options(cli.commands[name])}
    assert set(names) - options == set()


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_help_renders_in_groups_at_80_columns(name: str) -> None:
    text = help_text(name)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    headings = [line for line in lines if re.fullmatch(r"[A-Z][A-Za-z ]*:", line)]
    assert "Options:" not in headings
    assert f"{UNGROUPED}:" == headings[-1] and len(headings) >= 6, headings
    groups = [heading for heading, _ in OPTION_GROUPS]
    assert [h[:-1] for h in headings] == [g for g in groups if f"{g}:" in headings]
    assert lines[-1] == f"Full manual: {GROUPED[name]} (and docs/ in the repository)"
    # every option line's text starts in the same column, whatever its group
    starts = {len(line) - len(line.lstrip()) for line in lines if line.startswith(" " * 30)}
    assert len(starts) == 1, starts


def test_run_help_groups_as_a_reader_expects() -> None:
    text = help_text("run")
    sections = dict(re.findall(r"\n([A-Z][A-Za-z ]*):\n(.*?)(?=\n\n)", text, re.S))
    assert "-H, --host" in sections["Placement"] and "-np, --np N" in sections["Placement"]
    assert "-x NAME[=VALUE]" in sections["Environment"]
    assert "--mca" in sections["MPI"] and "--ssh-port" in sections["SSH"]
    assert "--hang-timeout" in sections["Failures and limits"]
    assert "--on-hang [fail|dump]" in sections["Failures and limits"]  # never split at "-"


def test_peer_spellings_stay_hidden() -> None:
    command = cli.commands["run"]
    ctx = click.Context(command, info_name="run")
    hidden = {
        opt
        for p in command.get_params(ctx)
        if isinstance(p, click.Option) and p.hidden
        for opt in (*p.opts, *p.secondary_opts)
    }
    assert {"-hostfile", "--nproc_per_node", "-n"} <= hidden
    shown = {opt for term in option_terms(help_text("run")) for opt in re.findall(r"-[\w-]+", term)}
    assert shown and not shown & hidden, shown & hidden


def test_columns_80_in_a_terminal() -> None:
    """As a person reads it: the real command with COLUMNS=80."""
    result = run_dtrain("run", "--help", env={**child_env(), "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "Placement:" in lines and "SSH:" in lines
    assert max(len(line) for line in lines) <= 80
    assert lines[-1] == "Full manual: docs/running.md (and docs/ in the repository)"
