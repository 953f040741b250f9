"""The whole job path (config -> plan -> survey -> specs -> supervisor -> job directory) on a
fake transport: no process, no socket."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from launcher.base.errors import PlanError, UsageError
from launcher.core.config import JobConfig, PlacementConfig, ViewConfig
from launcher.core.plan import Plan
from launcher.core.specs import Site
from launcher.run.attempt import DryRun, Finished
from launcher.run.job import run_job
from launcher.run.planning import plan_job
from launcher.run.survey import Survey
from launcher.streams.jobdir import JobDir
from launcher.view.reports import format_failure
from tests.fakes import FakeClock, FakeTransport, RecordingFrontend, Script

PORTS = [29400, 29401, 29402, 29403]


def local_survey(plan: Plan, config: JobConfig, environ: Mapping[str, str], workdir: str) -> Survey:
    """Every host is this machine, with known free ports and no GPU."""
    return Survey(
        Site(
            local={h.name: True for h in plan.hosts},
            ports={h.name: PORTS for h in plan.hosts},
            addresses={h.name: "127.0.0.1" for h in plan.hosts},
        )
    )


def run_fake(
    config: JobConfig, scripts: dict[int, Script]
) -> tuple[Finished | DryRun, FakeTransport, RecordingFrontend]:
    clock = FakeClock()
    transport = FakeTransport(scripts, clock)
    frontend = RecordingFrontend()
    outcome = run_job(
        config,
        {"PATH": "/usr/bin"},
        frontend,
        survey=local_survey,
        transports=lambda survey, config, environ: transport,
        clock=clock,
    )
    return outcome, transport, frontend


def test_a_failing_rank_fails_the_job_with_its_summary_and_record(tmp_path: Path) -> None:
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(np=3),
        job_dir=str(tmp_path),
        job_id="20261123-000000-aaaaaa",
        grace_s=10,
    )
    outcome, transport, frontend = run_fake(
        config,
        {
            0: ({"stdout": [b"step 1\n"]}, None, False),
            1: ({"stderr": [b"Traceback\nValueError: boom\n"]}, 3, False),
            2: ({}, None, True),  # ignores SIGTERM: killed after the grace period
        },
    )
    assert isinstance(outcome, Finished)
    result = outcome.result
    assert result.exit_code == 3
    assert format_failure(result) == [
        "dtrain: last stderr lines of rank 1:",
        "    Traceback",
        "    ValueError: boom",
        "dtrain: stopped the other 2 ranks (1 with SIGKILL after the 10 s grace)",
        "dtrain: rank 1 on localhost failed (exit code 3); dtrain exits 3",
    ]
    assert transport.started[0].signals == [signal.SIGTERM]
    assert transport.started[2].signals == [signal.SIGTERM, signal.SIGKILL]
    term_at, kill_at = transport.started[2].signal_times
    assert kill_at - term_at == 10
    # What each rank was given: the plan, the rendezvous on the first free port.
    envs = [transport.started[r].spec.env for r in range(3)]
    assert [(e["RANK"], e["WORLD_SIZE"], e["MASTER_PORT"]) for e in envs] == [
        (str(r), "3", "29400") for r in range(3)
    ]
    assert {e["DTRAIN_JOB_ID"] for e in envs} == {"20261123-000000-aaaaaa"}
    # The view saw every line; the job directory recorded the plan, the lines and the end.
    assert (1, "stderr", b"ValueError: boom") in frontend.sink.lines
    assert frontend.views == [("20261123-000000-aaaaaa", 3)]
    job = JobDir(tmp_path / "20261123-000000-aaaaaa")
    status = job.status()
    assert (status["state"], status["exit_code"]) == ("failed", 3)
    assert [r["status"] for r in status["ranks"].values()] == [-15, 3, -9]
    assert [e["rank"] for e in job.plan()] == [0, 1, 2]
    assert job.log_path(1).read_bytes().endswith(b" e ValueError: boom\n")
    assert transport.closed


def test_success_records_every_line_in_order(tmp_path: Path) -> None:
    config = JobConfig(command=("true",), placement=PlacementConfig(np=2), job_dir=str(tmp_path))
    outcome, _, frontend = run_fake(
        config,
        {
            0: ({"stdout": [b"a\nb", b"c\n"]}, 0, False),
            1: ({"stdout": [b"d\n"], "stderr": [b"w\n"]}, 0, False),
        },
    )
    assert isinstance(outcome, Finished) and outcome.result.exit_code == 0
    assert format_failure(outcome.result) == []
    assert sorted(frontend.sink.lines) == [
        (0, "stdout", b"a"),
        (0, "stdout", b"bc"),
        (1, "stderr", b"w"),
        (1, "stdout", b"d"),
    ]
    (job_path,) = tmp_path.iterdir()
    assert json.loads((job_path / "status.json").read_text())["state"] == "succeeded"


def test_dry_run_starts_nothing_and_describes_every_rank(tmp_path: Path) -> None:
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(host_lists=("a:2,b:2",), np=4, map_by="node"),
        dry_run=True,
        job_dir=str(tmp_path),
    )
    outcome, transport, frontend = run_fake(config, {})
    assert isinstance(outcome, DryRun) and outcome.mpirun is None
    assert [(e["rank"], e["host"]) for e in outcome.entries] == [
        (0, "a"),
        (1, "b"),
        (2, "a"),
        (3, "b"),
    ]
    assert transport.started == {} and frontend.views == [] and list(tmp_path.iterdir()) == []


def test_bad_config_fails_before_anything_runs(tmp_path: Path) -> None:
    config = JobConfig(command=("true",), view=ViewConfig(ranks="one"), job_dir=str(tmp_path))
    with pytest.raises(UsageError, match="--ranks 'one'"):
        run_fake(config, {})
    with pytest.raises(UsageError, match="-np 5 is more than the 2 slots"):
        run_fake(
            replace(
                config, view=ViewConfig(), placement=PlacementConfig(host_lists=("a:2",), np=5)
            ),
            {},
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("excluded", "expected"),
    [((), ["a", "b"]), (("a",), ["b", "c"]), (("b",), ["a", "c"])],
)
def test_nnodes_takes_a_spare_host_for_a_failed_one(
    excluded: tuple[str, ...], expected: list[str]
) -> None:
    config = JobConfig(
        command=("true",), placement=PlacementConfig(host_lists=("a,b,c",), nnodes=2)
    )
    plan = plan_job(config, {}, excluded=excluded)
    assert [h.name for h in plan.hosts] == expected


def test_nnodes_without_enough_healthy_hosts_says_which_failed() -> None:
    config = JobConfig(command=("true",), placement=PlacementConfig(host_lists=("a,b",), nnodes=2))
    with pytest.raises(
        PlanError, match=r"only 1 host\(s\) given \(b\) \(after leaving out a: failed\)"
    ):
        plan_job(config, {}, excluded=("a",))


def remote_survey(
    plan: Plan, config: JobConfig, environ: Mapping[str, str], workdir: str
) -> Survey:
    """Every host is another machine (a fake one: the fake transport runs its ranks)."""
    return Survey(
        Site(
            local={h.name: False for h in plan.hosts},
            ports={h.name: PORTS for h in plan.hosts},
            addresses={h.name: f"10.0.0.{i + 1}" for i, h in enumerate(plan.hosts)},
        )
    )


@pytest.mark.parametrize(("delay_s", "waits"), [(None, [1, 2, 4]), (600.0, [600, 600, 600])])
def test_restarts_wait_their_backoff_on_the_jobs_clock(
    tmp_path: Path, delay_s: float | None, waits: list[int]
) -> None:
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(np=2),
        job_dir=str(tmp_path),
        max_restarts=3,
        restart_delay_s=delay_s,
    )
    clock = FakeClock()
    transport = FakeTransport({0: ({}, None, False), 1: ({}, 3, False)}, clock)
    frontend = RecordingFrontend()
    began, real_began = clock.now(), time.monotonic()
    outcome = run_job(
        config, {"PATH": "/usr/bin"}, frontend, survey=local_survey,
        transports=lambda survey, config, environ: transport, clock=clock,
    )  # fmt: skip
    assert isinstance(outcome, Finished) and outcome.result.exit_code == 3
    restarts = [n for n in frontend.notices if "restart" in n]
    assert restarts == [
        f"dtrain: attempt {n} failed (rank 1 on localhost: exit code 3); restart {n + 1} of 3 "
        f"in {wait} s"
        for n, wait in enumerate(waits)
    ]
    assert clock.now() - began >= sum(waits)  # waited on the job's clock...
    assert time.monotonic() - real_began < 30  # ...not on the machine's


@pytest.mark.parametrize("cooldown_s", [30.0, 600.0])
def test_a_lost_host_comes_back_after_its_cooldown_on_the_jobs_clock(
    tmp_path: Path, cooldown_s: float
) -> None:
    """Host a is lost at once, every time: its cooldown decides where the restart runs."""
    config = JobConfig(
        command=("true",),
        placement=PlacementConfig(host_lists=("a:2,b:2",), np=2, blacklist_cooldown_s=cooldown_s),
        job_dir=str(tmp_path),
        max_restarts=1,
        restart_delay_s=0,
        grace_s=5,
    )
    wait_s = config.ssh.host_timeout_s + config.grace_s  # for the lost host's ranks to end
    assert 30.0 < wait_s < 600.0  # one cooldown ends before the restart, the other after
    clock = FakeClock()
    scripts: dict[int, Script] = {0: ({}, 0, False), 1: ({}, 0, False)}
    transport = FakeTransport(scripts, clock, lost={"a": ({}, 255, False)})
    frontend = RecordingFrontend()
    began = clock.now()
    outcome = run_job(
        config, {"PATH": "/usr/bin"}, frontend, survey=remote_survey,
        transports=lambda survey, config, environ: transport, clock=clock,
    )  # fmt: skip
    assert isinstance(outcome, Finished)
    hosts = [(p.spec.rank, p.spec.host.name) for p in transport.history]
    assert clock.now() - began >= wait_s
    if cooldown_s < wait_s:  # back before the restart: it fails there again
        assert hosts == [(0, "a"), (1, "a"), (0, "a"), (1, "a")]
        assert outcome.result.exit_code == 255
        assert not any("leaving out" in n for n in frontend.notices)
    else:
        assert hosts == [(0, "a"), (1, "a"), (0, "b"), (1, "b")]
        assert outcome.result.exit_code == 0
        assert "dtrain: leaving out a (failed; back after 600 s)" in frontend.notices
