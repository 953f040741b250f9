"""The per-host agent: one SSH channel per host carries every rank of that host.

Started through ``watchdog.BOOTSTRAP`` (its source arrives on stdin), the agent runs the
host probe (``probe.py``, sent as text) and reports it, then starts one watchdog per rank
it is asked for, as local children, and multiplexes their output and status back on its
stdout.  Its stdin is the lifeline: when it closes, the agent closes every watchdog's
stdin, and each ends its rank as it would for a lost launcher.

Frames, both ways: ``!IBI`` header (run, kind, length), then the payload; a run is one
start of one rank (a restarted rank is a new run).  Both ends send heartbeats: an agent
that hears nothing for the launcher's host timeout takes the launcher for dead (a cut
network closes no channel) and drops the lifeline; a launcher that hears nothing from an
agent for that long takes the host for lost.  Output is flow-controlled per run: the agent
sends at most ``WINDOW_BYTES`` of a rank's output beyond what the launcher has taken (it
returns CREDIT) and stops reading that rank's pipes until then, so a slow terminal slows
that rank alone.  Stdlib only and self-contained, like the watchdog.
"""

import json
import os
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from typing import Any

HEADER = struct.Struct("!IBI")
# agent -> launcher
STDOUT, STDERR, EXITED, PROBED, STARTED, FAILED, STDOUT_END, STDERR_END, STATUS = range(9)
STACKS_DUMPED, STATS_TAKEN = 9, 10
# launcher -> agent
START, SIGNAL, HEARTBEAT, CREDIT, DUMP_STACKS, TAKE_STATS = 100, 101, 102, 103, 104, 105
ANSWERS = {DUMP_STACKS: STACKS_DUMPED, TAKE_STATS: STATS_TAKEN}  # questions about a rank
# A question's payload is its request id; the answer echoes it: {"request": id, "answer": ...}
# --mpi (mpirun, not this agent, starts the ranks): the job's id and its daemons' session
# folder (a line each), to end what is left of it here and remove the folder when the
# launcher is gone or done; then signals for its ranks (SIGTERM: mpirun lives on)
MPI_JOB, SIGNAL_MPI_JOB = 106, 107
NO_RUN = 0xFFFFFFFF
# Written before the first frame: what a login shell's rc files print before it is skipped.
START_MARK = b"\0dtrain-agent-frames\0"
SILENCE_S = 30.0  # unless the config says otherwise (the launcher's --host-timeout)
HEARTBEAT_S = 5.0  # how often the agent says it lives (unless its config says otherwise)
WINDOW_BYTES = 2 << 20  # a run's output in flight to the launcher, at most
PY_SPY_TIMEOUT_S = 20.0


def encode(rank: int, kind: int, payload: bytes) -> bytes:
    return HEADER.pack(rank, kind, len(payload)) + payload


def program_pid(watchdog_pid: int) -> "int | None":
    """The rank's program: the watchdog's child (the watchdog forks it)."""
    try:
        with open(f"/proc/{watchdog_pid}/task/{watchdog_pid}/children") as f:
            children = f.read().split()
        if children:
            return int(children[0])
    except OSError:
        pass
    return next((int(e) for e in os.listdir("/proc") if parent_of(e) == watchdog_pid), None)


