"""Other launchers' spellings: every row of launcher.cli.dialects.PEER_FLAGS, through the real CLI.

An alias must give the very config that dtrain's own spelling gives; an accepted flag
must change nothing; a refused one must be one line naming the peer, exit 2.  The
config is taken where ``dtrain run`` hands it to the job (nothing starts).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli import main as cli
from launcher.core.config import JobConfig
from launcher.core.peerflags import PEER_FLAGS, PeerFlag

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch) -> object:
    """``parse(*args)``: the JobConfig of ``dtrain run ARGS true`` (or the exit code)."""

    def parse(*args: str) -> JobConfig | int:
        seen: list[JobConfig] = []
        monkeypatch.setattr(cli, "start_job", lambda config: seen.append(config) or 0)
        code = cli.main(["run", *args, "true"])
        return seen[0] if seen else code

    return parse


def rows(kind: str) -> list[tuple[PeerFlag, str]]:
    """(row, one spelling) for every spelling of every row of that kind."""
    picked = [
        row
        for row in PEER_FLAGS
        if (kind == "refused") == (row.refused is not None)
        and (kind != "alias" or row.field is not None)
        and (kind != "accepted" or (row.field is None and row.refused is None))
    ]
    return [(row, flag) for row in picked for flag in row.flags.split()]


def flag_args(row: PeerFlag, flag: str) -> list[str]:
    return [flag] if row.kind == "flag" else [flag, row.example or "x"]


@pytest.mark.parametrize(("row", "flag"), rows("alias"), ids=lambda v: getattr(v, "peer", v))
def test_an_alias_means_what_dtrains_spelling_means(parse, row: PeerFlag, flag: str) -> None:  # type: ignore[no-untyped-def]
    context = row.context.split()
    theirs = parse(*context, *flag_args(row, flag))
    ours = parse(*context, *row.equivalent)
    assert isinstance(ours, JobConfig), f"dtrain's own {row.equivalent} failed: {ours}"
    assert theirs == ours
    assert theirs != parse(*context), f"{flag} changed nothing"


@pytest.mark.parametrize(("row", "flag"), rows("accepted"), ids=lambda v: getattr(v, "peer", v))
def test_an_accepted_flag_changes_nothing(parse, row: PeerFlag, flag: str) -> None:  # type: ignore[no-untyped-def]
    assert parse(*flag_args(row, flag)) == parse()


@pytest.mark.parametrize(("row", "flag"), rows("refused"), ids=lambda v: getattr(v, "peer", v))
def test_a_refused_flag_is_one_line_naming_the_peer(
    row: PeerFlag, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", *flag_args(row, flag), "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"dtrain: error: {flag} ({row.peer}) has no dtrain equivalent (hint: ")
    assert row.refused is not None and row.refused in err


def test_every_flag_is_in_the_guide() -> None:
    guide = (REPO / "docs" / "coming-from.md").read_text()
    missing = [f for row in PEER_FLAGS for f in row.flags.split() if f"`{f}`" not in guide]
    assert missing == []


def test_a_peer_value_and_dtrains_own_disagreeing_is_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["run", "-np", "2", "-n", "3", "true"]) == 2
    assert (
        capsys.readouterr().err
        == "dtrain: error: -n 3 and -np 2 both given (hint: give one of them)\n"
    )


def test_host_lists_of_both_spellings_add_up(parse) -> None:  # type: ignore[no-untyped-def]
    config = parse("-H", "a:2", "-host", "b:2")
    assert config.placement.host_lists == ("a:2", "b:2")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--map-by", "ppr:2:node"], {"nproc_per_node": 2, "map_by": "slot"}),
        (["--map-by", "node:OVERSUBSCRIBE"], {"map_by": "node", "oversubscribe": True}),
        (["--map-by", "core"], {"map_by": "slot"}),
        (["--nproc_per_node=auto"], {"nproc_per_node": "auto"}),
        (["-N", "gpu"], {"nproc_per_node": "gpu"}),
        (["--nnodes", "2:2"], {"nnodes": 2}),
        (["--bind-to", "CORE"], {"bind_to": "core"}),
        (["--rdzv_endpoint", "[::1]:29400"], {"master_addr": "::1", "master_port": 29400}),
    ],
)
def test_peer_values_in_dtrains_terms(parse, args: list[str], expected: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    placement = parse(*args).placement
    assert {name: getattr(placement, name) for name in expected} == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--map-by", "ppr:2:socket"], "--map-by ppr:2:socket: dtrain maps by slot, node"),
        (["--map-by", "slot:PE=2"], "--map-by slot:PE=2: unknown modifier 'PE=2'"),
        (["--nproc-per-node", "many"], "--nproc-per-node many: expected a number, auto, gpu"),
        (["--nnodes", "1:4"], "--nnodes 1:4: elastic node ranges are not supported yet"),
        (["--launcher", "slurm"], "--launcher slurm: dtrain starts ranks over ssh"),
        (["--redirects", "0:3,1:1"], "--redirects 0:3,1:1: dtrain takes 0, 1, 2 or 3"),
        (["--rdzv-endpoint", "node1"], "--rdzv-endpoint node1: expected HOST:PORT"),
        (["--bind-to", "l3cache"], "--bind-to l3cache: not one of none, core, socket"),
    ],
)
def test_peer_values_dtrain_cannot_take(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", *args, "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    ("typed", "suggested"),
    [
        ("--gpus-per-rnk", "--gpus-per-rank"),
        ("--nproc_per_nod", "--nproc_per_node"),
        ("--nproc-per-nod", "--nproc-per-node"),
        ("--hostfle", "--hostfile"),  # not mpirun's -hostfile: the spelling as typed
        ("--tage-output", "--tag-output"),
        ("--tee", None),  # accepted: no error at all
        ("--tf-config", None),
        ("--bogus", None),
        ("--ranktile", None),  # near --rankfile, which is refused: never suggested
    ],
)
def test_suggestions_are_typos_of_the_same_flag_only(
    typed: str, suggested: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["run", "--dry-run", typed, "3", "true"])
    err = capsys.readouterr().err
    if typed == "--tee":
        assert code == 0
        return
    assert code == 2
    assert ("did you mean" in err) == (suggested is not None), err
    if suggested:
        assert f"(did you mean {suggested}?)" in err


@pytest.mark.parametrize("flag", ["--tee", "--redirects", "--log-dir", "-N"])
def test_a_peer_flag_never_takes_the_next_option_as_its_value(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", "--dry-run", flag, "-np", "2", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} takes a value, not the option -np" in err, err
