"""MNIST (paper Fig. 3d–f and Table 1), with AIS test log-likelihoods and a 500-hidden-unit run.

The 10k MNIST images in the data directory, binarized (as in the paper, for both models), split
8k train / 2k test. n_h = 50, CD-10, batch 100: BRBM and GRBM with learned diagonal variance,
each trained by SGD, Nesterov SGD (momentum 0.9) and SSD (exact low-rank polar step).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch

from experiments import common
from experiments.common import EvalPlan, ModelSpec, RunResult, RunSpec
from ssdcore.data import load_mnist, preprocess, split
from ssdcore.optim import OptimizerConfig

logger = logging.getLogger(__name__)

NAME = "mnist"
IMAGE_SHAPE = (28, 28)
# Table 1 of the paper: seconds per 1k iterations, CD-10, batch 100, n_h = 50 (their hardware).
PAPER_SECONDS_PER_1K = {
    ("GRBM", "SSD"): 67.0,
    ("GRBM", "SGD"): 54.0,
    ("GRBM", "Nesterov"): 58.0,
    ("BRBM", "SSD"): 48.0,
    ("BRBM", "SGD"): 44.0,
    ("BRBM", "Nesterov"): 45.5,
}
OPTIMIZERS = ("SGD", "Nesterov", "SSD")
MODELS = {"BRBM": ("bernoulli", "mnist-brbm"), "GRBM": ("gaussian", "mnist-grbm")}
FALLBACK_LR = {"SGD": 0.1, "Nesterov": 0.01, "SSD": 1e-3}


@dataclass(frozen=True)
class Config:
    limit: int | None = None  # use only the first `limit` images (quick runs)
    test_fraction: float = 0.2
    n_hidden: int = 50
    cd_k: int = 10
    batch_size: int = 100
    steps: int = 1500
    eval_every: int = 100
    ais_points: int = 3  # AIS checkpoints per curve
    ais_chains: int = 100
    ais_betas: int = 1000
    timing_steps: int = 50  # per round, for Table 1
    timing_rounds: int = 3
    large_hidden: int = 500
    large_steps: int = 500
    large_eval_every: int = 50
    # GRBM variance floor: binarized digits have pixels that never change, whose learned
    # variance would otherwise sink to the library's 1e-4 and make C⁻¹-scaled steps explode.
    min_variance: float = 0.01
    seed: int = 0

    def model(self, kind: str, n_hidden: int) -> ModelSpec:
        return ModelSpec(kind, n_hidden, variance="diagonal", min_variance=self.min_variance)

    def method(self, n_hidden: int) -> str:
        return common.ssd_method(IMAGE_SHAPE[0] * IMAGE_SHAPE[1], n_hidden, self.batch_size)


FULL = Config()
QUICK = Config(
    limit=500,
    n_hidden=8,
    cd_k=1,
    batch_size=50,
    steps=10,
    eval_every=5,
    ais_points=1,
    ais_chains=8,
    ais_betas=20,
    timing_steps=2,
    timing_rounds=1,
    large_hidden=12,
    large_steps=4,
    large_eval_every=2,
)


def load_data(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test): binarized MNIST images, split at random with the experiment's seed."""
    images = load_mnist(common.data_dir() / "mnist")
    if config.limit is not None:
        images = images[: config.limit]
    images = preprocess(images, "binarize")
    return split(images, config.test_fraction, seed=config.seed)


def optimizer_config(name: str, lr: float, method: str = "lowrank") -> OptimizerConfig:
    """SGD, Nesterov SGD (momentum 0.9) or SSD with the exact polar `method`."""
    if name == "SGD":
        return OptimizerConfig(name="sgd", lr=lr)
    if name == "Nesterov":
        return OptimizerConfig(name="nesterov", lr=lr, momentum=0.9)
    return OptimizerConfig(name="ssd", lr=lr, method=method)


def runs(config: Config, chosen: dict[str, float]) -> list[RunSpec]:
    specs = []
    for model_name, (kind, key) in MODELS.items():
        for optimizer in OPTIMIZERS:
            lr = common.step_size(chosen, f"{key}/{optimizer.lower()}", FALLBACK_LR[optimizer])
            specs.append(
                RunSpec(
                    label=f"{model_name} {optimizer}",
                    model=config.model(kind, config.n_hidden),
                    optimizer=optimizer_config(optimizer, lr, config.method(config.n_hidden)),
                    steps=config.steps,
                    batch_size=config.batch_size,
                    cd_k=config.cd_k,
                    seed=config.seed,
                )
            )
    return specs


