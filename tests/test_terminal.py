"""What a person sees on a real terminal (a pty of 80 columns and 30 rows): 40 ranks drawing
progress bars, the Ctrl-C hint, the status line's width."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import DTRAIN, JOBS, REPO, child_env, py, wait_until_gone
from tests.testhosts import TestHosts

pytestmark = pytest.mark.timeout(120)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def on_terminal(
    args: list[str],
    columns: int = 80,
    rows: int = 30,
    interrupt_after: str | tuple[str, ...] | None = None,
    again_after: str | None = None,
    keep_escapes: bool = False,
    stderr_path: Path | None = None,
) -> tuple[int, str]:
    """Run dtrain on a pty of that size; send SIGINT (Ctrl-C) once ``interrupt_after`` shows
    (each of them, if several), and again once ``again_after`` shows after that.  The screen
    comes back without its escape sequences unless ``keep_escapes``.  ``stderr_path``:
    dtrain's stderr goes to that file, not to the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {**child_env(), "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    err = open(stderr_path, "wb") if stderr_path is not None else None  # noqa: SIM115
    proc = subprocess.Popen(
        [*DTRAIN, *args],
        stdin=slave,
        stdout=slave,
        stderr=err if err is not None else slave,
        env=env,
        cwd=REPO,
    )
    os.close(slave)
    if err is not None:
        err.close()
    screen, sent, seen = b"", interrupt_after is None, 0
    awaited = (interrupt_after,) if isinstance(interrupt_after, str) else interrupt_after or ()
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the terminal closed with the last process on it
            break
        if not chunk:
            break
        screen += chunk
        shown = ANSI.sub("", screen.decode("utf-8", "replace")) if not sent else ""
        if not sent and all(text in shown for text in awaited):
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
            sent, seen = True, len(screen)
        elif (
            again_after is not None
            and sent
            and interrupt_after is not None
            and again_after.encode()
            in ANSI.sub("", screen[seen:].decode("utf-8", "replace")).encode()
        ):
            proc.send_signal(signal.SIGINT)
            again_after = None
    os.close(master)
    text = screen.decode("utf-8", "replace")
    return proc.wait(timeout=60), text if keep_escapes else ANSI.sub("", text)


BARS = (
    "import os, sys, time\n"
    "rank = int(os.environ['RANK'])\n"
    "for i in range(0, 101, 10):\n"
    "    bar = f'\\repoch 1: {min(100, i + rank)}% |' + '#' * (i // 10)\n"
    "    sys.stdout.write(bar); sys.stdout.flush()\n"
    "    time.sleep(0.25)\n"
    "print(); print('done', flush=True)\n"
)


def test_forty_ranks_of_progress_bars_fit_the_terminal(mark: str) -> None:
    code, screen = on_terminal(
        ["run", "-np", "40", "--oversubscribe", "-x", f"DTRAIN_TEST_MARK={mark}", *py(BARS)]
    )
    assert code == 0, screen[-2000:]
    # One summary line for the bars, never forty rows: min, median, max, the slowest named.
    summaries = re.findall(
        r"progress of (\d+) ranks: min \d+% \(rank \d+\), median \d+%, max", screen
    )
    assert summaries and max(map(int, summaries)) > 8, screen[-3000:]
    lines = screen.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    run = longest = 0  # bar rows drawn one after the other: a frame of the live area
    for line in lines:
        is_bar = re.search(r"\[\d+\] epoch 1: \d+% \|#*$", line) and "100%" not in line
        run = run + 1 if is_bar else 0
        longest = max(longest, run)
    assert longest <= 8  # never a row per rank: at most 8, else the summary
    status = [ln for ln in lines if re.match(r"dtrain(?: \S+)?: \d+/40 running", ln)]
    live = status + [ln for ln in lines if ln.startswith("progress of")]
    assert live and all(len(line) <= 80 for line in live), max(live, key=len)
    # The last status line, printed as the job ends, fits too and keeps what matters.
    assert re.fullmatch(r"dtrain: 0/40 running  exited 40 \(failed 0, stopped 0\)  .*", status[-1])
    done = [re.fullmatch(r"\[([\d,-]+)\] done", line) for line in lines]
    assert sorted(r for m in done if m for r in expand_ranks(m[1])) == list(range(40))
    assert wait_until_gone(mark) == []


