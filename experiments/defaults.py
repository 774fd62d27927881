"""Default step sizes chosen by measurement, counting the steps the blow-up rollback costs.

Every built-in data set with the service's preprocessing (the synthetic binary data as it is;
MNIST and Frey Face binarized for a Bernoulli RBM, standardized per pixel for a Gaussian one),
each model kind and Gaussian variance form that applies, a small and a large hidden layer: each
trains at every step size of a half-decade grid, for SGD and for SSD under both step rules
(``paper`` and ``normalized``), with everything else at the library's defaults (batch 100,
CD-1, the model's default initialization, ``method="auto"``, seed 0) — what a user who sets only
the step size gets. Each run is ``ssdcore.fit`` with validation data, evaluated every
``eval_every`` steps, under the blow-up rule of :class:`ssdcore.blowup.Recovery` (the service's
too): a run that blows up is rolled back to its last healthy evaluation with a smaller step and
continues.

Horizons are budgets of steps *computed*: the steps a rollback throws away count. A run's score
at horizon H is the validation reconstruction error at its last healthy evaluation reached
within H computed steps; a run that gives up (its backoffs spent) before H scores infinity. Its
backoffs and thrown-away steps up to H are reported beside it.

A cell is (data set, model, n_hidden, horizon). Per cell, each optimizer's best grid value is
its reference; a default for (model kind, variance form, optimizer, step rule) is the grid value
within 15% of the best in the most cells of that model kind and form, the smaller of equals
(:func:`choose`): the value within 15% everywhere, where one exists. The
target (:func:`target_rows`): per cell, the default optimizer's default step against the best of
every optimizer and step rule. When the best value of a cell sits at an end of its grid, one more
half-decade beyond is run there (the rule of :func:`experiments.tuning.next_step_size`).

Affordable on two shared cores: data subsets (``Setup.n_examples`` rows, 20% of them held out
for validation), one torch thread per process, ``SSDRBM_EXPERIMENT_WORKERS`` processes (default
1). ``python -m experiments defaults`` writes ``docs/figures/defaults/``: ``runs.jsonl`` (every
run's curve, one line per run as it finishes; a rerun trains only the runs it lacks), ``grid``
(every run's scores), ``choice`` and ``target`` tables (Markdown, CSV, JSON).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

import ssdcore
from experiments import common, tuning
from experiments.common import ModelSpec
from ssdcore.data import load_frey_face, load_mnist, preprocess, split, synthetic_rbm_data
from ssdcore.optim import OptimizerConfig
from ssdcore.optim.step_rules import DEFAULT_STEP_RULE
from ssdcore.step_sizes import default_lr

logger = logging.getLogger(__name__)

NAME = "defaults"
WORKERS_ENV = "SSDRBM_EXPERIMENT_WORKERS"
TOLERANCE = 1.15  # "close to best": within 15% of the cell's best reconstruction error
VALID_FRACTION = 0.2
DEFAULT_OPTIMIZER = OptimizerConfig().name  # what a user who names no optimizer gets

# (optimizer, step rule) under test, by label; SGD has no step rule.
OPTIMIZERS: dict[str, tuple[str, str]] = {
    "sgd": ("sgd", "paper"),
    "ssd": ("ssd", "paper"),
    "ssd-normalized": ("ssd", "normalized"),
}
# Half-decade grids per model kind, around the best values of a first pass at n_hidden 200 and of
# the Frey Face probe in docs/RESULTS.md; the table's current default joins each grid, and a
# grid whose best is at an end is extended (Setup.extend).
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    "bernoulli": {
        "sgd": (0.03, 0.1, 0.3, 1.0),
        "ssd": (1e-3, 3e-3, 1e-2, 3e-2),
        "ssd-normalized": (0.03, 0.1, 0.3, 1.0),
    },
    "gaussian": {
        "sgd": (3e-3, 1e-2, 3e-2, 0.1),
        "ssd": (3e-5, 1e-4, 3e-4, 1e-3),
        "ssd-normalized": (1e-3, 3e-3, 1e-2, 3e-2),
    },
}


@dataclass(frozen=True)
class Model:
    """A data set and the model trained on it: ``variance`` is None for a Bernoulli RBM."""

    dataset: str  # "synthetic" | "mnist" | "freyface"
    kind: str  # "bernoulli" | "gaussian"
    variance: str | None = None

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.variance}" if self.variance else self.kind

    @property
    def label(self) -> str:
        return f"{self.dataset} {self.key}"


@dataclass(frozen=True)
class Setup:
    """Sizes, grids and budgets of one run of the experiment."""

    n_examples: int  # rows of each data set (its first ones), before the validation split
    sizes: tuple[int, ...]  # hidden-layer sizes: small and large
    horizons: tuple[int, ...]  # budgets of computed steps; the last is each run's length
    eval_every: int
    models: tuple[Model, ...]
    grids: dict[str, dict[str, tuple[float, ...]]]
    between: int  # a run length between the horizons, where the table's values are checked too
    extend: bool = True  # one more half-decade where a cell's best is at a grid end


# What two shared cores afford (on 2026-11-28 under a load average of 10, an MNIST Gaussian run
# at n_hidden 200 took 2 min): large is n_hidden 100; the isotropic and identity forms are
# tuned on Frey Face only; "full" (a V×V precision, projected to SPD by an eigendecomposition
# every step) is left out and keeps the diagonal values.
_GAUSSIAN_FORMS = ("diagonal", "isotropic", "identity")
FULL = Setup(
    n_examples=2_000,
    sizes=(25, 100),
    horizons=(400, 2_000),
    between=1_000,
    eval_every=50,
    models=(
        Model("synthetic", "bernoulli"),
        Model("synthetic", "gaussian", "diagonal"),
        Model("mnist", "bernoulli"),
        Model("mnist", "gaussian", "diagonal"),
        Model("freyface", "bernoulli"),
        *(Model("freyface", "gaussian", form) for form in _GAUSSIAN_FORMS),
    ),
    grids=GRIDS,
)
QUICK = Setup(
    n_examples=200,
    sizes=(4, 8),
    horizons=(10, 20),
    between=15,
    eval_every=5,
    models=(Model("synthetic", "bernoulli"), Model("freyface", "gaussian", "diagonal")),
    grids={
        kind: {name: grid[1:3] for name, grid in grids.items()} for kind, grids in GRIDS.items()
    },
    extend=False,
)


@dataclass(frozen=True)
class Case:
    """One training run of the grid."""

    model: Model
    n_hidden: int
    optimizer: str  # a key of OPTIMIZERS
    lr: float
    steps: int
    eval_every: int
    n_examples: int


@functools.cache
def load_data(dataset: str, kind: str, n_examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, valid) of a built-in data set with the service's preprocessing for ``kind``:
    its first ``n_examples`` rows, 20% held out at random (seed 0)."""
    if dataset == "synthetic":
        rows = synthetic_rbm_data(n_samples=n_examples)
    else:
        if dataset == "mnist":
            images = load_mnist(common.data_dir() / "mnist")
        else:
            images = load_frey_face(common.data_dir() / "freyface" / "frey_rawface.mat")
        rows = preprocess(images[:n_examples], "standardize" if kind == "gaussian" else "binarize")
    return split(rows, VALID_FRACTION, seed=0)


