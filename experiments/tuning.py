"""Step sizes for a fair comparison: a small grid per optimizer and setting, scored on validation.

For each setting (data set, model, CD-k) and optimizer, a short run is trained at every step size
of the optimizer's grid on 80% of the experiment's training portion and scored by the mean
reconstruction error on the other 20% (the validation set) over the run's last evaluations. The
test portion is never seen. When the best value sits at an end of the grid, the grid is extended
by one more half-decade in that direction (at most `MAX_EXTENSIONS` times), so that a chosen value
is a minimum rather than a boundary. The best value of each grid goes into
`experiments/step_sizes.json`, which the other experiments read; a full run rewrites it after
each setting (so the next experiment may start early), a quick run leaves it alone.

The runs of a grid differ only in their step size, so those `ssdcore.pack` can train together
(Bernoulli and Gaussian RBMs with SGD, Nesterov or SSD) are trained as one pack per setting and
optimizer, each run with its own seed and step size and bit for bit its solo trajectory on the
CPU; the rest (Adam, RMSprop, preconditioned SSD) run one by one. `--sequential` trains every
run alone.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

from experiments import common, freyface, mnist, packed, simulation
from experiments.common import EvalPlan, ModelSpec, RunSpec, TorchOptimizer
from ssdcore.data import split
from ssdcore.optim import OptimizerConfig

logger = logging.getLogger(__name__)

NAME = "tuning"
HALF_DECADE = 10**0.5
# Starting grids (half-decades), by model family, centred where a probe on MNIST found each update
# rule's useful range. SSD's step is ‖σ(G)‖₁·UVᵀ (‖g‖₁·sign(g) for vectors), much longer than G;
# for the GRBM the l∞ step of the 784 log-variances moves each by lr·‖g‖₁, hence far smaller values.
GRIDS: dict[str, dict[str, tuple[float, ...]]] = {
    "bernoulli": {
        "sgd": (0.1, 0.3, 1.0, 3.0),
        "nesterov": (0.01, 0.03, 0.1, 0.3),
        "ssd": (1e-3, 3e-3, 1e-2, 3e-2),
        "adam": (3e-4, 1e-3, 3e-3, 1e-2),
        "rmsprop": (3e-4, 1e-3, 3e-3, 1e-2),
        "pssd-rmsprop": (1e-4, 3e-4, 1e-3, 3e-3),
        "pssd-adam": (1e-4, 3e-4, 1e-3, 3e-3),
    },
    "gaussian": {
        "sgd": (0.003, 0.01, 0.03, 0.1),
        "nesterov": (0.001, 0.003, 0.01, 0.03),
        "ssd": (1e-5, 3e-5, 1e-4, 3e-4),
    },
}
MAX_EXTENSIONS = 2
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
    ssd_method: str = "svd"


def optimizer_for(name: str, lr: float, ssd_method: str) -> OptimizerConfig | TorchOptimizer:
    if name == "sgd":
        return OptimizerConfig(name="sgd", lr=lr)
    if name == "nesterov":
        return OptimizerConfig(name="nesterov", lr=lr, momentum=0.9)
    if name == "ssd":
        return OptimizerConfig(name="ssd", lr=lr, method=ssd_method)
    if name in ("adam", "rmsprop"):
        return TorchOptimizer(name, lr)
    # the preconditioned gradient is full-rank: the exact SVD is the polar method
    return OptimizerConfig(name="ssd-preconditioned", lr=lr, preconditioner=name[len("pssd-") :])


def settings(quick: bool) -> list[Setting]:
    """The settings in the order they are tuned: the cheap simulation first."""
    sim = simulation.QUICK if quick else simulation.FULL
    mn = mnist.QUICK if quick else mnist.FULL
    ff = freyface.QUICK if quick else freyface.FULL
    steps = {"sim": 4, "mnist": 4, "ff": 4} if quick else {"sim": 600, "mnist": 200, "ff": 150}
    every = 2 if quick else 25

    def sim_train() -> torch.Tensor:
        return simulation.load_data(sim)[0]

    def mnist_train() -> torch.Tensor:
        return mnist.load_data(mn)[0]

    def ff_train() -> torch.Tensor:
        return freyface.load_data(ff)[0]

    def shared(config: Any, n_visible: int, key: str) -> dict[str, Any]:
        return {
            "steps": steps[key],
            "cd_k": config.cd_k,
            "batch_size": config.batch_size,
            "eval_every": every,
            "ssd_method": common.ssd_method(n_visible, config.n_hidden, config.batch_size),
        }

    sim_args = shared(sim, sim.n_visible, "sim")
    mnist_args = shared(mn, 784, "mnist")
    ff_args = shared(ff, 560, "ff")
    return [
        Setting(
            "simulation-brbm",
            sim_train,
            ModelSpec("bernoulli", sim.n_hidden),
            ("sgd", "ssd"),
            **sim_args,
        ),
        Setting(
            "simulation-grbm",
            sim_train,
            ModelSpec("gaussian", sim.n_hidden, "isotropic"),
            ("sgd", "ssd"),
            **sim_args,
        ),
        Setting(
            "mnist-brbm",
            mnist_train,
            mn.model("bernoulli", mn.n_hidden),
            ("sgd", "nesterov", "ssd"),
            **mnist_args,
        ),
        Setting(
            "mnist-grbm",
            mnist_train,
            mn.model("gaussian", mn.n_hidden),
            ("sgd", "nesterov", "ssd"),
            **mnist_args,
        ),
        Setting("freyface-brbm", ff_train, ff.model("bernoulli"), ("nesterov", "ssd"), **ff_args),
        Setting("freyface-grbm", ff_train, ff.model("gaussian"), ("nesterov", "ssd"), **ff_args),
        Setting(
            "beyond",
            mnist_train,
            mn.model("bernoulli", mn.n_hidden),
            ("adam", "rmsprop", "pssd-rmsprop", "pssd-adam"),
            **mnist_args,
        ),
    ]


def score(result: common.RunResult) -> float:
    """Mean validation reconstruction error of the last evaluations; inf when it diverged."""
    if result.diverged_at is not None:
        return math.inf
    _, values = result.series("test_recon")
    tail = values[-SCORE_POINTS:]
    return sum(tail) / len(tail) if tail and all(map(math.isfinite, tail)) else math.inf


def run_spec(setting: Setting, name: str, lr: float, seed: int) -> RunSpec:
    """The short run that scores step size `lr` of optimizer `name` on `setting`."""
    return RunSpec(
        f"{setting.key}/{name} lr={lr:.3g}",
        setting.model,
        optimizer_for(name, lr, setting.ssd_method),
        setting.steps,
        setting.batch_size,
        setting.cd_k,
        seed=seed,
    )


def next_step_size(scores: dict[float, float]) -> float | None:
    """One half-decade past the end of the grid where the best score sits, or None when the
    best is inside the grid (or every run diverged)."""
    ordered = sorted(scores)
    best = min(ordered, key=lambda lr: scores[lr])
    if math.isinf(scores[best]) or best not in (ordered[0], ordered[-1]):
        return None
    beyond = best * HALF_DECADE if best == ordered[-1] else best / HALF_DECADE
    return float(f"{beyond:.3g}")


def tune_setting(
    setting: Setting, quick: bool, seed: int, *, sequential: bool = False
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Tunes every optimizer of `setting`; returns the table rows and the chosen step sizes.

    The grids of all optimizers are trained in one round, then each extension in a round of
    its own: within a round, runs that can share a pack are trained as one
    (`experiments.packed`) unless `sequential`; each run is scored as if trained alone.
    """
    train, valid = split(setting.load(), VALID_FRACTION, seed=seed)
    plan = EvalPlan(train, valid, every=setting.eval_every)
    scores: dict[str, dict[float, float]] = {name: {} for name in setting.optimizers}
    pack_sizes: dict[tuple[str, float], int] = {}
    grids = GRIDS[setting.model.kind]
    pending = {
        name: list(grids[name][1:3] if quick else grids[name]) for name in setting.optimizers
    }
    for _ in range(1 + (0 if quick else MAX_EXTENSIONS)):
        points = [(name, lr) for name, grid in pending.items() for lr in grid]
        specs = [run_spec(setting, name, lr, seed) for name, lr in points]
        results = packed.execute_all(specs, plan, packed=not sequential)
        for (name, lr), result in zip(points, results, strict=True):
            scores[name][lr] = score(result)
            pack_sizes[name, lr] = result.extra.get("pack_size", 1)
        pending = {
            name: [lr]
            for name in setting.optimizers
            if (lr := next_step_size(scores[name])) is not None
        }
        if not pending:
            break
    rows, chosen = [], {}
    for name in setting.optimizers:
        ordered = sorted(scores[name])
        best = min(ordered, key=lambda lr: scores[name][lr])
        edge = best in (ordered[0], ordered[-1])
        if edge:
            logger.warning(
                "%s/%s: best step size %g is at the end of the grid", setting.key, name, best
            )
        chosen[f"{setting.key}/{name}"] = best
        rows += [
            {
                "setting": setting.key,
                "optimizer": name,
                "lr": lr,
                "valid_recon": scores[name][lr],
                "chosen": ("yes (grid end)" if edge else "yes") if lr == best else "",
                "pack": pack_sizes[name, lr],
            }
            for lr in ordered
        ]
    return rows, chosen


