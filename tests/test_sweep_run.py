"""dtrain sweep end to end: real trials (each a dtrain job) on local slots and on the SSH test
hosts, queueing, failures, retries, Ctrl-C, --resume."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    DTRAIN,
    JOBS,
    REPO,
    child_env,
    dtrain_in_process,
    marked_pids,
    run_dtrain,
    start_dtrain,
    wait_for_pids,
    wait_until_gone,
)
from tests.testhosts import TestHosts

# A trial: says when it started, works 2 s, then x=3 fails; the others print a score and write
# JSON lines to $DTRAIN_METRICS_FILE.
TRIAL = """
import json, os, sys, time
x = int(sys.argv[1])
start = time.time()
print("metric: start=%.6f" % start, flush=True)
time.sleep(2)
if x == 3:
    print("no good", file=sys.stderr)
    sys.exit(5)
print("metric: score=%d end=%.6f" % (x * x, time.time()), flush=True)
with open(os.environ["DTRAIN_METRICS_FILE"], "a") as f:
    record = {"half": x / 2, "trial": int(os.environ["DTRAIN_TRIAL"])}
    f.write(json.dumps({**record, "px": os.environ["DTRAIN_PARAM_X"]}) + "\\n")
"""


def sweep_record(sweep_id: str) -> dict[str, Any]:
    return json.loads((JOBS / "sweeps" / sweep_id / "sweep.json").read_text())


def results(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def test_four_trials_on_two_slots_queue_and_one_fails(mark: str) -> None:
    result = run_dtrain(
        "sweep", "--json", "--plain", "--grid", "x=1,2,3,4", "-H", "localhost:2",
        "-x", f"DTRAIN_TEST_MARK={mark}", "--objective", "score", "--maximize",
        sys.executable, "-c", TRIAL, "{x}",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr  # one trial failed
    table = results(result.stdout)
    assert [t["trial"] for t in table["trials"]] == [3, 1, 0, 2]  # best score first, failed last
    trials = {t["trial"]: t for t in table["trials"]}
    for index, x in enumerate([1, 2, 3, 4]):
        trial = trials[index]
        assert trial["params"] == {"x": str(x)}
        if x == 3:
            assert (trial["state"], trial["exit_code"]) == ("failed", 5)
            assert set(trial["metrics"]) == {"start"}
            continue
        assert (trial["state"], trial["exit_code"]) == ("succeeded", 0)
        metrics = trial["metrics"]
        # read from its output (metric: lines) and its metrics file (JSON lines)
        assert (metrics["score"], metrics["half"], metrics["trial"]) == (x * x, x / 2, index)
        assert metrics["px"] == str(x)
        assert metrics["end"] - metrics["start"] >= 2
    # Two slots: never more than two trials at once, and the third waited for one to end.
    spans = [
        (t["metrics"]["start"], t["metrics"].get("end", t["metrics"]["start"] + 2))
        for t in (trials[i] for i in range(4))
    ]
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 2
    first_end = min(spans[0][1], spans[1][1])
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # 0 and 1 side by side
    assert min(spans[2][0], spans[3][0]) >= first_end - 0.05
    lines = result.stderr.splitlines()
    first_done = next(i for i, ln in enumerate(lines) if " succeeded (" in ln or " failed (" in ln)
    assert next(i for i, ln in enumerate(lines) if "trial 2 running" in ln) > first_done
    # Each trial is a dtrain job of its own: listed, with its logs.
    sweep_id = table["sweep"]
    listed = dtrain_in_process("jobs").stdout
    assert all(f"{sweep_id}-t{i}" in listed for i in range(4))
    logs = dtrain_in_process("logs", f"{sweep_id}-t2")
    assert "[0]<stderr> no good" in logs.stdout
    record = sweep_record(sweep_id)
    assert record["state"] == "finished"
    assert [t["state"] for t in record["trials"]] == ["succeeded"] * 2 + ["failed", "succeeded"]


def test_retries_run_a_failed_trial_again(tmp_path: Path, mark: str) -> None:
    flag = tmp_path / "failed-once"
    script = (
        f"if [ {{x}} = 2 ] && [ ! -e {flag} ]; then touch {flag}; exit 4; fi; echo metric: v={{x}}"
    )
    result = run_dtrain(
        "sweep", "--json", "--plain", "--retries", "1", "--grid", "x=1,2", "-H", "localhost:2",
        "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trials = {t["trial"]: t for t in results(result.stdout)["trials"]}
    assert [(t["state"], t["tries"], t["metrics"]) for t in trials.values()] == [
        ("succeeded", 1, {"v": 1.0}),
        ("succeeded", 2, {"v": 2.0}),
    ]
    assert "dtrain: trial 1 failed (exit code 4); retry 1 of 1" in result.stderr
    first, second = sweep_record(results(result.stdout)["sweep"])["trials"][1]["jobs"]
    assert json.loads((JOBS / first / "status.json").read_text())["exit_code"] == 4
    assert json.loads((JOBS / second / "status.json").read_text())["exit_code"] == 0


def test_json_with_follow_keeps_stdout_for_the_json(mark: str) -> None:
    """dtrain sweep --json --follow 0 > results.json: the followed lines go to stderr."""
    result = run_dtrain(
        "sweep", "--json", "--plain", "--follow", "0", "--objective", "acc", "--grid", "x=1,2",
        "-H", "localhost:2", "-x", f"DTRAIN_TEST_MARK={mark}",
        "sh", "-c", "echo hello {x}; echo metric: v={x}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)  # the whole of stdout
    assert [t["metrics"] for t in table["trials"]] == [{"v": 1.0}, {"v": 2.0}]
    assert "[t0:0] hello 1\n" in result.stderr and "[t1:0]" not in result.stderr
    assert "dtrain: note: no trial reported --objective acc (metrics: v)" in result.stderr


def test_trials_get_one_thread_each_unless_told(mark: str) -> None:
    """As torchrun does for ranks side by side: OMP_NUM_THREADS=1, unless -x or the
    environment gives it."""
    show = ["sh", "-c", "echo metric: omp=${OMP_NUM_THREADS:-unset}"]
    args = ["sweep", "--json", "--plain", "--grid", "x=1,2", "-H", "localhost:2"]
    mine = ["-x", f"DTRAIN_TEST_MARK={mark}"]
    # The three sweeps side by side (each waits mostly on its trials' processes starting).
    default = start_dtrain(*args, *mine, *show)
    told = start_dtrain(*args, *mine, "-x", "OMP_NUM_THREADS=3", *show)
    inherited = start_dtrain(*args, *mine, *show, env={**child_env(), "OMP_NUM_THREADS": "2"})
    for proc, expected in ((default, 1.0), (told, 3.0), (inherited, 2.0)):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert [t["metrics"]["omp"] for t in json.loads(out)["trials"]] == [expected] * 2


def test_max_parallel_caps_the_trials_at_once(mark: str) -> None:
    code = (
        "import time; s = time.time(); time.sleep(1); print('metric: s=%f e=%f' % (s, time.time()))"
    )
    result = run_dtrain(
        "sweep", "--json", "--plain", "--max-parallel", "1", "--grid", "x=1,2,3",
        "-H", "localhost:3", "-x", f"DTRAIN_TEST_MARK={mark}", sys.executable, "-c", code,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trials = results(result.stdout)["trials"]
    spans = sorted((t["metrics"]["s"], t["metrics"]["e"]) for t in trials)
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans))


def test_a_terminal_shows_the_live_table_and_the_followed_trial(mark: str) -> None:
    from tests.test_terminal import on_terminal

    code, screen = on_terminal(
        [
            "sweep", "--follow", "1", "--grid", "x=1,2,3", "-H", "localhost:2",
            "-x", f"DTRAIN_TEST_MARK={mark}",
            "sh", "-c", "sleep 1; echo hello {x}; echo metric: v={x}",
        ],
        columns=120,
    )  # fmt: skip
    assert code == 0, screen
    sweep_id = screen.split("dtrain: sweep ", 1)[1].split(":", 1)[0]
    assert f"dtrain sweep {sweep_id}: " in screen  # the live table's title
    assert "[t1:0] hello 2" in screen and "[t0:0]" not in screen
    final = screen[screen.rindex("trial  x  state") :].splitlines()
    assert [line.split()[:5] for line in final[:4]] == [
        ["trial", "x", "state", "exit", "time"],
        ["0", "1", "succeeded", "0", final[1].split()[4]],
        ["1", "2", "succeeded", "0", final[2].split()[4]],
        ["2", "3", "succeeded", "0", final[3].split()[4]],
    ]
    assert [line.split()[5] for line in final[1:4]] == ["1", "2", "3"]  # metric v


def launchers_of(sweep_id: str) -> list[int]:
    """Trial launchers (``python -m launcher _resume``) of this sweep still running."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"_resume" in cmdline and sweep_id.encode() in cmdline:
            found.append(int(entry))
    return found