def eval_plan(
    config: Config,
    train: torch.Tensor,
    test: torch.Tensor,
    steps: int,
    every: int,
) -> EvalPlan:
    at = tuple(round(steps * i / config.ais_points) for i in range(1, config.ais_points + 1))
    return EvalPlan(
        train,
        test,
        every=every,
        likelihood="ais",
        likelihood_at=at,
        ais_chains=config.ais_chains,
        ais_betas=config.ais_betas,
        ais_seed=config.seed,
    )


def time_per_1k(config: Config, specs: list[RunSpec], train: torch.Tensor) -> list[dict[str, Any]]:
    """Seconds per 1k training iterations per run, the median of interleaved rounds.

    Rounds alternate between the runs so that a change in machine load hits all of them alike.
    Besides the runs' own SSD (the exact step by `Config.method`), SSD with the other exact
    method is timed too, so the table shows what the choice costs.
    """
    other = {"svd": "lowrank", "lowrank": "svd"}
    timed = list(specs)
    for spec in specs:
        if spec.label.endswith(" SSD"):
            method = other[spec.optimizer.method]
            timed.append(
                replace(
                    spec,
                    label=f"{spec.label} ({method})",
                    optimizer=replace(spec.optimizer, method=method),
                )
            )
    trainers = []
    for spec in timed:
        common.seed_everything(spec.seed)
        model = spec.model.build(train.shape[1])
        trainer = common.make_trainer(model, train, spec)
        trainer.train_steps(2)  # warm-up: first-call allocations
        trainers.append(trainer)
    seconds: dict[str, list[float]] = {spec.label: [] for spec in timed}
    for _ in range(config.timing_rounds):
        for spec, trainer in zip(timed, trainers, strict=True):
            started = time.perf_counter()
            trainer.train_steps(config.timing_steps)
            seconds[spec.label].append((time.perf_counter() - started) / config.timing_steps)
    rows = []
    for spec in timed:
        model_name, optimizer = spec.label.split(" ", 1)
        measured = float(np.median(seconds[spec.label]))
        sgd = float(np.median(seconds[f"{model_name} SGD"]))
        paper = PAPER_SECONDS_PER_1K.get((model_name, optimizer), math.nan)
        paper_sgd = PAPER_SECONDS_PER_1K[(model_name, "SGD")]
        name = optimizer if optimizer != "SSD" else f"SSD ({spec.optimizer.method})"
        rows.append(
            {
                "model": model_name,
                "optimizer": name,
                "s per 1k iterations": 1000 * measured,
                "÷ SGD": measured / sgd,
                "paper s per 1k": paper,
                "paper ÷ SGD": paper / paper_sgd,
            }
        )
    return sorted(rows, key=lambda r: (r["model"], r["optimizer"]))


