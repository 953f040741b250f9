"""The per-rank watchdog: ``python -I -S watchdog.py GRACE_S -- PROGRAM ARGS...``.

Runs in the rank's own session and process group, starts the program there
and makes sure nothing of it outlives the launcher (DESIGN.md rule 4):

* its stdin is a pipe from the launcher (or the SSH channel).  EOF means
  the launcher is gone: SIGTERM the group, wait GRACE_S, SIGKILL it.
  A line ``<signal number>`` on stdin signals the group (SSH cannot).
* when the program exits, whatever it left in the group is terminated too.
* it exits with the program's status; a program killed by a signal is
  mirrored by the watchdog dying from the same signal.

Stdlib only and self-contained: over SSH it travels as text on stdin
(``BOOTSTRAP`` below), followed by the rank's spec as JSON (argv,
environment, working directory), so remote hosts need no dtrain and the
environment never meets the command line's length limit or sshd's
AcceptEnv.  In that mode the final status is reported on stderr as
``STATUS_MARK<status>\n`` (sshd's exit-signal does not reach paramiko).
"""

import os
import signal
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.05
STATUS_MARK = b"\0DTRAIN_STATUS:"
LENGTH_DIGITS = 10

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
    "exec(compile(read_exact(int(read_exact(10))), 'dtrain-watchdog', 'exec'),"
    " {'__name__': '__dtrain_remote__'})\n"
)


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


def ignore(signum: int, frame: object) -> None:
    """Handler (not SIG_IGN, which exec would pass on to the program)."""


def become_subreaper() -> None:
    # Orphaned grandchildren are re-parented to us, so we can reap them.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def group_members(pgid: int) -> list[int]:
    """Pids of the processes in process group ``pgid`` other than this one."""
    me = os.getpid()
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


def reap_any() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def end_leftovers(pgid: int, grace_s: float) -> None:
    """SIGTERM what the program left in the group, then SIGKILL after ``grace_s``."""
    members = group_members(pgid)
    if not members:
        return
    for pid in members:
        signal_pid(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while members and time.monotonic() < deadline:
        time.sleep(POLL_S)
        reap_any()
        members = group_members(pgid)
    for pid in members:
        signal_pid(pid, signal.SIGKILL)
    reap_any()


def signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def watch_control(pgid: int, grace_s: float) -> None:
    """Follow the launcher's pipe: signal numbers to forward, EOF to end everything."""
    stdin = os.fdopen(0, "rb", buffering=0)
    buf = b""
    while True:
        try:
            chunk = stdin.read(4096)
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip().isdigit():
                os.killpg(pgid, int(line))
    os.killpg(pgid, signal.SIGTERM)
    time.sleep(grace_s)
    os.killpg(pgid, signal.SIGKILL)  # this process included


def start_program(argv: list[str]) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"dtrain: cannot run {argv[0]!r}: {exc.strerror}\n".encode())
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    return 0  # not reached


def exit_like(status: int, report: bool) -> None:
    """Exit with the program's wait status: same code, or death by the same signal.

    With ``report``, the status is also written on stderr (signals as -N)
    and a signal death becomes exit code 128 + N.
    """
    if report:
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)
        os.write(2, STATUS_MARK + str(code).encode() + b"\n")
        os._exit(128 - code if code < 0 else code)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the program's core, not ours
        except (ImportError, ValueError, OSError):
            pass
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(1)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


def main(args: list[str]) -> None:
    if len(args) < 3 or args[1] != "--":
        os.write(2, b"usage: watchdog.py GRACE_S -- PROGRAM [ARGS...]\n")
        os._exit(2)
    watch(args[2:], float(args[0]), report=False)


def main_remote() -> None:
    """Spec from stdin: {"argv", "env", "unset", "cwd", "path_prefix", "grace_s"}."""
    import json

    spec = json.loads(read_exact(int(read_exact(LENGTH_DIGITS))))
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
            exit_like(2 << 8, report=True)
    watch(spec["argv"], float(spec["grace_s"]), report=True)


def watch(argv: list[str], grace_s: float, report: bool) -> None:
    if os.getsid(0) != os.getpid():
        os.setsid()
    pgid = os.getpgid(0)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, ignore)
    become_subreaper()
    child = start_program(argv)
    threading.Thread(target=watch_control, args=(pgid, grace_s), daemon=True).start()
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    end_leftovers(pgid, grace_s)
    exit_like(status, report)


if __name__ == "__main__":
    main(sys.argv[1:])
elif __name__ == "__dtrain_remote__":
    main_remote()
