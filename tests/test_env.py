"""Environment building and dotenv parsing: whole dicts compared."""

from __future__ import annotations

import json

import pytest

from launcher.base.errors import EnvError
from launcher.core.env import (
    EnvOptions,
    build_env,
    build_tf_configs,
    copied_names,
    parse_env_file,
    resolve_env_args,
)
from launcher.core.hosts import Host
from launcher.core.plan import bind_gpus, plan_ranks

OPTIONS = EnvOptions(job_id="job1", master_addr="10.0.0.1", master_port=29400)


def test_rank_environment() -> None:
    plan = bind_gpus(plan_ranks([Host("a", 2), Host("b", 2)], 4), {"b": ("0", "1")})
    assert build_env(plan.ranks[3], OPTIONS) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
        "ROLE_NAME": "default",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "1",
        "TORCHELASTIC_RUN_ID": "job1",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "DTRAIN_JOB_ID": "job1",
        "DTRAIN_RESTART_COUNT": "0",
        "DTRAIN_HOST": "b",
        "DTRAIN_ROLE": "worker",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "1",
    }


def test_omp_threads_only_when_shared_and_unset() -> None:
    single = plan_ranks([Host("a", 1)], 1).ranks[0]
    shared = plan_ranks([Host("a", 2)], 2).ranks[0]
    assert "OMP_NUM_THREADS" not in build_env(single, OPTIONS)
    user_set = EnvOptions("j", "h", 1, base_env={"OMP_NUM_THREADS": "8"})
    assert "OMP_NUM_THREADS" not in build_env(shared, user_set)


def test_user_variables_win() -> None:
    rank = plan_ranks([Host("a", 2)], 2).ranks[0]
    options = EnvOptions("j", "h", 1, extra={"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "INFO"})
    env = build_env(rank, options)
    assert (env["OMP_NUM_THREADS"], env["NCCL_DEBUG"]) == ("4", "INFO")


def test_tf_config_every_rank_a_worker() -> None:
    plan = plan_ranks([Host("a", 2), Host("::1", 1)], 3)
    configs = build_tf_configs(plan, {0: 5000, 1: 5001, 2: 6000}, {"a": "10.1.1.1"})
    workers = ["10.1.1.1:5000", "10.1.1.1:5001", "[::1]:6000"]
    assert [json.loads(configs[r]) for r in range(3)] == [
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": r}} for r in range(3)
    ]
    env = build_env(plan.ranks[2], EnvOptions("j", "h", 1, tf_config=configs))
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 2}


def test_env_file_syntax() -> None:
    text = """
# a comment
PLAIN=value
export EXPORTED=yes
SPACED = padded   # trailing comment
SINGLE='$HOME # kept'
DOUBLE="line\\nnext \\"q\\" # kept"
EMPTY=
HASH=a#b
"""
    assert parse_env_file(text, ".env") == {
        "PLAIN": "value",
        "EXPORTED": "yes",
        "SPACED": "padded",
        "SINGLE": "$HOME # kept",
        "DOUBLE": 'line\nnext "q" # kept',
        "EMPTY": "",
        "HASH": "a#b",
    }


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("A=1", {"A": "1"}),
        ("A='$HOME # x'", {"A": "$HOME # x"}),
        ('A="a\\tb"', {"A": "a\tb"}),
        ("A=x # c", {"A": "x"}),
        ("A=a#b", {"A": "a#b"}),
        ("export A=1", {"A": "1"}),
        ("A=", {"A": ""}),
        ("A = spaced", {"A": "spaced"}),
    ],
)
def test_env_file_lines(line: str, expected: dict[str, str]) -> None:
    assert parse_env_file(line, ".env") == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("NOEQUALS", ".env:1: 'NOEQUALS': expected NAME=value"),
        ("\n1BAD=x", ".env:2: '1BAD=x': '1BAD' is not a valid variable name"),
        ("A='open", "unterminated ' quote"),
        ('A="x" y', "unexpected text after the quoted value"),
    ],
)
def test_env_file_errors(text: str, message: str) -> None:
    with pytest.raises(EnvError) as info:
        parse_env_file(text, ".env")
    assert message in str(info.value)
    assert info.value.exit_code == 2