def train_case(case: Case) -> dict[str, Any]:
    """Trains one run under the blow-up rule; its curve in computed steps and its backoffs."""
    common.configure_threads()
    train, valid = load_data(case.model.dataset, case.model.kind, case.n_examples)
    common.seed_everything(0)
    variance = case.model.variance or "diagonal"
    model = ModelSpec(case.model.kind, case.n_hidden, variance).build(train.shape[1])
    name, rule = OPTIMIZERS[case.optimizer]
    config = OptimizerConfig(name, lr=case.lr, step_rule=rule)
    started = time.perf_counter()
    history, gave_up = fit_or_give_up(model, train, valid, config, case.steps, case.eval_every)
    curve, backoffs = computed_steps(history)
    if gave_up:  # it failed at the evaluation after its last healthy one, or sooner
        backoffs.append({"step": None, "spent": curve[-1][1] + case.eval_every, "wasted": 0})
    seconds = time.perf_counter() - started
    logger.info(
        "%s n_h=%d %s lr=%g: %.4g after %d steps, %d backoffs%s, %.0f s",
        case.model.label,
        case.n_hidden,
        case.optimizer,
        case.lr,
        curve[-1][2],
        curve[-1][0],
        len(backoffs),
        " (gave up)" if gave_up else "",
        seconds,
    )
    return {
        "case": asdict(case),
        "curve": curve,
        "backoffs": backoffs,
        "gave_up": gave_up,
        "seconds": seconds,
        # the table's value for this run's length, as it was when the run was made
        "table_default": current_default(case.model, case.optimizer, case.steps),
    }


