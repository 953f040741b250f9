"""Where a job runs, found before anything starts (effects): hosts read, reached and probed.

``survey_hosts`` decides which hosts are this machine (by address), connects
to the others over SSH in parallel, starts each host's agent (which probes
the working directory, the program, free ports, GPUs and the NIC towards the
rendezvous) and returns the facts as a pure ``Site`` beside the open agents.
``check_hosts`` is ``dtrain check``: the same probe, reported per host.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.base.errors import HostConnectionError, LauncherError, UsageError
from launcher.base.log import LOG, PHASES
from launcher.base.parallel import run_parallel
from launcher.core.config import JobConfig, SshConfig, check_host_sources
from launcher.core.hosts import Host, parse_host_list, parse_hostfile
from launcher.core.plan import Cpu, Plan
from launcher.core.specs import Site
from launcher.remote.probe import cpus as probe_cpus
from launcher.remote.probe import port_refusal
from launcher.run.namedfiles import discovery_output, read_hostfile
from launcher.run.preflight import check_master_port, explicit_script, is_file, python_script
from launcher.run.syncing import prepare_sync, sync_hosts
from launcher.transport.local import detect_local_gpus, find_free_ports
from launcher.transport.locality import LOCALITY, HostNames, Locality, is_local_address

if TYPE_CHECKING:
    from launcher.transport.remotecalls import HostReport
    from launcher.transport.slurm import Allocation


GPU_BUSY_UTILIZATION = 5  # percent
GPU_BUSY_MEMORY_MIB = 500


def slurm_allocation(config: JobConfig, environ: Mapping[str, str]) -> Allocation | None:
    """The Slurm allocation whose nodes the job runs on through srun (None: not so)."""
    placement = config.placement
    if placement.transport == "ssh" or (
        placement.transport == "auto" and not environ.get("SLURM_JOB_ID")
    ):
        return None  # (without loading the Slurm transport)
    from launcher.transport.slurm import allocation_from

    allocation = allocation_from(environ)
    if placement.transport == "slurm" and allocation is None:
        raise UsageError(
            "--transport slurm: not inside a Slurm allocation (SLURM_JOB_ID is not set)",
            "run dtrain inside salloc or an sbatch script, or use --transport ssh",
        )
    if placement.transport == "auto" and (placement.hosts_given or placement.host_discovery_script):
        return None  # hosts of your own: reached over ssh unless --transport slurm
    return allocation


def allocation_hosts(config: JobConfig, environ: Mapping[str, str]) -> Allocation | None:
    """The Slurm allocation the job's hosts come from: inside one without -H, --hostfile or
    a discovery script, whichever transport starts the ranks (None: not so)."""
    placement = config.placement
    if placement.hosts_given or placement.host_discovery_script:
        return None
    return current_allocation(environ)


def current_allocation(environ: Mapping[str, str]) -> Allocation | None:
    """The Slurm allocation dtrain runs inside (None: not inside one)."""
    if not environ.get("SLURM_JOB_ID"):
        return None  # (as allocation_from says, without loading the Slurm transport)
    from launcher.transport.slurm import allocation_from

    return allocation_from(environ)


def read_hosts(
    host_lists: Sequence[str], hostfile: str | None, default_slots: int | None
) -> list[Host]:
    """Hosts from -H and --hostfile; localhost with ``default_slots`` when neither is given."""
    check_host_sources(tuple(host_lists), hostfile)
    if hostfile:
        return parse_hostfile(read_hostfile(hostfile), source=hostfile)
    if host_lists:
        for spec in host_lists:  # each -H on its own first: errors name the list given
            found = parse_host_list(spec, source="-H")
        if len(host_lists) > 1:  # repeated -H: the merged list, checked for duplicates
            found = parse_host_list(",".join(host_lists), source="-H")
        return found
    return [Host("localhost", slots=default_slots or 1)]


DISCOVERY_TIMEOUT_S = 30.0


def discover_hosts(script: str) -> list[Host]:
    """Run ``--host-discovery-script`` (horovodrun's): one ``host[:slots]`` per line."""
    # (a bare line is 1 slot: hosts come and go between surveys, horovodrun's way)
    text = discovery_output(script, DISCOVERY_TIMEOUT_S)
    return parse_hostfile(text, source=script, bare_on_host=False)


def hostfile_shorthand(host_lists: Sequence[str]) -> str | None:
    """``-H hosts`` where ``hosts`` is a file here and no host list (DeepSpeed's ``-H``): the
    file to read as a hostfile; None when -H lists hosts.  A name that is both a file and a
    host is a usage error naming both ways out."""
    if len(host_lists) != 1:
        return None
    name = host_lists[0]
    if any(mark in name for mark in ",:@[") or not is_file(Path(name)):
        return None  # (a name too long for a file, say, is no file: the host check says why)
    if name_resolves(name):
        raise UsageError(
            f"-H {name}: both a file here and a host name",
            f"pass --hostfile {name} to read the file, or -H {name}:1 for the host",
        )
    return name


def shorthand_notice(path: str) -> str:
    return f"dtrain: -H {path}: reading the hostfile {Path(path).resolve()}"


def name_resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return False
    return True


@dataclass
class Survey:
    """The facts (``site``) and what the survey opened: SSH connections and host agents."""

    site: Site
    connections: dict[str, Any] = field(default_factory=dict)  # SshConnection per remote host
    agents: dict[str, Any] = field(default_factory=dict)  # HostAgent per remote host

    def hand_over(self) -> dict[str, Any]:
        """The agents, for a transport that owns them from now on (closing them ends the ranks)."""
        agents, self.agents, self.connections = self.agents, {}, {}
        return agents

    def lost_hosts(self) -> dict[str, str]:
        """Hosts whose agent is gone (its srun step ended, its SSH connection was cut), and
        why.  Under --mpi the agents stay open while mpirun runs: one gone means the host
        was lost under the job."""
        return {name: a.ended for name, a in self.agents.items() if a.ended is not None}

    def keep_hosts(self, names: Collection[str]) -> None:
        """Let go of the hosts not in ``names`` (surveyed to count their slots, then given no
        rank): their agents and connections close, and the site forgets them."""
        for name in [n for n in self.agents if n not in names]:
            self.agents.pop(name).close()
        for name in [n for n in self.connections if n not in names]:
            self.connections.pop(name).close()
        site = self.site
        kept: dict[str, Any] = {
            f.name: {k: v for k, v in getattr(site, f.name).items() if k in names}
            for f in fields(site)
            if isinstance(getattr(site, f.name), Mapping)
        }
        self.site = replace(site, **kept)

    def close(self) -> None:
        """Drop what is still ours (agents first: closing them ends nothing yet started)."""
        for host_agent in self.agents.values():
            host_agent.close()
        for connection in self.connections.values():
            connection.close()
        self.agents, self.connections = {}, {}


def ssh_settings(ssh: SshConfig) -> Any:
    from launcher.transport.sshconfig import SshSettings

    return SshSettings(
        config_file=ssh.config_file,
        port=ssh.port,
        identity=ssh.identity,
        timeout_s=ssh.timeout_s,
        accept_new_host_keys=ssh.accept_new_host_keys,
    )


class SshAccess:
    """dtrain's ssh settings and the user's SSH config, read the first time they are needed:
    a job on this machine alone never loads paramiko."""

    def __init__(self, ssh: SshConfig) -> None:
        self.ssh = ssh
        self.loaded: tuple[Any, Any] | None = None  # (SshSettings, paramiko's SSHConfig)

    def load(self) -> tuple[Any, Any]:
        if self.loaded is None:
            from launcher.transport.sshconfig import load_ssh_config

            settings = ssh_settings(self.ssh)
            self.loaded = settings, load_ssh_config(settings)
        return self.loaded

    def host_names(self, hosts: Mapping[str, Host]) -> HostNames:
        """The HostName the SSH config gives each of the names asked about (an ssh alias of
        this machine is local too); none without an SSH config."""

        def given(names: Collection[str]) -> dict[str, str]:
            if self.ssh.config_file is None and not is_file(Path("~/.ssh/config").expanduser()):
                return {}  # (no config to read: paramiko stays unloaded)
            from launcher.transport.sshconfig import resolve_target

            settings, ssh_config = self.load()
            return {n: resolve_target(hosts[n], settings, ssh_config).hostname for n in names}

        return given


def survey_hosts(
    plan: Plan,
    config: JobConfig,
    environ: Mapping[str, str],
    workdir: str,
    locality: Locality = LOCALITY,
) -> Survey:
    """Decide local or remote by address (``transport/locality.py``: the SSH config's HostName
    where it gives one, else the names resolved in parallel); connect to and probe remote
    hosts (not in dry runs); the program and working directory are checked on every remote
    host."""
    through_slurm = slurm_allocation(config, environ) is not None
    access = SshAccess(config.ssh)
    by_name = {h.name: h for h in plan.hosts}
    # Through Slurm, every node is started by srun, this machine's too (Slurm sees every step).
    local = (
        dict.fromkeys(by_name, False)
        if through_slurm
        else locality.decide(by_name, access.host_names(by_name))
    )
    remote_hosts = [h for h in plan.hosts if not local[h.name]]
    settings: Any = None
    ssh_config: Any = None
    if remote_hosts and not through_slurm:
        settings, ssh_config = access.load()
    master_port, rank0 = config.placement.master_port, plan.ranks[0].host.name
    if master_port and local[rank0]:  # (a remote rank 0's host: its probe tries the port)
        check_master_port(master_port, rank0, port_refusal(master_port))
    ranks_on = {h.name: sum(1 for r in plan.ranks if r.host.name == h.name) for h in plan.hosts}
    facts = SiteFacts(local, python_script=python_script(config, workdir))
    # Our interpreter; on other hosts the same path where it exists, else their python3 (the
    # probe says which; a dry run, which probes nothing, shows ours).
    facts.pythons = {h.name: sys.executable for h in plan.hosts}
    local_names = [name for name, is_local in local.items() if is_local]
    if local_names:
        gpus = detect_local_gpus(environ) if config.placement.gpu_binding else ()
        ports = find_free_ports(1 + sum(ranks_on[n] for n in local_names))
        cpus = tuple((c, s) for c, s in probe_cpus())
        for name in local_names:
            facts.gpus[name] = gpus
            facts.cpus[name] = cpus
            facts.ports[name] = ports  # one pool: the local names are one machine
            facts.addresses[name] = "127.0.0.1" if not remote_hosts else name
    sync = prepare_sync(config, workdir, through_slurm, bool(remote_hosts))
    survey = Survey(facts.freeze())
    if remote_hosts and config.dry_run:
        facts.addresses.update({h.name: h.name for h in remote_hosts})
        survey.site = facts.freeze()
    elif remote_hosts:
        survey.connections = open_connections(
            remote_hosts, through_slurm, settings, ssh_config, environ
        )
        try:
            if sync is not None:
                facts.workdirs.update(sync_hosts(sync, survey.connections, config, environ))
            probe_remote_hosts(survey, facts, plan, config, environ, workdir, ranks_on)
        except BaseException:
            survey.close()
            raise
        survey.site = facts.freeze()
    return survey


def open_connections(
    hosts: Sequence[Host],
    through_slurm: bool,
    settings: Any,
    ssh_config: Any,
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """A way into every host: srun steps inside a Slurm allocation, else SSH connections."""
    if through_slurm:
        from launcher.transport.slurm import srun_connections

        LOG.debug("reaching %d node(s) through srun", len(hosts))
        PHASES.info("starting %d srun step(s)", len(hosts))
        return dict(srun_connections(hosts, environ))
    from launcher.transport.ssh import connect_all

    PHASES.info("connecting to %d host(s) over ssh", len(hosts))  # --verbose shows it too
    return dict(connect_all(hosts, settings, ssh_config))


@dataclass
class SiteFacts:
    """A ``Site`` while the survey fills it in."""

    local: dict[str, bool]
    ports: dict[str, list[int]] = field(default_factory=dict)
    gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)
    addresses: dict[str, str] = field(default_factory=dict)
    interfaces: dict[str, str] = field(default_factory=dict)
    networks: dict[str, str] = field(default_factory=dict)
    pythons: dict[str, str] = field(default_factory=dict)
    cpus: dict[str, tuple[Cpu, ...]] = field(default_factory=dict)
    workdirs: dict[str, str] = field(default_factory=dict)  # --sync: each host's copy
    python_script: bool = False

    def freeze(self) -> Site:
        maps = {k: dict(v) for k, v in asdict(self).items() if isinstance(v, dict)}
        return Site(**maps, python_script=self.python_script)


def probe_remote_hosts(
    survey: Survey,
    facts: SiteFacts,
    plan: Plan,
    config: JobConfig,
    environ: Mapping[str, str],
    workdir: str,
    ranks_on: Mapping[str, int],
) -> None:
    """Start every remote host's agent and check its probe (directory, program, ports, GPUs,
    NIC), in parallel."""
    from launcher.remote.probe import interface_towards
    from launcher.transport.agentlink import HostAgent

    for name, connection in survey.connections.items():
        facts.addresses[name] = connection.peer_address
    our_address = next(iter(survey.connections.values())).local_address
    for name, is_local in facts.local.items():
        if is_local:
            facts.addresses[name] = our_address or name
    master = config.placement.master_addr or facts.addresses[plan.ranks[0].host.name]

    # None: a standing TF cluster, or a module (-m), which its interpreter finds
    program = config.command[0] if config.command and not config.module else None
    if program and facts.python_script and "/" not in program:
        program = f"./{program}"  # a script is looked for in the working directory, not PATH
    script = None if facts.python_script else explicit_script(config.command)
    if script and "/" not in script:
        script = f"./{script}"  # python SCRIPT: in the working directory
    rank0 = plan.ranks[0].host.name

    started: list[str] = []  # hosts whose agent answered (the terminal shows the count)

    def open_agent(name: str) -> Any:
        args = {
            "ports": 1 + ranks_on[name],
            "program": program,
            "cwd": facts.workdirs.get(name, workdir),
            "path_prefix": environ.get("PATH"),
            "route_to": master,
            "script": script,
            "master_port": config.placement.master_port if name == rank0 else None,
        }
        connection = survey.connections[name]
        ssh = config.ssh
        opened = HostAgent.open(connection, sys.executable, args, ssh.timeout_s, ssh.host_timeout_s)
        started.append(name)
        PHASES.info("starting agents: %d of %d hosts ready", len(started), len(survey.connections))
        return opened

    settings = ssh_settings(config.ssh)
    opened = run_parallel(list(survey.connections), open_agent, settings.fanout)
    survey.agents = {
        n: pair[0] for n, pair in opened.items() if not isinstance(pair, BaseException)
    }
    errors = [pair for pair in opened.values() if isinstance(pair, BaseException)]
    if errors:
        raise errors[0]
    for name, (_, report) in opened.items():  # type: ignore[misc]  # no errors left
        take_report(
            facts, name, report, config, facts.workdirs.get(name, workdir), (program, script)
        )
    local_route = interface_towards(master)
    for name, is_local in facts.local.items():
        if is_local and local_route:
            facts.interfaces[name] = local_route["interface"]


def take_report(
    facts: SiteFacts,
    name: str,
    report: HostReport,
    config: JobConfig,
    workdir: str,
    looked_up: tuple[str | None, str | None],
) -> None:
    """One host's probe into the facts; a missing directory, program or script (``looked_up``:
    the program and python's script asked about), or a busy --master-port is an error."""
    program, script = looked_up
    facts.pythons[name] = report.python
    if config.placement.master_port and report.master_port_refusal:
        check_master_port(config.placement.master_port, name, report.master_port_refusal)
    if not report.cwd_ok:
        raise HostConnectionError(
            f"{name}: working directory {workdir} does not exist there",
            "create it (same path on every host), or pass --workdir",
        )
    if program is not None and report.program is None and facts.python_script:
        raise HostConnectionError(
            f"{name}: script {config.command[0]} not found there in {workdir}",
            "the same working directory must hold it on every host (a shared file "
            "system, or a copy at the same path)",
        )
    if program is not None and report.program is None:
        raise HostConnectionError(
            f"{name}: program {config.command[0]!r} not found there (PATH, {workdir})",
            "install it there, or give a path that exists on every host",
        )
    if script is not None and report.script is None:
        raise HostConnectionError(
            f"{name}: script {explicit_script(config.command)} not found there in {workdir}",
            "the same working directory must hold it on every host (a shared file "
            "system, or a copy at the same path)",
        )
    facts.ports[name] = list(report.ports)
    facts.gpus[name] = tuple(g["index"] for g in report.gpus)
    facts.cpus[name] = report.cpus
    LOG.debug(
        "agent started on %s: %s %s, %d cpu(s), %d gpu(s), interface %s",
        name,
        report.python,
        report.python_version,
        len(report.cpus),
        len(report.gpus),
        (report.route or {}).get("interface", "?"),
    )
    if report.route:
        facts.interfaces[name] = report.route["interface"]
        facts.networks[name] = report.route.get("network", "")


def check_hosts(
    hosts: Sequence[Host], ssh: SshConfig, environ: Mapping[str, str]
) -> list[dict[str, Any]]:
    """``dtrain check``: one report row per host; a host that fails gets ``ok: False``."""
    from launcher.core.gpucheck import with_findings
    from launcher.remote import probe

    args = {"ports": 1, "versions": True, "gpu_details": True, "path_prefix": environ.get("PATH")}

    def check_one(host: Host) -> dict[str, Any]:
        try:
            if is_local_address(host.name):
                report = probe.probe(args)
                return summarize_host(host.name, report, None, 0.0)
            from launcher.transport.remotecalls import probe_host
            from launcher.transport.ssh import connect
            from launcher.transport.sshconfig import load_ssh_config

            settings = ssh_settings(ssh)
            connection = connect(host, settings, load_ssh_config(settings))
            try:
                rtt_s = connection.round_trip_s()
                offset_s = connection.clock_offset_s(settings.timeout_s)
                found = probe_host(connection, sys.executable, args, settings.timeout_s)
                return summarize_host(host.name, asdict(found), rtt_s, offset_s)
            finally:
                connection.close()
        except LauncherError as exc:
            return {"host": host.name, "ok": False, "error": str(exc)}

    rows = run_parallel(list(range(len(hosts))), lambda i: check_one(hosts[i]), 32)
    for row in rows.values():
        if isinstance(row, BaseException):
            raise row
    return with_findings([row for row in rows.values() if not isinstance(row, BaseException)])


def summarize_host(
    name: str, report: Mapping[str, Any], rtt_s: float | None, offset_s: float | None
) -> dict[str, Any]:
    from launcher.core.gpucheck import gpu_fields

    gpus = report["gpus"]
    busy = [
        g
        for g in gpus
        if float(g.get("utilization") or 0) >= GPU_BUSY_UTILIZATION
        or float(g.get("memory_mib") or 0) >= GPU_BUSY_MEMORY_MIB
    ]
    return {
        "host": name,
        "ok": True,
        "error": None,
        "hostname": report["hostname"],
        "rtt_ms": None if rtt_s is None else round(rtt_s * 1000, 2),
        "python": report["python"],
        "python_version": report["python_version"],
        "versions": report.get("versions", {}),
        "gpus": len(gpus),
        "gpus_busy": len(busy),
        "free_port": report["ports"][0],
        "clock_offset_ms": None if offset_s is None else round(offset_s * 1000, 1),
        **gpu_fields(report.get("gpu_details")),
    }