def test_exports_copy_and_override() -> None:
    base = {"HOME": "/root", "TOKEN": "t"}
    files = [("a.env", "X=from-file\nY=file")]
    assert resolve_env_args(["TOKEN", "Y=cli", "Z=a=b"], files, base) == {
        "X": "from-file",
        "Y": "cli",
        "TOKEN": "t",
        "Z": "a=b",
    }
    with pytest.raises(EnvError, match="-x MISSING: MISSING is not set"):
        resolve_env_args(["MISSING"], [], base)
    with pytest.raises(EnvError, match="not a valid variable name"):
        resolve_env_args(["A-B=1"], [], base)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("A=1\nSECRET=ab\0cd\n", ".env:2: SECRET: the value contains a NUL byte"),
        ('A="x\0"', ".env:1: A: the value contains a NUL byte"),
        ("BIG=" + "x" * 131068, ".env:1: BIG: NAME=value is 131,072 bytes"),
        ("\x0c\nA=\0", ".env:2: A: the value contains a NUL byte"),  # lines as an editor counts
    ],
)
def test_env_file_values_a_process_cannot_carry(text: str, message: str) -> None:
    """posix_spawn refuses a NUL byte (every rank died of it) and Linux a variable over
    128 KiB (E2BIG): refused up front, naming the file, the line and the name, not the value."""
    with pytest.raises(EnvError) as info:
        parse_env_file(text, ".env")
    assert str(info.value).startswith(message)
    assert "cd" not in str(info.value)  # (the value may be a secret)


@pytest.mark.parametrize(
    ("export", "message"),
    [
        ("TOKEN=ab\0cd", "-x TOKEN: the value contains a NUL byte"),
        ("TOKEN=" + "x" * 200_000, "-x TOKEN: NAME=value is 200,006 bytes"),
        ("TOKEN=\ud800", "-x TOKEN: the value is not valid text"),
        ("TO\0KEN=1", "-x 'TO\\x00KEN=1': 'TO\\x00KEN' is not a valid variable name"),
    ],
)
def test_export_values_a_process_cannot_carry(export: str, message: str) -> None:
    with pytest.raises(EnvError) as info:
        resolve_env_args([export], [], {})
    assert str(info.value).startswith(message)


def test_values_a_process_can_carry_pass() -> None:
    undecodable = b"\xff".decode("utf-8", "surrogateescape")  # (argv's bytes that are not UTF-8)
    exports = ["A=" + "x" * 131_000, f"B={undecodable}", "C=\t\x1b[0m\u00e9"]
    assert resolve_env_args(exports, [], {}) == {
        "A": "x" * 131_000,
        "B": undecodable,
        "C": "\t\x1b[0m\u00e9",
    }


def test_x_pattern_copies_every_matching_variable() -> None:
    base = {"WANDB_API_KEY": "k", "WANDB_PROJECT": "p", "WANDB": "no", "wandb_x": "no", "A1": "a"}
    assert resolve_env_args(["WANDB_*", "A?", "WANDB_PROJECT=mine"], [], base) == {
        "WANDB_API_KEY": "k",
        "WANDB_PROJECT": "mine",  # (a later -x NAME=value wins, as for names)
        "A1": "a",
    }
    assert resolve_env_args(["NOTHING_*"], [], base) == {}  # a family may be empty
    assert resolve_env_args(["[AW]1"], [], base) == {"A1": "a"}


@pytest.mark.parametrize(
    ("export", "message"),
    [
        ("WANDB_*=1", "-x 'WANDB_*=1': a pattern copies the variables it matches from here"),
        ("WAN DB_*", "-x 'WAN DB_*': not a pattern of variable names"),
        ("A-B", "-x 'A-B': 'A-B' is not a valid variable name"),
    ],
)
def test_x_pattern_mistakes(export: str, message: str) -> None:
    with pytest.raises(EnvError) as info:
        resolve_env_args([export], [], {})
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("exports", "names", "copied"),
    [
        (["A", "B=1"], ["A", "B"], {"A"}),
        (["A=1", "A"], ["A"], {"A"}),  # (the last -x of a name decides)
        (["A", "A=1"], ["A"], set()),
        (["A=1", "A*"], ["A", "AB"], {"A", "AB"}),
        ([], ["FROM_ENV_FILE"], {"FROM_ENV_FILE"}),
    ],
)
def test_copied_names_are_the_values_dry_run_hides(
    exports: list[str], names: list[str], copied: set[str]
) -> None:
    assert copied_names(exports, names) == copied
