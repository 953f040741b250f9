"""Config validation as a table: every cross-check, its one-line message (pure)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields, replace

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
    bounded_fields,
    config_from_json,
    config_to_json,
    validate_config,
)
from launcher.core.optionvalues import config_from_options

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


DURATIONS = [(path, row.flag) for path, row in bounded_fields() if row.kind == "seconds"]


def durations(value: float) -> list[tuple[JobConfig, str]]:
    """BASE with ``value`` in each duration of a config, and the flag its message names."""
    configs = []
    for path, flag in DURATIONS:
        concern, _, name = path.rpartition(".")
        if concern:
            inner = replace(getattr(BASE, concern), **{name: value})
            configs.append((replace(BASE, **{concern: inner}), flag))
        else:
            configs.append((replace(BASE, **{name: value}), flag))
    return configs


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e12, -1.0])
def test_every_duration_is_finite_and_within_a_year(value: float) -> None:
    """The Python API and --detach's JSON get what the options' type checks: a nan grace
    never escalated to SIGKILL, an inf or 1e12 one overflowed the teardown's waits."""
    for config, flag in durations(value):
        restarting = replace(config, max_restarts=1)  # (--restart-delay needs restarts)
        with pytest.raises(UsageError) as caught:
            validate_config(restarting)
        assert caught.value.message.startswith(f"{flag} "), caught.value.message
        assert caught.value.hint


def test_the_durations_table_names_every_seconds_field() -> None:
    """A new *_s field of a config must be bounded too (and named as its flag)."""
    concerns = {"": BASE, "placement": BASE.placement, "ssh": BASE.ssh, "view": BASE.view}
    named = {path for path, _ in DURATIONS}
    for prefix, value in concerns.items():
        for f in fields(value):  # type: ignore[arg-type]
            if f.name.endswith("_s"):
                assert (f"{prefix}.{f.name}" if prefix else f.name) in named, f.name


BOUNDED = [
    (PlacementConfig(np=100_000_000), "-np 100000000: more than 100,000"),
    (PlacementConfig(np=10**20), "-np 100000000000000000000: more than 100,000"),
    (PlacementConfig(np=0), "-np 0: must be at least 1"),
    (PlacementConfig(nnodes=100_001), "--nnodes 100001: more than 100,000"),
    (PlacementConfig(nproc_per_node=100_001), "--nproc-per-node 100001: more than 100,000"),
    (
        PlacementConfig(nproc_per_node=1000, nnodes=1000),
        "--nproc-per-node x --nnodes: 1,000,000 ranks in all, more than 100,000",
    ),
    (PlacementConfig(gpus_per_rank=10**18), "--gpus-per-rank 1000000000000000000: more than 1,024"),
    (PlacementConfig(gpus_per_rank=0), "--gpus-per-rank 0: must be at least 1"),
    (PlacementConfig(master_port=70000), "--master-port 70000: not a port (1-65535)"),
    (PlacementConfig(master_addr="a b"), "--master-addr: invalid host name 'a b'"),
    (PlacementConfig(master_addr="-oProxyCommand=x"), "--master-addr: invalid host name"),
    (PlacementConfig(master_addr="10.0.0.256"), "--master-addr: invalid IPv4 address"),
    (PlacementConfig(master_addr="fe80::zz"), "--master-addr: invalid IPv6 address"),
]


@pytest.mark.parametrize(("placement", "message"), BOUNDED, ids=[m for _, m in BOUNDED])
def test_counts_ports_and_addresses_are_bounded(placement: PlacementConfig, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        validate_config(replace(BASE, placement=placement))
    assert caught.value.message.startswith(message)
    assert caught.value.hint


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (replace(BASE, max_restarts=10**7), "--max-restarts 10000000: more than 1,000,000"),
        (replace(BASE, ssh=SshConfig(port=0)), "--ssh-port 0: not a port"),
        (replace(BASE, ps=PsConfig(workers=100_000)), "--workers and --ps: 100,002 tasks in all"),
        (replace(BASE, ps=PsConfig(ps_tasks=10**9)), "--ps 1000000000: more than 100,000"),
    ],
)
def test_other_counts_are_bounded(config: JobConfig, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        validate_config(config)


@pytest.mark.parametrize(
    "nics", ["eth0;id", "eth0 ", "", "a" * 16, "eth0,", "..", "eth0/1", "eth0:1", "$(id)"]
)
def test_network_interfaces_are_names_linux_takes(nics: str) -> None:
    with pytest.raises(UsageError, match="is not a network interface name"):
        validate_config(replace(BASE, env=EnvConfig(nics=nics)))


@pytest.mark.parametrize("nics", ["eth0", "ib0,ib1", "enp3s0f1np1", "bond0.100", "br-1a2b3c4d5e6f"])
def test_real_interface_names_pass(nics: str) -> None:
    validate_config(replace(BASE, env=EnvConfig(nics=nics)))


@pytest.mark.parametrize("address", ["node1", "10.0.0.1", "fe80::1", "node1.cluster.example."])
def test_master_addresses_pass(address: str) -> None:
    validate_config(replace(BASE, placement=PlacementConfig(master_addr=address)))


def test_a_bracketed_master_address_loses_its_brackets() -> None:
    config = config_from_options({"command": ("true",), "master_addr": "[fe80::1]"})
    assert config.placement.master_addr == "fe80::1"


@pytest.mark.parametrize(
    ("option", "value", "flag"),
    [("mca", (("btl", "tcp,self"),), "--mca"), ("mpirun", "/opt/mpirun", "--mpirun"),
     ("mpirun_args", "-v", "--mpirun-args")],
)  # fmt: skip
def test_mpi_only_options_need_mpi(option: str, value: object, flag: str) -> None:
    options = {"command": ("true",), option: value}
    with pytest.raises(UsageError, match=f"^{flag} is for jobs run through mpirun, and --mpi is"):
        config_from_options(options)
    assert config_from_options(options, mpi=MpiConfig()).mpi == MpiConfig()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nproc_per_node": "\u00b2"}, "--nproc-per-node \u00b2: expected a number"),
        ({"nproc_per_node": "0"}, "--nproc-per-node 0: must be at least 1"),
        ({"nproc_per_node": "9" * 5000}, "--nproc-per-node 99999999999999999999...: more than"),
        ({"nnodes": "\u00b2"}, "--nnodes \u00b2: expected a number of hosts"),
        ({"nnodes": "9" * 5000}, "--nnodes 99999999999999999999...: more than 100,000"),
        ({"map_by": "ppr:\u00b2:node"}, "--map-by ppr:\u00b2:node: ppr needs a count"),
        ({"map_by": "ppr:100001:node"}, "--map-by ppr:100001:node: N of ppr:N:node must be"),
        ({"map_by": "ppr:0:node"}, "--map-by ppr:0:node: N of ppr:N:node must be from 1 to"),
        ({"rdzv_endpoint": "h:\u00b2"}, "--rdzv-endpoint h:\u00b2: expected HOST:PORT"),
        ({"rdzv_endpoint": "h:" + "9" * 5000}, "--rdzv-endpoint h:9999"),
    ],
)
def test_peer_counts_are_ascii_and_bounded(options: dict[str, str], message: str) -> None:
    """str.isdigit() says yes to '²' (int() then raised), and int() refuses 4,300 digits."""
    with pytest.raises(UsageError, match=re.escape(message)):
        config_from_options({"command": ("true",), **options})
