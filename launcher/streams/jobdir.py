"""The job directory: ids, plan, per-rank logs with timestamps, status (streams layer).

A job lives in ``<root>/<id>/`` (root ``~/.dtrain/jobs`` unless ``--job-dir``):

* ``meta.json``   what was run, where, by which launcher (pid)
* ``plan.json``   the ranks as ``--dry-run --json`` shows them
* ``status.json`` the job state and every rank's host, pid, start, end, status
* ``attempts.json`` with ``--max-restarts``: each attempt's start, end, exit code and
                  failure (the rank logs go on across attempts; times tell them apart)
* ``rank.N.log``  rank N's output, one line per line:
                  ``<unix time> <o|e> <text>`` (o: stdout, e: stderr)

Lines that a program ends with a bare ``\\r`` (progress-bar updates) are kept
in their final state only: the update that a newline closes.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from launcher.base.errors import UsageError
from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.core.outcome import JobResult, RankReport, RankState, Stream

DEFAULT_ROOT = Path("~/.dtrain/jobs")
STOP_MARK = "stop-requested"  # dtrain stop leaves it: the job ends as "stopped"
ID_TIME_CHARS = len("20261122-035012")  # the part of a job id that is its start time
STREAM_CODES: dict[str, bytes] = {"stdout": b"o", "stderr": b"e"}
RUNNING = "running"
ACTIVE = (RUNNING, "starting", "restarting")  # a launcher is at work on the job


def jobs_root(option: str | None, environ: Mapping[str, str]) -> Path:
    """``--job-dir``, else ``$DTRAIN_JOB_DIR``, else ``~/.dtrain/jobs``."""
    return Path(option or environ.get("DTRAIN_JOB_DIR") or DEFAULT_ROOT).expanduser()


FILE_MODE = 0o600  # a job's files and directory are its owner's alone (rule 7)
DIR_MODE = 0o700


def open_private(path: Path, mode: str = "ab") -> BinaryIO:
    """Open (creating it 0600) a file of the job directory."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return cast(BinaryIO, os.fdopen(os.open(path, flags | os.O_CLOEXEC, FILE_MODE), mode))


INDENTED_ITEMS = 64  # a record of more items is written on one line


def write_json(path: Path, value: object) -> None:
    """Replace ``path`` atomically (readers never see half a file), readable by its owner only.
    Indented for a person to read, but for a large record (a thousand hosts' plan): json's
    indentation runs in Python, 0.8 s for 8,000 ranks, against 0.05 s on one line in C."""
    large = isinstance(value, list | dict) and len(value) > INDENTED_ITEMS
    write_text(path, json.dumps(value, indent=None if large else 1))


