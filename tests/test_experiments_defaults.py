"""The default-step-size experiment (experiments/defaults.py): how it counts the steps a rollback
costs, how it scores a run at a horizon and chooses a default, and its quick run end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments import defaults, defaults_large, probe, schedules

pytestmark = pytest.mark.usefixtures("one_thread")


def _metrics(step: int, error: float) -> dict:
    return {"step": step, "reconstruction_error": error}


def _backoff(step: int, rolled_back_to: int) -> dict:
    return {"event": "backoff", "step": step, "rolled_back_to": rolled_back_to}


# A run evaluated every 50 steps that blew up at 100 (back to 50) and at 130 (a NaN step, back
# to 100): computed steps by hand, counting every step taken, thrown away or not.
HISTORY = [
    _metrics(0, 100.0),
    _metrics(50, 80.0),
    _backoff(100, 50),  # 100 steps computed, 50 thrown away
    _metrics(100, 70.0),  # computed 100 + 50
    _backoff(130, 100),  # computed 150 + 30 = 180, 30 thrown away
    _metrics(150, 60.0),  # computed 150 + 80 = 230
    _metrics(200, 50.0),  # 280
]


def test_computed_steps_count_what_each_rollback_threw_away():
    curve, backoffs = defaults.computed_steps(HISTORY)
    assert curve == [(0, 0, 100.0), (50, 50, 80.0), (100, 150, 70.0), (150, 230, 60.0),
                     (200, 280, 50.0)]  # fmt: skip
    assert backoffs == [
        {"step": 100, "spent": 100, "wasted": 50},
        {"step": 130, "spent": 180, "wasted": 30},
    ]


def test_a_run_is_scored_by_what_it_reached_within_the_budget():
    curve, backoffs = defaults.computed_steps(HISTORY)
    run = {"curve": curve, "backoffs": backoffs, "gave_up": False}
    assert defaults.at_horizon(run, 200) == {
        "recon": 70.0, "step": 100, "backoffs": 2, "wasted": 80, "gave_up": False
    }  # fmt: skip
    assert defaults.at_horizon(run, 280)["recon"] == 50.0
    assert defaults.at_horizon(run, 99)["backoffs"] == 0
    # a run that gave up scores inf from the evaluation after its last healthy one
    gave_up = {**run, "gave_up": True, "backoffs": [*backoffs, {"step": None, "spent": 330,
                                                                "wasted": 0}]}  # fmt: skip
    assert defaults.at_horizon(gave_up, 329)["recon"] == 50.0
    assert math.isinf(defaults.at_horizon(gave_up, 330)["recon"])


def test_cells_within_15_percent_and_the_worst_ratio():
    cells = {
        "a": {1.0: 10.0, 3.0: 11.0, 10.0: 30.0},  # best 1: ratios 1, 1.1, 3
        "b": {1.0: 20.0, 3.0: 10.0, 10.0: 9.0},  # best 10: ratios 2.22, 1.11, 1
        "c": {1.0: 10.0, 3.0: 12.0, 10.0: 11.0},  # best 1: ratios 1, 1.2, 1.1
    }
    within = {lr: defaults.cells_within(cells, lr) for lr in (1.0, 3.0, 10.0)}
    assert within == {1.0: 2, 3.0: 2, 10.0: 2}
    assert defaults.worst_ratio(cells, 3.0) == (pytest.approx(1.2), "c")
    assert defaults.ratio(math.inf, math.inf) == 1.0


def test_quick_runs_write_their_tables_and_the_schedules_are_scored_per_cell(tmp_path: Path):
    summary = defaults.run(tmp_path, quick=True)
    directory = tmp_path / defaults.NAME
    grid = json.loads((directory / "grid.json").read_text())
    setup = defaults.QUICK
    per_model = {m.kind: sum(len(g) for g in setup.grids[m.kind].values()) for m in setup.models}
    assert len(grid) >= len(setup.sizes) * sum(per_model.values())
    assert {row["model"] for row in summary["choice"]} == {m.key for m in setup.models}
    for name in ("choice", "target_ssd", "target_ssd-normalized", "target_old_defaults"):
        assert (directory / f"{name}.md").read_text().startswith("| ")
    target = json.loads((directory / "target_ssd.json").read_text())
    assert len(target) == len(setup.models) * len(setup.sizes) * len(setup.horizons)
    assert all(row["ratio"] >= 1 for row in target)
    # the table's interpolated step checked at a length between the horizons, per model and size
    between = json.loads((directory / "target_between.json").read_text())
    assert len(between) == len(setup.models) * len(setup.sizes)
    assert all(row["horizon"] == setup.between and row["ratio"] >= 1 for row in between)

    # a probe of the step, read off the grid runs just written: every candidate set and length
    probe_summary = probe.run(tmp_path, quick=True)
    rows = json.loads((tmp_path / probe.NAME / "target.json").read_text())
    assert len(rows) == probe_summary["rows"] == len(probe.FACTOR_SETS)
    assert all(0 <= r["cells_met"] <= r["cells"] == len(target) for r in rows)

    # the decaying and self-adjusting alternatives, scored against the grids just written:
    # cosine once per horizon (a run as long as the job), grow at every horizon of one run
    alternatives = schedules.run(tmp_path, quick=True)
    rows = json.loads((tmp_path / schedules.NAME / "target.json").read_text())
    cells = len(setup.models) * len(setup.sizes) * len(setup.horizons)
    assert {rule: sum(r["rule"] == rule for r in rows) for rule in schedules.RULES} == {
        rule: cells for rule in schedules.RULES
    }
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in rows)
    assert alternatives["met"] == {
        rule: sum(r["met"] for r in rows if r["rule"] == rule) for rule in schedules.RULES
    }


def test_the_large_layer_check_runs_a_grid_around_the_table_and_scores_the_default(tmp_path: Path):
    summary = defaults_large.run(tmp_path, quick=True)
    setup = defaults_large.QUICK
    target = json.loads((tmp_path / defaults_large.NAME / "target_ssd.json").read_text())
    assert summary["cells"] == len(target) == len(setup.models) * len(setup.horizons)
    assert all(row["ratio"] >= 1 for row in target)
    # the grid spans a half-decade beyond the table's short- and long-run values
    model = setup.models[0]
    assert defaults_large.grid(model, "ssd", (400, 2000)) == (3e-3, 1e-2, 3e-2, 1e-1)
