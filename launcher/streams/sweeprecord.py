"""A sweep's record (job layer): what a sweep is, and how it is kept on disk.

The record (``<job dir root>/sweeps/<id>/sweep.json``) lists the trials, their
parameters, states, jobs and last metrics, with the config every trial starts
from (``-x`` values kept by name only); ``--resume`` reads it back to run again
the trials that did not finish.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from launcher.base.errors import UsageError
from launcher.base.userfiles import RECORD_LIMIT, read_user_text
from launcher.core.config import JobConfig, config_from_json, config_to_json
from launcher.core.hosts import Host
from launcher.core.sweep import Distribution, Params, SearchSpace, TrialRow, Value
from launcher.streams.jobdir import process_start, write_json

SWEEPS = "sweeps"  # under the job directory root: one directory per sweep
RECORD = "sweep.json"


@dataclass(frozen=True)
class SweepSettings:
    """How trials run: ranks each, how many at once, retries, and the table's order."""

    np_per_trial: int = 1
    max_parallel: int | None = None
    retries: int = 0
    objective: str | None = None
    maximize: bool = False


@dataclass
class TrialRecord:
    """One trial, as the sweep's record keeps it."""

    index: int
    params: Params
    command: tuple[str, ...]
    state: str = "pending"  # pending, running, succeeded, failed, stopped
    exit_code: int | None = None
    duration_s: float | None = None
    metrics: dict[str, Value] = field(default_factory=dict)
    jobs: list[str] = field(default_factory=list)  # one per run of the trial, latest last
    hosts: str | None = None
    error: str | None = None  # the trial's launcher's own error (it could not start, say)

    def row(self, elapsed_s: float | None = None) -> TrialRow:
        return TrialRow(
            trial=self.index,
            params=self.params,
            state=self.state,
            exit_code=self.exit_code,
            duration_s=self.duration_s if elapsed_s is None else elapsed_s,
            metrics=dict(self.metrics),
            job=self.jobs[-1] if self.jobs else None,
            hosts=self.hosts,
            tries=len(self.jobs),
        )


@dataclass
class Sweep:
    """A sweep: its directory, the config every trial starts from, hosts, trials."""

    id: str
    path: Path  # <root>/sweeps/<id>
    root: Path  # the job directory root (the trials' jobs)
    base: JobConfig
    hosts: list[Host]
    settings: SweepSettings
    space: SearchSpace
    trials: list[TrialRecord]
    state: str = "created"

    def save(self) -> None:
        exports = self.base.env.exports
        stored = replace(self.base, env=replace(self.base.env, exports=()))
        write_json(
            self.path / RECORD,
            {
                "id": self.id,
                "state": self.state,
                "launcher_pid": os.getpid(),
                "launcher_start": process_start(os.getpid()),
                "hosts": [asdict(h) for h in self.hosts],
                "settings": asdict(self.settings),
                "space": asdict(self.space),
                # -x values may be secrets: names only (--resume asks for them again).
                "exports": [e for e in exports if "=" not in e],
                "export_names": sorted(e.partition("=")[0] for e in exports if "=" in e),
                "config": config_to_json(stored),
                "trials": [asdict(t) for t in self.trials],
            },
        )

    def rows(self) -> list[TrialRow]:
        return [t.row() for t in self.trials]


def check_fits(hosts: Sequence[Host], settings: SweepSettings) -> None:
    total = sum(h.slots for h in hosts)
    if settings.np_per_trial > total:
        raise UsageError(
            f"--np-per-trial {settings.np_per_trial}: the hosts have {total} slot(s)",
            "lower --np-per-trial, or give more hosts or slots with -H",
        )


def find_sweep(root: Path, wanted: str) -> Path:
    """The directory of the sweep named (or uniquely prefixed) by ``wanted``."""
    base = root / SWEEPS
    if not wanted.strip():
        raise UsageError(f"--resume {wanted!r}: no sweep id", "give the id dtrain sweep printed")
    found = sorted(p for p in base.glob("*") if (p / RECORD).is_file()) if base.is_dir() else []
    matches = [p for p in found if p.name == wanted] or [
        p for p in found if p.name.startswith(wanted)
    ]
    if len(matches) != 1:
        what = "no sweep" if not matches else f"{len(matches)} sweeps"
        raise UsageError(
            f"--resume {wanted}: {what} matching it in {base}",
            "give the id dtrain sweep printed (see the directories there)",
        )
    return matches[0]


def load_sweep(
    root: Path,
    wanted: str,
    exports: Sequence[str],
    hosts: Sequence[Host] | None,
    overrides: Mapping[str, Any],
) -> Sweep:
    """A recorded sweep, for ``--resume``: its config with the -x values given again, and
    the hosts and settings the resume command line gives instead of the recorded ones."""
    path = find_sweep(root, wanted)
    record = read_record(path)
    pid, started = int(record.get("launcher_pid", 0)), record.get("launcher_start")
    if record.get("state") == "running" and pid != os.getpid() and process_start(pid) == started:
        raise UsageError(f"sweep {path.name} is running (pid {pid})", "let it end, or stop it")
    given = {e.partition("=")[0] for e in exports}
    missing = [name for name in record.get("export_names", []) if name not in given]
    if missing:
        raise UsageError(
            f"--resume {path.name}: the sweep had -x {', '.join(missing)} with values, which "
            "are not recorded",
            "give them again: " + " ".join(f"-x {name}=..." for name in missing),
        )
    try:
        base = config_from_json(record["config"])
        exports = (*record.get("exports", []), *exports)
        settings = replace(SweepSettings(**record["settings"]), **overrides)
        sweep = Sweep(
            id=path.name,
            path=path,
            root=root,
            base=replace(base, env=replace(base.env, exports=exports)),
            hosts=list(hosts) if hosts else [Host(**h) for h in record["hosts"]],
            settings=settings,
            space=space_from_json(record["space"]),
            trials=[trial_from_json(t) for t in record["trials"]],
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # (not what dtrain wrote)
        raise damaged(path, f"{type(exc).__name__}: {exc}") from None
    check_fits(sweep.hosts, settings)
    return sweep


def read_record(path: Path) -> dict[str, Any]:
    """A sweep's record read back for ``--resume``, as a file the user names (the job root
    may be any folder): a regular file of at most 64 MiB holding a JSON object."""
    text = read_user_text(str(path / RECORD), f"--resume {path.name}: its record", RECORD_LIMIT)
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise damaged(path, f"not JSON: line {getattr(exc, 'lineno', '?')}") from None
    if not isinstance(record, dict):
        raise damaged(path, f"a JSON {type(record).__name__}, not an object")
    return record


def damaged(path: Path, why: str) -> UsageError:
    return UsageError(
        f"--resume {path.name}: its record {path / RECORD} is damaged ({why})",
        "start the sweep again without --resume",
    )


def space_from_json(data: Mapping[str, Any]) -> SearchSpace:
    return SearchSpace(
        grid=tuple((str(name), tuple(values)) for name, values in data["grid"]),
        params=tuple(
            (str(name), Distribution(d["kind"], tuple(d["args"]))) for name, d in data["params"]
        ),
        random_count=int(data["random_count"]),
        seed=int(data["seed"]),
    )


def trial_from_json(data: Mapping[str, Any]) -> TrialRecord:
    return TrialRecord(
        **{
            **data,
            "params": tuple((str(k), str(v)) for k, v in data["params"]),
            "command": tuple(data["command"]),
            "jobs": list(data["jobs"]),
            "metrics": dict(data["metrics"]),
        }
    )