def run(out: Path, quick: bool = False, sequential: bool = False) -> dict[str, Any]:
    """Tunes every setting and writes the grid table, a figure and the chosen step sizes;
    `sequential` trains every run alone (the reference the packed runs must match)."""
    directory = common.output_dir(out, NAME)
    rows: list[dict[str, Any]] = []
    chosen: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for setting in settings(quick):
        started = time.perf_counter()
        setting_rows, setting_chosen = tune_setting(setting, quick, seed=0, sequential=sequential)
        seconds[setting.key] = time.perf_counter() - started
        logger.info("%s tuned in %.0f s", setting.key, seconds[setting.key])
        rows += setting_rows
        chosen |= setting_chosen
        document = {
            "chosen": chosen,
            "grids": GRIDS,
            "extensions": 0 if quick else MAX_EXTENSIONS,
            "criterion": f"mean validation reconstruction error over the last {SCORE_POINTS} "
            f"evaluations; {VALID_FRACTION:.0%} of the training portion held out",
        }
        text = json.dumps(document, indent=1) + "\n"
        (directory / "step_sizes.json").write_text(text)
        if not quick:
            common.STEP_SIZES_PATH.write_text(text)
        common.write_table(rows, directory, "grid")
    grid_figure(rows, directory / "grid.png")
    return {"chosen": chosen, "packed": not sequential, "setting_seconds": seconds}


def grid_figure(rows: list[dict[str, Any]], path: Path) -> Path:
    """Validation error against step size, one panel per setting, both axes logarithmic."""
    keys = list(dict.fromkeys(r["setting"] for r in rows))
    columns = 4
    panel_rows = -(-len(keys) // columns)
    figure, grid = plt.subplots(
        panel_rows, columns, figsize=(3.2 * columns, 2.8 * panel_rows), squeeze=False
    )
    axes = list(grid.flatten())
    for unused in axes[len(keys) :]:
        unused.axis("off")
    for axis, key in zip(axes, keys, strict=False):
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
        axis.set_yscale("log")  # diverging step sizes reach errors of 1e12
        axis.set_title(key, fontsize=9)
        axis.set_xlabel("step size")
        axis.set_ylabel("validation recon. error")
        axis.legend(fontsize=7)
    figure.tight_layout()
    return common.save_figure(figure, path)
