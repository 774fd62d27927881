"""Could a short probe of the step on the job's own data pick the step better than the table?

A probe trains a few candidate steps from the same start for a few evaluations, keeps the one
with the lowest validation error and goes on with it; the steps spent on the candidates it
drops count against the job's budget. Nothing is trained here: each candidate's run is the
defaults experiment's grid run at that step (same data, size, seed and start), so a probe is
read off its stored curves (``docs/figures/defaults/runs.jsonl``: run ``python -m experiments
defaults`` first). The winner's score at horizon H is its error within H minus the probe's cost
in computed steps, against the same per-cell best as the defaults target (``target_ssd.json``).

Candidates are multiples of the table's SSD value for a run of unknown length (its long-run
value), each taken to the nearest step of the cell's grid. Writes ``docs/figures/probe/``: the
``target`` table, one row per candidate set and probe length.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from experiments import common, defaults, schedules

NAME = "probe"
# Candidate sets (× the table step) and probe lengths (steps per candidate) tried.
FACTOR_SETS: tuple[tuple[float, ...], ...] = ((1.0, 3.16), (1.0, 3.16, 10.0), (0.316, 1.0, 3.16))
PROBE_STEPS = (50, 100, 150)
QUICK_PROBE_STEPS = (5,)


def nearest(values: list[float], target: float) -> float:
    """The grid step closest to ``target`` on a log scale."""
    return min(values, key=lambda value: abs(math.log(value / target)))


def probed(by_lr: dict[float, Any], base: float, factors: tuple[float, ...], length: int) -> float:
    """The step a probe of ``length`` steps per candidate keeps (lowest error, then smaller)."""
    grid = sorted(by_lr)
    candidates = {nearest(grid, base * factor) for factor in factors}
    return min(candidates, key=lambda lr: (defaults.at_horizon(by_lr[lr], length)["recon"], lr))


def target_rows(
    setup: defaults.Setup,
    runs: list[dict[str, Any]],
    best: dict[tuple, dict[str, Any]],
    probe_steps: tuple[int, ...],
) -> list[dict[str, Any]]:
    """Per candidate set and probe length: the cells met within 15% of the best, and the worst."""
    label = defaults.default_label()
    groups = {key: by_lr for key, by_lr in defaults.grouped(runs).items() if key[2] == label}
    rows = []
    for factors in FACTOR_SETS:
        for length in probe_steps:
            cost = (len(factors) - 1) * length
            ratios = {}
            for (model, size, _), by_lr in groups.items():
                kept = probed(by_lr, defaults.current_default(model, label), factors, length)
                for horizon in setup.horizons:
                    reference = best[model.dataset, model.key, size, horizon]["best_recon"]
                    score = defaults.at_horizon(by_lr[kept], horizon - cost)["recon"]
                    ratios[model.dataset, model.key, size, horizon] = defaults.ratio(
                        score, reference
                    )
            worst = max(ratios, key=lambda cell: ratios[cell])
            rows.append(
                {
                    "factors": " ".join(f"{f:g}" for f in factors),
                    "probe_steps": length,
                    "cost_steps": cost,
                    "cells_met": sum(r <= defaults.TOLERANCE for r in ratios.values()),
                    "cells": len(ratios),
                    "worst_ratio": ratios[worst],
                    "worst_cell": " ".join(str(part) for part in worst),
                }
            )
    return rows


def run(out: Path, *, quick: bool = False) -> dict[str, Any]:
    setup = defaults.QUICK if quick else defaults.FULL
    journal = common.output_dir(out, defaults.NAME) / "runs.jsonl"
    if not journal.exists():
        raise SystemExit(f"{journal} is missing: run `python -m experiments defaults` first")
    runs = [
        run
        for run in defaults.load_journal(journal).values()
        if run["case"]["steps"] == setup.horizons[-1]
    ]
    steps = QUICK_PROBE_STEPS if quick else PROBE_STEPS
    rows = target_rows(setup, runs, schedules.best_of_grids(out), steps)
    common.write_table(rows, common.output_dir(out, NAME), "target")
    return {"rows": len(rows), "best_cells_met": max(row["cells_met"] for row in rows)}
