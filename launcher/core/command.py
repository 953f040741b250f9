"""What each rank runs: ``LaunchSpec`` values (pure)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from launcher.core.hosts import Host
from launcher.core.plan import Plan, Rank


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a transport needs to start one rank."""

    rank: int
    host: Host
    local_rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # set on top of the host's environment
    cwd: str | None = None
    env_unset: tuple[str, ...] = ()  # removed from the host's environment
    role: str = "worker"
    gpus: tuple[str, ...] | None = None
    node_rank: int = 0
    label: str | None = None  # shown instead of the tag (e.g. "mpirun" for mpirun's own lines)
    task: int = 0  # index among the ranks of its role (worker 1, ps 0)


def build_launch_specs(
    plan: Plan,
    argv: Sequence[str],
    make_env: Callable[[Rank], Mapping[str, str]],
    cwd: str | None = None,
    env_unset: Sequence[str] = (),
    argv_for: Callable[[Rank], Sequence[str]] | None = None,
    workdirs: Mapping[str, str] | None = None,
) -> list[LaunchSpec]:
    """One spec per rank of ``plan``, running ``argv`` (or ``argv_for(rank)``) in ``cwd`` (or
    in its host's folder in ``workdirs``, by host name)."""
    unset = tuple(env_unset)
    every_argv = tuple(argv)
    folders = workdirs or {}
    return [
        LaunchSpec(
            rank=r.rank,
            host=r.host,
            local_rank=r.local_rank,
            argv=tuple(argv_for(r)) if argv_for else every_argv,
            role=r.role,
            env=make_env(r),
            cwd=folders.get(r.host.name, cwd),
            env_unset=unset,
            gpus=r.gpus,
            node_rank=r.node_rank,
            task=r.task_index,
        )
        for r in plan.ranks
    ]


def is_python_script(program: str, head: bytes | None) -> bool:
    """Does ``program`` run with Python (as torchrun and deepspeed run ``train.py``)?

    A name ending in ``.py``; or a file here that is not executable (``head``: its first
    bytes; None when it is no such file) with a Python shebang (one without a shebang may
    be a shell script: run with Python, every rank would fail on its first line).
    """
    if program.endswith(".py"):
        return True
    if head is None:
        return False
    words = shebang_words(head)
    return bool(words) and "python" in " ".join(words)


def shebang_words(head: bytes) -> list[str]:
    """The interpreter and arguments a file's ``#!`` line names, ``env`` left out
    (``#!/usr/bin/env python3 -u`` -> ``['python3', '-u']``); [] without a shebang."""
    first = head.split(b"\n", 1)[0]
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if words and words[0].rsplit("/", 1)[-1] == "env":
        words = words[1:]
    return words


def describe_specs(
    specs: Sequence[LaunchSpec], hidden: Collection[str] = ()
) -> list[dict[str, object]]:
    """The plan as plain values for ``--dry-run`` (text or JSON) and the job directory.

    Variables named in ``hidden`` (the user's ``-x`` and ``--env-file`` ones, which
    may be secrets) keep their names only, under ``env_hidden``.
    """
    return [
        {
            "rank": s.rank,
            "host": s.host.ssh_target,
            "local_rank": s.local_rank,
            "node_rank": s.node_rank,
            "role": s.role,
            "task": s.task,
            "gpus": list(s.gpus) if s.gpus is not None else None,
            "argv": list(s.argv),
            "env": {k: v for k, v in s.env.items() if k not in hidden},
            **({"env_hidden": sorted(k for k in s.env if k in hidden)} if hidden else {}),
            "env_unset": list(s.env_unset),
            "cwd": s.cwd,
        }
        for s in specs
    ]


def build_remote_command(python: str, args: Sequence[str]) -> str:
    """A POSIX shell command running ``python args`` on a remote host.

    ``python`` (the launcher's interpreter) is used where that path exists on
    the host, else the first ``python3`` on its PATH.
    """
    import shlex  # (here: a job on this machine alone never loads it)

    quoted = " ".join(shlex.quote(a) for a in args)
    return (
        f'p={shlex.quote(python)}; [ -x "$p" ] || p=$(command -v python3) || '
        "{ echo 'dtrain: no python3 on PATH' >&2; exit 127; }; "
        f'exec "$p" {quoted}'
    )