def write_text(path: Path, text: str) -> None:
    """``write_json`` for JSON already encoded."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open_private(temporary, "wb") as f:
        f.write(text.encode())
    os.replace(temporary, path)


def make_private_dir(path: Path, exist_ok: bool) -> None:
    """``mkdir -p`` whose new directories are 0700 (whatever the umask)."""
    if not path.parent.is_dir():
        make_private_dir(path.parent, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if not exist_ok:
            raise
        return
    os.chmod(path, DIR_MODE)  # mkdir's mode is masked by the umask


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class JobDir:
    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    @staticmethod
    def create(root: Path, job_id: str, meta: Mapping[str, object]) -> JobDir:
        try:
            path = root / job_id
            make_private_dir(path, exist_ok=False)
        except OSError as exc:
            raise UsageError(
                f"--job-dir {root}: cannot create the job directory ({exc.strerror})",
                "give a directory you can write to",
            ) from None
        job = JobDir(path)
        write_json(path / "meta.json", dict(meta))
        return job

    def log_path(self, rank: int) -> Path:
        return self.path / f"rank.{rank}.log"

    def meta(self) -> dict[str, Any]:
        return read_json(self.path / "meta.json") or {}

    def plan(self) -> list[dict[str, Any]]:
        return read_json(self.path / "plan.json") or []

    def status(self) -> dict[str, Any]:
        return read_json(self.path / "status.json") or {}

    def state(self) -> str:
        """The job's state; a running job whose launcher is gone is ``lost``."""
        status = self.status()
        state = str(status.get("state", "starting"))
        here = status.get("launcher_host", socket.gethostname()) == socket.gethostname()
        alive = self.launcher_alive(status)
        # A launcher on another machine (a shared job directory) cannot be checked from here.
        if state in ACTIVE and here and not alive:
            return "lost"  # the launcher died without recording an end
        return state

    @staticmethod
    def launcher_alive(status: Mapping[str, Any]) -> bool:
        """The recorded launcher still runs: its pid lives and, if its start time was
        recorded, is the same process (not a new one that reused the pid)."""
        pid = int(status.get("launcher_pid", 0))
        started = status.get("launcher_start")
        return pid_alive(pid) and (started is None or process_start(pid) == started)

    def started(self) -> float:
        """When its launcher started the job (its directory's creation, before that)."""
        value = self.status().get("started")
        return float(value) if value is not None else self.path.stat().st_ctime

    def recorded_specs(self) -> dict[int, LaunchSpec]:
        """The ranks of the recorded plan as specs (rank, host, role...), to tag log lines."""
        return {
            int(e["rank"]): LaunchSpec(
                rank=int(e["rank"]),
                host=Host(str(e["host"]).split("@")[-1]),
                local_rank=int(e["local_rank"]),
                argv=(),
                env={},
                role=str(e.get("role", "worker")),
                node_rank=int(e["node_rank"]),
                task=int(e.get("task", 0)),
            )
            for e in self.plan()
        }

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.path.iterdir() if p.is_file())


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def process_start(pid: int) -> int | None:
    """When a process started (clock ticks after boot): with its pid, it names one process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def list_jobs(root: Path) -> list[JobDir]:
    """Every job under ``root``, oldest first: ids sort by time to the second, and jobs of
    the same second by when their launcher started them."""
    if not root.is_dir():
        return []
    jobs = [JobDir(p) for p in root.iterdir() if (p / "meta.json").is_file()]
    return sorted(jobs, key=lambda j: (j.id[:ID_TIME_CHARS], j.started(), j.id))


def running_jobs(root: Path) -> list[JobDir]:
    """The jobs whose launcher runs (or starts), oldest first."""
    return [job for job in list_jobs(root) if job.state() in ACTIVE]


def find_job(root: Path, wanted: str | None) -> JobDir:
    """The job named (or uniquely prefixed) by ``wanted``; the latest when None."""
    jobs = list_jobs(root)
    if not jobs:
        raise UsageError(f"no jobs in {root}", "start one with dtrain run, or pass --job-dir")
    if wanted is None:
        return jobs[-1]
    matches = [j for j in jobs if j.id == wanted] or [j for j in jobs if j.id.startswith(wanted)]
    if len(matches) != 1:
        what = "no job" if not matches else f"{len(matches)} jobs"
        raise UsageError(f"{what} matching {wanted!r} in {root}", "see dtrain jobs")
    return matches[0]


STATUS_EVERY_S = 0.25  # while a job runs, status.json is rewritten at most this often
MAX_OPEN_LOGS = 256  # rank logs kept open (append mode: one closed and reopened loses nothing)


class JobRecorder:
    """The sink that keeps everything in the job directory (all ranks, whatever is shown).

    Rank states reach ``status.json`` at most every ``status_every_s`` (a burst of starts
    or exits is one write, made when the interval is over); the job's end is written at once.
    """

    def __init__(
        self,
        job: JobDir,
        clock: Callable[[], float] = time.time,
        status_every_s: float = STATUS_EVERY_S,
    ) -> None:
        self.job = job
        self.clock = clock
        self.status_every_s = status_every_s
        self.status_lock = threading.Lock()  # the writer thread, a pending write, the end
        self.status_written = -math.inf  # when status.json was last written (monotonic)
        self.pending: threading.Timer | None = None  # the write that ends a burst
        self.ended = False  # the job's end is recorded: nothing may overwrite it
        self.files_closed = False  # the job ended: a late line opens its file for itself
        self.files: dict[str, BinaryIO] = {}
        self.failed = False
        self.ranks: dict[int, str] = {}  # each rank's state, as status.json shows it (JSON)
        self.launcher_pid = os.getpid()
        self.launcher_start = process_start(self.launcher_pid)
        # A restart's recorder keeps the job's start: `dtrain jobs` times all its attempts.
        earlier = job.status().get("started") if (job.path / "status.json").exists() else None
        self.started = float(earlier) if isinstance(earlier, int | float) else clock()
        self.result: dict[str, Any] | None = None  # how it ended, for dtrain logs' summary

    def show(self, spec: LaunchSpec, stream: Stream, lines: list[bytes]) -> None:
        if self.failed:
            return
        key = spec.label or str(spec.rank)  # mpirun's own lines go to mpirun.log
        prefix = b"%.6f %s " % (self.clock(), STREAM_CODES[stream])
        if b"\r" in b"".join(lines):
            lines = [line for line in lines if not line.endswith(b"\r")]
        if not lines:
            return
        try:
            file = None if self.files_closed else self.files.pop(key, None)
            if file is None:
                name = f"{spec.label}.log" if spec.label else self.job.log_path(spec.rank).name
                file = open_private(self.job.path / name)
                if len(self.files) >= MAX_OPEN_LOGS:  # thousands of ranks: not one fd each
                    self.files.pop(next(iter(self.files))).close()  # the least recently used
            if not self.files_closed:
                self.files[key] = file  # (last: the most recently used)
            # One C-level join per batch: this runs for every line of every rank.
            file.write(prefix + (b"\n" + prefix).join(lines) + b"\n")
            file.flush()
            if self.files_closed:  # a line after the job's end (its reader had waited)
                file.close()
        except OSError:
            # A full disk must not kill the training: the job goes on without its log.
            self.failed = True

    def update(self, state: RankState) -> None:
        encoded = json.dumps(vars(state))  # a flat record: each state encoded once, not per write
        with self.status_lock:
            self.ranks[state.rank] = encoded
            wait_s = self.status_written + self.status_every_s - time.monotonic()
            if wait_s > 0:
                if self.pending is None:
                    self.pending = threading.Timer(wait_s, self.write_pending)
                    self.pending.daemon = True
                    self.pending.start()
                return
        self.write_pending()

    def write_pending(self) -> None:
        """Write the rank states now (unless the job's end is written already)."""
        with self.status_lock:
            self.pending = None
            if self.ended:
                return
            try:
                self.write_status(RUNNING, None)
            except OSError:
                self.failed = True  # as for the logs: the job goes on

    def write_plan(self, entries: Sequence[Mapping[str, object]]) -> None:
        write_json(self.job.path / "plan.json", list(entries))

    def write_status(self, state: str, exit_code: int | None) -> None:
        self.status_written = time.monotonic()
        head = {
            "id": self.job.id,
            "state": state,
            "exit_code": exit_code,
            "launcher_pid": self.launcher_pid,
            "launcher_start": self.launcher_start,
            "launcher_host": socket.gethostname(),
            "started": self.started,
            "updated": self.clock(),
            **({"result": self.result} if self.result is not None else {}),
        }
        ranks = ",\n".join(f'"{r}": {s}' for r, s in sorted(self.ranks.items()))
        text = json.dumps(head, indent=1)[:-2] + ',\n "ranks": {\n' + ranks + "\n}\n}"
        write_text(self.job.path / "status.json", text)

    def close_files(self) -> None:
        self.files_closed = True
        for file in self.files.values():
            try:
                file.close()
            except OSError:
                pass

    def end_status(self, state: str, exit_code: int | None) -> None:
        """The job's end, written at once; no pending write comes after it."""
        with self.status_lock:
            self.ended = True
            if self.pending is not None:
                self.pending.cancel()
                self.pending = None
            try:
                self.write_status(state, exit_code)
            except OSError:
                pass  # a full disk: the job's end is still the launcher's exit code

    def finish_error(self) -> None:
        """The launcher failed before the job's end was known: the job failed."""
        self.close_files()
        self.end_status("failed", 1)

    def finish(self, result: JobResult, stopped: bool, restarting: bool = False) -> None:
        self.close_files()
        if restarting:  # another attempt follows: the job is not over
            state = "restarting"
        elif result.exit_code == 0:
            state = "succeeded"
        elif stopped:
            state = "stopped"
        elif result.interrupt is not None and result.failure is None:
            state = "interrupted"
        else:
            state = "failed"
        self.result = result_record(result)
        self.end_status(state, result.exit_code)


def result_record(result: JobResult) -> dict[str, Any]:
    """A job's result as JSON values (status.json keeps it for ``dtrain logs``)."""
    record = asdict(result)
    record.pop("statuses", None)
    record["failed_hosts"] = sorted(result.failed_hosts)
    record["lost_hosts"] = sorted(result.lost_hosts)
    return record


def recorded_result(job: JobDir) -> JobResult | None:
    """The result a finished job recorded (None: still running, or an older dtrain's)."""
    record = job.status().get("result")
    if not isinstance(record, dict):
        return None
    failure = record.get("failure")
    try:
        return JobResult(
            **{
                **record,
                "failure": RankReport(**{**failure, "last_lines": tuple(failure["last_lines"])})
                if failure
                else None,
                "failed_hosts": frozenset(record.get("failed_hosts", ())),
                "lost_hosts": frozenset(record.get("lost_hosts", ())),
            }
        )
    except TypeError:
        return None


@dataclass(frozen=True)
class LogLine:
    time: float
    rank: int
    stream: Stream
    text: bytes


def parse_log_line(rank: int, raw: bytes) -> LogLine | None:
    stamp, _, rest = raw.partition(b" ")
    code, _, text = rest.partition(b" ")
    try:
        return LogLine(float(stamp), rank, "stderr" if code == b"e" else "stdout", text)
    except ValueError:
        return None


class LogReader:
    """Reads a job's rank logs incrementally: whole lines only, from where it stopped."""

    def __init__(self, job: JobDir, ranks: set[int] | None = None) -> None:
        self.job = job
        self.ranks = ranks
        self.offsets: dict[int, int] = {}
        self.partial: dict[int, bytes] = {}

    def rank_files(self) -> dict[int, Path]:
        found = {}
        for path in self.job.path.glob("rank.*.log"):
            try:
                rank = int(path.name.split(".")[1])
            except (IndexError, ValueError):
                continue
            if self.ranks is None or rank in self.ranks:
                found[rank] = path
        return found

    def read_new(self) -> list[LogLine]:
        """New lines of every rank, merged by time (each rank's file is in time order)."""
        per_rank: list[Iterator[LogLine]] = []
        for rank, path in sorted(self.rank_files().items()):
            with open(path, "rb") as f:
                f.seek(self.offsets.get(rank, 0))
                data = self.partial.pop(rank, b"") + f.read()
                self.offsets[rank] = f.tell()
            *whole, rest = data.split(b"\n")
            if rest:
                self.partial[rank] = rest
            lines = [line for line in (parse_log_line(rank, raw) for raw in whole) if line]
            per_rank.append(iter(lines))
        return list(heapq.merge(*per_rank, key=lambda line: line.time))


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h``, ``1d`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise UsageError(f"--since {text!r}: not a duration", "write e.g. 30s, 10m, 2h or 1d")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def remove_job(job: JobDir) -> None:
    import shutil  # (not at the top: it loads bz2 and lzma, for every job's start)

    shutil.rmtree(job.path, ignore_errors=True)


@dataclass(frozen=True)
class LogQuery:
    """``dtrain logs``'s filters: ranks, a role, the last N seconds, a regular expression."""

    ranks: frozenset[int] | None = None
    role: str | None = None
    since_s: float | None = None
    pattern: str | None = None
    attempt: int | None = None  # only this attempt's lines (--max-restarts)


def end_record(job: JobDir, exit_code: int) -> None:
    """A job recorded as restarting ends after all, failed with ``exit_code``."""
    status = job.status()
    status.update(state="failed" if exit_code else "succeeded", exit_code=exit_code)
    try:
        write_json(job.path / "status.json", status)
    except OSError:
        pass  # a full disk: the launcher's exit code still says it


def record_attempt(job: JobDir, number: int, values: Mapping[str, object]) -> None:
    """Add to (or start) attempt ``number``'s entry in attempts.json."""
    entries = attempts_of(job)
    while len(entries) <= number:
        entries.append({"attempt": len(entries)})
    entries[number].update(values)
    write_json(job.path / "attempts.json", entries)


def attempts_of(job: JobDir) -> list[dict[str, Any]]:
    found = read_json(job.path / "attempts.json")
    return found if isinstance(found, list) else []


def attempt_window(job: JobDir, number: int) -> tuple[float, float]:
    """When attempt ``number`` ran: from its start to the next one's (or forever)."""
    entries = attempts_of(job)
    if not entries and number == 0:
        return (0.0, float("inf"))  # a job without restarts is its attempt 0
    if not 0 <= number < len(entries):
        raise UsageError(
            f"--attempt {number}: job {job.id} has attempts 0 to {max(len(entries) - 1, 0)}",
            "see dtrain logs without --attempt",
        )
    start = float(entries[number].get("started", 0.0))
    later = entries[number + 1].get("started") if number + 1 < len(entries) else None
    return (start, float(later) if later is not None else float("inf"))


def attempt_events(job: JobDir) -> list[tuple[float, str]]:
    """What a restarted job's launcher said between its attempts, as (time, line): each
    failed attempt that was followed by another, and each restart, so ``dtrain logs`` tells
    the story of a detached job (the last attempt's end is the job's, said after the lines)."""
    from launcher.core.policy import describe_status

    events: list[tuple[float, str]] = []
    entries = attempts_of(job)
    for number, entry in enumerate(entries):
        if number > 0 and isinstance(entry.get("started"), int | float):
            hosts = ", ".join(str(h) for h in entry.get("hosts", []))
            events.append(
                (
                    float(entry["started"]),
                    f"dtrain: restart {number}: {entry.get('world_size', '?')} ranks on {hosts}",
                )
            )
        ended, failure = entry.get("ended"), entry.get("failure")
        again = number + 1 < len(entries) or job.state() == "restarting"
        if again and isinstance(ended, int | float) and entry.get("exit_code"):
            what = f"exit code {entry['exit_code']}"
            if isinstance(failure, dict) and isinstance(failure.get("rank"), int):
                status = failure.get("status")
                cause = failure.get("cause") or (
                    describe_status(status) if isinstance(status, int) else "failed"
                )
                what = f"rank {failure['rank']} on {failure.get('host', '?')} {cause}"
            events.append((float(ended), f"dtrain: attempt {number} failed ({what})"))
    return sorted(events)


def select_lines(
    job: JobDir,
    specs: Mapping[int, LaunchSpec],
    query: LogQuery,
    follow: bool,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[LogLine]:
    """The job's log lines that ``query`` selects, merged by time; with ``follow``, new
    ones until the job ends."""
    wanted = set(query.ranks) if query.ranks is not None else None
    if query.role is not None:
        by_role = {r for r, spec in specs.items() if spec.role == query.role}
        wanted = by_role if wanted is None else wanted & by_role
    try:
        matcher = re.compile(query.pattern.encode()) if query.pattern else None
    except re.error as exc:
        raise UsageError(
            f"--grep {query.pattern!r}: {exc}", "give a Python regular expression"
        ) from None
    cutoff = clock() - query.since_s if query.since_s is not None else None
    window = attempt_window(job, query.attempt) if query.attempt is not None else None
    reader = LogReader(job, wanted)
    while True:
        running = job.state() in ACTIVE
        for line in reader.read_new():
            if cutoff is not None and line.time < cutoff:
                continue
            if window is not None and not window[0] <= line.time < window[1]:
                continue
            if matcher is None or matcher.search(line.text):
                yield line
        if not (follow and running):
            return
        sleep(LOG_POLL_S)


LOG_POLL_S = 0.2


def prepare_output_dir(path: str | None) -> Path | None:
    """Create ``--output-dir`` now, so a bad path fails before any rank starts."""
    if path is None:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path, ".dtrain-write-test")
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"--output-dir {path}: cannot write there ({exc.strerror})",
            "give a directory you can write to",
        ) from None
    return Path(path)


@dataclass(frozen=True)
class JobSummary:
    """One line of ``dtrain jobs``."""

    id: str
    state: str
    world_size: str
    hosts: tuple[str, ...]
    size: int
    age_s: float
    command: tuple[str, ...]
    exit_code: int | None = None  # None while it runs, or when its end was not recorded
    duration_s: float | None = None  # from start to its recorded end, or until now


def summarize_jobs(
    root: Path, prune: bool, clock: Callable[[], float] = time.time
) -> tuple[list[JobSummary], int]:
    """Every job under ``root`` (oldest first); with ``prune``, finished ones are removed
    instead (their count is returned)."""
    summaries: list[JobSummary] = []
    removed = 0
    for job in list_jobs(root):
        state = job.state()
        if prune and state not in (RUNNING, "starting"):
            remove_job(job)
            removed += 1
            continue
        meta, status = job.meta(), job.status()
        started = float(status.get("started") or job.path.stat().st_mtime)
        ended = clock() if state in (RUNNING, "starting") else status.get("updated")
        summaries.append(
            JobSummary(
                id=job.id,
                state=state,
                world_size=str(meta.get("world_size", "?")),
                hosts=tuple(meta.get("hosts", [])),
                size=job.size(),
                age_s=clock() - started,
                command=tuple(meta.get("command", [])),
                exit_code=status.get("exit_code"),
                duration_s=None if ended is None else max(0.0, float(ended) - started),
            )
        )
    return summaries, removed
