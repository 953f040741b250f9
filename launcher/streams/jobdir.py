"""One job's directory, ``<root>/<id>/`` (streams layer): its layout (the names below, the
only spelling of them), its files read back and written privately.  ``streams/recorder.py``
writes them while the job runs, ``streams/joblogs.py`` reads the rank logs back."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from launcher.base.errors import UsageError
from launcher.base.pids import process_alive
from launcher.base.trust import trust_doubt
from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host

META = "meta.json"  # what was run, where, by which launcher (pid)
PLAN = "plan.json"  # the ranks as ``--dry-run --json`` shows them
STATUS = "status.json"  # the job state and every rank's host, pid, start, end, status
ATTEMPTS = "attempts.json"  # with --max-restarts: each attempt's start, end, exit, failure
RANK_LOGS = "rank.*.log"  # ``rank_log``: '<unix time> <o|e> <text>' (o: stdout, e: stderr)
LAUNCH_FILE, LAUNCHER_LOG = "launch.json", "launcher.log"  # a background launcher's: in, out
STRAGGLERS_LOG = "stragglers.log"  # '<unix time> <the notice>' lines
STACKS = "stacks.txt"  # every rank's stack at a hang, appended
CONTROL_SOCKET = "control.sock"  # where the running launcher answers (``streams/control.py``)
TF_CONFIG, COORDINATOR = "tf_config.json", "coordinator.sh"  # a standing TF cluster's join
HOSTFILE, METRICS = "hosts", "metrics.jsonl"  # a sweep's trial's: hosts, $DTRAIN_METRICS_FILE
STOP_MARK = "stop-requested"  # dtrain stop leaves it: the job ends as "stopped"
# (and ``errors/``: the ranks' error files, named by ``core/errorfile.py`` for their env)

RUNNING = "running"
ACTIVE = (RUNNING, "starting", "restarting")  # a launcher is at work on the job

FILE_MODE = 0o600  # a job's files and directory are its owner's alone (rule 7)
DIR_MODE = 0o700


def rank_log(rank: object, label: str | None = None) -> str:
    """Rank ``rank``'s log (a labelled output's, e.g. mpirun's own lines: ``<label>.log``)."""
    return f"{label}.log" if label else f"rank.{rank}.log"


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


def check_root(root: Path, named: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a jobs root another user could write to, as OpenSSH refuses a loose ``~/.ssh``:
    a ``status.json`` planted there names the pid ``dtrain stop`` signals.  The root must be
    ours (or root's) and not writable by group or others, nor may the folders above it be
    (``base/trust.py``'s rule, the project file's too; a folder listed in the user's config
    as trusted lifts it).  A missing one is made 0700 when the first job is (``named``: how
    the user gave it, for the message)."""
    try:
        root.stat()
    except FileNotFoundError:
        pass  # not there (yet): made private with the first job; the folders above count
    except (OSError, ValueError) as exc:  # a name too long, a file on the way...
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise UsageError(f"{named} {root}: cannot use it ({reason})", "check the path") from None
    environ = os.environ if environ is None else environ
    doubt = trust_doubt(str(root), environ, parents_only=True) or trust_doubt(str(root), environ)
    if doubt is None:
        return
    if doubt.at != doubt.path:  # a folder above it
        theirs = doubt.owner is not None  # (no chmod of ours helps there)
        raise UsageError(
            f"{named} {root}: its folder {doubt.at} is {doubt.why(names=True)}: another user "
            "could swap the jobs for their own",
            "pass a --job-dir in a folder of yours"
            if theirs
            else f"chmod go-w {doubt.at}, or pass a --job-dir in a folder of yours",
        )
    if doubt.owner is not None:
        raise UsageError(
            f"{named} {root}: {doubt.why(names=True)}, not by you: another user's jobs cannot "
            "be trusted",
            f"use a directory of your own: --job-dir {DEFAULT_ROOT_SHOWN}, or another",
        )
    shared = root.stat().st_mode & stat.S_ISVTX  # /tmp: everyone's, and meant to stay so
    raise UsageError(
        f"{named} {root}: {doubt.why()}: another user could plant a job there",
        f"pass a folder of yours inside it, made private: --job-dir {root / 'dtrain-jobs'}"
        if shared
        else f"chmod go-w {root}, or pass another --job-dir",
    )


DEFAULT_ROOT_SHOWN = "~/.dtrain/jobs"


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
        check_root(root, "--job-dir")  # (again: one made by another user just before ours)
        return JobDir(path).write_meta(meta)

    def write_meta(self, meta: Mapping[str, object]) -> JobDir:
        write_json(self.path / META, dict(meta))
        return self

    def write_status(self, status: Mapping[str, object]) -> None:
        write_json(self.path / STATUS, dict(status))

    def log_path(self, rank: int) -> Path:
        return self.path / rank_log(rank)

    def meta(self) -> dict[str, Any]:
        return read_json(self.path / META) or {}

    def plan(self) -> list[dict[str, Any]]:
        return read_json(self.path / PLAN) or []

    def status(self) -> dict[str, Any]:
        return read_json(self.path / STATUS) or {}

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
        return process_alive(pid) and (started is None or process_start(pid) == started)

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


def attempts_of(job: JobDir) -> list[dict[str, Any]]:
    """The entries of attempts.json (none for a job that never restarted)."""
    found = read_json(job.path / ATTEMPTS)
    return found if isinstance(found, list) else []


def process_start(pid: int) -> int | None:
    """When a process started (clock ticks after boot): with its pid, it names one process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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
