"""Config validation as a table: every cross-check, its one-line message (pure)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from launcher.base.errors import UsageError
from launcher.core.config import (
    EnvConfig,
    JobConfig,
    MpiConfig,
    PlacementConfig,
    PsConfig,
    SshConfig,
    ViewConfig,
    config_from_json,
    config_to_json,
    validate_config,
)

BASE = JobConfig(command=("python", "train.py"))

INVALID = [
    (replace(BASE, command=()), "no command given"),
    (
        replace(BASE, view=ViewConfig(ranks="0,x")),
        "--ranks '0,x': not a list of ranks",
    ),
    (
        replace(BASE, view=ViewConfig(tag_format="[{rnk}]")),
        "--tag-format '[{rnk}]': unknown field {rnk}",
    ),
    (
        replace(BASE, view=ViewConfig(tag_format="[{rank")),
        "--tag-format '[{rank': expected '}' before end of string",
    ),
    (
        replace(BASE, placement=PlacementConfig(gpus_per_rank=2, gpu_binding=False)),
        "--gpus-per-rank and --no-gpu-binding both given",
    ),
    (
        replace(BASE, placement=PlacementConfig(host_lists=("a:2",), hostfile="hosts")),
        "both -H and --hostfile given",
    ),
    (
        replace(BASE, ps=PsConfig(framework="torch", builtin_servers=True)),
        "--builtin-servers is for --framework tf",
    ),
    (
        replace(BASE, ps=PsConfig(framework="torch", evaluator=True)),
        "--evaluator is for --framework tf",
    ),
    (
        replace(BASE, ps=PsConfig(framework="torch", restart_workers=1)),
        "--restart-workers is for --framework tf",
    ),
    (replace(BASE, ps=PsConfig(ps_hosts=" ")), "--ps-hosts: empty host list"),
    (
        replace(BASE, max_restarts=1, placement=PlacementConfig(min_np=3, max_np=2)),
        "--min-np 3 is more than --max-np 2",
    ),
    (
        replace(BASE, max_restarts=1, placement=PlacementConfig(np=2, max_np=1)),
        "-np 2 is more than --max-np 1",
    ),
    (replace(BASE, ps=PsConfig(worker_hosts="")), "--worker-hosts: empty host list"),
]


@pytest.mark.parametrize(("config", "message"), INVALID, ids=[m for _, m in INVALID])
def test_invalid_configs_are_refused_with_one_line(config: JobConfig, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        validate_config(config)
    assert caught.value.message == message
    assert caught.value.hint and "\n" not in str(caught.value)


FULL = JobConfig(
    command=("python", "train.py", "--lr", "0.1"),
    placement=PlacementConfig(
        host_lists=("a:4", "b:4"),
        np=8,
        map_by="node",
        oversubscribe=True,
        master_addr="a",
        master_port=1234,
        gpus_per_rank=1,
    ),
    env=EnvConfig(exports=("A=1", "B"), env_files=("x.env",), workdir="/w", tf_config=True),
    ssh=SshConfig(config_file="cfg", port=2222, identity="key", timeout_s=3.0),
    view=ViewConfig(tag_format="[{rank}]", color=False, plain=True, ranks="0,3", quiet=True),
    ps=PsConfig(workers=3, ps_tasks=2, evaluator=True, ps_hosts="a", restart_workers=2),
    mpi=MpiConfig(mpirun="/opt/mpirun"),
    grace_s=2.5,
    dry_run=True,
    job_dir="/jobs",
    job_id="20261123-000000-abcdef",
)


@pytest.mark.parametrize("config", [BASE, FULL], ids=["defaults", "every-field"])
def test_valid_configs_pass_and_survive_json(config: JobConfig) -> None:
    assert validate_config(config) is config
    assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config


def test_rank_set_parses_the_list() -> None:
    assert ViewConfig(ranks="0, 3,,7").rank_set == frozenset({0, 3, 7})
    assert ViewConfig().rank_set is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"min_np": 2}, "--min-np acts between attempts, but --max-restarts is 0"),
        ({"blacklist_cooldown_s": 5.0}, "--blacklist-cooldown acts between attempts"),
        ({"min_np": 3, "np": 2, "max_restarts": 1}, "--min-np 3 is more than -np 2"),
    ],
)
def test_restart_options_need_restarts(changes: dict[str, object], message: str) -> None:
    job = {k: changes.pop(k) for k in ("max_restarts",) if k in changes}
    config = JobConfig(command=("true",), placement=PlacementConfig(**changes), **job)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=message):
        validate_config(config)
