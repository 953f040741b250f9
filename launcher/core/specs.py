"""From a plan and what the survey found to each rank's ``LaunchSpec`` (pure).

``build_job_specs`` is the one place where a rank's environment is put
together: torch.distributed variables, the rendezvous port, TF_CONFIG, the
role variables of parameter-server jobs, the NIC variables for gloo/NCCL and
the user's ``-x``/``--env-file`` values (applied last).  Everything arrives
as arguments, so tables of inputs and outputs test it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from launcher.core.command import LaunchSpec, build_launch_specs
from launcher.core.config import JobConfig
from launcher.core.env import (
    PROXY_VARIABLES,
    EnvOptions,
    build_env,
    build_ps_tf_configs,
    build_tf_configs,
)
from launcher.core.errorfile import error_file_name
from launcher.core.plan import Cpu, Plan, Rank

DEFAULT_MASTER_PORT = 29500  # torchrun's default, shown by dry runs of remote jobs
# Across hosts, gloo and NCCL must talk over the NIC that reaches MASTER_ADDR (as horovodrun does).
# torch.distributed.rpc's TensorPipe too: it binds 127.0.0.1 where the host name does not resolve.
NIC_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


@dataclass(frozen=True)
class Site:
    """Where the job runs, as the survey found it before anything starts."""

    local: Mapping[str, bool]  # host name -> is this machine
    ports: Mapping[str, Sequence[int]] = field(default_factory=dict)  # TCP ports free there
    gpus: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # GPU ids found there
    addresses: Mapping[str, str] = field(default_factory=dict)  # how the other ranks reach it
    interfaces: Mapping[str, str] = field(default_factory=dict)  # its NIC towards MASTER_ADDR
    networks: Mapping[str, str] = field(default_factory=dict)  # that NIC's network (CIDR)
    pythons: Mapping[str, str] = field(default_factory=dict)  # the interpreter to use there
    cpus: Mapping[str, tuple[Cpu, ...]] = field(default_factory=dict)  # (cpu, socket) there
    python_script: bool = False  # COMMAND is a Python script: it runs with that interpreter
    workdirs: Mapping[str, str] = field(default_factory=dict)  # --sync: the ranks' copy there

    @property
    def remote_hosts(self) -> set[str]:
        return {name for name, is_local in self.local.items() if not is_local}


@dataclass(frozen=True)
class ServerProgram:
    """``dtrain ps --builtin-servers``: ps and workers run this TensorFlow server's source."""

    source: str
    local_python: str  # the launcher's interpreter, for ranks on this machine


def build_job_specs(
    plan: Plan,
    site: Site,
    config: JobConfig,
    *,
    job_id: str,
    extra: Mapping[str, str],
    environ: Mapping[str, str],
    cwd: str,
    server: ServerProgram | None = None,
    attempt: int = 0,
    avoid_ports: Collection[int] = (),
    checkpoint_dir: str | None = None,
    job_path: str | None = None,
) -> list[LaunchSpec]:
    """One spec per rank: argv, working directory and the environment dtrain sets.

    ``extra`` holds the resolved ``-x``/``--env-file`` variables, ``environ``
    the launcher's own environment (variables the user set there win over
    dtrain's NIC guesses).  A Python script COMMAND (``site.python_script``) runs
    with each host's interpreter (``site.pythons``, or ``--python``).  A restart's
    ``attempt`` (from 1) avoids the rendezvous ports of the attempts before it.
    ``job_path``: the job directory, where each rank on this machine gets its own
    ``TORCHELASTIC_ERROR_FILE`` (not under ``--mpi``: mpirun shares one environment).
    """
    ports = PortPool(site, avoid_ports)
    rank0 = plan.ranks[0].host.name
    master_port = config.placement.master_port or ports.take(rank0, DEFAULT_MASTER_PORT)
    tf_configs: dict[int, str] = {}
    if config.env.tf_config or config.tf_ps:
        tf_ports = {
            r.rank: ports.take(r.host.name, DEFAULT_MASTER_PORT + 1 + r.local_rank)
            for r in plan.ranks
        }
        build = build_ps_tf_configs if config.tf_ps else build_tf_configs
        tf_configs = build(plan, tf_ports, site.addresses)
    checkpoints = {"DTRAIN_CHECKPOINT_DIR": checkpoint_dir} if checkpoint_dir else {}
    extra = {**role_env(config), **checkpoints, **extra}
    if site.remote_hosts and not config.dry_run and "VIRTUAL_ENV" in environ:
        extra = {"VIRTUAL_ENV": environ["VIRTUAL_ENV"], **extra}
    env_options = EnvOptions(
        job_id=job_id,
        master_addr=config.placement.master_addr or site.addresses.get(rank0, rank0),
        master_port=master_port,
        extra=extra,
        base_env=environ,
        tf_config=tf_configs,
        host_env=nic_env(site, environ, extra, config.env.nics),
        groups=role_groups(plan) if config.ps is not None else {},
        nodes=len({r.host.name for r in plan.ranks}),
        restart_count=attempt,
        max_restarts=config.max_restarts,
        error_files=error_files(plan, site, job_path) if config.mpi is None else {},
    )
    specs = build_launch_specs(
        plan,
        config.command,
        lambda r: build_env(r, env_options),
        cwd=cwd,
        env_unset=PROXY_VARIABLES if config.tf_ps else (),
        argv_for=rank_argv(config, site, server),
        workdirs=site.workdirs,  # --sync: a remote rank runs in its host's copy of the folder
    )
    return specs


