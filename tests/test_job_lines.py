"""The job's own lines say its size in words: "(1 rank)", "(2 ranks)", never "(1 ranks)"."""

from __future__ import annotations

import io

import pytest

from launcher.core.config import ViewConfig
from launcher.core.outcome import JobResult
from launcher.view.frontend import TerminalFrontend
from launcher.view.reports import format_ending
from tests.conftest import run_dtrain


@pytest.mark.parametrize(
    ("world_size", "attempt", "size"),
    [
        (1, 0, "1 rank"),
        (2, 0, "2 ranks"),
        (1, 2, "1 rank, attempt 2"),
        (8, 1, "8 ranks, attempt 1"),
    ],
)
def test_the_job_line_counts_its_ranks_in_words(world_size: int, attempt: int, size: str) -> None:
    err = io.StringIO()
    TerminalFrontend(ViewConfig(), io.StringIO(), err).announce("J", world_size, attempt)
    assert err.getvalue().splitlines() == [
        f"dtrain: job J ({size}); its logs:",
        "    dtrain logs J",
    ]


@pytest.mark.parametrize(("world_size", "size"), [(1, "1 rank"), (3, "3 ranks")])
def test_the_success_line_counts_its_ranks_in_words(world_size: int, size: str) -> None:
    result = JobResult(exit_code=0, world_size=world_size, elapsed_s=2.25)
    assert format_ending("J", "succeeded", result) == [f"dtrain: job J succeeded ({size}, 2.2 s)"]


def test_a_job_of_one_rank_says_one_rank() -> None:
    done = run_dtrain("run", "-np", "1", "true")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0].endswith(" (1 rank); its logs:"), done.stderr
