"""dtrain sweep's view: the live table fits the terminal (80 columns, a few rows) without
losing a parameter's value, and the results table gives way on a narrow terminal."""

from __future__ import annotations

import io

from rich.console import Console

from launcher.core.sweep import TrialRow
from launcher.view.sweepview import SweepView, fit_columns, format_results, pick_rows


def row(trial: int, state: str, **metrics: float) -> TrialRow:
    running = state == "running"
    return TrialRow(
        trial=trial,
        params=(("lr", f"0.00{trial}4567"), ("hidden", str(16 * (trial + 1)))),
        state=state,
        exit_code=None if state in ("pending", "running") else (3 if state == "failed" else 0),
        duration_s=None if state == "pending" else 2.5,
        metrics=metrics,
        job=f"20261125-104109-b2f7bd-t{trial}",
        hosts=None if state == "pending" else ("node1:1" if running else "node2:1"),
        tries=0 if state == "pending" else 1,
    )


def draw(rows: list[TrialRow], objective: str | None = None) -> list[str]:
    """The live table as an 80x24 terminal shows it."""
    view = SweepView(
        "20261125-104109-b2f7bd", io.StringIO(), io.StringIO(), False, objective=objective
    )
    out = io.StringIO()
    Console(file=out, width=80, height=24).print(view.table(rows))
    return out.getvalue().splitlines()


METRICS = {"epoch": 15.0, "loss": 0.0048, "val_acc": 0.975, "final_val_acc": 0.975, "x": 1.0}


def test_the_live_table_fits_80_columns_with_every_parameter_value() -> None:
    rows = [row(0, "succeeded", **METRICS), row(1, "failed"), row(2, "running"), row(3, "pending")]
    lines = draw(rows, objective="final_val_acc")
    assert all(len(line) <= 80 for line in lines), lines
    assert (
        lines[0]
        == "dtrain sweep 20261125-104109-b2f7bd: 1 succeeded, 1 failed, 1 running, 1 pending"
    )
    header = lines[2].replace("┃", " ").split()
    # every parameter, the objective first of the metrics; others while they fit
    assert header[:7] == ["trial", "state", "lr", "hidden", "hosts", "elapsed", "final_val_acc"]
    cells = [line.replace("│", " ").split() for line in lines[4:8]]
    assert [c[:4] for c in cells] == [
        ["0", "succeeded", "0.0004567", "16"],
        ["1", "failed", "(3)", "0.0014567"],
        ["2", "running", "0.0024567", "48"],
        ["3", "pending", "0.0034567", "64"],
    ]
    assert "…" not in "".join(lines)  # nothing cut short


def test_columns_that_do_not_fit_give_way_metrics_then_hosts() -> None:
    columns = [
        ("trial", ["0"], 0),
        ("hosts", ["node1:1"], 2),
        ("obj", ["0.9"], 1),
        ("m2", ["12345"], 4),
        ("m1", ["1"], 3),
    ]
    widths = {  # 1 + (width + 3) per column
        40: ["trial", "hosts", "obj", "m2", "m1"],
        32: ["trial", "hosts", "obj", "m1"],
        27: ["trial", "hosts", "obj"],
        20: ["trial", "obj"],
        10: ["trial"],
    }
    for width, names in widths.items():
        assert [name for name, _, _ in fit_columns(columns, width)] == names, width


def test_a_long_sweep_shows_its_running_trials_first() -> None:
    rows = [row(i, "succeeded") for i in range(30)]
    rows += [row(i, "running") for i in range(30, 32)]
    rows += [row(32, "failed")] + [row(i, "pending") for i in range(33, 60)]
    shown = pick_rows(rows, 8)
    assert [(r.trial, r.state) for r in shown] == [
        (25, "succeeded"),
        (26, "succeeded"),
        (27, "succeeded"),
        (28, "succeeded"),
        (29, "succeeded"),
        (30, "running"),
        (31, "running"),
        (32, "failed"),
    ]
    lines = draw(rows)
    assert len(lines) <= 24
    assert lines[-1] == "... and 43 more: 16 succeeded, 27 pending"  # 17 rows shown
    assert any(line.startswith("│ 31 ") for line in lines)


def test_the_results_table_drops_the_job_column_on_a_narrow_terminal() -> None:
    rows = [row(0, "succeeded", loss=0.5, val_acc=0.9), row(1, "succeeded", loss=0.4, val_acc=0.95)]
    wide = format_results(rows, "val_acc", True)
    assert wide[0].split() == [
        "trial",
        "lr",
        "hidden",
        "state",
        "exit",
        "time",
        "val_acc",
        "loss",
        "job",
    ]
    assert wide[1].split()[0] == "1" and wide[1].endswith("20261125-104109-b2f7bd-t1")
    narrow = format_results(rows, "val_acc", True, width=72, sweep_id="20261125-104109-b2f7bd")
    assert all(len(line) <= 72 for line in narrow)
    assert narrow[0].split()[-1] == "loss" and len(narrow) == 4
    assert narrow[-1] == "(a trial's logs: dtrain logs 20261125-104109-b2f7bd-tN, N its number)"
    assert format_results(rows, "val_acc", True, width=200) == wide


def test_the_results_table_drops_metrics_when_still_too_wide() -> None:
    """80 columns: the README's example table (four metrics) was one character too wide
    even without its job column, and the terminal wrapped its header."""
    metrics = {"val_acc": 0.975, "epoch": 15.0, "loss": 0.0048, "final_val_acc": 0.975}
    rows = [row(i, "succeeded", **metrics) for i in range(6)]
    lines = format_results(rows, "val_acc", True, width=68, sweep_id="S")
    assert all(len(line) <= 68 for line in lines[:-2]), lines
    assert lines[0].split()[-2:] == ["val_acc", "epoch"]
    assert lines[-2] == "(a trial's logs: dtrain logs S-tN, N its number)"
    assert lines[-1] == "(too wide for the terminal: loss, final_val_acc; --json has every metric)"
    tiny = format_results(rows, "val_acc", True, width=20, sweep_id="S")
    assert tiny[0].split()[-1] == "time"  # every metric left out; parameters stay
    assert tiny[-1].startswith("(too wide for the terminal: val_acc, epoch, loss,")
