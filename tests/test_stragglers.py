"""Stragglers named while a job runs, and each rank's rate in dtrain top: a rank that steps
slower (it sleeps longer, or its host's link is shaped with tc) is named once, with its
host; a uniform job names none; the options' bad values are one line each."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.base.errors import UsageError
from launcher.core.command import LaunchSpec
from launcher.core.config import JobConfig, config_from_json, config_to_json, validate_config
from launcher.core.hosts import Host
from launcher.core.options import keywords
from launcher.run.stragglers import STRAGGLERS_LOG, ProgressWatch
from launcher.streams.jobdir import JobDir
from launcher.view.topview import rows_between, top_table
from tests.conftest import JOBS, dtrain_in_process, run_dtrain, start_dtrain, wait_until_gone
from tests.fakes import FakeClock
from tests.testhosts import BRIDGE_ADDRESS, TestHosts

pytestmark = pytest.mark.timeout(120)

NAMED = re.compile(r"dtrain: ranks? .* the median step rate for \d+ s")

# Ranks step at 20 steps/s for SECONDS (those in $SLOW_RANKS at 8): even ranks print
# 'metric: step=N' lines, odd ones a tqdm bar on stderr (redrawn with \r, as tqdm does).
STEPS = """import os, sys, time
rank = int(os.environ["RANK"])
rate = 8.0 if str(rank) in os.environ.get("SLOW_RANKS", "").split(",") else 20.0
steps = int(rate * float(sys.argv[1]))
start = time.monotonic()
for step in range(1, steps + 1):
    time.sleep(max(0.0, start + step / rate - time.monotonic()))
    if rank % 2:
        done = 100 * step // steps
        sys.stderr.write(f"\\r{done:3d}%|####      | {step}/{steps} [00:01<00:03, {rate:.2f}it/s]")
        sys.stderr.flush()
    else:
        print(f"metric: step={step} loss=0.5", flush=True)
print(flush=True, file=sys.stderr)
"""


def named_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if NAMED.fullmatch(line)]


def job_of(proc: subprocess.Popen[str]) -> str:
    """The job id its first line names."""
    assert proc.stderr is not None
    first = proc.stderr.readline()
    found = re.match(r"dtrain: job (\S+) \(", first)
    assert found, first
    return found[1]


def wait_for_step(proc: subprocess.Popen[str], rank: int, step: int) -> None:
    """Read the job's stdout until rank ``rank`` printed step ``step``."""
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.fullmatch(rf"\[{rank}\] metric: step=(\d+) loss=0.5\n", line)
        if found and int(found[1]) >= step:
            return
    raise AssertionError(f"rank {rank} never printed step {step}")


def test_the_slow_rank_is_named_once_and_a_uniform_job_names_none(
    tmp_path: Path, mark: str
) -> None:
    program = tmp_path / "steps.py"
    program.write_text(STEPS)
    common = ["-np", "4", "--straggler-after", "1.5", "-x", f"DTRAIN_TEST_MARK={mark}"]
    slow = start_dtrain("run", *common, "-x", "SLOW_RANKS=2", str(program), "5")
    uniform = start_dtrain("run", *common, str(program), "5")  # (side by side: no time lost)
    try:
        job = job_of(slow)
        wait_for_step(slow, 2, 8)  # a second in: every rank has a rate
        top = run_dtrain("top", "--once", "--json", job)
        assert top.returncode == 0, top.stderr
        rows = {row["rank"]: row for row in json.loads(top.stdout)}
        _, slow_err = slow.communicate(timeout=60)
        _, uniform_err = uniform.communicate(timeout=60)
    finally:
        for proc in (slow, uniform):
            proc.kill()
            proc.communicate()
    assert slow.returncode == 0 and uniform.returncode == 0, slow_err + uniform_err
    # the rank that sleeps longer per step, and only it, once (at about 8/20 of the others'
    # rate, for at least --straggler-after); none in the uniform job
    named = named_lines(slow_err)
    assert len(named) == 1, slow_err
    found = re.fullmatch(
        r"dtrain: rank 2 on localhost runs at (0\.\d\d)x the median step rate for (\d+) s",
        named[0],
    )
    assert found and float(found[1]) < 0.7 and int(found[2]) >= 2, named
    assert named_lines(uniform_err) == [], uniform_err
    recorded = (JOBS / job / STRAGGLERS_LOG).read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in recorded] == named_lines(slow_err)
    # dtrain top: every rank's rate (metric lines and tqdm bars alike), the slow one's share
    assert all(isinstance(row["steps_per_s"], float) for row in rows.values()), rows
    assert all(isinstance(row["step"], int) and row["step"] > 0 for row in rows.values()), rows
    assert rows[2]["rate_ratio"] < 0.7 < min(rows[r]["rate_ratio"] for r in (0, 1, 3)), rows
    assert wait_until_gone(mark) == []


