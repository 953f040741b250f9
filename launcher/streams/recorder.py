"""The job's records, written while it runs: rank logs, status, attempts, result (streams layer).

``JobRecorder`` is the sink that keeps every rank's output in the job directory, whatever
the terminal shows.  Lines that a program ends with a bare ``\\r`` (progress-bar updates)
are kept in their final state only: the update that a newline closes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from json.encoder import encode_basestring_ascii as json_string
from typing import Any

from launcher.core.command import LaunchSpec
from launcher.core.outcome import JobResult, LineBatch, RankReport, RankState, Stream
from launcher.core.results import (
    RESULTS_FOLDER,
    is_result_line,
    may_hold_results,
    result_file_name,
)
from launcher.streams.jobdir import (
    ATTEMPTS,
    PLAN,
    RUNNING,
    STATUS,
    JobDir,
    attempts_of,
    open_private,
    process_start,
    rank_log,
    write_json,
    write_text,
)
from launcher.streams.logfiles import LogFiles

STREAM_CODES: dict[str, bytes] = {"stdout": b"o", "stderr": b"e"}
STATUS_EVERY_S = 0.25  # while a job runs, status.json is rewritten at most this often
CREATE_AHEAD_RANKS = 64  # a job of more ranks has their logs created while it starts


def state_json(state: RankState) -> str:
    """``json.dumps(vars(state))``, the same text at half the cost: thousands of ranks start
    and exit together, and json's encoder calls back into Python for every float."""
    status, ended = state.status, state.ended
    return (
        f'{{"rank": {state.rank:d}, "host": {json_string(state.host)}, '
        f'"role": {json_string(state.role)}, "pid": {state.pid:d}, '
        f'"started": {json_float(state.started)}, '
        f'"status": {"null" if status is None else f"{status:d}"}, '
        f'"ended": {"null" if ended is None else json_float(ended)}, '
        f'"restarts": {state.restarts:d}, "stopped": {"true" if state.stopped else "false"}}}'
    )


def json_float(value: float) -> str:
    return repr(value) if math.isfinite(value) else json.dumps(value)


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
        self.logs = LogFiles(job.path)  # the rank logs' descriptors
        self.failed = False
        self.ranks: dict[int, str] = {}  # each rank's state, as status.json shows it (JSON)
        # States not yet encoded: a rank starts, runs and exits within one interval, and
        # thousands do at once; only the state that is written is encoded (once).
        self.changed: dict[int, RankState] = {}
        self.launcher_pid = os.getpid()
        self.launcher_start = process_start(self.launcher_pid)
        # A restart's recorder keeps the job's start: `dtrain jobs` times all its attempts.
        earlier = job.status().get("started") if (job.path / STATUS).exists() else None
        self.started = float(earlier) if isinstance(earlier, int | float) else clock()
        self.result: dict[str, Any] | None = None  # how it ended, for dtrain logs' summary

    def show(self, spec: LaunchSpec, stream: Stream, lines: Sequence[bytes]) -> None:
        if self.failed:
            return
        prefix = b"%.6f %s " % (self.clock(), STREAM_CODES[stream])
        # One C-level join per batch, and one write: this runs for every line of every rank.
        # (The prefix holds neither a \r nor the result mark: the block tells for its lines.)
        if isinstance(lines, LineBatch):  # plain lines (no \r): stamped in one pass over them
            block = b"".join((prefix, lines.data.replace(b"\n", b"\n" + prefix), b"\n"))
            special = stream == "stdout" and may_hold_results(lines.data)
        else:
            block = prefix + (b"\n" + prefix).join(lines) + b"\n"
            special = b"\r" in block or (stream == "stdout" and may_hold_results(block))
        if special:
            lines = [line for line in lines if not line.endswith(b"\r")]
            if stream == "stdout":
                lines = self.keep_results(spec, lines)
            if not lines:
                return
            block = prefix + (b"\n" + prefix).join(lines) + b"\n"
        name = rank_log(spec.rank, spec.label)
        try:
            self.logs.append(name, block)
        except OSError:
            # A full disk must not kill the training: the job goes on without its log.
            self.failed = True

    def keep_results(self, spec: LaunchSpec, lines: Sequence[bytes]) -> Sequence[bytes]:
        """What ``launcher.launch``'s function returned or raised (``core/results.py``) goes
        to ``results/rank.N``, not to the rank's log; the other lines are returned."""
        results = [line for line in lines if is_result_line(line)]
        if not results:
            return lines
        try:
            (self.job.path / RESULTS_FOLDER).mkdir(mode=0o700, exist_ok=True)
            with open_private(self.job.path / result_file_name(spec.rank)) as file:
                file.write(b"\n".join(results) + b"\n")
        except OSError:
            pass  # a full disk: the caller is told the rank's result never came
        return [line for line in lines if not is_result_line(line)]

    def update(self, state: RankState) -> None:
        with self.status_lock:
            self.changed[state.rank] = state  # encoded when written: the last state only
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
        write_json(self.job.path / PLAN, list(entries))
        if len(entries) > CREATE_AHEAD_RANKS:  # their files made while the job starts
            self.logs.create_ahead([rank_log(entry["rank"]) for entry in entries])

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
        if self.changed:
            self.ranks.update({r: state_json(s) for r, s in self.changed.items()})
            self.changed.clear()
        ranks = ",\n".join(f'"{r}": {s}' for r, s in sorted(self.ranks.items()))
        text = json.dumps(head, indent=1)[:-2] + ',\n "ranks": {\n' + ranks + "\n}\n}"
        write_text(self.job.path / STATUS, text)

    def close_files(self) -> None:
        self.logs.close()

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
    # (statuses left out before asdict's deep copy: at 8,000 ranks, a tenth of a second at
    # the job's end)
    record = asdict(replace(result, statuses={}))
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


def clear_results(job: JobDir) -> None:
    """No result of an earlier attempt is left to be taken for this one's."""
    for old in (job.path / RESULTS_FOLDER).glob("rank.*"):
        old.unlink(missing_ok=True)


def end_record(job: JobDir, exit_code: int) -> None:
    """A job recorded as restarting ends after all, failed with ``exit_code``."""
    status = job.status()
    status.update(state="failed" if exit_code else "succeeded", exit_code=exit_code)
    try:
        job.write_status(status)
    except OSError:
        pass  # a full disk: the launcher's exit code still says it


def record_attempt(job: JobDir, number: int, values: Mapping[str, object]) -> None:
    """Add to (or start) attempt ``number``'s entry in attempts.json."""
    entries = attempts_of(job)
    while len(entries) <= number:
        entries.append({"attempt": len(entries)})
    entries[number].update(values)
    write_json(job.path / ATTEMPTS, entries)
