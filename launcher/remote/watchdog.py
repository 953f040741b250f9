"""The per-rank watchdog: ``python -I -S watchdog.py GRACE_S STATUS_FD -- PROGRAM ARGS...``.

Runs in the rank's own session and process group, starts the program there
and makes sure nothing of it outlives the launcher (DESIGN.md rule 4).  The
rank's processes are its process group plus every descendant of the
watchdog (it is a child subreaper, so orphans come back to it even when
they ``setsid`` away from the group).

* stdin is the launcher's lifeline (a pipe, or the SSH channel).  A line
  ``<signal number>`` signals every process of the rank; EOF means the
  launcher is gone: SIGTERM them, wait GRACE_S, SIGKILL them.
* when the program exits, its status is reported at once as ``<status>\\n``
  (a signal as -N) on STATUS_FD, a pipe of the launcher (or the agent) that
  the program never sees (close-on-exec), so no output can forge it; the
  launcher learns which rank failed first without waiting for the cleanup.
  Then whatever the program left behind is terminated, and the watchdog
  exits (128 + N for a signal).

Stdlib only and self-contained: over SSH it travels as text on stdin
(``BOOTSTRAP`` below), followed by the rank's spec as JSON (argv,
environment, working directory), so remote hosts need no dtrain and the
environment never meets the command line's length limit or sshd's
AcceptEnv.

On the launcher's own machine one ``serve()`` process (the local
agent, ``serve`` below) forks every local rank's watchdog: a fork of a
small idle interpreter instead of a new interpreter per rank (about 25 ms of
CPU each).  Each forked watchdog is the same as one started alone: its own
session, subreaper, lifeline, pipes and status pipe, all created by the
launcher and handed over on a Unix socket (SCM_RIGHTS).
"""

import _signal  # type: ignore[import-not-found]  # (CPython's; no stub)
import _thread
import errno
import os
import sys
import time

TYPE_CHECKING = False  # typing is not imported at run time: each watchdog starts faster
if TYPE_CHECKING:
    import _socket
    from collections.abc import Mapping
    from typing import Any

PR_SET_CHILD_SUBREAPER = 36
# ``_signal``, not ``signal``: the module ``signal`` turns its numbers into enums as it loads
# (``enum``, ``functools``, ``collections``: about 5 ms of the local agent's start, and of
# every watchdog started alone), and its wrapper turns them into enums and back at every
# call (a third of a millisecond of each watchdog the local agent forks).  The C module
# takes and gives plain numbers.
set_handler = _signal.signal
SIGTERM: int = _signal.SIGTERM
SIGINT: int = _signal.SIGINT
SIGHUP: int = _signal.SIGHUP
SIGKILL: int = _signal.SIGKILL
SIGCHLD: int = _signal.SIGCHLD
SIGPIPE: int = _signal.SIGPIPE
SIGXFSZ: int = _signal.SIGXFSZ
POLL_S = 0.05
LENGTH_DIGITS = 10
STOP_SIGNALS = (SIGTERM, SIGINT, SIGHUP)

# ``python -c BOOTSTRAP`` reads a length-prefixed program from stdin and runs it.
BOOTSTRAP = (
    "import os\n"
    "def read_exact(n):\n"
    "    b = b''\n"
    "    while len(b) < n:\n"
    "        c = os.read(0, n - len(b))\n"
    "        if not c:\n"
    "            os._exit(1)\n"
    "        b += c\n"
    "    return b\n"
    "exec(compile(read_exact(int(read_exact(10))), 'dtrain-remote', 'exec'),"
    " {'__name__': '__dtrain_remote__', 'read_exact': read_exact})\n"
)

pending: list[int] = []  # stop signals that arrived before the program started
child_pid = 0
status_fd = -1  # where the program's status goes (-1: nowhere)


def frame(payload: bytes) -> bytes:
    """``payload`` prefixed by its length, as ``read_exact`` expects it."""
    return b"%010d" % len(payload) + payload