def top_row(rank: int, rate: float | None) -> dict[str, object]:
    """A rank's figures as the launcher answers dtrain top."""
    row: dict[str, object] = {"host": "gpu1", "pid": 100 + rank, "time": 1.0, "cpu_s": 1.0}
    if rate is not None:
        row.update(step=40, steps_per_s=rate)
    return row


@pytest.mark.parametrize(
    ("rates", "ratios"),
    [
        ({0: 3.6, 1: 3.6, 2: 1.98, 3: 3.63}, [1.0, 1.0, 0.55, 1.01]),
        ({0: 3.6, 1: None, 2: 1.8, 3: 3.6}, [1.0, None, 0.5, 1.0]),  # one printed no steps
        ({0: 3.6, 1: 1.8}, [None, None]),  # two: no median to speak of
        ({0: 0.0, 1: 0.0, 2: 0.0}, [None, None, None]),
    ],
)
def test_top_shows_each_ranks_rate_and_its_share_of_the_median(
    rates: dict[int, float | None], ratios: list[float | None]
) -> None:
    rows = rows_between({}, {rank: top_row(rank, rate) for rank, rate in rates.items()})
    assert [row["steps_per_s"] for row in rows] == list(rates.values())
    assert [row["rate_ratio"] for row in rows] == ratios


def test_top_at_80_columns_shows_the_rate_whole() -> None:
    from rich.console import Console

    rows = rows_between({}, {rank: top_row(rank, 3.6 if rank != 2 else 1.98) for rank in range(4)})
    for row in rows:
        row.update(gpu_mib=1200, gpu_percent=37, last_line="epoch 3 step 120")
    rows[1]["steps_per_s"] = rows[1]["rate_ratio"] = None  # (a rank without steps: empty)
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(top_table("20261125-124940-55dd0c", rows))
    shown = console.export_text().splitlines()
    assert "steps/s" in shown[1]
    assert "1.98 0.55x" in shown[5] and "3.60 1.00x" in shown[3], shown
    assert "x" not in shown[4].split("37%")[1].split("epoch")[0], shown  # rank 1: empty
    assert all("epoch 3" in line for line in shown[3:7]), shown


def spec(rank: int, host: str) -> LaunchSpec:
    return LaunchSpec(rank=rank, host=Host(host), local_rank=0, argv=("x",), env={})


def test_the_watch_says_it_once_and_keeps_it_in_the_job_directory(tmp_path: Path) -> None:
    """The watch, on a fake clock: the notice once per episode, with the rank's host, and
    the same line in stragglers.log; --no-stragglers starts no watch."""
    clock = FakeClock(start=0.0)
    job = JobDir(tmp_path)
    said: list[str] = []
    config = JobConfig(("x",), straggler_after_s=2.0)
    watch = ProgressWatch(job, config, clock, said.append)
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node3"}
    for tick in range(20):  # 10 s, every half second: rank 2 at a quarter of the others' rate
        clock.time = tick / 2
        for rank, host in hosts.items():
            step = tick * (5 if rank == 2 else 20)
            watch.board.observe(spec(rank, host), [b"metric: step=%d" % step])
        watch.check()
    # rates from the second sample on (0.5 s), below the line from then: named at 2.5 s
    assert said == ["dtrain: rank 2 on node2 runs at 0.25x the median step rate for 2 s"]
    named_at = f"{FakeClock(start=2.5).wall():.6f}"
    assert (tmp_path / STRAGGLERS_LOG).read_text() == f"{named_at} {said[0]}\n"
    # ranks of a host with a long name: the notice within 80 columns, the log one line
    long_name = "gpu-node-017.rack4.cluster.example.org"
    (tmp_path / "long").mkdir()
    watch = ProgressWatch(JobDir(tmp_path / "long"), config, clock, said.append)
    for tick in range(20):
        clock.time = tick / 2
        for rank in range(8):
            step = tick * (5 if rank in (3, 6) else 20)
            watch.board.observe(spec(rank, long_name), [b"metric: step=%d" % step])
        watch.check()
    assert said[1:] == [
        "dtrain: ranks 3,6 on gpu-node-017.rack4.cluster.example.org run at 0.25x the\n"
        "    median step rate for 2 s"
    ]
    logged = (tmp_path / "long" / STRAGGLERS_LOG).read_text()
    assert logged.endswith(" " + said[1].replace("\n   ", "") + "\n") and logged.count("\n") == 1
    quiet = ProgressWatch(job, JobConfig(("x",), stragglers=False), clock, said.append)
    before = threading.active_count()
    quiet.start()
    assert threading.active_count() == before


