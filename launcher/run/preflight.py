"""The command checked against this machine before anything starts (job layer).

A mistake that can be seen here (a script that is not there, a shell script that is
not executable, a host typed where the program goes, a busy ``--master-port``) is
refused in one line before a host is reached or a rank started: otherwise every rank
would start only to fail the same way.  A dry run refuses what a real run refuses here,
and says what it could not check (the other hosts, which it does not reach).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from launcher.base.errors import UsageError
from launcher.core.command import is_python_script, shebang_words
from launcher.core.config import JobConfig
from launcher.core.plan import Plan
from launcher.core.specs import Site
from launcher.run.namedfiles import read_head
from launcher.transport.local import find_program

# host, user@host or a Slurm range, with slots; or a comma list of such hosts
HOST_ITEM = r"(?:[\w.-]+@)?[\w.\[\]-]+(?::(?:\d+|\*))?"
HOST_LIST = rf"{HOST_ITEM}(?:,{HOST_ITEM})*"  # (compiled by a job with -H only: about 1 ms)
PYTHON_NAME = re.compile(r"python(?:\d+(?:\.\d+)*)?")
PYTHON_OPTIONS_WITH_VALUE = "WX"  # python -W arg, -X opt: the next word is no script
NOTED_HOSTS = 5  # a dry run's note names this many hosts, then counts the rest


def is_file(path: Path) -> bool:
    """``path.is_file()`` for a name the user typed: one too long for the file system
    (ENAMETOOLONG) or otherwise unusable is no file, not a traceback."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def file_head(path: Path) -> bytes | None:
    """The first bytes of a file here that is not executable (None: no such file, or one
    that runs as it is)."""
    try:
        if os.access(path, os.X_OK):
            return None
    except (OSError, ValueError):
        return None
    return read_head(str(path), 256)


def python_script(config: JobConfig, workdir: str) -> bool:
    """Does COMMAND run with Python (``train.py``, or a non-executable file here with a
    Python shebang)?"""
    if config.module:
        return True
    if config.no_python or not config.command:
        return False
    return is_python_script(config.command[0], file_head(Path(workdir, config.command[0])))


def explicit_script(command: Sequence[str]) -> str | None:
    """The script of ``python [options] SCRIPT ...`` (``python -u train.py``); None when the
    command is not Python's or runs no file (``python -c``, ``python -m``, ``python -``)."""
    if not command or not is_python_interpreter(command[0]):
        return None
    words = iter(command[1:])
    for word in words:
        if word == "--":
            return next(words, None)
        if word == "-" or word.startswith("--"):
            return None  # stdin, or --help / --version / --check-hash-based-pycs
        if not word.startswith("-"):
            return word
        flags = word[1:]
        for index, flag in enumerate(flags):
            if flag in "cm":
                return None  # a command or a module follows, not a file
            if flag in PYTHON_OPTIONS_WITH_VALUE:
                if index == len(flags) - 1:
                    next(words, None)  # its value is the next word
                break
    return None


def is_python_interpreter(program: str) -> bool:
    return program == sys.executable or PYTHON_NAME.fullmatch(Path(program).name) is not None


def check_local_program(
    plan: Plan, site: Site, command: Sequence[str], workdir: str, environ: Mapping[str, str]
) -> None:
    """Refuse, before anything starts, a missing program, script or directory on this
    machine, or a file here that cannot run (not executable, not Python)."""
    if not any(site.local.get(h.name) for h in plan.hosts):
        return
    try:
        is_dir = Path(workdir).is_dir()
    except (OSError, ValueError):
        is_dir = False
    if not is_dir:
        raise UsageError(f"--workdir {workdir}: no such directory", "check the path")
    if not command:
        return  # a standing TF cluster (the servers are dtrain's), or a module
    program = command[0]
    here = Path(workdir, program)
    if site.python_script:
        if not is_file(here):
            raise UsageError(
                f"script {program} not found in {workdir}",
                "check the path, or pass --no-python to run a program of that name from PATH",
            )
        return
    if "/" in program:
        if not exists(here):
            raise UsageError(f"program {program} not found on localhost", "check the path")
        if not program.endswith(".py"):
            refuse_unrunnable(program, file_head(here))
    elif find_program(program, environ.get("PATH")) is None:
        if not program.endswith(".py"):  # (--no-python train.py: a program from PATH, said so)
            refuse_unrunnable(program, file_head(here))
        beside = is_file(here) and os.access(here, os.X_OK)
        raise UsageError(
            f"program {program!r} not found on PATH on localhost",
            f"to run the file in {workdir}, write ./{program}"
            if beside
            else "check the spelling, install it, or give its full path",
        )
    check_explicit_script(command, workdir)


