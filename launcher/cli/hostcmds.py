"""``dtrain hosts`` and ``dtrain check`` (the edge): the hosts a job would get, and their
readiness; and the reading of -H/--hostfile the other commands share.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from launcher.base.errors import UsageError
from launcher.cli.options import CONTEXT, seconds, table_options
from launcher.core.config import SshConfig, pick

DEFAULT_NETWORK_TIMEOUT_S = 10.0
NETWORK_FLAGS = {  # check's options that only --network takes
    "network_timeout_s": "--timeout",
    "min_bandwidth": "--min-bandwidth",
    "interface": "--network-interface",
    "no_allreduce": "--no-allreduce",
}

if TYPE_CHECKING:
    from launcher.core.hosts import Host


@click.command(context_settings=CONTEXT)
@table_options("hosts")
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
def hosts(host_lists: tuple[str, ...], hostfile: str | None, as_json: bool) -> int:
    """Show the hosts and slots a hostfile or -H list resolves to (inside a Slurm allocation,
    without either: the allocation's nodes and tasks, as dtrain run takes them); a bare
    hostfile line or HOST:* has its slots counted there when a job starts (*)."""
    from launcher.run.planning import count_local_slots
    from launcher.run.survey import current_allocation
    from launcher.view.tables import format_hosts, hosts_as_json

    allocation = None if host_lists or hostfile else current_allocation(os.environ)
    if allocation is not None:
        click.echo(f"dtrain: {allocation.describe()}", err=True)
    found = list(allocation.hosts) if allocation else hosts_given(host_lists, hostfile)
    found = count_local_slots(found, os.environ)  # (this machine's; the others' are a '*')
    click.echo(hosts_as_json(found) if as_json else "\n".join(format_hosts(found)))
    return 0


@click.command(context_settings=CONTEXT)
@table_options("check")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--network",
    is_flag=True,
    help="Measure the network between the hosts instead: each host's bandwidth out and in "
    "and round trip to its peers on the ranks' interface, and an allreduce over all of them; "
    "names the hosts and pairs below half the median.",
)
@click.option(
    "--timeout",
    "network_timeout_s",  # (timeout_s is --ssh-timeout's)
    type=seconds("--timeout", 0.5, 3600),
    default=DEFAULT_NETWORK_TIMEOUT_S,
    metavar="SECONDS",
    show_default=True,
    help="With --network: how long the measurements may take (hosts measure in parallel).",
)
@click.option(
    "--min-bandwidth",
    metavar="RATE",
    help="With --network: name every host or pair below RATE instead: bits per second "
    "(1Gbit, 500Mbit) or bytes per second (100MB, 1.5GB).",
)
@click.option(
    "--network-interface",
    "interface",
    metavar="IFACE",
    help="With --network: measure through IFACE on every host (default: the one towards the "
    "first host, as ranks use).",
)
@click.option(
    "--no-allreduce", is_flag=True, help="With --network: point to point only (no torch)."
)
def check(
    host_lists: tuple[str, ...],
    hostfile: str | None,
    as_json: bool,
    network: bool,
    no_allreduce: bool,
    **options: Any,
) -> int:
    """Check every host in parallel: SSH, Python, frameworks, GPUs, ports, clock; or with
    --network, the network between them."""
    import json

    from launcher.run.namedfiles import check_ssh_files
    from launcher.run.survey import check_hosts
    from launcher.view.reports import print_check_report

    network_only = {k: options.pop(k) for k in ("network_timeout_s", "min_bandwidth", "interface")}
    context = click.get_current_context()
    given = [
        flag
        for name, flag in NETWORK_FLAGS.items()
        if context.get_parameter_source(name) != ParameterSource.DEFAULT
    ]
    if given and not network:
        raise UsageError(f"{given[0]} is an option of check --network", "add --network")
    found = hosts_given(host_lists, hostfile)
    check_ssh_files(pick(SshConfig, options))
    if network:
        return check_network(found, pick(SshConfig, options), as_json, no_allreduce, **network_only)
    rows = check_hosts(found, pick(SshConfig, options), dict(os.environ))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        print_check_report(rows, sys.stdout)
    return 0 if all(row["ok"] for row in rows) else 1


def check_network(
    found: list[Host],
    ssh: SshConfig,
    as_json: bool,
    no_allreduce: bool,
    network_timeout_s: float,
    min_bandwidth: str | None,
    interface: str | None,
) -> int:
    """``dtrain check --network``: 0 when nothing is slow or failed, else 1."""
    from launcher.core.bounds import check_interfaces
    from launcher.core.netcheck import parse_rate
    from launcher.run.netcheck import NetcheckOptions, check_network
    from launcher.view.netview import network_report_as_json, print_network_report

    if interface is not None and "," in interface:
        raise UsageError(
            f"--network-interface {interface!r}: check --network measures one interface",
            "give one name, and run the check again for each other",
        )
    check_interfaces("--network-interface", interface)  # ('' and 'a/b' too: no name)
    options = NetcheckOptions(
        timeout_s=network_timeout_s,
        floor_bytes_per_s=None if min_bandwidth is None else parse_rate(min_bandwidth),
        interface=interface,
        allreduce=not no_allreduce,
    )
    report = check_network(found, ssh, options)
    if as_json:
        click.echo(network_report_as_json(report))
    else:
        print_network_report(report, sys.stdout)
    return 0 if report.ok else 1


def hosts_given(host_lists: tuple[str, ...], hostfile: str | None) -> list[Host]:
    """The hosts of -H or --hostfile (``-H FILE`` reads FILE, saying so)."""
    from launcher.run.survey import hostfile_shorthand, read_hosts, shorthand_notice

    path = hostfile_shorthand(host_lists)
    if path is not None:
        click.echo(shorthand_notice(path), err=True)
        host_lists, hostfile = (), path
    return read_hosts(host_lists, hostfile, default_slots=None)