def expand_ranks(text: str) -> list[int]:
    """``0-3,5`` -> [0, 1, 2, 3, 5]: the ranks of a collapsed line's tag."""
    ranks: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


# Every rank waits for all to start (a file each in a shared folder), then says the same
# warning (with its own logging timestamp), a line of its own, and the same closing line.
SAME_WARNING = (
    "import logging, os, sys, time\n"
    "rank, size, room = int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), sys.argv[1]\n"
    "open(os.path.join(room, str(rank)), 'w').close()\n"
    "while len(os.listdir(room)) < size: time.sleep(0.01)\n"
    "logging.basicConfig(format='%(asctime)s %(levelname)s %(message)s')\n"
    "logging.warning('numpy is not available: some features are disabled')\n"
    "time.sleep(0.05)\n"
    "print(f'loss of rank {rank}: {rank / 10:.2f}', flush=True)\n"
    "time.sleep(0.05)\n"
    "print('epoch 1 done', flush=True)\n"
)


@pytest.mark.parametrize("collapse", [True, False])
def test_eight_ranks_saying_the_same_warning_show_it_once(
    mark: str, tmp_path: Path, collapse: bool
) -> None:
    args = ["run", "-np", "8", "--oversubscribe", "-x", f"DTRAIN_TEST_MARK={mark}"]
    if collapse:
        args += ["--collapse-window", "3"]  # a loaded machine may start ranks far apart
    else:
        args += ["--no-collapse"]
    code, screen = on_terminal([*args, *py(SAME_WARNING), str(tmp_path)])
    assert code == 0, screen[-2000:]
    lines = screen.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    warnings = [ln for ln in lines if "numpy is not available" in ln]
    losses = sorted(ln for ln in lines if "loss of rank" in ln)
    assert losses == [f"[{r}] loss of rank {r}: {r / 10:.2f}" for r in range(8)]  # never merged
    if collapse:
        assert len(warnings) == 1, warnings
        assert re.match(r"\[0-7\]<stderr> \d{4}-\d\d-\d\d [\d:,]+ WARNING numpy", warnings[0])
        assert [ln for ln in lines if ln.endswith("epoch 1 done")] == ["[0-7] epoch 1 done"]
    else:
        assert len(warnings) == 8
        assert sum(1 for ln in lines if ln.endswith("epoch 1 done")) == 8


# A rank's stderr line before the live region starts (LIVE_AFTER_S) and one after it.
CURSOR = re.compile(r"\x1b\[\?25[lh]")  # the live region hides the cursor, shows it at the end
EARLY_AND_LATE = (
    "import os, sys, time\n"
    "rank = os.environ['RANK']\n"
    "print('early stderr', rank, file=sys.stderr, flush=True)\n"
    "time.sleep(1.0)\n"
    "print('late stderr', rank, file=sys.stderr, flush=True)\n"
)


def test_stderr_lines_go_to_the_terminal_alike_before_and_after_the_live_region(
    mark: str, tmp_path: Path
) -> None:
    errors = tmp_path / "err.txt"
    code, screen = on_terminal(
        ["run", "--no-collapse", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}",
         *py(EARLY_AND_LATE)],
        keep_escapes=True,
        stderr_path=errors,
    )  # fmt: skip
    assert code == 0, screen[-2000:]
    assert "stderr" not in errors.read_text()  # dtrain's own lines only, none of a rank's
    lines = screen.replace("\r\n", "\n").split("\n")
    for rank in ("0", "1"):
        early = [ln for ln in lines if ln.endswith(f"early stderr {rank}")]
        late = [ln for ln in lines if ln.endswith(f"late stderr {rank}")]
        assert len(early) == len(late) == 1, screen
        # The same tag and mark, in the same colours (after what the live area draws: on a
        # busy machine the early line may come after it started, behind its hidden cursor).
        early_tag = CURSOR.sub("", early[0].split("\x1b[2K")[-1]).removesuffix(
            f"early stderr {rank}"
        )
        late_tag = CURSOR.sub("", late[0].split("\x1b[2K")[-1]).removesuffix(f"late stderr {rank}")
        assert ANSI.sub("", early_tag) == f"[{rank}]<stderr> "
        assert early_tag == late_tag


