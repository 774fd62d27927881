"""Step sizes for a fair comparison: a small grid per optimizer and setting, scored on validation.

For each setting (data set, model, CD-k) and optimizer, a short run is trained at every step size
of the optimizer's grid on 80% of the experiment's training portion and scored by the mean
reconstruction error on the other 20% (the validation set) over the run's last evaluations. The
test portion is never seen. The best value of each grid goes into `experiments/step_sizes.json`,
which the other experiments read; a full run rewrites it, a quick run leaves it alone.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch
from ssdcore.data import split

from experiments import common, freyface, mnist, simulation
from experiments.common import EvalPlan, ModelSpec, RunSpec, TorchOptimizer
from ssdcore.optim import OptimizerConfig

logger = logging.getLogger(__name__)

NAME = "tuning"
# Half-decade grids, centred where each update rule's step has a sensible size. SSD's step is
# ‖σ(G)‖₁·UVᵀ (and ‖g‖₁·sign(g) for vectors), far longer than G itself, hence its small values.
GRIDS: dict[str, tuple[float, ...]] = {
    "sgd": (0.01, 0.03, 0.1, 0.3),
    "nesterov": (0.001, 0.003, 0.01, 0.03),
    "ssd": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3),
    "adam": (3e-4, 1e-3, 3e-3, 1e-2),
    "rmsprop": (3e-4, 1e-3, 3e-3, 1e-2),
    "pssd-rmsprop": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3),
    "pssd-adam": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3),
}
VALID_FRACTION = 0.2
SCORE_POINTS = 3  # validation error averaged over the last few evaluations: less noise


@dataclass(frozen=True)
class Setting:
    """A data set and model on which a list of optimizers is tuned."""

    key: str
    load: Callable[[], torch.Tensor]  # the experiment's training portion
    model: ModelSpec
    optimizers: tuple[str, ...]
    steps: int
    cd_k: int
    batch_size: int
    eval_every: int


def optimizer_for(name: str, lr: float) -> OptimizerConfig | TorchOptimizer:
    if name == "sgd":
        return OptimizerConfig(name="sgd", lr=lr)
    if name == "nesterov":
        return OptimizerConfig(name="nesterov", lr=lr, momentum=0.9)
    if name == "ssd":
        return OptimizerConfig(name="ssd", lr=lr, method="lowrank")
    if name in ("adam", "rmsprop"):
        return TorchOptimizer(name, lr)
    preconditioner = name.removeprefix("pssd-")
    # the preconditioned gradient is full-rank: the exact SVD is the polar method
    return OptimizerConfig(name="ssd-preconditioned", lr=lr, preconditioner=preconditioner)


def settings(quick: bool) -> list[Setting]:
    sim = simulation.QUICK if quick else simulation.FULL
    mn = mnist.QUICK if quick else mnist.FULL
    ff = freyface.QUICK if quick else freyface.FULL
    steps = {"sim": 4, "mnist": 4, "ff": 4} if quick else {"sim": 1000, "mnist": 400, "ff": 300}
    every = 2 if quick else 50

    def sim_train() -> torch.Tensor:
        return simulation.load_data(sim)[0]

    def mnist_train() -> torch.Tensor:
        return mnist.load_data(mn)[0]

    def ff_train() -> torch.Tensor:
        return freyface.load_data(ff)[0]

    common_mnist = {
        "steps": steps["mnist"],
        "cd_k": mn.cd_k,
        "batch_size": mn.batch_size,
        "eval_every": every,
    }
    common_ff = {
        "steps": steps["ff"],
        "cd_k": ff.cd_k,
        "batch_size": ff.batch_size,
        "eval_every": every,
    }
    common_sim = {
        "steps": steps["sim"],
        "cd_k": sim.cd_k,
        "batch_size": sim.batch_size,
        "eval_every": every,
    }
    return [
        Setting(
            "simulation-brbm",
            sim_train,
            ModelSpec("bernoulli", sim.n_hidden),
            ("sgd", "ssd"),
            **common_sim,
        ),
        Setting(
            "simulation-grbm",
            sim_train,
            ModelSpec("gaussian", sim.n_hidden, "isotropic"),
            ("sgd", "ssd"),
            **common_sim,
        ),
        Setting(
            "mnist-brbm",
            mnist_train,
            ModelSpec("bernoulli", mn.n_hidden),
            ("sgd", "nesterov", "ssd"),
            **common_mnist,
        ),
        Setting(
            "mnist-grbm",
            mnist_train,
            ModelSpec("gaussian", mn.n_hidden, "diagonal"),
            ("sgd", "nesterov", "ssd"),
            **common_mnist,
        ),
        Setting(
            "beyond",
            mnist_train,
            ModelSpec("bernoulli", mn.n_hidden),
            ("adam", "rmsprop", "pssd-rmsprop", "pssd-adam"),
            **common_mnist,
        ),
        Setting(
            "freyface-brbm",
            ff_train,
            ModelSpec("bernoulli", ff.n_hidden),
            ("nesterov", "ssd"),
            **common_ff,
        ),
        Setting(
            "freyface-grbm",
            ff_train,
            ModelSpec("gaussian", ff.n_hidden, "diagonal"),
            ("nesterov", "ssd"),
            **common_ff,
        ),
    ]


def score(result: common.RunResult) -> float:
    """Mean validation reconstruction error of the last evaluations; inf when it diverged."""
    if result.diverged_at is not None:
        return math.inf
    _, values = result.series("test_recon")
    tail = values[-SCORE_POINTS:]
    return sum(tail) / len(tail) if tail and all(map(math.isfinite, tail)) else math.inf


def tune_setting(
    setting: Setting,
    grids: dict[str, tuple[float, ...]],
    seed: int,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Runs every grid point of every optimizer of `setting`; returns the rows and the choices."""
    train, valid = split(setting.load(), VALID_FRACTION, seed=seed)
    plan = EvalPlan(train, valid, every=setting.eval_every)
    rows, chosen = [], {}
    for name in setting.optimizers:
        scores = {}
        for lr in grids[name]:
            spec = RunSpec(
                f"{setting.key}/{name} lr={lr:g}",
                setting.model,
                optimizer_for(name, lr),
                setting.steps,
                setting.batch_size,
                setting.cd_k,
                seed=seed,
            )
            scores[lr] = score(common.execute(spec, plan))
        best = min(scores, key=lambda lr: scores[lr])
        edge = best in (grids[name][0], grids[name][-1])
        if edge:
            logger.warning(
                "%s/%s: best step size %g is at the edge of the grid", setting.key, name, best
            )
        chosen[f"{setting.key}/{name}"] = best
        rows += [
            {
                "setting": setting.key,
                "optimizer": name,
                "lr": lr,
                "valid_recon": value,
                "chosen": "yes" + (" (grid edge)" if edge else "") if lr == best else "",
            }
            for lr, value in scores.items()
        ]
    return rows, chosen


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Tunes every setting and writes the grid table, a figure and the chosen step sizes."""
    directory = common.output_dir(out, NAME)
    grids = {k: v[1:3] for k, v in GRIDS.items()} if quick else GRIDS
    rows: list[dict[str, Any]] = []
    chosen: dict[str, float] = {}
    for setting in settings(quick):
        setting_rows, setting_chosen = tune_setting(setting, grids, seed=0)
        rows += setting_rows
        chosen |= setting_chosen
    common.write_table(rows, directory, "grid")
    document = {
        "chosen": chosen,
        "grids": {k: list(v) for k, v in grids.items()},
        "criterion": f"mean validation reconstruction error over the last "
        f"{SCORE_POINTS} evaluations; {VALID_FRACTION:.0%} of the training "
        "portion held out",
    }
    (directory / "step_sizes.json").write_text(json.dumps(document, indent=1) + "\n")
    if not quick:
        common.STEP_SIZES_PATH.write_text(json.dumps(document, indent=1) + "\n")
    grid_figure(rows, directory / "grid.png")
    return {"chosen": chosen}


def grid_figure(rows: list[dict[str, Any]], path: Path) -> Path:
    keys = list(dict.fromkeys(r["setting"] for r in rows))
    figure, axes = plt.subplots(1, len(keys), figsize=(2.9 * len(keys), 2.8), squeeze=False)
    for axis, key in zip(axes[0], keys, strict=True):
        for name in dict.fromkeys(r["optimizer"] for r in rows if r["setting"] == key):
            points = [
                (r["lr"], r["valid_recon"])
                for r in rows
                if r["setting"] == key
                and r["optimizer"] == name
                and math.isfinite(r["valid_recon"])
            ]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=name)
        axis.set_xscale("log")
        axis.set_title(key, fontsize=9)
        axis.set_xlabel("step size")
        axis.legend(fontsize=7)
    axes[0][0].set_ylabel("validation recon. error")
    figure.tight_layout()
    return common.save_figure(figure, path)
