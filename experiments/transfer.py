"""SSD step sizes across model sizes: the paper's rule against the normalized one.

For each step rule (``OptimizerConfig.step_rule``) and each hidden-layer size, a small grid of
step sizes (half-decades) trains a Bernoulli RBM on binarized MNIST (a fixed subset; batch 100,
CD-1, the same seed everywhere) and scores it by its held-out log-likelihood: exact where n_h
allows enumeration, above that the certified pair (AIS upper, reverse-AIS lower; steps are
chosen by the lower one). The question: does the best step size found at the smallest size stay
(near-)best at the larger ones? ``transfer`` rows give, per rule and size, the best step there,
the likelihood the smallest size's best step gets there, and its loss against that size's own
best. ``python -m experiments transfer`` writes them to ``docs/figures/transfer/``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ssdcore
from experiments import common
from experiments.common import EvalPlan
from ssdcore.data import load_mnist, preprocess, split
from ssdcore.optim import OptimizerConfig

logger = logging.getLogger(__name__)

EXACT_MAX_HIDDEN = 20  # enumerate 2^n_h hidden states up to this size, AIS above


@dataclass(frozen=True)
class Setup:
    """Sizes, grids and budgets of one run of the experiment."""

    n_examples: int
    sizes: tuple[int, ...]  # hidden-layer sizes, the first one the size tuned at
    steps: int
    grids: dict[str, tuple[float, ...]]  # step rule -> step sizes
    ais_chains: int
    ais_betas: int


FULL = Setup(
    n_examples=4_000,
    sizes=(32, 128, 512),
    steps=1_000,
    grids={
        "paper": (3e-4, 1e-3, 3e-3, 1e-2, 3e-2),
        "normalized": (0.03, 0.1, 0.3, 1.0, 3.0),
    },
    ais_chains=100,
    ais_betas=500,
)
QUICK = Setup(
    n_examples=400,
    sizes=(4, 24),  # one exact size, one certified (above EXACT_MAX_HIDDEN)
    steps=20,
    grids={"paper": (1e-3, 1e-2), "normalized": (0.1, 1.0)},
    ais_chains=10,
    ais_betas=50,
)


def load_data(n_examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Binarized MNIST: the first ``n_examples`` images, split 80/20 at random (seed 0)."""
    images = preprocess(load_mnist(common.data_dir() / "mnist")[:n_examples], "binarize")
    return split(images, 0.2, seed=0)


def test_log_likelihood(
    model: ssdcore.RBM, train: torch.Tensor, test: torch.Tensor, setup: Setup
) -> dict[str, float]:
    """Held-out log-likelihood: exact for small n_h; above, the certified pair (AIS with the
    training data's base rates as ``test_ll``, reverse AIS's conservative ``ll_lower``)."""
    plan = EvalPlan(
        train,
        test,
        every=setup.steps,
        likelihood="exact" if model.n_hidden <= EXACT_MAX_HIDDEN else "ais",
        ais_chains=setup.ais_chains,
        ais_betas=setup.ais_betas,
    )
    return plan.log_likelihood(model)


def train_one(
    rule: str, lr: float, n_hidden: int, train: torch.Tensor, test: torch.Tensor, setup: Setup
) -> dict[str, Any]:
    """One run: SSD with ``rule`` at ``lr``; its held-out log-likelihood (−inf if it diverged)."""
    common.seed_everything(0)
    model = ssdcore.BernoulliRBM(train.shape[1], n_hidden)
    model.init_from_data(train)
    config = OptimizerConfig(
        "ssd",
        lr=lr,
        step_rule=rule,
        method=common.ssd_method(train.shape[1], n_hidden, 100),
    )
    trainer = ssdcore.Trainer(model, train, optimizer=config, batch_size=100, seed=0)
    try:
        trainer.train_steps(setup.steps)
        record = test_log_likelihood(model, train, test, setup)
        upper, lower = record["test_ll"], record["ll_lower"]
    except ssdcore.DivergenceError:
        upper = lower = -math.inf
    if not (math.isfinite(upper) and math.isfinite(lower)):
        upper = lower = -math.inf
    logger.info("%s lr %g n_h %d: test LL %.2f / %.2f", rule, lr, n_hidden, upper, lower)
    return {"rule": rule, "n_hidden": n_hidden, "lr": lr, "test_ll": upper, "ll_lower": lower}


def conservative(row: dict[str, Any]) -> float:
    """The lower of a run's two bounds. Reverse AIS is a lower bound only when its chains at
    β = 1 mix; on a badly trained model it can overshoot above the AIS value, and then the AIS
    value is the safer of the two."""
    return min(row["ll_lower"], row["test_ll"])


def transfer_rows(grid_rows: list[dict[str, Any]], setup: Setup) -> list[dict[str, Any]]:
    """Per rule and size: its best step, and what the smallest size's best step gives there.
    "Best" by the conservative value (:func:`conservative`); both bounds are reported."""
    rows = []
    for rule in setup.grids:
        by_size = {
            size: {r["lr"]: r for r in grid_rows if r["rule"] == rule and r["n_hidden"] == size}
            for size in setup.sizes
        }
        tuned = by_size[setup.sizes[0]]
        transferred = max(tuned, key=lambda lr: conservative(tuned[lr]))
        for size in setup.sizes:
            runs = by_size[size]
            best = max(runs, key=lambda lr, runs=runs: conservative(runs[lr]))
            rows.append(
                {
                    "rule": rule,
                    "n_hidden": size,
                    "best_lr": best,
                    "ll_best_lower": runs[best]["ll_lower"],
                    "ll_best_upper": runs[best]["test_ll"],
                    "tuned_lr": transferred,
                    "ll_tuned_lower": runs[transferred]["ll_lower"],
                    "ll_tuned_upper": runs[transferred]["test_ll"],
                    "loss_nats": conservative(runs[best]) - conservative(runs[transferred]),
                }
            )
    return rows


def run(out: Path, *, quick: bool = False) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    train, test = load_data(setup.n_examples)
    grid_rows = [
        train_one(rule, lr, size, train, test, setup)
        for rule, grid in setup.grids.items()
        for size in setup.sizes
        for lr in grid
    ]
    directory = common.output_dir(out, "transfer")
    common.write_table(grid_rows, directory, "grid")
    rows = transfer_rows(grid_rows, setup)
    common.write_table(rows, directory, "transfer")
    return {
        "setup": {**setup.__dict__, "grids": {k: list(v) for k, v in setup.grids.items()}},
        "grid": grid_rows,
        "transfer": rows,
    }