def test_a_few_bars_are_drawn_tagged_like_their_lines(mark: str) -> None:
    code, screen = on_terminal(["run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", *py(BARS)])
    assert code == 0, screen[-2000:]
    assert re.search(r"\[1\] epoch 1: \d+% \|", screen)  # a bar row with its rank's tag


def test_ctrl_c_says_what_it_does_and_how_to_hurry(mark: str) -> None:
    code, screen = on_terminal(
        [
            "run",
            "-np",
            "3",
            "-x",
            f"DTRAIN_TEST_MARK={mark}",
            *py("import os, time; print('up', os.environ['RANK'], flush=True); time.sleep(60)"),
        ],
        interrupt_after="[2] up 2",
    )
    assert code == 130
    assert "dtrain: stopping 3 rank(s) (grace 5 s); Ctrl-C again to kill now" in screen
    assert "dtrain: stopped 3 ranks\r\ndtrain: interrupted by SIGINT; dtrain exits 130" in screen
    assert wait_until_gone(mark) == []


def test_ctrl_c_twice_leaves_no_status_line_of_running_ranks(mark: str) -> None:
    stubborn = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', os.environ['RANK'], flush=True)\n"
        "time.sleep(60)\n"
    )
    code, screen = on_terminal(
        # A long grace: the second Ctrl-C, not the grace's end, must be what kills (a busy
        # machine once delayed it past the default 5 s).
        ["run", "-np", "3", "--grace", "60", "-x", f"DTRAIN_TEST_MARK={mark}", *py(stubborn)],
        # every rank up (SIGTERM ignored): one still starting would die of the first SIGTERM,
        # and the count killed at the second signal would be short (a busy machine, once)
        interrupt_after=("[0] up 0", "[1] up 1", "[2] up 2"),
        again_after="Ctrl-C again to kill now",
        keep_escapes=True,
    )
    plain = ANSI.sub("", screen)
    assert code == 130, plain
    assert "(3 with SIGKILL at the second signal)" in plain, plain
    assert "dtrain: interrupted by SIGINT; dtrain exits 130" in plain, plain
    ending = screen[screen.index("Ctrl-C again to kill now") :]
    # The live area redraws its status line in bold; the status line printed when the view
    # stops is plain: it said "3/3 running ..." above the summary, as the view was left at
    # the second Ctrl-C before the ranks' ends came.
    printed = re.findall(r"\x1b\[2K(?!\x1b\[1m)(dtrain(?: \S+)?: \d+/3 running[^\r\n]*)", ending)
    assert printed == [], ANSI.sub("", ending)
    assert wait_until_gone(mark) == []


@pytest.mark.sshhosts
def test_the_phase_line_counts_hosts_while_connecting(ssh_hosts: TestHosts, mark: str) -> None:
    code, screen = on_terminal(
        ["run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2,node3",
         "-x", f"DTRAIN_TEST_MARK={mark}", "true"]
    )  # fmt: skip
    assert code == 0, screen
    assert "dtrain: connecting to 3 host(s) over ssh" in screen
    assert "dtrain: starting agents: 3 of 3 hosts ready" in screen
    assert wait_until_gone(mark) == []


TICKS = (
    "import os, time\n"
    "while True:\n"
    "    print('tick', os.environ['RANK'], flush=True)\n"
    "    time.sleep(0.2)\n"
)
LIVE_ON = b"\x1b[?25l"  # rich hides the cursor while it draws the live region...
CURSOR_SHOWN = b"\x1b[?25h"  # ...and shows it again


