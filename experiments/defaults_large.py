"""Do the default step sizes hold at a large hidden layer?

The defaults experiment (:mod:`experiments.defaults`) chose the table's values at n_hidden 25 and
100; users train 400–500 hidden units, where the paper rule's best step is known to fall (RESULTS
§6). This runs MNIST (binarized for a Bernoulli RBM, standardized for a Gaussian diagonal one,
the same 2,000 rows and split) at n_hidden 400, for SGD and SSD (paper rule), at every half-decade
from a half-decade below the table's smaller value to a half-decade above its larger one (its
values for 400 and 2,000 steps), under the same blow-up rule and scoring. Writes
``docs/figures/defaults_large/``: ``runs.jsonl`` (a rerun trains only what it lacks), ``choice``
(the best value per horizon, as the defaults experiment chooses) and ``target_ssd`` (SSD at the
table's value for each horizon against the best run of either optimizer).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from experiments import common, defaults
from experiments.defaults import Model, Setup

NAME = "defaults_large"
LABELS = ("sgd", "ssd")  # the optimizers of the grid (the default rule's SSD and SGD)
HALF_DECADES = tuple(float(f"{c}e{e}") for e in range(-6, 1) for c in (1, 3))  # as written
MARGIN = 3.5  # one half-decade (×3 or ×3.33 on this ladder) beyond the table's values

FULL = Setup(
    n_examples=2_000,
    sizes=(400,),
    horizons=(400, 2_000),
    between=1_000,
    eval_every=50,
    models=(Model("mnist", "bernoulli"), Model("mnist", "gaussian", "diagonal")),
    grids={},
    extend=False,
)
QUICK = replace(
    FULL,
    n_examples=200,
    sizes=(8,),
    horizons=(10, 20),
    between=15,
    eval_every=5,
    models=(Model("synthetic", "bernoulli"),),
)


def grid(model: Model, label: str, horizons: tuple[int, ...]) -> tuple[float, ...]:
    """The half-decades from one below the table's values for ``horizons`` to one above."""
    table = [defaults.current_default(model, label, horizon) for horizon in horizons]
    low, high = min(table) / MARGIN, max(table) * MARGIN
    return tuple(value for value in HALF_DECADES if low <= value <= high)


def with_grids(setup: Setup) -> Setup:
    grids = {
        model.kind: {label: grid(model, label, setup.horizons) for label in LABELS}
        for model in setup.models
    }
    return replace(setup, grids=grids)


def run(out: Path, *, quick: bool = False) -> dict[str, Any]:
    setup = with_grids(QUICK if quick else FULL)
    directory = common.output_dir(out, NAME)
    runs = defaults.execute(defaults.cases(setup), defaults.workers(), directory / "runs.jsonl")
    choice = defaults.choose(setup, runs)
    common.write_table(choice, directory, "choice")
    label = defaults.default_label()
    target = defaults.target_rows(
        setup, runs, lambda model, horizon: defaults.current_default(model, label, horizon), label
    )
    common.write_table(target, directory, "target_ssd")
    return {"runs": len(runs), "cells": len(target), "met": sum(row["met"] for row in target)}
