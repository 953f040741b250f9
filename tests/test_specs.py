"""The spec builder as tables: plan + site + config -> every rank's argv and environment."""

from __future__ import annotations

import json
from dataclasses import replace

from launcher.core.command import LaunchSpec
from launcher.core.config import EnvConfig, JobConfig, PlacementConfig, PsConfig
from launcher.core.env import PROXY_VARIABLES
from launcher.core.hosts import Host
from launcher.core.plan import plan_ps, plan_ranks
from launcher.core.specs import DEFAULT_MASTER_PORT, ServerProgram, Site, build_job_specs

CONFIG = JobConfig(command=("python", "train.py"))
LOCAL = Site(local={"localhost": True}, ports={"localhost": [4000, 4001, 4002]})
TWO_HOSTS = Site(
    local={"a": True, "b": False},
    ports={"a": [5000, 5001], "b": [6000, 6001]},
    addresses={"a": "10.0.0.1", "b": "10.0.0.2"},
    interfaces={"a": "eth0", "b": "ens5"},
    networks={"a": "10.0.0.0/24", "b": "10.0.0.0/24"},
)


def build(
    config: JobConfig,
    site: Site,
    hosts: list[Host],
    np: int,
    environ: dict[str, str] | None = None,
    extra: dict[str, str] | None = None,
) -> list[LaunchSpec]:
    plan = plan_ranks(hosts, np)
    return build_job_specs(
        plan, site, config, job_id="J", extra=extra or {}, environ=environ or {}, cwd="/w"
    )