class Screen:
    """dtrain on a pty of 80x30 (its stdin, stdout and stderr), what it drew read as it
    comes.  ``own_terminal``: the pty is its controlling terminal, as for a shell's job
    (closing it hangs dtrain up); else dtrain is a process group of its own, in ours (a
    shell's job in the foreground: Ctrl-Z stops it)."""

    def __init__(self, args: list[str], own_terminal: bool = False) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 80, 0, 0))
        env = {**child_env(), "TERM": "xterm-256color"}
        env.pop("COLUMNS", None)
        env.pop("LINES", None)
        self.proc = subprocess.Popen(
            [*DTRAIN, *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=REPO,
            start_new_session=own_terminal,
            process_group=None if own_terminal else 0,
            preexec_fn=take_terminal if own_terminal else None,
        )
        os.close(slave)
        self.seen = b""

    def read_until(self, done: Callable[[bytes], bool], timeout: float = 60.0) -> bytes:
        """Read what dtrain draws until ``done(all of it)``; all of it."""
        deadline = time.monotonic() + timeout
        while not done(self.seen):
            assert time.monotonic() < deadline, ANSI.sub("", self.seen.decode("utf-8", "replace"))
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: every process on the terminal has gone
                    chunk = b""
                assert chunk, f"dtrain's terminal closed: {self.seen[-500:]!r}"
                self.seen += chunk
        return self.seen

    def read_to_end(self, timeout: float = 60.0) -> bytes:
        """Read until every process on the terminal has gone."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    return self.seen
                if not chunk:
                    return self.seen
                self.seen += chunk
        raise AssertionError(f"the terminal is still open: {self.seen[-500:]!r}")

    def job_id(self) -> str:
        found = re.search(
            r"dtrain: job (\S+) \(", ANSI.sub("", self.seen.decode("utf-8", "replace"))
        )
        assert found, self.seen
        return found[1]


def take_terminal() -> None:
    """(In the child, a session leader now:) the pty on stdin becomes its terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def ticking(seen: bytes) -> bool:
    """The live region is drawn and both ranks print."""
    return LIVE_ON in seen and b"tick 0" in seen and b"tick 1" in seen


def close_terminal_of_running_job(args: list[str], ranks: int, mark: str) -> None:
    """The window closes, or the SSH session to the login node drops: dtrain is hung up
    (SIGHUP) and its terminal answers EIO from then on.  The view is dropped, the ranks are
    stopped in order, the job is recorded as interrupted, and dtrain exits 129."""
    screen = Screen(["run", *args, "-x", f"DTRAIN_TEST_MARK={mark}", *py(TICKS)], True)
    screen.read_until(lambda seen: LIVE_ON in seen and all(
        f"tick {rank}".encode() in seen for rank in range(ranks)))  # fmt: skip
    os.close(screen.master)  # the terminal goes away
    code = screen.proc.wait(timeout=60)
    status = json.loads((JOBS / screen.job_id() / "status.json").read_text())
    assert (code, status["state"], status["exit_code"]) == (129, "interrupted", 129), status
    assert status["result"]["interrupt"] == signal.SIGHUP
    assert status["result"]["stopped"] == ranks
    assert [rank["ended"] is not None for rank in status["ranks"].values()] == [True] * ranks
    assert wait_until_gone(mark) == []


def test_closing_the_terminal_ends_the_job_in_order(mark: str) -> None:
    close_terminal_of_running_job(["-np", "2"], 2, mark)


@pytest.mark.sshhosts
def test_closing_the_terminal_ends_a_job_over_ssh_in_order(ssh_hosts: TestHosts, mark: str) -> None:
    hosts = ["--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1:3,node2:3,node3:2"]
    close_terminal_of_running_job([*hosts, "-np", "8"], 8, mark)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] == b"T"


def test_ctrl_z_gives_the_cursor_back_and_fg_redraws(mark: str) -> None:
    """Ctrl-Z stops dtrain with the terminal as the shell needs it (the cursor shown, as
    ``less`` and ``top`` leave it); ``fg`` draws the live region again."""
    screen = Screen(["run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", *py(TICKS)])
    pid = screen.proc.pid
    try:
        screen.read_until(ticking)
        os.killpg(pid, signal.SIGTSTP)  # Ctrl-Z: the terminal's foreground group
        at_stop = screen.read_until(lambda seen: stopped(pid))
        assert at_stop.rfind(CURSOR_SHOWN) > at_stop.rfind(LIVE_ON), at_stop[-300:]
        os.killpg(pid, signal.SIGCONT)  # fg
        again = len(at_stop)
        screen.read_until(lambda seen: LIVE_ON in seen[again:] and b"running" in seen[again:])
        screen.proc.send_signal(signal.SIGINT)
        screen.read_to_end()
        assert screen.proc.wait(timeout=60) == 130
    finally:
        if screen.proc.poll() is None:
            os.killpg(pid, signal.SIGCONT)
            screen.proc.kill()
            screen.proc.wait()
        os.close(screen.master)
    assert wait_until_gone(mark) == []