def large_runs(config: Config, chosen: dict[str, float]) -> list[RunSpec]:
    """BRBM with 500 hidden units: SSD against Nesterov SGD, at the n_h = 50 step sizes."""
    specs = []
    for optimizer in ("Nesterov", "SSD"):
        lr = common.step_size(chosen, f"mnist-brbm/{optimizer.lower()}", FALLBACK_LR[optimizer])
        specs.append(
            RunSpec(
                label=f"BRBM-500 {optimizer}",
                model=config.model("bernoulli", config.large_hidden),
                optimizer=optimizer_config(optimizer, lr, config.method(config.large_hidden)),
                steps=config.large_steps,
                batch_size=config.batch_size,
                cd_k=config.cd_k,
                seed=config.seed,
            )
        )
    return specs


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Runs the MNIST experiment and writes its figures and tables under `out/mnist`."""
    config = QUICK if quick else FULL
    directory = common.output_dir(out, NAME)
    chosen = common.load_step_sizes()
    train, test = load_data(config)
    logger.info("MNIST: %d train, %d test images", len(train), len(test))

    specs = runs(config, chosen)
    plan = eval_plan(config, train, test, config.steps, config.eval_every)
    results = [common.execute(spec, plan) for spec in specs]
    timing = time_per_1k(config, specs, train)

    large_plan = eval_plan(config, train, test, config.large_steps, config.large_eval_every)
    large = [common.execute(spec, large_plan) for spec in large_runs(config, chosen)]

    write_outputs(directory, results, large, timing)
    return {
        "summary": common.summary_rows(results),
        "timing": timing,
        "large": common.summary_rows(large),
        "sparsity": sparsity_rows(results),
    }


# ---------------------------------------------------------------------------------------------
# Figures and tables


def sparsity_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    """How concentrated the learned weights are: spread, excess kurtosis, share of small entries."""
    rows = []
    for result in results:
        weights = result.model.W.detach().flatten().double()
        centered = weights - weights.mean()
        std = float(centered.std())
        kurtosis = float((centered**4).mean() / centered.var(unbiased=False) ** 2 - 3.0)
        small = float((weights.abs() < 0.1 * weights.abs().max()).double().mean())
        rows.append(
            {
                "run": result.label,
                "std(W)": std,
                "max|W|": float(weights.abs().max()),
                "excess kurtosis": kurtosis,
                "share |w| < 0.1·max": small,
            }
        )
    return rows


def filters_figure(results: list[RunResult], path: Path) -> Path:
    columns = max(1, math.isqrt(results[0].model.n_hidden))
    figure, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.4), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        weights = result.model.W.detach().T.cpu().numpy()  # (H, V): one filter per row
        axis.imshow(
            common.image_grid(weights, IMAGE_SHAPE, columns), cmap="gray", interpolation="nearest"
        )
        axis.set_title(result.label, fontsize=9)
        axis.axis("off")
    figure.tight_layout()
    return common.save_figure(figure, path)


def histogram_figure(results: list[RunResult], path: Path) -> Path:
    figure, axes = plt.subplots(1, len(results), figsize=(3.0 * len(results), 2.6), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        axis.hist(result.model.W.detach().flatten().numpy(), bins=80, color="C0")
        axis.set_yscale("log")
        axis.set_title(result.label, fontsize=9)
        axis.set_xlabel("w")
    figure.tight_layout()
    return common.save_figure(figure, path)


def variance_figure(results: list[RunResult], path: Path) -> Path:
    figure, axes = plt.subplots(1, len(results), figsize=(3.0 * len(results), 2.8), squeeze=False)
    for axis, result in zip(axes[0], results, strict=True):
        variance = result.model.log_var.detach().exp().reshape(IMAGE_SHAPE).numpy()
        shown = axis.imshow(variance, cmap="viridis")
        figure.colorbar(shown, ax=axis, fraction=0.046)
        axis.set_title(f"{result.label}: diag(C)", fontsize=9)
        axis.axis("off")
    figure.tight_layout()
    return common.save_figure(figure, path)


def curve_figures(directory: Path, curves: Sequence[Any]) -> None:
    """Fig. 3d and the AIS figure, from anything with `label` and `series` (runs, or curves
    loaded back from `curves.json` by `common.load_curves`). BRBM and GRBM get separate panels,
    the GRBM's on a log scale: its errors span several decades."""
    brbm = [c for c in curves if c.label.startswith("BRBM ")]
    grbm = [c for c in curves if c.label.startswith("GRBM ")]
    figure, axes = plt.subplots(1, 3, figsize=(12.6, 3.4))
    common.plot_metric(
        axes[0], brbm, "train_recon", title="(d) MNIST BRBM train", ylabel="reconstruction error"
    )
    common.plot_metric(
        axes[1], brbm, "test_recon", title="(d) MNIST BRBM test", ylabel="reconstruction error"
    )
    common.plot_metric(
        axes[2],
        grbm,
        "test_recon",
        title="(d) MNIST GRBM test (log scale)",
        ylabel="reconstruction error",
        log_y=True,
    )
    figure.tight_layout()
    common.save_figure(figure, directory / "fig3d_recon.png")
    figure, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    common.plot_metric(
        axes[0], brbm, "test_ll", title="BRBM AIS test log-likelihood", ylabel="nats per example"
    )
    common.plot_metric(
        axes[1], grbm, "test_ll", title="GRBM AIS test log-density", ylabel="nats per example"
    )
    figure.tight_layout()
    common.save_figure(figure, directory / "ais_ll.png")


def write_outputs(
    directory: Path, results: list[RunResult], large: list[RunResult], timing: list[dict[str, Any]]
) -> None:
    brbm = [r for r in results if r.label.startswith("BRBM")]
    grbm = [r for r in results if r.label.startswith("GRBM")]
    curve_figures(directory, results)
    filters_figure(brbm, directory / "fig3e_filters_brbm.png")
    filters_figure(grbm, directory / "fig3e_filters_grbm.png")
    histogram_figure(results, directory / "w_histograms.png")
    variance_figure(grbm, directory / "fig3f_variances.png")
    common.curve_figure(
        large,
        [
            ("test_recon", "BRBM n_h = 500 test", "reconstruction error"),
            ("test_ll", "BRBM n_h = 500 AIS test LL", "nats per example"),
        ],
        directory / "h500.png",
    )
    common.write_table(common.summary_rows(results), directory, "summary")
    common.write_table(timing, directory, "table1_time")
    common.write_table(sparsity_rows(results), directory, "sparsity")
    common.write_table(common.summary_rows(large), directory, "h500_summary")
    common.write_curves([*results, *large], directory, "curves")
