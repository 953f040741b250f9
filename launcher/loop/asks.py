"""What the supervisor asks every rank where it runs, in parallel (loop layer): its Python
stacks (a hang, ``dtrain stacks``) and its figures (``dtrain top``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from launcher.base.parallel import run_parallel
from launcher.loop.rankrun import RankRun

StackDumps = dict[int, tuple[str, dict[str, Any]]]  # rank -> (host, its stacks or an error)


class HangReporter(Protocol):
    """What the supervisor is given for --hang-timeout (the job layer's ``HangReport``): it
    shows and keeps every rank's stack and returns where the ranks were, for the summary."""

    def __call__(self, dumps: StackDumps, /) -> str: ...


def no_stacks(error: BaseException) -> dict[str, Any]:
    """A rank's stacks that could not be taken: why, as its dump says it."""
    if isinstance(error, TimeoutError):
        return {"error": "no answer in time"}
    return {"error": f"cannot take its stacks: {error}"}


def dump_stacks(runs: Mapping[int, RankRun], timeout_s: float) -> StackDumps:
    """Every running rank's Python stacks (py-spy, where each rank runs), in parallel."""
    running = {rank: run for rank, run in list(runs.items()) if run.running}
    # One deadline for all: each answer is due within timeout_s, and one second more to
    # come back.
    found = run_parallel(
        list(running),
        lambda rank: running[rank].process.dump_stacks(timeout_s),
        timeout_s=timeout_s + 1,
    )
    return {
        rank: (
            running[rank].spec.host.name,
            no_stacks(dump) if isinstance(dump, BaseException) else dump,
        )
        for rank, dump in found.items()
    }


def rank_stats(
    runs: Mapping[int, RankRun], now: float, timeout_s: float
) -> dict[int, dict[str, Any]]:
    """Every rank's figures for ``dtrain top``: host, pid, state, its last line and how long
    ago, and for running ranks what their processes use (asked where they run)."""
    rows: dict[int, dict[str, Any]] = {}
    for rank, run in list(runs.items()):
        rows[rank] = {
            "host": run.spec.host.name,
            "role": run.spec.role,
            "status": run.status,
            "silent_s": round(now - run.heard(now), 1),
            "last_line": run.last_line.decode("utf-8", "replace")[-200:],
        }
    running = {rank: run for rank, run in list(runs.items()) if run.running}
    used = run_parallel(
        list(running),
        lambda rank: running[rank].process.take_stats(timeout_s),
        timeout_s=timeout_s + 1,
    )
    for rank, figures in used.items():
        if not isinstance(figures, BaseException):  # no answer in time: no figures
            rows[rank].update(figures)
    return rows