def sweep_id_of(proc: Any) -> str:
    """The sweep's id, from its first line on stderr."""
    line = proc.stderr.readline()
    assert line.startswith("dtrain: sweep "), line
    return line.split()[2].rstrip(":")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_the_sweep_stops_every_trial(mark: str, signum: int) -> None:
    proc = start_dtrain(
        "sweep", "--plain", "--grid", "x=1,2,3", "-H", "localhost:2",
        "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "sleep 300 & wait",
    )  # fmt: skip
    sweep_id = sweep_id_of(proc)
    wait_for_pids(mark, 4)  # two trials: a shell and its sleep each
    assert len(launchers_of(sweep_id)) == 2
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert wait_until_gone(mark, timeout=15) == []
    deadline = time.monotonic() + 15
    while launchers_of(sweep_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launchers_of(sweep_id) == []
    if signum == signal.SIGKILL:  # nobody to tell: the trials' launchers tore down alone
        return
    assert proc.returncode == 130, err
    assert (
        "dtrain: stopping 2 running trial(s) (grace 5 s); 1 not started; Ctrl-C again to kill now"
        in err
    )
    states = [t["state"] for t in sweep_record(sweep_id)["trials"]]
    assert states == ["stopped", "stopped", "pending"]
    assert sweep_record(sweep_id)["state"] == "interrupted"
    rows = {line.split()[0]: line.split()[2] for line in out.splitlines()[1:]}
    assert rows == {"0": "stopped", "1": "stopped", "2": "pending"}


def wait_for_sleep(mark: str, timeout: float = 30.0) -> None:
    """Until a marked ``sleep 300`` runs (trial 0's shell and watchdog, marked too, may still
    be there: a count of marked processes would not tell the trials apart)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in marked_pids(mark):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00300\x00":
                    return
        time.sleep(0.05)
    raise AssertionError(f"no sleep 300 marked {mark}")


def test_a_terminal_gone_ends_only_the_view(mark: str) -> None:
    """Its terminal closed (writes fail with EIO), a stopped sweep still records its trials,
    tears them down and exits 130 (a traceback would exit 1)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*DTRAIN, "sweep", "--grid", "x=1,2", "-H", "localhost:1",
         "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "sleep 300 & wait"],
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=child_env(), cwd=REPO,
    )  # fmt: skip
    os.close(slave)
    wait_for_sleep(mark)
    os.close(master)  # the terminal is gone: every write to it fails
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert wait_until_gone(mark, timeout=15) == []
    records = sorted((JOBS / "sweeps").glob("*/sweep.json"), key=lambda p: p.stat().st_mtime)
    record = json.loads(records[-1].read_text())
    assert [t["state"] for t in record["trials"]] == ["stopped", "pending"]