def test_local_job_environment_whole() -> None:
    specs = build(CONFIG, LOCAL, [Host("localhost", slots=2)], 2)
    assert [s.env for s in specs] == [
        {
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": "2",
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "localhost",
            "MASTER_PORT": "4000",
            "ROLE_NAME": "default",
            "ROLE_RANK": str(r),
            "ROLE_WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "1",
            "TORCHELASTIC_RUN_ID": "J",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "DTRAIN_JOB_ID": "J",
            "DTRAIN_RESTART_COUNT": "0",
            "DTRAIN_HOST": "localhost",
            "DTRAIN_ROLE": "worker",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        for r in range(2)
    ]
    assert {(s.argv, s.cwd, s.env_unset) for s in specs} == {(("python", "train.py"), "/w", ())}


def test_user_values_win_and_set_omp_threads_is_kept() -> None:
    specs = build(
        CONFIG,
        LOCAL,
        [Host("localhost", slots=2)],
        2,
        environ={"OMP_NUM_THREADS": "8"},
        extra={"MASTER_PORT": "7", "NCCL_DEBUG": "INFO"},
    )
    assert [(s.env["MASTER_PORT"], s.env["NCCL_DEBUG"]) for s in specs] == [("7", "INFO")] * 2
    assert all("OMP_NUM_THREADS" not in s.env for s in specs)  # the launcher's own applies


def test_two_hosts_addresses_nic_variables_and_virtualenv() -> None:
    hosts = [Host("a", slots=2), Host("b", slots=2)]
    environ = {"VIRTUAL_ENV": "/venv", "NCCL_SOCKET_IFNAME": "ib0"}
    specs = build(CONFIG, TWO_HOSTS, hosts, 4, environ=environ)
    assert [(s.rank, s.host.name, s.env["MASTER_ADDR"], s.env["MASTER_PORT"]) for s in specs] == [
        (r, "ab"[r // 2], "10.0.0.1", "5000") for r in range(4)
    ]
    # The user's NCCL_SOCKET_IFNAME stands; GLOO's is dtrain's guess per host.
    assert [s.env.get("GLOO_SOCKET_IFNAME") for s in specs] == ["eth0", "eth0", "ens5", "ens5"]
    assert [s.env.get("TP_SOCKET_IFNAME") for s in specs] == ["eth0", "eth0", "ens5", "ens5"]
    assert {s.env["GROUP_WORLD_SIZE"] for s in specs} == {"2"}
    assert all("NCCL_SOCKET_IFNAME" not in s.env for s in specs)
    assert all(s.env["VIRTUAL_ENV"] == "/venv" for s in specs)  # remote ranks need it
    dry = build(replace(CONFIG, dry_run=True), TWO_HOSTS, hosts, 4, environ=environ)
    assert all("VIRTUAL_ENV" not in s.env for s in dry)


def test_master_address_and_port_options() -> None:
    config = replace(CONFIG, placement=PlacementConfig(master_addr="head", master_port=1234))
    specs = build(config, TWO_HOSTS, [Host("a"), Host("b")], 2)
    assert {(s.env["MASTER_ADDR"], s.env["MASTER_PORT"]) for s in specs} == {("head", "1234")}


def test_tf_config_ports_come_from_each_host_pool() -> None:
    config = replace(CONFIG, env=EnvConfig(tf_config=True))
    specs = build(config, TWO_HOSTS, [Host("a"), Host("b")], 2)
    configs = [json.loads(s.env["TF_CONFIG"]) for s in specs]
    # a's first port is the rendezvous; each rank's TF port is its host's next free one.
    assert [s.env["MASTER_PORT"] for s in specs] == ["5000", "5000"]
    assert configs == [
        {
            "cluster": {"worker": ["10.0.0.1:5001", "10.0.0.2:6000"]},
            "task": {"type": "worker", "index": i},
        }
        for i in range(2)
    ]


def test_without_probed_ports_dry_runs_use_the_defaults() -> None:
    site = Site(local={"a": False, "b": False}, addresses={"a": "a", "b": "b"})
    config = replace(CONFIG, env=EnvConfig(tf_config=True), dry_run=True)
    specs = build(config, site, [Host("a"), Host("b")], 2)
    assert specs[0].env["MASTER_PORT"] == str(DEFAULT_MASTER_PORT)
    workers = json.loads(specs[0].env["TF_CONFIG"])["cluster"]["worker"]
    assert workers == [f"a:{DEFAULT_MASTER_PORT + 1}", f"b:{DEFAULT_MASTER_PORT + 1}"]


def test_parameter_server_roles_and_builtin_servers() -> None:
    config = replace(CONFIG, ps=PsConfig(workers=2, ps_tasks=1, builtin_servers=True))
    plan = plan_ps([Host("localhost", slots=2)], 2, 1, chief=True)
    site = Site(local={"localhost": True}, ports={"localhost": list(range(7000, 7010))})
    server = ServerProgram(source="print('serve')", local_python="/py")
    specs = build_job_specs(
        plan, site, config, job_id="J", extra={}, environ={}, cwd="/w", server=server
    )
    assert [(s.role, s.argv) for s in specs] == [
        (r.role, ("python", "train.py") if r.role == "chief" else ("/py", "-c", "print('serve')"))
        for r in plan.ranks
    ]
    for spec in specs:
        assert spec.env["DTRAIN_NUM_PS"] == "1" and spec.env["GRPC_FAIL_FAST"] == "use_caller"
        assert spec.env_unset == PROXY_VARIABLES
    cluster = json.loads(specs[0].env["TF_CONFIG"])["cluster"]
    assert sorted(cluster) == ["chief", "ps", "worker"]
    ports = [a.rsplit(":", 1)[1] for addresses in cluster.values() for a in addresses]
    assert len(set(ports)) == 4 and specs[0].env["MASTER_PORT"] not in ports
    roles = [tuple(s.env[v] for v in ("ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE")) for s in specs]
    assert roles == [
        ("chief", "0", "1"),
        ("worker", "0", "2"),
        ("worker", "1", "2"),
        ("ps", "0", "1"),
    ]


def test_torch_parameter_server_has_no_tf_variables() -> None:
    config = replace(CONFIG, ps=PsConfig(framework="torch", workers=2))
    plan = plan_ps([Host("localhost", slots=2)], 2, 1, chief=False)
    specs = build_job_specs(plan, LOCAL, config, job_id="J", extra={}, environ={}, cwd="/w")
    assert all("TF_CONFIG" not in s.env and "GRPC_FAIL_FAST" not in s.env for s in specs)
    assert all(s.env["DTRAIN_NUM_PS"] == "1" and s.env_unset == () for s in specs)


def test_two_names_of_this_machine_share_one_port_pool() -> None:
    pool = [7000, 7001, 7002, 7003, 7004, 7005]
    site = Site(
        local={"localhost": True, "127.0.0.1": True},
        ports={"localhost": pool, "127.0.0.1": pool},
        addresses={"localhost": "127.0.0.1", "127.0.0.1": "127.0.0.1"},
    )
    config = replace(CONFIG, env=EnvConfig(tf_config=True))
    specs = build(config, site, [Host("localhost", slots=2), Host("127.0.0.1", slots=2)], 4)
    workers = json.loads(specs[0].env["TF_CONFIG"])["cluster"]["worker"]
    ports = [int(w.rsplit(":", 1)[1]) for w in workers] + [int(specs[0].env["MASTER_PORT"])]
    assert sorted(ports) == pool[:5]  # five distinct ports: the rendezvous and four workers
