"""``dtrain hosts`` and ``dtrain check`` (the edge): the hosts a job would get, and their
readiness; and the reading of -H/--hostfile the other commands share.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from launcher.cli.options import CONTEXT, host_options, ssh_options
from launcher.core.config import SshConfig, pick

if TYPE_CHECKING:
    from launcher.core.hosts import Host


@click.command(context_settings=CONTEXT)
@host_options
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
@host_options
@ssh_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check(host_lists: tuple[str, ...], hostfile: str | None, as_json: bool, **ssh: Any) -> int:
    """Check every host in parallel: SSH, Python, frameworks, GPUs, ports, clock."""
    import json

    from launcher.run.survey import check_hosts
    from launcher.view.reports import print_check_report

    found = hosts_given(host_lists, hostfile)
    rows = check_hosts(found, pick(SshConfig, ssh), dict(os.environ))
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        print_check_report(rows, sys.stdout)
    return 0 if all(row["ok"] for row in rows) else 1


def hosts_given(host_lists: tuple[str, ...], hostfile: str | None) -> list[Host]:
    """The hosts of -H or --hostfile (``-H FILE`` reads FILE, saying so)."""
    from launcher.run.survey import hostfile_shorthand, read_hosts, shorthand_notice

    path = hostfile_shorthand(host_lists)
    if path is not None:
        click.echo(shorthand_notice(path), err=True)
        host_lists, hostfile = (), path
    return read_hosts(host_lists, hostfile, default_slots=None)