def read_exact(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit(1)
        data += chunk
    return data


def on_stop_signal(signum: int, frame: object) -> None:
    """A handler, not SIG_IGN (which exec would pass on to the program).

    A signal aimed at the whole group reaches the program by itself; one that
    came before the program existed is passed on once it does.
    """
    if not child_pid:
        pending.append(signum)


subreaper = False  # orphans of the rank come back to us
libc: "Any" = None  # ctypes' handle on the C library, once loaded (the local agent preloads it)


def load_libc() -> "Any":
    global libc
    if libc is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        getattr(libc, "prctl", None)  # looked up once: the watchdogs the agent forks share it
    return libc


def become_subreaper() -> None:
    global subreaper
    try:
        subreaper = load_libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        pass


def has_children() -> bool:
    """Any child of ours (of any of our threads), zombies included; True when unknown."""
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children", "rb") as f:
                if f.read().strip():
                    return True
    except OSError:
        return True  # no such file (CONFIG_PROC_CHILDREN): look the long way
    return False


def rank_processes(pgid: int) -> list[int]:
    """Live processes of the rank: the group and our descendants, without us."""
    # Every process of the group descends from us (the group lives in our session), and
    # as a subreaper we adopt the orphans: no child means nothing left, without reading
    # every process of the machine.
    if subreaper and not has_children():
        return []
    me = os.getpid()
    parent: dict[int, int] = {}
    members: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 3 or fields[0] == b"Z":
            continue
        pid = int(entry)
        parent[pid] = int(fields[1])
        if int(fields[2]) == pgid:
            members.add(pid)
    for pid in parent:
        ancestor, hops = parent.get(pid, 0), 0
        while ancestor > 1 and hops < 64:
            if ancestor == me:
                members.add(pid)
                break
            ancestor, hops = parent.get(ancestor, 0), hops + 1
    members.discard(me)
    return sorted(members)


def signal_all(pgid: int, signum: int) -> None:
    for pid in rank_processes(pgid):
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def reap_any() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def end_leftovers(pgid: int, grace_s: float) -> None:
    """SIGTERM what the program left behind, then SIGKILL after ``grace_s``."""
    if not rank_processes(pgid):
        return
    signal_all(pgid, SIGTERM)
    deadline = time.monotonic() + grace_s
    while rank_processes(pgid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        reap_any()
    # SIGKILL until nothing is left: a leftover that forks while it is being killed leaves
    # children (new pids, orphaned to us, the subreaper) that one round would miss.
    deadline = time.monotonic() + KILL_ROUNDS_S
    while True:
        signal_all(pgid, SIGKILL)
        reap_any()
        if not rank_processes(pgid) or time.monotonic() > deadline:
            return
        time.sleep(POLL_S)


KILL_ROUNDS_S = 10.0  # SIGKILL rounds for leftovers that keep forking, at most


def watch_control(pgid: int, grace_s: float) -> None:
    """Follow the launcher's lifeline: signal numbers to pass on, EOF to end everything."""
    buf = b""
    while True:
        try:
            chunk = os.read(0, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                signum = int(line)
                signal_all(pgid, signum)
                if signum == SIGKILL:
                    os.killpg(pgid, SIGKILL)  # this process included
            except (ValueError, OSError):
                continue
    signal_all(pgid, SIGTERM)
    time.sleep(grace_s)
    signal_all(pgid, SIGKILL)
    os.killpg(pgid, SIGKILL)


# The launcher's variables that name a folder, or a file whose folder must be there.
FOLDER_VARIABLES = ("DTRAIN_CHECKPOINT_DIR",)
FILE_VARIABLES = ("DTRAIN_METRICS_FILE", "TORCHELASTIC_ERROR_FILE")


def make_named_folders(env: "Mapping[str, str]") -> None:
    """Make the folders the launcher's variables name, before the program can write there
    (on every host: a remote one has no job directory of its own).  A folder the user named
    (``--checkpoint-dir``) that cannot be made fails the rank's start, naming the variable,
    rather than the program's first save; one dtrain chose (in the launcher's job directory,
    a path that may mean nothing on this host) is said and the rank starts: a program that
    never saves there must not fail for it."""
    for name in FOLDER_VARIABLES + FILE_VARIABLES:
        path = env.get(name)
        folder = (path if name in FOLDER_VARIABLES else os.path.dirname(path)) if path else ""
        if not folder or os.path.isdir(folder):
            continue
        try:
            make_private_folders(os.path.normpath(folder))
        except OSError as exc:
            in_the_way = os.path.exists(folder) and not os.path.isdir(folder)
            why = "a file is in the way" if in_the_way else exc.strerror or str(exc)
            if not named_by_the_user(name, folder, env):
                os.write(2, f"dtrain: warning: cannot create {name} {folder}: {why}\n".encode())
                continue
            os.write(2, f"dtrain: cannot create {name} {folder}: {why}\n".encode())
            not_started(126)
    make_error_file(env.get("TORCHELASTIC_ERROR_FILE"))


def make_error_file(path: "str | None") -> None:
    """torch's ``@record`` writes its error file with ``open(path, "w")``, as the umask
    makes it (0644): made here first, empty and 0600, it keeps that mode (the launcher reads
    an empty one as none written).  One already there is left as it is."""
    if not path:
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        os.close(os.open(path, flags, 0o600))
    except OSError:
        pass  # (there already, or no folder for it: torch says so when it writes)


def named_by_the_user(name: str, folder: str, env: "Mapping[str, str]") -> bool:
    """``--checkpoint-dir``'s folder; not the default, the job directory's ``<job id>/
    checkpoints``, nor the folders of files dtrain names."""
    default = os.path.join(env.get("DTRAIN_JOB_ID") or "\0", "checkpoints")
    return name == "DTRAIN_CHECKPOINT_DIR" and not os.path.normpath(folder).endswith(default)


def make_private_folders(path: str) -> None:
    """``path`` and every missing folder above it, each 0700 (as the job directory: what
    the program keeps there is the user's).  Ranks of a host start at once: a folder that
    another made meanwhile is no error."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        make_private_folders(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):  # a file: the folders below it cannot be
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None


def start_program(argv: list[str], env: "Mapping[str, str]") -> int:
    """Start the program with the environment ``env`` in our group (``posix_spawnp``: a
    vfork, not a copy of this interpreter); its pid.  When it cannot start, this says why
    on the rank's stderr and ends the watchdog as a shell would: 127 not found, 126 not
    runnable."""
    make_named_folders(env)
    cpus = env.get("DTRAIN_CPUS")  # --bind-to: we are the rank's; the program inherits it
    if cpus:
        try:
            os.sched_setaffinity(0, [int(cpu) for cpu in cpus.split(",")])
        except (OSError, ValueError) as exc:
            os.write(2, f"dtrain: cannot bind to CPUs {cpus}: {exc}\n".encode())
            not_started(126)
    if env is not os.environ and env.get("PATH") != os.environ.get("PATH"):
        # posix_spawnp looks the program up on our own PATH: the rank's, as its shell would.
        if "PATH" in env:
            os.environ["PATH"] = env["PATH"]
        else:
            os.environ.pop("PATH", None)
    try:
        return os.posix_spawnp(
            argv[0],
            argv,
            env,
            # Python ignores SIGPIPE and SIGXFSZ; the program must get the defaults.
            setsigdef=(*STOP_SIGNALS, SIGPIPE, SIGXFSZ),
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
        )
    except OSError as exc:
        os.write(2, f"dtrain: cannot run {argv[0]!r}: {exc.strerror}\n".encode())
        not_started(127 if isinstance(exc, FileNotFoundError) else 126)
    return 0  # not reached


def not_started(code: int) -> None:
    """The program could not start: nothing of the rank runs; end with ``code``."""
    report(code)
    os._exit(code)


def status_of(wait_status: int) -> int:
    """A wait status as the launcher counts it: exit code, or -N for signal N."""
    if os.WIFSIGNALED(wait_status):
        return -os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status)


def report(status: int) -> None:
    """The program's status, out of band; closing the pipe says that no other will come."""
    if status_fd >= 0:
        try:
            os.write(status_fd, str(status).encode() + b"\n")
            os.close(status_fd)
        except OSError:
            pass


def main(args: list[str]) -> None:
    if len(args) < 4 or args[2] != "--":
        os.write(2, b"usage: watchdog.py GRACE_S STATUS_FD -- PROGRAM [ARGS...]\n")
        os._exit(2)
    watch(args[3:], float(args[0]), int(args[1]))


def main_remote() -> None:
    """Spec from stdin: {"argv", "env", "unset", "cwd", "path_prefix", "grace_s", "status_fd"}."""
    import json

    spec = json.loads(read_exact(int(read_exact(LENGTH_DIGITS))))
    fd = int(spec.get("status_fd", -1))
    enter_remote_spec(spec, fd)
    watch(spec["argv"], float(spec["grace_s"]), fd)


def enter_remote_spec(spec: "dict[str, Any]", status_fd: int) -> None:
    """A remote rank's environment (the host's, less ``unset``, plus ``env``, ``path_prefix``
    in front of PATH) and working directory; one it cannot enter fails the rank (exit 2)."""
    for name in spec.get("unset", ()):
        os.environ.pop(name, None)
    os.environ.update(spec.get("env", {}))
    if spec.get("path_prefix"):
        os.environ["PATH"] = spec["path_prefix"] + os.pathsep + os.environ.get("PATH", "")
    if spec.get("cwd"):
        try:
            os.chdir(spec["cwd"])
        except OSError as exc:
            os.write(2, f"dtrain: cannot enter {spec['cwd']}: {exc.strerror}\n".encode())
            if status_fd >= 0:
                os.write(status_fd, b"2\n")
            os._exit(2)


TREES_MARK = ".dtrain-trees"  # (remote/syncrecv.py's) beside every tree of a --sync cache
held_trees: "dict[str, int]" = {}  # --sync: each tree a rank of this agent uses, locked


def hold_tree(cwd: "str | None") -> None:
    """--sync: a shared ``flock`` on the synced tree ``cwd`` is in (the folder beside a
    ``TREES_MARK``), held by the agent for the job's life, so that no later sync prunes it:
    prune locks a tree exclusively without waiting, and skips it when it cannot.  (A mark
    planted elsewhere costs a shared lock on a folder of the rank's path: nothing.)"""
    path = os.path.abspath(cwd or "/")
    while path != "/" and not os.path.isfile(os.path.join(os.path.dirname(path), TREES_MARK)):
        path = os.path.dirname(path)
    if path != "/" and path not in held_trees:
        import fcntl

        try:  # (a tree gone or being removed: the rank cannot enter it, and says so)
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            held_trees[path] = os.open(path, flags)
            for _ in range(40):  # a prune's lock lasts a moment: waited out, 2 s at most
                try:  # (never a blocking wait: a lock another holds for good is no hang)
                    return fcntl.flock(held_trees[path], fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    time.sleep(0.05)
        except OSError:
            pass


def take_pipes(fds: "list[int] | tuple[int, ...]") -> int:
    """In a forked watchdog: the lifeline, stdout and stderr become fds 0-2 and every other
    fd but the status pipe is closed (the parent's pipes, sockets, selector); the status fd."""
    lifeline, out, err, status = fds
    for fd, target in ((lifeline, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2 and int(name) != status:
            try:
                os.close(int(name))
            except OSError:
                pass  # the directory's own fd
    return status


def watch(argv: list[str], grace_s: float, fd: int, env: "Mapping[str, str] | None" = None) -> None:
    """Start the program (``argv``; its environment ``env``, else ours) and watch it to its
    end and that of what it left; report its status on ``fd``; exit."""
    global child_pid, status_fd
    status_fd = fd
    if status_fd >= 0:
        os.set_inheritable(status_fd, False)  # the program must not be able to write it
    for signum in STOP_SIGNALS:
        set_handler(signum, on_stop_signal)
    if os.getsid(0) != os.getpid():
        os.setsid()
    pgid = os.getpgid(0)
    become_subreaper()
    child_pid = start_program(argv, os.environ if env is None else env)
    for early in pending:
        signal_all(pgid, early)
    # (_thread, not threading: a C module, nothing to import in each forked watchdog)
    _thread.start_new_thread(watch_control, (pgid, grace_s))
    while True:
        pid, wait_status = os.waitpid(-1, 0)
        if pid == child_pid:
            break
    status = status_of(wait_status)
    report(status)
    end_leftovers(pgid, grace_s)
    os._exit(128 - status if status < 0 else status)


SPAWN_FDS = 4  # per rank, from the launcher: lifeline, stdout, stderr, status pipe


def serve() -> None:
    """``watchdog.py --serve``: fork a watchdog for each request on stdin (a Unix socket).

    A request is a length-prefixed ``marshal`` of ``{"argv", "env", "cwd", "grace_s"}``
    (the launcher runs this same interpreter) carrying the rank's four pipe ends; the
    answer is ``<pid>\\n`` (or ``! <error>\\n``), and when a watchdog exits,
    ``x <pid> <status>\\n``.  EOF on the socket (the launcher closed it or died) ends the
    server; the watchdogs go on, each held by its own lifeline.

    Only C modules are loaded here (``_socket``, ``select``, ``marshal``, ``array``; not
    ``socket``, ``selectors``, ``json``, which pull in ``enum`` and ``re``): the agent is
    ready in about half the time, and the launcher's first rank need not wait for it.
    """
    import _socket
    import array  # noqa: F401  (now, not at the first rank: a library, and collections.abc)
    import select

    try:
        load_libc()
    except OSError:
        pass
    sock = _socket.socket(fileno=0)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    _signal.set_wakeup_fd(wake_write)
    set_handler(SIGCHLD, lambda signum, frame: None)  # wakes the poll
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    try:
        while True:
            for fd, _ in poller.poll():
                if fd == wake_read:
                    os.read(wake_read, 4096)
                    report_exits(sock)
                    continue
                request = receive_request(sock)
                if request is None:
                    os._exit(0)
                sock.sendall(spawn(*request, sock))
    except OSError:  # the launcher is gone (a reset, a broken pipe): as at EOF, quietly
        os._exit(0)


def spawn(spec: "dict[str, Any]", fds: "list[int]", sock: "_socket.socket") -> bytes:
    """Fork the rank's watchdog; the answer for the launcher (its pid, or why not)."""
    try:
        pid = os.fork()
    except OSError as exc:
        answer = b"! %s\n" % str(exc).encode()
    else:
        if pid == 0:
            try:
                become_watchdog(spec, fds, sock)  # (never returns)
            except BaseException as exc:  # this fork must never go on as a second agent
                os.write(2, f"dtrain: the rank's watchdog failed: {exc!r}\n".encode())
            os._exit(126)
        answer = b"%d\n" % pid
    for fd in fds:
        os.close(fd)  # the watchdog's now: no other process may hold its pipes
    return answer


def report_exits(sock: "_socket.socket") -> None:
    """Reap the watchdogs that exited and tell the launcher their statuses."""
    try:
        while True:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            sock.sendall(b"x %d %d\n" % (pid, status_of(wait_status)))
    except ChildProcessError:
        return


def receive_request(sock: "_socket.socket") -> "tuple[dict[str, Any], list[int]] | None":
    """One request and its file descriptors; None at EOF (``socket.recv_fds``, in C parts)."""
    import _socket
    import array
    import marshal

    fds = array.array("i")
    header, ancillary, _, _ = sock.recvmsg(
        LENGTH_DIGITS, _socket.CMSG_LEN(SPAWN_FDS * fds.itemsize)
    )
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if not header:
        return None
    while len(header) < LENGTH_DIGITS:
        header += sock.recv(LENGTH_DIGITS - len(header))
    size, body = int(header), b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return marshal.loads(body), list(fds)


def become_watchdog(spec: "dict[str, Any]", fds: "list[int]", sock: "_socket.socket") -> None:
    """In the forked child: take the rank's pipes and environment, then watch its program."""
    try:
        _signal.set_wakeup_fd(-1)
        set_handler(SIGCHLD, _signal.SIG_DFL)
        sock.detach()  # fd 0, replaced by the lifeline
        status = take_pipes(fds)
        # The rank's environment goes to the program as it is: rewriting os.environ here
        # (clear, then update) costs a forked watchdog about 1 ms of CPU for nothing.
        if spec.get("cwd"):
            os.chdir(spec["cwd"])
    except OSError as exc:
        os.write(2, f"dtrain: cannot start the rank: {exc}\n".encode())
        os._exit(126)
    watch(spec["argv"], float(spec["grace_s"]), status, spec["env"])


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    main(sys.argv[1:])
elif __name__ == "__dtrain_remote__":
    main_remote()
