"""Can a decaying or self-adjusting default step beat the constant table default everywhere?

The defaults experiment (:mod:`experiments.defaults`) found no constant step within 15% of the
best in every cell: short horizons want longer steps than long ones. Two ways around a single
constant, each started from the step-size table's SSD value (what a user who sets nothing gets)
and trained under the library's blow-up rule, on the Bernoulli and Gaussian-diagonal cells of
the defaults experiment (same data, sizes, seed and evaluation spacing):

- ``cosine``: from 3× the table step down to a tenth of that along half a cosine over the job's
  own length (``ssdcore.schedules.Schedule("cosine")``, which the service fills in from the
  job's steps). A job of 400 steps and one of 2,000 are separate runs.
- ``grow``: the table step, multiplied by 1.5 after every evaluation whose validation
  reconstruction error improved on the previous one and divided by 1.5 after one that did not
  (within 1/10× and 10×; back to 1× after a backoff): the "bold driver" rule. One 2,000-step run
  is scored at both horizons.

Each is compared per cell with the best of the defaults experiment's grids (its
``target_ssd.json``: run ``python -m experiments defaults`` first), by the same rule: a cell is
met within 15%. Writes ``docs/figures/schedules/``: ``runs.jsonl`` (a rerun trains only what it
lacks) and the ``target`` table.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ssdcore
from experiments import common, defaults
from experiments.common import ModelSpec
from ssdcore.blowup import BlowUpError, Recovery, blowup_from_error
from ssdcore.optim import OptimizerConfig
from ssdcore.schedules import Schedule

logger = logging.getLogger(__name__)

NAME = "schedules"
COSINE_PEAK = 3.0  # × the table step at the first step
COSINE_FLOOR = 0.1  # the schedule's last factor (the library's default floor)
GROW = 1.5  # grow: factor per evaluation
GROW_LIMIT = 10.0  # grow: the factor stays within [1/GROW_LIMIT, GROW_LIMIT]
RULES = ("cosine", "grow")


@dataclass(frozen=True)
class Case:
    """One run: ``steps`` is the job's length (cosine) or the longest horizon (grow)."""

    model: defaults.Model
    n_hidden: int
    rule: str  # one of RULES
    steps: int
    eval_every: int
    n_examples: int


def cases(setup: defaults.Setup) -> list[Case]:
    models = [m for m in setup.models if m.variance in (None, "diagonal")]
    todo = []
    for model in models:
        for size in setup.sizes:
            todo += [
                Case(model, size, "cosine", h, setup.eval_every, setup.n_examples)
                for h in setup.horizons
            ]
            todo.append(
                Case(model, size, "grow", setup.horizons[-1], setup.eval_every, setup.n_examples)
            )
    return sorted(todo, key=lambda c: (c.n_hidden, c.steps))


def table_step(model: defaults.Model) -> float:
    return defaults.current_default(model, defaults.DEFAULT_OPTIMIZER)


def train_case(case: Case) -> dict[str, Any]:
    """One run's curve in computed steps and its backoffs (as the defaults experiment's)."""
    common.configure_threads()
    train, valid = defaults.load_data(case.model.dataset, case.model.kind, case.n_examples)
    common.seed_everything(0)
    model = ModelSpec(case.model.kind, case.n_hidden, case.model.variance or "diagonal")
    rbm = model.build(train.shape[1])
    lr = table_step(case.model)
    if case.rule == "cosine":
        schedule = Schedule("cosine", floor=COSINE_FLOOR)
        config = OptimizerConfig(lr=COSINE_PEAK * lr, schedule=schedule)
        history, gave_up = defaults.fit_or_give_up(
            rbm, train, valid, config, case.steps, case.eval_every
        )
    else:
        history, gave_up = _grow(rbm, train, valid, OptimizerConfig(lr=lr), case)
    curve, backoffs = defaults.computed_steps(history)
    return {"case": asdict(case), "curve": curve, "backoffs": backoffs, "gave_up": gave_up}


def _grow(rbm: Any, train: Any, valid: Any, config: OptimizerConfig, case: Case) -> tuple:
    """``fit``'s evaluate / recover loop with the step's factor adjusted at each evaluation."""
    trainer = ssdcore.Trainer(rbm, train, optimizer=config, seed=0, valid_data=valid)
    recovery = Recovery()
    history: list[dict[str, Any]] = []
    factor, previous = 1.0, math.inf
    metrics = trainer.evaluate()
    blowup = recovery.check(metrics, trainer)
    while True:
        if blowup is not None:
            try:
                history.append(recovery.recover(blowup, trainer).history_entry())
            except BlowUpError:
                return history, True
            factor, previous = 1.0, math.inf
        else:
            history.append(metrics)
            error = metrics["reconstruction_error"]
            if math.isfinite(previous):
                grown = factor * GROW if error < previous else factor / GROW
                factor = min(max(grown, 1 / GROW_LIMIT), GROW_LIMIT)
            previous = error
            if trainer.step_count >= case.steps:
                return history, False
        trainer.set_lr_scale(recovery.lr_scale * factor)
        try:
            trainer.train_steps(case.eval_every)
        except ssdcore.DivergenceError as failure:
            blowup = blowup_from_error(failure, trainer.step_count)
            continue
        metrics = trainer.evaluate()
        blowup = recovery.check(metrics, trainer)


def target_rows(
    runs: list[dict[str, Any]], best: dict[tuple, dict[str, Any]], horizons: tuple[int, ...]
) -> list[dict[str, Any]]:
    """Per cell and rule: the rule's error at the horizon against the grid's best there."""
    rows = []
    for run in runs:
        case = run["case"]
        model = defaults.Model(**case["model"])
        scored = [case["steps"]] if case["rule"] == "cosine" else list(horizons)
        for horizon in scored:
            reference = best.get((model.dataset, model.key, case["n_hidden"], horizon))
            if reference is None:
                continue
            recon = defaults.at_horizon(run, horizon)["recon"]
            ratio = defaults.ratio(recon, reference["best_recon"])
            rows.append(
                {
                    "dataset": model.dataset,
                    "model": model.key,
                    "n_hidden": case["n_hidden"],
                    "horizon": horizon,
                    "rule": case["rule"],
                    "recon": recon,
                    "constant_default_ratio": reference["ratio"],
                    "best": reference["best"],
                    "best_recon": reference["best_recon"],
                    "ratio": ratio,
                    "met": ratio <= defaults.TOLERANCE,
                }
            )
    return sorted(rows, key=lambda r: (r["rule"], r["model"], r["dataset"], r["n_hidden"]))


def best_of_grids(out: Path) -> dict[tuple, dict[str, Any]]:
    """The defaults experiment's per-cell best (its target table for the default rule)."""
    path = common.output_dir(out, defaults.NAME) / "target_ssd.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `python -m experiments defaults` first")
    rows = json.loads(path.read_text())
    return {(r["dataset"], r["model"], r["n_hidden"], r["horizon"]): r for r in rows}


def run(out: Path, *, quick: bool = False) -> dict[str, Any]:
    setup = defaults.QUICK if quick else defaults.FULL
    directory = common.output_dir(out, NAME)
    todo = cases(setup)
    runs = defaults.execute(todo, defaults.workers(), directory / "runs.jsonl", train_case)
    rows = target_rows(runs, best_of_grids(out), setup.horizons)
    common.write_table(rows, directory, "target")
    met = {rule: sum(r["met"] for r in rows if r["rule"] == rule) for rule in RULES}
    return {"runs": len(runs), "cells": len(rows) // len(RULES), "met": met}