def fit_or_give_up(
    model: Any, train: torch.Tensor, valid: torch.Tensor, config: Any, steps: int, every: int
) -> tuple[list[dict[str, Any]], bool]:
    """``ssdcore.fit``'s history (seed 0), and whether it gave up (every backoff spent)."""
    try:
        history = ssdcore.fit(
            model, train, steps=steps, optimizer=config, eval_every=every, valid_data=valid, seed=0
        )
        return history, False
    except ssdcore.DivergenceError as error:  # a BlowUpError: every backoff spent
        return getattr(error, "history", []), True


def computed_steps(
    history: list[dict[str, Any]],
) -> tuple[list[tuple[int, int, float]], list[dict[str, Any]]]:
    """``fit``'s history as (step, computed steps, validation error) per healthy evaluation,
    and each backoff with the computed steps it had cost when it happened (``spent``) and the
    steps it threw away (``wasted``)."""
    curve, backoffs, wasted = [], [], 0
    for entry in history:
        if entry.get("event") == "backoff":
            thrown = entry["step"] - entry["rolled_back_to"]
            wasted += thrown
            backoffs.append(
                {"step": entry["step"], "spent": entry["step"] + wasted - thrown, "wasted": thrown}
            )
        else:
            step = int(entry["step"])
            curve.append((step, step + wasted, float(entry["reconstruction_error"])))
    return curve, backoffs


def at_horizon(run: dict[str, Any], horizon: int) -> dict[str, Any]:
    """A run's score within ``horizon`` computed steps: its last healthy error (inf when it
    gave up or was not finite), its backoffs and thrown-away steps so far."""
    reached = [point for point in run["curve"] if point[1] <= horizon]
    taken = [b for b in run["backoffs"] if b["spent"] <= horizon]
    failed = run["gave_up"] and any(b["step"] is None for b in taken)
    error = reached[-1][2] if reached and not failed else math.inf
    return {
        "recon": error if math.isfinite(error) else math.inf,
        "step": reached[-1][0] if reached else 0,
        "backoffs": sum(b["step"] is not None for b in taken),
        "wasted": sum(b["wasted"] for b in taken),
        "gave_up": failed,
    }


def cases(setup: Setup) -> list[Case]:
    """The first round: every model, size, optimizer and grid value (the table's current
    default at each horizon included), the small hidden layer first: a run cut short has whole
    cells."""
    todo = []
    for model in setup.models:
        for size in setup.sizes:
            for label, grid in setup.grids[model.kind].items():
                table = {current_default(model, label, horizon) for horizon in setup.horizons}
                values = sorted({*grid, *table})
                todo += [case_for(setup, model, size, label, lr) for lr in values]
    return sorted(todo, key=lambda c: c.n_hidden)


def earlier_defaults(
    setup: Setup, runs: list[dict[str, Any]], journal: Path
) -> list[dict[str, Any]]:
    """The journal's full-length runs at values the table held when they were made and holds
    no more (the old defaults the tables compare with), beside ``runs``."""
    have = {key_of(run["case"]) for run in runs}
    return [
        run
        for key, run in load_journal(journal).items()
        if key not in have
        and run["case"]["steps"] == setup.horizons[-1]
        and run["case"]["n_examples"] == setup.n_examples
        and run["case"]["lr"] == run["table_default"]
    ]