def error_files(plan: Plan, site: Site, job_path: str | None) -> dict[int, str]:
    """Each rank's error file in the job directory, for the ranks on this machine (the job
    directory is here: on another host torch could not write it, and would fail trying)."""
    if job_path is None:
        return {}
    return {
        r.rank: f"{job_path.rstrip('/')}/{error_file_name(r.rank)}"
        for r in plan.ranks
        if site.local.get(r.host.name, False)
    }


def rank_argv(
    config: JobConfig, site: Site, server: ServerProgram | None
) -> Callable[[Rank], Sequence[str]]:
    """What each rank runs: COMMAND (through Python for a script), or the built-in server."""

    def argv(rank: Rank) -> Sequence[str]:
        if server is not None and rank.role in ("ps", "worker"):
            return server_argv(site, server, rank)
        if site.python_script or config.module:
            python = config.python or site.pythons.get(rank.host.name, "python3")
            return (python, *(("-m",) if config.module else ()), *config.command)
        return config.command

    return argv


class PortPool:
    """The free ports the survey found on each machine, handed out once each.

    Every name of this machine (``localhost``, ``127.0.0.1``, its hostname) draws
    from one pool: two names for one machine must not get the same port.
    """

    def __init__(self, site: Site, avoid: Collection[int] = ()) -> None:
        self.avoid = set(avoid)  # ports earlier attempts used: a restart gets new ones
        self.free: dict[str, Iterator[int]] = {}
        here: Iterator[int] | None = None
        for name, ports in site.ports.items():
            if site.local.get(name):
                here = here or iter(ports)
                self.free[name] = here
            else:
                self.free[name] = iter(ports)

    def take(self, host: str, fallback: int) -> int:
        """A free port of ``host``; ``fallback`` where none was found (dry runs, no probe)."""
        for port in self.free.get(host, iter(())):
            if port not in self.avoid:
                return port
        while fallback in self.avoid:
            fallback += 1
        return fallback


def role_groups(plan: Plan) -> dict[str, int]:
    """How many ranks each role has (torchrun's ROLE_WORLD_SIZE in parameter-server jobs)."""
    groups: dict[str, int] = {}
    for rank in plan.ranks:
        groups[rank.role] = groups.get(rank.role, 0) + 1
    return groups


def role_env(config: JobConfig) -> dict[str, str]:
    """Variables of parameter-server jobs: the ps count; gRPC fails fast in TF's way."""
    if config.ps is None:
        return {}
    env = {"DTRAIN_NUM_PS": str(config.ps.ps_tasks)}
    if config.ps.tf:
        env["GRPC_FAIL_FAST"] = "use_caller"
    return env


def nic_env(
    site: Site, environ: Mapping[str, str], extra: Mapping[str, str], nics: str | None = None
) -> dict[str, dict[str, str]]:
    """Per host, GLOO/NCCL/TP_SOCKET_IFNAME: ``--network-interface`` on every host, else the
    NIC towards MASTER_ADDR, unless the user set them."""
    interfaces = {name: nics for name in site.local} if nics else site.interfaces
    return {
        name: {var: interface for var in NIC_VARIABLES if var not in environ and var not in extra}
        for name, interface in interfaces.items()
    }


def server_argv(site: Site, server: ServerProgram, rank: Rank) -> Sequence[str]:
    """The built-in TensorFlow server (locally with our Python, remotely python3)."""
    python = server.local_python if site.local.get(rank.host.name, True) else "python3"
    return (python, "-c", server.source)
