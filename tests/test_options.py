"""The options table (``core/options.py``): one row per option, and what is made of it."""

from __future__ import annotations

from collections import Counter
from dataclasses import MISSING, fields
from pathlib import Path

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


BAD = {"int": "x", "seconds": "nan", "share": "2", "size": "lots", "choice": "zzz"}
# Text options the config checks (validate_config), each with a value it refuses.
BAD_TEXT = {
    "ranks": "x",
    "local_ranks": "0-",
    "tag_format": "{nope}",
    "network_interface": "a b",
    "master_addr": "a b",
    "map_by": "nod",
    "nproc_per_node": "0",
    "nnodes": "x",
    "progress_regex": "step",
}


def cli_error(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """The problem and the hint ``dtrain run`` says of ``flag value`` (one line, exit 2)."""
    from launcher.cli.main import main

    capsys.readouterr()
    assert main(["run", "--dry-run", "--no-config", flag, value, "true"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("dtrain: error: ") and "\n" not in line, line
    said, _, hint = line.removeprefix("dtrain: error: ").rpartition(" (hint: ")
    return said, hint.removesuffix(")")


def api_error(keyword: str, value: str) -> tuple[str, str]:
    """The problem and the hint ``launch(keyword=value)`` raises, before anything starts."""
    from launcher.api.options import build_config
    from launcher.base.errors import UsageError
    from launcher.core.config import validate_config

    with pytest.raises(UsageError) as caught:
        validate_config(build_config({keyword: value, "no_config": True}, ["x"]))
    return caught.value.message, caught.value.hint


def bad_values() -> list[tuple[str, str, str]]:
    from launcher.api.options import api_keywords

    cases = []
    for keyword, (row, negative) in api_keywords().items():
        value = BAD.get(row.kind) or BAD_TEXT.get(keyword)
        if value is not None and not negative:
            cases.append((keyword, row.flag, value))
    return cases


@pytest.mark.parametrize(("keyword", "flag", "value"), bad_values())
def test_a_bad_value_is_the_same_mistake_from_the_cli_and_the_api(
    keyword: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every option the table checks, and every text option the config checks: the command
    line and launch() say the same problem and the same hint, each naming it as it was
    given (``-np x`` / ``np='x'``) or both as its flag (a check of the whole config)."""
    cli_said, cli_hint = cli_error(flag, value, capsys)
    api_said, api_hint = api_error(keyword, value)
    if api_said.startswith(f"{keyword}="):  # (named as given: the table's own check)
        assert cli_said.startswith(f"{flag} ")
        assert cli_said.partition(": ")[2] == api_said.partition(": ")[2]
        assert cli_hint.replace(f"{flag} ", f"{keyword}=") == api_hint
    else:
        assert (cli_said, cli_hint) == (api_said, api_hint)


def test_every_checked_kind_has_a_bad_value_case() -> None:
    from launcher.api.options import api_keywords

    kinds = {row.kind for row, _ in api_keywords().values()}
    assert kinds - set(BAD) == {"text", "list", "pairs", "flag", "off", "toggle"}
    assert len(bad_values()) >= 30


def test_the_typed_keywords_are_the_tables() -> None:
    """launch()'s and start()'s typed keywords (what an editor shows) are the table's, each
    typed as its kind takes it."""
    import typing

    from launcher.api.options import api_keywords
    from launcher.api.typedoptions import Options

    hints = typing.get_type_hints(Options)
    spelled = api_keywords()
    assert set(hints) | {"np", "hosts", "hostfile"} == set(spelled)  # (those: named parameters)
    single = {"flag": bool, "off": bool, "toggle": bool | None, "int": int, "seconds": float}
    for name, hint in hints.items():
        row, _ = spelled[name]
        if row.kind in single or row.kind == "share":
            assert hint in (single.get(row.kind, float), bool), name  # (no_color=: a bool)
        elif row.kind == "choice":
            assert (
                typing.get_origin(hint) is typing.Literal and typing.get_args(hint) == row.choices
            )
        else:
            assert hint is str or str in typing.get_args(hint) or row.kind == "pairs", name


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        ("nod", "did you mean --map-by node?"),
        ("slots", "did you mean --map-by slot?"),
        ("socket", "for per-socket placement use --nproc-per-node with --bind-to socket"),
        ("l3cache", "for per-socket placement use --nproc-per-node with --bind-to socket"),
    ],
)
def test_a_typo_of_a_map_by_policy_is_named_and_mpiruns_others_are_not(
    typed: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--map-by nod was answered with a hint about sockets; socket is no typo of slot."""
    from launcher.cli.main import main

    assert main(["run", "--dry-run", "--no-config", "--map-by", typed, "-np", "2", "true"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"(hint: {hint})")


def test_a_project_file_with_a_byte_order_mark_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An editor's BOM before [run] was 'Invalid statement' at 1:1."""
    import json

    from launcher.cli.main import main

    (tmp_path / "dtrain.toml").write_bytes(b"\xef\xbb\xbf[run]\nnp = 3\n")
    monkeypatch.chdir(tmp_path)
    jobs = str(tmp_path / "jobs")
    assert main(["run", "--dry-run", "--json", "--job-dir", jobs, "true"]) == 0
    assert [entry["rank"] for entry in json.loads(capsys.readouterr().out)] == [0, 1, 2]
