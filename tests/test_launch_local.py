"""A local launch loads and does only what it uses (issue 28, "Local launch"): the other
commands' modules stay unloaded, the collector leaves start-up and the job's modules alone,
the local agent loads no enum, a forked watchdog hands the rank its environment as it is,
and the agent's end is awaited without polling.  What each saves is measured by
benchmarks/launch_local.py, not here."""

from __future__ import annotations

import gc
import json
import marshal
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.base.interpreter import loading
from launcher.cli.main import cli
from launcher.remote import watchdog
from launcher.transport.localagent import LocalAgent, Spawned
from tests.conftest import child_env, run_dtrain, tagged

OTHER_COMMANDS = (
    "launcher.cli.jobcmds",
    "launcher.cli.hostcmds",
    "launcher.cli.sweepcmd",
    "launcher.cli.exportcmd",
)


def test_a_plain_local_launch_loads_no_other_command_and_no_hashing(tmp_path: Path) -> None:
    code = (
        "import gc, io, json, os, sys, contextlib\n"
        "spawn, at_agent = os.posix_spawn, []\n"
        "def watched(path, argv, *args, **kwargs):\n"  # what was loaded when the agent started
        "    if '-S' in argv: at_agent.append(sorted(sys.modules))\n"
        "    return spawn(path, argv, *args, **kwargs)\n"
        "os.posix_spawn = watched\n"
        "from launcher.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = main(['run', '-np', '2', '--plain', '--job-dir', {str(tmp_path / 'jobs')!r},"
        " 'true'])\n"
        "    frozen_after_job, modules = gc.get_freeze_count(), sorted(sys.modules)\n"
        "    main(['run', '--dry-run', '-np', '2', 'true'])\n"
        "print(json.dumps({'code': code, 'modules': modules, 'at_agent': at_agent,\n"
        "    'collecting': gc.isenabled(), 'frozen': [frozen_after_job, gc.get_freeze_count()]}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,  # (no project file here: tomllib would load string)
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0
    loaded = set(seen["modules"])
    assert "launcher.loop.supervisor" in loaded  # (the job did run here)
    # (shlex, base64 and string load where a remote host, a rank's result or --tag-format
    # needs them; hashlib with --sync)
    unused = {*OTHER_COMMANDS, "hashlib", "_hashlib", "shlex", "base64", "string"}
    assert sorted(loaded & unused) == []
    # The local agent started before the job's modules, and before socket and signal (the
    # agent's start-up runs while they load).
    [at_agent] = seen["at_agent"]
    assert sorted(set(at_agent) & {"socket", "signal", "launcher.run.job"}) == []
    # The collector is back, and what start-up froze was given back at the job's end (and
    # after a dry run, which starts no rank).
    assert seen["collecting"] is True
    assert seen["frozen"] == [0, 0]


def run_python(code: str, *flags: str) -> str:
    """The last line ``code`` printed, run in a new interpreter (the test's environment)."""
    out = subprocess.run(
        [sys.executable, *flags, "-c", code],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_start_up_loads_with_the_collector_off_and_gives_it_back() -> None:
    code = (
        "import gc, json, sys\n"
        "during = []\n"
        "def seen(phase, info):\n"  # a collection while codecache.py's imports load
        "    cache = sys.modules.get('launcher.base.codecache')\n"
        "    if phase == 'start' and cache is not None and not hasattr(cache, 'install'):\n"
        "        during.append(info['generation'])\n"
        "gc.callbacks.append(seen)\n"
        "import launcher\n"
        "api = [gc.isenabled(), gc.get_freeze_count()]\n"  # a program's import: as it was
        "gc.collect()\n"
        "later = []\n"
        "gc.callbacks.append(lambda phase, info: phase == 'start' and later.append(1))\n"
        "from launcher.cli import entry\n"
        "main = entry.load_cli()\n"  # the dtrain command: click, the commands, the options
        "print(json.dumps({'during': during, 'api': api, 'later': later,\n"
        "    'after': [gc.isenabled(), gc.get_freeze_count() > 0, hasattr(main, 'run_main')]}))\n"
    )
    seen = json.loads(run_python(code))
    assert seen["during"] == []
    assert seen["api"] == [True, 0]  # (nothing frozen for a program that imports dtrain)
    assert seen["later"] == []
    assert seen["after"] == [True, True, True]


def test_the_local_agent_loads_no_enum() -> None:
    from launcher.transport.localagent import SERVE

    # What the agent loads before it serves (serve() adds C modules only).
    code = SERVE.replace(
        "watchdog.serve()",
        "watchdog.load_libc(); print(sorted({'enum', 'signal', 're'} & set(sys.modules)))",
    )
    assert code != SERVE
    assert run_python(code, "-I", "-S") == "[]"


def test_the_other_commands_load_when_named_or_listed() -> None:
    assert set(cli.list_commands(None)) >= {"logs", "jobs", "top", "check", "sweep", "export"}  # type: ignore[arg-type]
    assert cli.get_command(None, "jobs").name == "jobs"  # type: ignore[arg-type, union-attr]
    assert cli.get_command(None, "no-such-command") is None  # type: ignore[arg-type]
    assert {"logs", "hosts", "sweep", "export", "run", "ps"} <= set(cli.commands)
    help_text = run_dtrain("--help").stdout
    for name in ("logs", "stop", "stacks", "top", "hosts", "check", "sweep", "export"):
        assert f"\n  {name} " in help_text
    result = run_dtrain("jobs", "--help")
    assert result.returncode == 0 and "--prune" in result.stdout


def test_the_job_modules_load_without_collections_then_stay_out_of_them() -> None:
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    was_frozen = gc.get_freeze_count()
    gc.callbacks.append(count)
    try:
        with loading(freeze=True):
            assert not gc.isenabled()
            kept = [[i] for i in range(5000)]  # more than a collection's threshold
        assert gc.isenabled()
        assert collections == []
        assert gc.get_freeze_count() >= was_frozen + len(kept)
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()


def test_what_start_up_froze_is_given_back_on_every_way_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from launcher.cli.main import main

    gc.unfreeze()
    try:
        # Refused after the job's modules loaded (a -H list split in two): no job ran.
        assert main(["run", "-H", "h1:1,h2:1", "h3:1,h4:1", "true"]) == 2
        assert "was taken as the program" in capsys.readouterr().err
        assert gc.get_freeze_count() == 0
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_forked_watchdog_gives_the_program_its_environment_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[tuple[str, list[str], object]] = []

    def posix_spawnp(path: str, argv: list[str], env: object, **_: object) -> int:
        spawned.append((path, argv, env))
        return 42

    monkeypatch.setattr(os, "posix_spawnp", posix_spawnp)
    monkeypatch.setenv("PATH", "/agent/bin")
    monkeypatch.setenv("DTRAIN_LAUNCH_TEST_AGENT_ONLY", "1")
    folder = tmp_path / "ckpt" / "a"
    env = {"PATH": "/rank/bin", "DTRAIN_CHECKPOINT_DIR": str(folder), "ONLY_THE_RANK": "1"}
    assert watchdog.start_program(["prog"], env) == 42
    assert spawned == [("prog", ["prog"], env)]  # the rank's own mapping, nothing added
    assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700
    # posix_spawnp looks the program up on the watchdog's PATH: the rank's now; the rest
    # of the watchdog's own environment is left as it was.
    assert os.environ["PATH"] == "/rank/bin"
    assert os.environ["DTRAIN_LAUNCH_TEST_AGENT_ONLY"] == "1"
    assert "ONLY_THE_RANK" not in os.environ
    del env["PATH"]
    watchdog.start_program(["prog"], env)
    assert "PATH" not in os.environ  # (none: the C library's default, as with no PATH)


def test_a_local_rank_runs_the_program_its_own_path_finds(tmp_path: Path) -> None:
    for folder in ("launcher-path", "rank-path"):  # the same name in both
        program = tmp_path / folder / "which-one"
        program.parent.mkdir()
        program.write_text(f'#!/bin/sh\necho "{folder} $RANK $ONLY_FOR_RANKS"\n')
        program.chmod(0o755)
    env = child_env()
    env["PATH"] = f"{tmp_path / 'launcher-path'}{os.pathsep}{env['PATH']}"
    rank_path = f"{tmp_path / 'rank-path'}{os.pathsep}{env['PATH']}"
    result = run_dtrain(
        "run", "-np", "2", "--plain", "-x", f"PATH={rank_path}", "-x", "ONLY_FOR_RANKS=yes",
        "which-one", env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [tagged(result.stdout, rank) for rank in (0, 1)]
    assert rows == [["rank-path 0 yes"], ["rank-path 1 yes"]]


def test_the_agent_is_awaited_until_it_exits_not_longer() -> None:
    stdin = os.open(os.devnull, os.O_RDONLY)
    try:
        quick = Spawned(["/bin/sh", "-c", "exit 3"], stdin, os.environ)
        slow = Spawned(["/bin/sh", "-c", "exec sleep 30"], stdin, os.environ)
    finally:
        os.close(stdin)
    assert quick.wait(30) == 3  # (woken by its exit: a pidfd)
    try:
        assert slow.wait(0.01) is None  # still there when the time is up
    finally:
        slow.kill()
    assert slow.wait(30) == -signal.SIGKILL


def test_a_watchdog_that_fails_to_start_exits_and_the_agent_goes_on(tmp_path: Path) -> None:
    agent = LocalAgent(sys.executable, child_env())
    try:
        pids = []
        for cwd in ("no\0such folder", str(tmp_path)):  # ValueError, then a good one
            pipes = [os.pipe() for _ in range(4)]
            body = marshal.dumps({"argv": ["true"], "env": {}, "cwd": cwd, "grace_s": 1.0})
            theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
            ticket = agent.request(body, theirs)
            for fd in theirs:
                os.close(fd)
            pids.append(ticket.pid())
            stderr = read_to_end(pipes[2][0])
            for fd in (pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]):
                os.close(fd)
            if cwd.startswith("no"):
                assert b"the rank's watchdog failed" in stderr
        # The fork that failed exited (no second agent on the socket); the next one ran.
        assert [agent.wait_exit(pid, 30) for pid in pids] == [126, 0]
    finally:
        agent.close()


def read_to_end(fd: int) -> bytes:
    """What a pipe carries until every writer closed it."""
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    return data