def test_resume_runs_only_the_trials_that_did_not_finish(tmp_path: Path, mark: str) -> None:
    go = tmp_path / "go"
    script = f"[ {{x}} = 0 ] || [ -e {go} ] || {{ sleep 300 & wait; }}; echo metric: v={{x}}"
    proc = start_dtrain(
        "sweep", "--plain", "--grid", "x=0,1,2", "-H", "localhost:1",
        "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", script,
    )  # fmt: skip
    sweep_id = sweep_id_of(proc)
    wait_for_sleep(mark)  # trial 1's (trial 0 ends at once; trial 2 waits for the slot)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert [t["state"] for t in sweep_record(sweep_id)["trials"]] == [
        "succeeded",
        "stopped",
        "pending",
    ]
    go.touch()
    forgot = dtrain_in_process("sweep", "--resume", sweep_id[:18], "--json")  # -x: not kept
    assert forgot.returncode == 2
    assert "give them again: -x DTRAIN_TEST_MARK=..." in forgot.stderr
    result = run_dtrain(
        "sweep", "--resume", sweep_id[:18], "--json", "-x", f"DTRAIN_TEST_MARK={mark}"
    )
    assert result.returncode == 0, result.stderr
    trials = results(result.stdout)["trials"]
    assert [(t["state"], t["metrics"]) for t in trials] == [
        ("succeeded", {"v": 0.0}),
        ("succeeded", {"v": 1.0}),
        ("succeeded", {"v": 2.0}),
    ]
    jobs = [t["jobs"] for t in sweep_record(sweep_id)["trials"]]
    assert jobs == [[f"{sweep_id}-t0"], [f"{sweep_id}-t1", f"{sweep_id}-t1-1"], [f"{sweep_id}-t2"]]
    assert result.stderr.splitlines()[:2] == [  # the command to paste on a line of its own
        f"dtrain: sweep {sweep_id}: 2 of 3 trial(s), 1 slot(s); to resume:",
        f"    dtrain sweep --resume {sweep_id}",
    ]
    again = run_dtrain("sweep", "--resume", sweep_id, "--json", "-x", f"DTRAIN_TEST_MARK={mark}")
    assert again.returncode == 0
    assert again.stderr.splitlines() == [
        f"dtrain: sweep {sweep_id}: nothing left to run (3 succeeded)"
    ]
    assert [t["state"] for t in results(again.stdout)["trials"]] == ["succeeded"] * 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grid", "lr=0.1", "t.py", "{lr}", "{batch}"], "COMMAND: unknown placeholder {batch}"),
        (["--grid", "lr0.1", "t.py"], "--grid 'lr0.1': 'lr0.1' needs NAME=VALUE"),
        (["--random", "2", "--param", "lr=normal(0,1)", "t.py"], "unknown distribution 'normal'"),
        (["--random", "2", "--param", "lr=uniform(1)", "t.py"], "uniform() takes two numbers"),
        (["--param", "lr=uniform(0,1)", "t.py"], "--param needs --random N"),
        (["t.py"], "no parameters to sweep"),
        (["--grid", "lr=1"], "no command given"),
        (["--np-per-trial", "3", "-H", "localhost:2", "--grid", "a=1", "t.py"], "the hosts have 2"),
        (["--master-port", "2000", "--grid", "a=1", "t.py"], "--master-port: every trial"),
        (["-x", "BAD NAME=1", "--grid", "a=1", "t.py"], "'BAD NAME' is not a valid variable"),
        (["-x", "DTRAIN_NOT_SET_ANYWHERE", "--grid", "a=1", "t.py"], "is not set in dtrain's"),
        (["--resume", "nosuchsweep"], "--resume nosuchsweep: no sweep matching it"),
        (["--retry-failed", "--grid", "a=1", "t.py"], "--retry-failed is for --resume"),
        (["--grid", "a=1", "-H", "bad host", "t.py"], "-H"),
        (["--job-dir", "/proc/nope", "--grid", "a=1", "t.py"], "--job-dir /proc/nope: cannot"),
        (["--follow", "2", "--grid", "a=1,2", "t.py"], "--follow 2: the sweep's trials are 0 to 1"),
        (["--maximize", "--grid", "a=1", "t.py"], "--maximize/--minimize order the results by"),
        (["--resume", ""], "--resume '': no sweep id"),
        (["--grid", "lr=loguniform(1e-3,1)", "t.py"], "loguniform(...) is a distribution"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = dtrain_in_process("sweep", *args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: ") and message in lines[0], lines


def test_a_parameter_not_in_the_command_is_a_note() -> None:
    """A program may read $DTRAIN_PARAM_<NAME>; a forgotten placeholder is said, not refused."""
    result = dtrain_in_process("sweep", "--dry-run", "--grid", "a=1,2 b=3", "t.py", "{a}")
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        "dtrain: note: COMMAND has no {b}: the trials see b only as $DTRAIN_PARAM_B\n"
    )


def test_a_chosen_seed_is_said_and_draws_the_same_trials_again() -> None:
    args = ["sweep", "--dry-run", "--json", "--random", "3", "--param", "lr=uniform(0,1)"]
    first = dtrain_in_process(*args, "t.py", "{lr}")
    assert first.returncode == 0, first.stderr
    seed = first.stderr.split("drawn with --seed ", 1)[1].split()[0]
    again = dtrain_in_process(*args, "--seed", seed, "t.py", "{lr}")
    assert again.stderr == "" and json.loads(again.stdout) == json.loads(first.stdout)


def test_dry_run_lists_the_trials() -> None:
    result = dtrain_in_process(
        "sweep", "--dry-run", "--json", "--random", "3", "--seed", "5",
        "--param", "lr=loguniform(1e-4,1e-1)", "--grid", "b=1,2", "t.py", "--lr", "{lr}", "{b}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trials = json.loads(result.stdout)
    assert [t["trial"] for t in trials] == list(range(6))
    assert [t["params"]["b"] for t in trials] == ["1", "2"] * 3
    assert all(
        t["command"] == ["t.py", "--lr", t["params"]["lr"], t["params"]["b"]] for t in trials
    )
    again = dtrain_in_process(
        "sweep", "--dry-run", "--json", "--random", "3", "--seed", "5",
        "--param", "lr=loguniform(1e-4,1e-1)", "--grid", "b=1,2", "t.py", "--lr", "{lr}", "{b}",
    )  # fmt: skip
    assert json.loads(again.stdout) == trials  # the same seed, the same draws


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_trains_and_the_table_ranks_it(mark: str) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    result = run_dtrain(
        "sweep", "--json", "--plain", "--grid", "lr=0.1,0.001", "-H", "localhost:2",
        "--objective", "val_acc", "--maximize", "-x", f"DTRAIN_TEST_MARK={mark}",
        sys.executable, "examples/sweep_train.py", "--lr", "{lr}", "--epochs", "5",
        timeout=230,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trials = results(result.stdout)["trials"]
    assert [t["params"]["lr"] for t in trials] == ["0.1", "0.001"]  # a tiny step learns less
    good, slow = (t["metrics"] for t in trials)
    assert good["epoch"] == slow["epoch"] == 5
    assert good["val_acc"] > 0.9 and slow["val_acc"] < good["val_acc"]
    assert good["final_val_acc"] == good["val_acc"]  # $DTRAIN_METRICS_FILE agrees


# Over the SSH test hosts: every trial a job on the hosts' slots.
@pytest.mark.sshhosts
def test_a_sweep_over_two_ssh_hosts(ssh_hosts: TestHosts, mark: str) -> None:
    from tests.test_ssh import assert_nothing_left, ssh

    result = run_dtrain(
        "sweep", *ssh(ssh_hosts), "--json", "--plain", "-H", "node1:1,node2:1",
        "--grid", "x=1,2,3,4", "-x", f"DTRAIN_TEST_MARK={mark}",
        "sh", "-c", "sleep 1; echo metric: host=$(hostname) v={x}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trials = results(result.stdout)["trials"]
    assert [t["metrics"]["v"] for t in trials] == [1.0, 2.0, 3.0, 4.0]
    assert {t["metrics"]["host"] for t in trials} == {"node1", "node2"}
    assert all(t["hosts"] == t["metrics"]["host"] + ":1" for t in trials)
    assert_nothing_left(ssh_hosts, mark)


@pytest.mark.sshhosts
@pytest.mark.timeout(300)
def test_torch_trials_of_two_ranks_over_ssh_hosts(ssh_hosts: TestHosts, mark: str) -> None:
    """Two ranks per trial: one trial on node3's two slots, one over node1 and node2, side by
    side, each with its own rendezvous (an all_reduce over its two ranks)."""
    pytest.importorskip("torch")
    from tests.test_ssh import assert_nothing_left, ssh

    result = run_dtrain(
        "sweep", *ssh(ssh_hosts), "--json", "--plain", "-H", "node3:2,node1:1,node2:1",
        "--np-per-trial", "2", "--grid", "scale=1,10", "-x", f"DTRAIN_TEST_MARK={mark}",
        "python", str(REPO / "tests" / "data" / "sweep_allreduce.py"), "{scale}",
        timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trials = results(result.stdout)["trials"]
    # ranks 0 and 1 add (rank + 1) * scale: 3 * scale
    assert [t["metrics"]["total"] for t in trials] == [3.0, 30.0]
    assert [t["hosts"] for t in trials] == ["node3:2", "node1:1,node2:1"]
    assert [t["metrics"]["world"] for t in trials] == [2.0, 2.0]
    assert_nothing_left(ssh_hosts, mark)


@pytest.mark.sshhosts
def test_ctrl_c_stops_the_trials_on_every_host(ssh_hosts: TestHosts, mark: str) -> None:
    from tests.test_ssh import assert_nothing_left, ssh

    proc = start_dtrain(
        "sweep", *ssh(ssh_hosts), "--plain", "-H", "node1:1,node2:1", "--grid", "x=1,2,3",
        "-x", f"DTRAIN_TEST_MARK={mark}", "sh", "-c", "sleep 300 & wait",
    )  # fmt: skip
    sweep_id = sweep_id_of(proc)
    wait_for_pids(mark, 4)  # the shells and sleeps of trials 0 and 1, on node1 and node2
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert_nothing_left(ssh_hosts, mark)
    assert launchers_of(sweep_id) == []
    trials = sweep_record(sweep_id)["trials"]
    assert [(t["state"], t["hosts"]) for t in trials] == [
        ("stopped", "node1:1"),
        ("stopped", "node2:1"),
        ("pending", None),
    ]