def between_cases(setup: Setup) -> list[Case]:
    """Each model and size under the default optimizer at the table's value for a run of
    ``setup.between`` steps, a length between the horizons where the table interpolates."""
    label, length = default_label(), setup.between
    return [
        case_for(setup, model, size, label, current_default(model, label, length), length)
        for model in setup.models
        for size in setup.sizes
    ]


def case_for(
    setup: Setup, model: Model, size: int, label: str, lr: float, steps: int | None = None
) -> Case:
    length = steps or setup.horizons[-1]
    return Case(model, size, label, lr, length, setup.eval_every, setup.n_examples)


def current_default(model: Model, label: str, steps: int | None = None) -> float:
    """The step-size table's value for this model and optimizer and a run of ``steps`` steps
    (what ``lr=None`` gives; None: a run of unknown length)."""
    name, rule = OPTIMIZERS[label]
    return default_lr(model.kind, name, model.variance, rule, steps)


def extension_cases(setup: Setup, runs: list[dict[str, Any]]) -> list[Case]:
    """One half-decade beyond the grid end where a cell's best sits, for any horizon."""
    todo = set()
    for (model, size, label), by_lr in grouped(runs).items():
        for horizon in setup.horizons:
            scores = {lr: at_horizon(run, horizon)["recon"] for lr, run in by_lr.items()}
            beyond = tuning.next_step_size(scores)
            if beyond is not None and beyond not in by_lr:
                todo.add(case_for(setup, model, size, label, beyond))
    return sorted(todo, key=lambda c: (c.n_hidden, c.model.label, c.optimizer, c.lr))


def grouped(runs: list[dict[str, Any]]) -> dict[tuple[Model, int, str], dict[float, Any]]:
    """Runs by (model, n_hidden, optimizer label), then by step size."""
    groups: dict[tuple[Model, int, str], dict[float, Any]] = {}
    for run in runs:
        case = run["case"]
        model = Model(**case["model"])
        groups.setdefault((model, case["n_hidden"], case["optimizer"]), {})[case["lr"]] = run
    return groups


def execute(
    todo: list[Any], workers: int, journal: Path, train: Callable[[Any], dict] = train_case
) -> list[dict[str, Any]]:
    """Trains every case with ``train`` in ``workers`` processes (each with one torch thread),
    appending each finished run to ``journal`` (JSON lines); cases found there are not trained
    again, so an interrupted run resumes where it stopped."""
    done = load_journal(journal)
    missing = [case for case in todo if key_of(case) not in done]
    logger.info("%d runs, %d of them in %s already", len(todo), len(todo) - len(missing), journal)
    with journal.open("a") as handle:
        if workers <= 1:
            finished = (train(case) for case in missing)
            for result in finished:
                done[key_of(result["case"])] = record(handle, result)
        else:
            with ProcessPoolExecutor(max_workers=workers) as pool:
                futures = [pool.submit(train, case) for case in missing]
                for future in as_completed(futures):
                    result = future.result()
                    done[key_of(result["case"])] = record(handle, result)
    return [done[key_of(case)] for case in todo]


def key_of(case: Any) -> str:
    """A case (a dataclass or its dict) as one JSON string (what the journal is keyed by)."""
    return json.dumps(case if isinstance(case, dict) else asdict(case), sort_keys=True)


def record(handle: Any, result: dict[str, Any]) -> dict[str, Any]:
    handle.write(json.dumps(result) + "\n")
    handle.flush()
    return result


def load_journal(journal: Path) -> dict[str, dict[str, Any]]:
    """The runs a journal holds, by case (a torn last line, from an interrupted write, is
    skipped)."""
    if not journal.exists():
        return {}
    runs = {}
    for line in journal.read_text().splitlines():
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        runs[key_of(result["case"])] = result
    return runs