def test_the_options_have_keywords_and_travel_to_a_detached_launcher() -> None:
    flags = keywords("run")
    assert {"progress_regex", "straggler_ratio", "straggler_after", "no_stragglers"} <= set(flags)
    config = JobConfig(
        ("x",),
        progress_regex=r"step (\d+)",
        straggler_ratio=0.5,
        straggler_after_s=60.0,
        stragglers=False,
    )
    assert config_from_json(json.loads(json.dumps(config_to_json(config)))) == config


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"straggler_ratio": 1.0}, "--straggler-ratio 1: must be more than 0 and less than 1"),
        ({"straggler_ratio": float("nan")}, "--straggler-ratio nan: must be more than 0"),
        ({"straggler_after_s": 0.0}, "--straggler-after 0: must be at least 0.1 seconds"),
        ({"progress_regex": "step"}, "--progress-regex 'step' has no group"),
    ],
)
def test_bad_values_through_the_python_api_are_refused(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        validate_config(JobConfig(("x",), **values))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--progress-regex", "step ("],
            "dtrain: error: --progress-regex 'step (': not a regular expression (missing ), "
            "unterminated subpattern at position 5) (hint: write e.g. --progress-regex "
            "'step (\\d+)')",
        ),
        (
            ["--progress-regex", r"step \d+"],
            "dtrain: error: --progress-regex 'step \\d+' has no group: it needs one around "
            "the step (hint: write e.g. --progress-regex 'step (\\d+)')",
        ),
        (
            ["--straggler-ratio", "0"],
            "dtrain: error: --straggler-ratio 0: must be more than 0 and less than 1 "
            "(hint: write e.g. --straggler-ratio 0.7)",
        ),
        (
            ["--straggler-after", "0"],
            "dtrain: error: --straggler-after 0: must be at least 0.1 seconds "
            "(hint: give --straggler-after 0.1 or more)",
        ),
    ],
)
def test_a_bad_option_is_one_line_and_starts_nothing(
    args: list[str], error: str, tmp_path: Path
) -> None:
    witness = tmp_path / "ran"
    result = dtrain_in_process("run", "-np", "1", *args, "touch", str(witness))
    assert (result.returncode, result.stderr) == (2, error + "\n")
    assert not witness.exists()


# Over the SSH test hosts: each step sends 200 KB to a sink in this process and waits for
# its answer; through a link shaped to 50 Mbit/s that takes 30 ms more than elsewhere.
NETWORK_STEPS = """import os, socket, sys, time
sink = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = b"x" * 200_000
end = time.monotonic() + float(sys.argv[3])
step = 0
while time.monotonic() < end:
    sink.sendall(block)
    sink.recv(1)
    step += 1
    print(f"metric: step={step}", flush=True)
    time.sleep(0.03)
"""


@pytest.fixture
def sink(ssh_hosts: TestHosts) -> Iterator[int]:
    """A TCP sink on the test hosts' bridge: it answers each 200 KB with a byte; its port."""
    if ssh_hosts.mode != "netns":
        pytest.skip("shaping a link needs the network-namespace test hosts")
    server = socket.create_server((BRIDGE_ADDRESS, 0))

    def serve(client: socket.socket) -> None:
        with client:
            got = 0
            while chunk := client.recv(1 << 16):
                got += len(chunk)
                while got >= 200_000:
                    got -= 200_000
                    client.sendall(b"k")

    def accept() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(client,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.mark.sshhosts
def test_the_rank_behind_a_shaped_link_is_named(
    ssh_hosts: TestHosts, sink: int, tmp_path: Path, mark: str
) -> None:
    program = tmp_path / "network_steps.py"
    program.write_text(NETWORK_STEPS)
    with ssh_hosts.shaped("node2"):
        result = run_dtrain(
            "run", "--ssh-config", str(ssh_hosts.ssh_config), "-H", "node1,node2,node3",
            "--straggler-after", "1.5", "-x", f"DTRAIN_TEST_MARK={mark}",
            str(program), BRIDGE_ADDRESS, str(sink), "5",
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    named = named_lines(result.stderr)
    assert len(named) == 1 and named[0].startswith("dtrain: rank 1 on node2 runs at 0."), (
        result.stderr
    )
    assert wait_until_gone(mark) == []