def parent_of(entry: str) -> "int | None":
    """The parent of process ``entry`` (a /proc name); None where it is no process."""
    try:
        with open(f"/proc/{entry}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def find_py_spy(hint: "str | None") -> "str | None":
    """py-spy: the launcher's path where it exists here, next to this Python, or on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    for candidate in (hint, beside):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("py-spy")


def descendants(pid: int) -> "list[int]":
    """Every process below ``pid`` (its children, theirs...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        parent = parent_of(entry) if entry.isdigit() else None
        if parent is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return found


def gpu_usage() -> "tuple[dict[int, int], dict[int, int]]":
    """pid -> MiB of GPU memory it holds, and pid -> use % of its busiest GPU (nvidia-smi)."""
    apps = nvidia_smi("--query-compute-apps=pid,gpu_uuid,used_memory")
    if not apps:
        return {}, {}
    busy = {row[0]: int(row[1]) for row in nvidia_smi("--query-gpu=uuid,utilization.gpu")
            if len(row) == 2 and row[1].isdigit()}  # fmt: skip
    memory: dict[int, int] = {}
    percent: dict[int, int] = {}
    for row in apps:
        if len(row) != 3 or not row[0].isdigit() or not row[2].isdigit():
            continue
        pid = int(row[0])
        memory[pid] = memory.get(pid, 0) + int(row[2])
        if row[1] in busy:
            percent[pid] = max(percent.get(pid, 0), busy[row[1]])
    return memory, percent


def nvidia_smi(query: str) -> "list[list[str]]":
    """nvidia-smi's CSV answer to a query, split into fields (nothing where it cannot)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    command = [smi, query, "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[part.strip() for part in line.split(",")] for line in out.splitlines()]


def take_stats(watchdog_pid: int) -> dict:  # type: ignore[type-arg]
    """What the rank's processes use now: CPU ticks, resident memory, GPU memory and use."""
    pids = descendants(watchdog_pid)
    ticks, rss = 0, 0
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{pid}/statm", "rb") as f:
                rss += int(f.read().split()[1]) * page
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    memory, percent = gpu_usage()
    held = [memory[p] for p in pids if p in memory]
    busy = [percent[p] for p in pids if p in percent]
    return {
        "pid": program_pid(watchdog_pid),
        "processes": len(pids),
        "cpu_s": ticks / os.sysconf("SC_CLK_TCK"),
        "time": time.monotonic(),
        "rss": rss,
        "gpu_mib": sum(held) if held else None,
        "gpu_percent": max(busy) if busy else None,
    }


def dump_stacks(watchdog_pid: int, py_spy_hint: "str | None") -> dict:  # type: ignore[type-arg]
    """The rank's program's Python stacks (py-spy dump --json), or why there are none."""
    pid = program_pid(watchdog_pid)
    if pid is None:
        return {"error": "the rank's program is not running"}
    return dump_pid(pid, py_spy_hint)


def job_processes(job_id: str, named: bytes = b"") -> dict[int, tuple[int, list[bytes]]]:
    """This host's processes of a job: pid -> (parent, environment), those with its
    DTRAIN_JOB_ID (or ``named`` in their command line) in this network namespace."""
    job = f"DTRAIN_JOB_ID={job_id}".encode()
    try:
        here = os.readlink("/proc/self/ns/net")
    except OSError:
        here = None
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                variables = f.read().split(b"\0")
            if job not in variables:
                if not named:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if named not in f.read():
                        continue
            if here is not None and os.readlink(f"/proc/{entry}/ns/net") != here:
                continue
        except OSError:
            continue
        parent = parent_of(entry)
        if parent is not None:
            found[int(entry)] = (parent, variables)
    return found


def claim_folder(path: str) -> str | None:
    """Make ``path`` 0700 (mpirun's daemon may have made it first); None unless ours, a folder."""
    try:
        os.mkdir(path, 0o700)
    except OSError:
        pass
    try:
        found = os.lstat(path)
    except OSError:
        return None
    return path if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() else None


def kill_job_processes(
    job_id: str, deadline_s: float = 5.0, named: str = ""
) -> dict[str, list[int]]:
    """SIGKILL what is left here of an ``--mpi`` job (a rank's child; mpirun's daemon, by its
    session folder ``named``), again until nothing is left; the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + deadline_s
    while True:  # one look at least, however late this thread runs (a busy machine)
        left = list(job_processes(job_id, named.encode()))
        for pid in left:
            try:
                os.kill(pid, 9)
            except OSError:
                continue
            if pid not in killed:
                killed.append(pid)
        if not left or time.monotonic() >= deadline:
            return {"killed": killed}
        time.sleep(0.05)


def mpi_rank_processes(job_id: str) -> dict[int, tuple[int, int]]:
    """This host's processes of an ``--mpi`` job's ranks (the job's DTRAIN_JOB_ID and Open
    MPI's OMPI_COMM_WORLD_RANK in their environment): pid -> (rank, parent)."""
    found: dict[int, tuple[int, int]] = {}
    for pid, (parent, variables) in job_processes(job_id).items():
        for variable in variables:
            if variable.startswith(b"OMPI_COMM_WORLD_RANK="):
                found[pid] = (int(variable.split(b"=", 1)[1]), parent)
    return found


def signal_mpi_ranks(job_id: str, signum: int, signalled: "set[tuple[int, int]]") -> None:
    """Signal an ``--mpi`` job's ranks here as a watchdog signals its rank: the topmost
    process of each (its process group, which mpirun's daemon makes it lead), unless
    ``signalled`` has it with that signal (asked again, only ranks started since are
    signalled); SIGKILL every process of the ranks.  mpirun (no rank) is left to hand on
    what they print."""
    found = mpi_rank_processes(job_id)
    for pid, (rank, parent) in found.items():
        top = found.get(parent, (None,))[0] != rank  # its parent is not the same rank's
        if signum != 9 and (pid, signum) in signalled:
            continue
        signalled.add((pid, signum))
        try:
            if top and os.getpgid(pid) == pid:
                os.killpg(pid, signum)
            elif top or signum == 9:
                os.kill(pid, signum)
        except OSError:
            continue


def mpi_rank_pids(job_id: str) -> dict[int, int]:
    """This host's processes of an ``--mpi`` job's ranks: rank -> the topmost process."""
    found = mpi_rank_processes(job_id)
    tops: dict[int, int] = {}
    for pid, (rank, parent) in sorted(found.items()):
        if found.get(parent, (None,))[0] != rank:  # its parent is not the same rank's
            tops.setdefault(rank, pid)
    return tops


def dump_mpi_stacks(job_id: str, py_spy_hint: "str | None") -> dict:  # type: ignore[type-arg]
    """Every ``--mpi`` rank of the job on this host: rank (as text) -> its py-spy dump."""
    found: dict = {}  # type: ignore[type-arg]

    def take(rank: int, pid: int) -> None:
        found[str(rank)] = dump_pid(pid, py_spy_hint)

    threads = [
        threading.Thread(target=take, args=item, daemon=True)
        for item in mpi_rank_pids(job_id).items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return found


def dump_pid(pid: int, py_spy_hint: "str | None") -> dict:  # type: ignore[type-arg]
    """A process's Python stacks (py-spy dump --json), or why there are none."""
    py_spy = find_py_spy(py_spy_hint)
    if py_spy is None:
        return {"pid": pid, "error": "py-spy is not installed on this host (pip install py-spy)"}
    try:
        command = [py_spy, "dump", "--json", "--pid", str(pid)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"pid": pid, "error": f"py-spy failed: {exc}"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"pid": pid, "error": f"py-spy: {last}"}
    try:
        return {"pid": pid, "threads": json.loads(done.stdout)}
    except ValueError:
        return {"pid": pid, "error": f"py-spy printed no JSON: {done.stdout[:200]!r}"}


class Forked:
    """A rank's watchdog, forked from the agent: what the agent needs of ``Popen``
    (``status_of``: the watchdog's, a wait status as an exit code or -N for signal N)."""

    def __init__(self, pid: int, stdin: Any, stdout: Any, stderr: Any, status_of: Any) -> None:
        self.pid = pid
        self.stdin = stdin  # its lifeline: signal numbers, and EOF when the launcher is gone
        self.stdout = stdout
        self.stderr = stderr
        self.status_of = status_of
        self.returncode: int | None = None

    def poll(self) -> "int | None":
        if self.returncode is None:
            try:
                pid, wait_status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid:
                self.returncode = self.status_of(wait_status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, wait_status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.returncode = -9  # reaped elsewhere: gone, its status unknown
                break
            self.returncode = self.status_of(wait_status)
        return self.returncode


def become_watchdog(watchdog: dict, spec: dict, fds: "tuple[int, int, int, int]") -> None:  # type: ignore[type-arg]
    """In the forked child: the rank's pipes and environment, then the watchdog's watch."""
    try:
        status = watchdog["take_pipes"](fds)
    except OSError as exc:
        os.write(2, f"dtrain: cannot start the rank: {exc}\n".encode())
        os._exit(126)
    watchdog["enter_remote_spec"](spec, status)
    watchdog["watch"](spec["argv"], float(spec["grace_s"]), status)
    os._exit(127)  # (watch never returns)


class Agent:
    def __init__(self, config: dict) -> None:  # type: ignore[type-arg]
        self.config = config
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, Forked] = {}
        self.watchdog: dict | None = None  # type: ignore[type-arg]  # (``watchdog_code``)
        self.open_pipes: dict[int, int] = {}
        self.reported: set[int] = set()  # runs whose watchdog reported the program's status
        self.outputs: dict[int, dict[Any, tuple[int, int | None]]] = {}  # open output pipes
        self.credit: dict[int, int] = {}  # bytes a run may still send before it waits
        self.paused: set[int] = set()  # runs waiting for credit (their pipes unregistered)
        self.beaten = time.monotonic()
        self.heartbeat_s = float(config.get("heartbeat_s", HEARTBEAT_S))
        self.silence_s = float(config.get("silence_s", SILENCE_S))
        self.inbox = bytearray()
        self.lifeline_open = True
        self.heard = time.monotonic()
        self.send_lock = threading.Lock()  # stack dumps answer from their own threads
        self.mpi_job: str | None = None  # --mpi: the job whose ranks mpirun starts here
        self.mpi_sessions: str | None = None  # ...its daemon's session folder here, made 0700
        self.mpi_signalled: set[tuple[int, int]] = set()  # ...(pid, signal) sent already

    def send(self, rank: int, kind: int, payload: bytes) -> None:
        data = encode(rank, kind, payload)
        with self.send_lock:
            while data:
                written = os.write(1, data)
                data = data[written:]

    def watchdog_code(self) -> dict:  # type: ignore[type-arg]
        """The watchdog's functions, compiled once (each rank's watchdog is a fork of this)."""
        if self.watchdog is None:
            namespace: dict = {"__name__": "dtrain_watchdog"}  # type: ignore[type-arg]
            exec(compile(self.config["watchdog"], "dtrain-watchdog", "exec"), namespace)
            try:
                namespace["load_libc"]()
            except OSError:
                pass
            self.watchdog = namespace
        return self.watchdog

    def start(self, rank: int, spec: dict) -> None:  # type: ignore[type-arg]
        watchdog = self.watchdog_code()
        watchdog["hold_tree"](spec.get("cwd"))  # --sync: no other sync prunes its tree
        # lifeline, stdout, stderr, and the watchdog's report (out of the program's reach)
        (lifeline, ours_in), (ours_out, out), (ours_err, err), (ours_status, status) = (
            os.pipe() for _ in range(4)
        )
        theirs = (lifeline, out, err, status)
        try:
            pid = os.fork()
        except OSError:
            for fd in (*theirs, ours_in, ours_out, ours_err, ours_status):
                os.close(fd)
            raise
        if pid == 0:
            become_watchdog(watchdog, spec, theirs)  # never returns
        for fd in theirs:
            os.close(fd)
        child = Forked(pid, os.fdopen(ours_in, "wb"), os.fdopen(ours_out, "rb", buffering=0),
                       os.fdopen(ours_err, "rb", buffering=0), watchdog["status_of"])  # fmt: skip
        self.children[rank] = child
        self.open_pipes[rank] = 3
        status_file = os.fdopen(ours_status, "rb", buffering=0)
        self.credit[rank] = WINDOW_BYTES
        self.outputs[rank] = {
            child.stdout: (STDOUT, STDOUT_END),
            child.stderr: (STDERR, STDERR_END),
        }
        for pipe, kinds in (*self.outputs[rank].items(), (status_file, (STATUS, None))):
            os.set_blocking(pipe.fileno(), False)
            self.selector.register(pipe, selectors.EVENT_READ, (rank, kinds))
        self.send(rank, STARTED, str(child.pid).encode())

    def handle_control(self, data: bytes) -> None:
        self.heard = time.monotonic()
        self.inbox += data
        offset = 0
        while len(self.inbox) - offset >= HEADER.size:
            rank, kind, length = HEADER.unpack_from(self.inbox, offset)
            if len(self.inbox) - offset < HEADER.size + length:
                break
            payload = bytes(self.inbox[offset + HEADER.size : offset + HEADER.size + length])
            offset += HEADER.size + length
            self.handle_frame(rank, kind, payload)
        del self.inbox[:offset]  # once per read, not once per frame

    def handle_frame(self, rank: int, kind: int, payload: bytes) -> None:
        if kind == START:
            try:
                self.start(rank, json.loads(payload))
            except OSError as exc:
                self.send(rank, FAILED, str(exc).encode())
        elif kind == CREDIT and rank in self.credit:
            self.credit[rank] += int(payload)
            if rank in self.paused and self.credit[rank] > 0:
                self.paused.discard(rank)
                for pipe, kinds in self.outputs[rank].items():
                    self.selector.register(pipe, selectors.EVENT_READ, (rank, kinds))
        elif kind in ANSWERS and rank in self.children:
            pid, hint = self.children[rank].pid, self.config.get("py_spy")
            request = payload.decode("ascii", "replace")

            def answer() -> None:
                found = dump_stacks(pid, hint) if kind == DUMP_STACKS else take_stats(pid)
                reply = {"request": request, "answer": found}
                self.send(rank, ANSWERS[kind], json.dumps(reply).encode())

            threading.Thread(target=answer, daemon=True).start()
        elif kind == MPI_JOB:
            self.mpi_job, _, folder = payload.decode().partition("\n")
            self.mpi_sessions = claim_folder(folder) if folder else None
        elif kind == SIGNAL_MPI_JOB and self.mpi_job is not None:
            signal_mpi_ranks(self.mpi_job, int(payload), self.mpi_signalled)
        elif kind == SIGNAL and rank in self.children:
            child = self.children[rank]
            if child.poll() is None and child.stdin is not None:
                try:
                    child.stdin.write(payload + b"\n")
                    child.stdin.flush()
                except OSError:
                    pass

    def drop_lifeline(self) -> None:
        """The launcher is gone (or done): every watchdog sees its stdin close and ends its
        rank, and what is left here of an ``--mpi`` job's ranks is killed."""
        self.lifeline_open = False
        self.selector.unregister(0)
        for rank in self.paused:  # nobody will return credit: read on, so ends are seen
            for pipe, kinds in self.outputs[rank].items():
                self.selector.register(pipe, selectors.EVENT_READ, (rank, kinds))
            self.credit[rank] = 1 << 62
        self.paused.clear()
        for child in self.children.values():
            if child.stdin is not None:
                try:
                    child.stdin.close()
                except OSError:
                    pass
        self.end_mpi_job()

    def terminated(self, *_: object) -> None:
        """SIGTERM (scancel): die of it at once (the launcher sees the host go), a child with no
        pipe of ours ending what is left of an --mpi job here (mpirun's daemon, its folder)."""
        if self.mpi_job is not None and os.fork() == 0:
            os.closerange(0, 65536)
            self.end_mpi_job()
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def end_mpi_job(self) -> None:
        """What is left here of an ``--mpi`` job, mpirun's daemon included, and its folder."""
        if self.mpi_job is not None:
            kill_job_processes(self.mpi_job, named=self.mpi_sessions or "")
        if self.mpi_sessions is not None:
            shutil.rmtree(self.mpi_sessions, ignore_errors=True)

    def pipe_ready(self, pipe: Any, rank: int, kinds: tuple[int, int | None]) -> None:
        try:
            data = os.read(pipe.fileno(), 65536)
        except BlockingIOError:
            return
        if data:
            self.send(rank, kinds[0], data)
            if kinds[1] is None:
                self.reported.add(rank)
            else:
                self.spend(rank, len(data))
            return
        self.selector.unregister(pipe)
        if kinds[1] is not None:
            del self.outputs[rank][pipe]
            self.send(rank, kinds[1], b"")
        else:
            pipe.close()
            if rank not in self.reported:
                # The watchdog died without reporting (OOM killer, kill -9): end its group,
                # whose processes still hold the output pipes, so the rank's end is seen.
                self.children[rank].wait()
                try:
                    os.killpg(self.children[rank].pid, 9)
                except OSError:
                    pass
        self.open_pipes[rank] -= 1
        if self.open_pipes[rank] == 0:
            child = self.children[rank]
            self.send(rank, EXITED, str(child.wait()).encode())
            if child.stdin is not None:
                try:
                    child.stdin.close()
                except OSError:
                    pass

    def spend(self, rank: int, size: int) -> None:
        """Count sent output; out of credit, stop reading the rank's pipes (it will wait)."""
        self.credit[rank] -= size
        if self.credit[rank] <= 0 and rank not in self.paused:
            self.paused.add(rank)
            for pipe in self.outputs[rank]:
                self.selector.unregister(pipe)

    def run(self) -> None:
        os.set_blocking(0, False)
        self.selector.register(0, selectors.EVENT_READ, None)
        while self.lifeline_open or any(self.open_pipes.values()):
            now = time.monotonic()
            if self.lifeline_open and now - self.heard > self.silence_s:
                self.drop_lifeline()
            if now - self.beaten >= self.heartbeat_s:
                self.beaten = now
                self.send(NO_RUN, HEARTBEAT, b"")
            for key, _ in self.selector.select(timeout=min(1.0, self.heartbeat_s)):
                if key.data is None:
                    try:
                        data = os.read(0, 65536)
                    except BlockingIOError:
                        continue
                    if data:
                        self.handle_control(data)
                    else:
                        self.drop_lifeline()
                else:
                    rank, kinds = key.data
                    self.pipe_ready(key.fileobj, rank, kinds)


def main() -> None:
    read_exact = globals()["read_exact"]  # given by watchdog.BOOTSTRAP, which started us
    config = json.loads(read_exact(int(read_exact(10))))
    namespace: dict = {"__name__": "dtrain_probe"}  # type: ignore[type-arg]
    exec(compile(config["probe_source"], "dtrain-probe", "exec"), namespace)
    report = namespace["probe"](config["probe"])
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.terminated)
    os.write(1, START_MARK)
    agent.send(NO_RUN, PROBED, json.dumps(report).encode())
    agent.run()


if __name__ == "__dtrain_remote__":
    main()