def grid_rows(setup: Setup, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: its error and backoffs at each horizon."""
    rows = []
    for (model, size, label), by_lr in grouped(runs).items():
        for lr in sorted(by_lr):
            row: dict[str, Any] = {
                "dataset": model.dataset,
                "model": model.key,
                "n_hidden": size,
                "optimizer": label,
                "lr": lr,
                "table_default": lr == by_lr[lr]["table_default"],
            }
            for horizon in setup.horizons:
                score = at_horizon(by_lr[lr], horizon)
                row[f"recon_{horizon}"] = score["recon"]
                row[f"backoffs_{horizon}"] = score["backoffs"]
                row[f"wasted_{horizon}"] = score["wasted"]
            row["gave_up"] = by_lr[lr]["gave_up"]
            row["seconds"] = round(by_lr[lr]["seconds"], 1)
            rows.append(row)
    return rows


def cell_scores(
    setup: Setup, runs: list[dict[str, Any]]
) -> dict[tuple[str, str], dict[tuple[str, int, int], dict[float, float]]]:
    """(model key, optimizer label) -> (data set, n_hidden, horizon) -> step size -> error."""
    table: dict[tuple[str, str], dict[tuple[str, int, int], dict[float, float]]] = {}
    for (model, size, label), by_lr in grouped(runs).items():
        for horizon in setup.horizons:
            table.setdefault((model.key, label), {})[model.dataset, size, horizon] = {
                lr: at_horizon(run, horizon)["recon"] for lr, run in by_lr.items()
            }
    return table


def worst_ratio(cells: dict[Any, dict[float, float]], lr: float) -> tuple[float, Any]:
    """The largest ratio of ``lr``'s error to its cell's best, and the cell where it is."""
    ratios = {cell: ratio(scores[lr], min(scores.values())) for cell, scores in cells.items()}
    worst = max(ratios, key=lambda cell: ratios[cell])
    return ratios[worst], worst


def choose(setup: Setup, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model kind and form, optimizer and horizon: the grid value within 15% of that
    optimizer's best in the most of the horizon's cells (values run in every cell only); of
    equals, the smaller step (the paper rule's best step falls as n_hidden grows,
    docs/RESULTS.md §6, and the small step is the one that does not blow up). Beside it its
    worst ratio, and the old default's."""
    rows = []
    for (key, label), all_cells in cell_scores(setup, runs).items():
        for horizon in setup.horizons:
            cells = {cell: s for cell, s in all_cells.items() if cell[2] == horizon}
            rows.append(choice_row(runs, key, label, horizon, cells))
    return rows


def choice_row(
    runs: list[dict[str, Any]],
    key: str,
    label: str,
    horizon: int,
    cells: dict[tuple[str, int, int], dict[float, float]],
) -> dict[str, Any]:
    """The choice among one horizon's ``cells`` (see :func:`choose`)."""
    common_lrs = set.intersection(*(set(scores) for scores in cells.values()))
    chosen = min(common_lrs, key=lambda lr: (-cells_within(cells, lr), lr))
    worst, where = worst_ratio(cells, chosen)
    old = table_default(runs, key, label)
    old_ratio, old_where = worst_ratio(cells, old)
    return {
        "model": key,
        "optimizer": label,
        "horizon": horizon,
        "chosen_lr": chosen,
        "cells_within_15pct": f"{cells_within(cells, chosen)}/{len(cells)}",
        "worst_ratio": worst,
        "worst_cell": describe(where),
        "old_default": old,
        "old_cells_within_15pct": f"{cells_within(cells, old)}/{len(cells)}",
        "old_worst_ratio": old_ratio,
        "old_worst_cell": describe(old_where),
    }


def cells_within(cells: dict[Any, dict[float, float]], lr: float) -> int:
    """In how many cells ``lr`` is within TOLERANCE of the cell's best."""
    return sum(ratio(scores[lr], min(scores.values())) <= TOLERANCE for scores in cells.values())


def ratio(value: float, best: float) -> float:
    """``value / best``; 1 where both are infinite (no step size trains that cell)."""
    return 1.0 if math.isinf(best) else value / best


def table_default(runs: list[dict[str, Any]], key: str, label: str) -> float:
    """The step-size table's value for (model key, optimizer label) when ``runs`` were run."""
    return next(
        run["table_default"]
        for run in runs
        if Model(**run["case"]["model"]).key == key and run["case"]["optimizer"] == label
    )


def describe(cell: tuple[str, int, int]) -> str:
    dataset, size, horizon = cell
    return f"{dataset} n_h={size} @{horizon}"


def default_label() -> str:
    """The label of the optimizer and step rule a user who names neither gets."""
    return next(
        label
        for label, (name, rule) in OPTIMIZERS.items()
        if name == DEFAULT_OPTIMIZER and rule == DEFAULT_STEP_RULE
    )


def target_rows(
    setup: Setup, runs: list[dict[str, Any]], default: Callable[[Model, int], float], label: str
) -> list[dict[str, Any]]:
    """Per cell: optimizer ``label`` at its default step against the best of every optimizer
    and step rule on the grid. ``default(model, horizon)`` is the step size it is scored at."""
    table = cell_scores(setup, runs)
    rows = []
    for model in setup.models:
        for size in setup.sizes:
            for horizon in setup.horizons:
                cell = (model.dataset, size, horizon)
                best = min(
                    ((scores[cell][lr], label, lr))
                    for (key, label), scores in table.items()
                    if key == model.key and cell in scores
                    for lr in scores[cell]
                )
                lr = default(model, horizon)
                value = table[model.key, label][cell][lr]
                rows.append(
                    {
                        "dataset": model.dataset,
                        "model": model.key,
                        "n_hidden": size,
                        "horizon": horizon,
                        "default": f"{label} {lr:.3g}",
                        "default_recon": value,
                        "best": f"{best[1]} {best[2]:.3g}",
                        "best_recon": best[0],
                        "ratio": ratio(value, best[0]),
                        "met": ratio(value, best[0]) <= TOLERANCE,
                    }
                )
    return rows


def workers() -> int:
    return int(os.environ.get(WORKERS_ENV, "1"))


def run(out: Path, *, quick: bool = False) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    directory = common.output_dir(out, NAME)
    journal = directory / "runs.jsonl"
    runs = execute(cases(setup), workers(), journal)
    runs += earlier_defaults(setup, runs, journal)
    if setup.extend:
        more = extension_cases(setup, runs)
        logger.info("extending %d grids by one half-decade", len(more))
        runs += execute(more, workers(), journal)
    choice = write_tables(setup, runs, directory)
    # the table's interpolated value between the horizons, against every run scored there
    checks = execute(between_cases(setup), workers(), journal)
    label, between = default_label(), replace(setup, horizons=(setup.between,))
    rows = target_rows(between, runs + checks, lambda m, h: current_default(m, label, h), label)
    common.write_table(rows, directory, "target_between")
    return {"setup": asdict(setup), "runs": len(runs), "workers": workers(), "choice": choice}


def write_tables(setup: Setup, runs: list[dict[str, Any]], directory: Path) -> list[dict[str, Any]]:
    """The grid, choice and target tables of ``runs`` (also from a journal's runs)."""
    common.write_table(grid_rows(setup, runs), directory, "grid")
    choice = choose(setup, runs)
    common.write_table(choice, directory, "choice")
    # the target for each SSD step rule at the table's value for the horizon (as ssdcore.fit
    # and the service take it), and for the defaults as they were when the runs were made
    for label in ("ssd", "ssd-normalized"):
        rows = target_rows(setup, runs, lambda m, h, x=label: current_default(m, x, h), label)
        common.write_table(rows, directory, f"target_{label}")
    label = default_label()
    old = target_rows(setup, runs, lambda m, h: table_default(runs, m.key, label), label)
    common.write_table(old, directory, "target_old_defaults")
    return choice