def refuse_unrunnable(program: str, head: bytes | None) -> None:
    """A file here that is not executable and not Python (``head``: its first bytes; None
    when it is no such file, or an executable one) cannot run: say how it can."""
    if head is None:
        return
    words = shebang_words(head)
    interpreter = Path(words[0]).name if words else "bash"
    runnable = program if "/" in program else f"./{program}"
    chmod = f"chmod +x {program}" + ("" if "/" in program else f" and run {runnable}")
    if not words:  # an executable file without a shebang fails too (exec format error)
        chmod = f"add a shebang line (#!/bin/bash) and {chmod}"
    raise UsageError(
        f"{program}: not executable, and not Python by its name or shebang",
        f"run {interpreter} {program}, or {chmod}",
    )


def check_explicit_script(command: Sequence[str], workdir: str) -> None:
    """``python trian.py``: the script refused here as ``trian.py`` alone is."""
    script = explicit_script(command)
    if script is not None and not exists(Path(workdir, script)):  # (a folder runs too)
        raise UsageError(
            f"{command[0]} {script}: script {script} not found in {workdir}", "check the path"
        )


def not_checked_note(hosts: Sequence[str], master_port: int | None) -> str:
    """A dry run's line about the hosts it does not reach (``master_port``: the one given,
    tried on rank 0's host when the job starts)."""
    shown = ", ".join(hosts[:NOTED_HOSTS])
    if len(hosts) > NOTED_HOSTS:
        shown += f" and {len(hosts) - NOTED_HOSTS} more"
    port = ", and --master-port tried," if master_port else ""
    return (
        f"dtrain: note: not checked on {shown}: the program and --workdir are looked up{port} "
        "when the job starts"
    )


def check_hosts_not_split(config: JobConfig, environ: Mapping[str, str]) -> None:
    """``-H h7:2 h8:2 prog``: a space where a comma was meant makes ``h8:2`` the program.
    Said before any host is resolved, when the program looks like hosts with slots (or a
    comma list) and is no file here and nothing on PATH."""
    host_lists = config.placement.host_lists
    if not host_lists or not config.command or config.module:
        return
    program = config.command[0]
    if not re.fullmatch(HOST_LIST, program) or not any(mark in program for mark in ":,"):
        return
    workdir = config.env.workdir or os.getcwd()
    if exists(Path(workdir, program)) or find_program(program, environ.get("PATH")):
        return
    given = host_lists[-1]
    raise UsageError(
        f"-H {given} {program}: {program} was taken as the program",
        f"separate hosts with commas: -H {given},{program}",
    )


def check_master_port(port: int, host: str, refusal: str | None) -> None:
    """``refusal``: why a server cannot listen on ``port`` on ``host`` (the probe's
    ``port_refusal``), None when it can."""
    if refusal is None:
        return
    if refusal == "in use":
        raise UsageError(
            f"--master-port {port} is in use on {host} (by another process)",
            "pick another, or leave it out for a free one",
        )
    raise UsageError(
        f"--master-port {port} cannot be used on {host} ({refusal})",
        "pick another (ports below 1024 need root), or leave it out for a free one",
    )
