"""Beyond the paper, on MNIST (BRBM, n_h = 50, batch 100, the 8k/2k split of `experiments.mnist`).

1. Adaptive steps: preconditioned SSD (RMSprop- and Adam-scaled spectral steps) against plain SSD
   and against `torch.optim.Adam` / `torch.optim.RMSprop` fed the same CD-10 gradients.
2. Polar methods for the spectral step (svd, lowrank, randomized, newton-schulz): accuracy of one
   step on a real CD gradient against `torch.linalg.svd`, time per step, and training quality.
3. PCD against CD under SSD.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

import ssdcore
from experiments import common, mnist
from experiments.common import EvalPlan, ModelSpec, RunResult, RunSpec, TorchOptimizer
from ssdcore.optim import OptimizerConfig, polar

logger = logging.getLogger(__name__)

NAME = "beyond"
LL_FLOOR = -1000.0  # nats per example; the adaptive figure leaves runs below it off its scale
POLAR_METHODS = ("svd", "lowrank", "randomized", "newton-schulz")
FALLBACK_LR = {"adam": 1e-3, "rmsprop": 1e-3, "pssd-rmsprop": 1e-4, "pssd-adam": 1e-4}


@dataclass(frozen=True)
class Config:
    data: mnist.Config = mnist.FULL
    n_hidden: int = 50
    steps: int = 1000
    eval_every: int = 100
    ais_points: int = 2
    polar_steps: int = 600
    polar_timing_hidden: tuple[int, ...] = (50, 500)
    polar_timing_steps: int = 20
    polar_timing_rounds: int = 3
    pcd_k: int = 1
    seed: int = 0

    @property
    def ssd_method(self) -> str:
        return common.ssd_method(784, self.n_hidden, self.data.batch_size)


FULL = Config()
QUICK = Config(
    data=mnist.QUICK,
    n_hidden=8,
    steps=10,
    eval_every=5,
    ais_points=1,
    polar_steps=6,
    polar_timing_hidden=(8,),
    polar_timing_steps=2,
    polar_timing_rounds=1,
)


def _spec(
    config: Config,
    label: str,
    optimizer: Any,
    *,
    steps: int | None = None,
    cd_k: int | None = None,
    persistent: bool = False,
    n_hidden: int | None = None,
) -> RunSpec:
    return RunSpec(
        label=label,
        model=ModelSpec("bernoulli", n_hidden or config.n_hidden),
        optimizer=optimizer,
        steps=steps or config.steps,
        batch_size=config.data.batch_size,
        cd_k=cd_k or config.data.cd_k,
        persistent=persistent,
        seed=config.seed,
    )


def adaptive_runs(config: Config, chosen: dict[str, float]) -> list[RunSpec]:
    lr = {k: common.step_size(chosen, f"beyond/{k}", v) for k, v in FALLBACK_LR.items()}
    ssd_lr = common.step_size(chosen, "mnist-brbm/ssd", mnist.FALLBACK_LR["SSD"])
    return [
        _spec(config, "SSD", OptimizerConfig(name="ssd", lr=ssd_lr, method=config.ssd_method)),
        _spec(
            config,
            "PSSD-RMSprop",
            OptimizerConfig(
                name="ssd-preconditioned",
                lr=lr["pssd-rmsprop"],
                preconditioner="rmsprop",
            ),
        ),
        _spec(
            config,
            "PSSD-Adam",
            OptimizerConfig(
                name="ssd-preconditioned",
                lr=lr["pssd-adam"],
                preconditioner="adam",
            ),
        ),
        _spec(config, "Adam", TorchOptimizer("adam", lr["adam"])),
        _spec(config, "RMSprop", TorchOptimizer("rmsprop", lr["rmsprop"])),
    ]


def polar_runs(
    config: Config, chosen: dict[str, float], n_hidden: int | None = None, steps: int | None = None
) -> list[RunSpec]:
    ssd_lr = common.step_size(chosen, "mnist-brbm/ssd", mnist.FALLBACK_LR["SSD"])
    return [
        _spec(
            config,
            f"SSD {method}",
            OptimizerConfig(name="ssd", lr=ssd_lr, method=method),
            steps=steps or config.polar_steps,
            n_hidden=n_hidden,
        )
        for method in POLAR_METHODS
    ]


def pcd_runs(config: Config, chosen: dict[str, float]) -> list[RunSpec]:
    ssd_lr = common.step_size(chosen, "mnist-brbm/ssd", mnist.FALLBACK_LR["SSD"])
    optimizer = OptimizerConfig(name="ssd", lr=ssd_lr, method=config.ssd_method)
    k = config.pcd_k
    return [
        _spec(config, f"SSD CD-{k}", optimizer, cd_k=k),
        _spec(config, f"SSD PCD-{k}", optimizer, cd_k=k, persistent=True),
    ]


def polar_accuracy(config: Config, train: torch.Tensor) -> list[dict[str, Any]]:
    """One spectral step on a real CD gradient: each method's direction and nuclear norm against
    `torch.linalg.svd`, and the time the polar step alone takes (median of repeats)."""
    rows = []
    for n_hidden in config.polar_timing_hidden:
        common.seed_everything(config.seed)
        model = ssdcore.BernoulliRBM(train.shape[1], n_hidden)
        estimator = ssdcore.CDEstimator(model, k=config.data.cd_k)
        estimator.estimate(train[: config.data.batch_size])
        gradient = model.W.grad.detach().clone()
        factors = model.W.grad_factors
        u, s, vh = torch.linalg.svd(gradient.double(), full_matrices=False)
        # Singular values below float32 rounding of G count as zero, as in ssdcore.optim.polar:
        # the reference direction spans G's numerical range only (rank ≤ 2B).
        tolerance = s[0] * max(gradient.shape) * torch.finfo(torch.float32).eps
        rank = int((s > tolerance).sum())
        exact = (u[:, :rank] @ vh[:rank]).float()
        nuclear = float(s.sum())
        for method in POLAR_METHODS:
            direction, norm = polar_step(method, gradient, factors)
            seconds = []
            for _ in range(5):
                started = time.perf_counter()
                polar_step(method, gradient, factors)
                seconds.append(time.perf_counter() - started)
            rows.append(
                {
                    "n_hidden": n_hidden,
                    "method": method,
                    "rank": rank,
                    "direction rel. error": float((direction - exact).norm() / exact.norm()),
                    "nuclear norm rel. error": abs(float(norm) - nuclear) / nuclear,
                    "ms per polar step": 1000 * statistics.median(seconds),
                }
            )
    return rows


def polar_step(method: str, gradient: torch.Tensor, factors: Any) -> tuple[torch.Tensor, Any]:
    """The polar factor and nuclear norm of `gradient` by `method`, as the SSD optimizer calls
    them (`ssdcore.optim.polar`; the randomized sketch rank is the factors' rank)."""
    if method == "svd":
        return polar.polar_svd(gradient)
    if method == "lowrank":
        return polar.polar_lowrank(*factors)
    if method == "randomized":
        rank = min(factors[0].shape[1], *gradient.shape)
        return polar.polar_randomized(gradient, rank, generator=torch.Generator().manual_seed(0))
    return polar.polar_newton_schulz(gradient)


def polar_timing(
    config: Config,
    chosen: dict[str, float],
    train: torch.Tensor,
) -> list[dict[str, Any]]:
    """Milliseconds per full SSD training step by polar method, interleaved rounds, median."""
    rows = []
    for n_hidden in config.polar_timing_hidden:
        specs = polar_runs(config, chosen, n_hidden=n_hidden, steps=1)
        trainers = []
        for spec in specs:
            common.seed_everything(spec.seed)
            trainer = common.make_trainer(spec.model.build(train.shape[1]), train, spec)
            trainer.train_steps(2)
            trainers.append(trainer)
        seconds: dict[str, list[float]] = {s.label: [] for s in specs}
        for _ in range(config.polar_timing_rounds):
            for spec, trainer in zip(specs, trainers, strict=True):
                started = time.perf_counter()
                trainer.train_steps(config.polar_timing_steps)
                elapsed = time.perf_counter() - started
                seconds[spec.label].append(elapsed / config.polar_timing_steps)
        reference = statistics.median(seconds["SSD lowrank"])
        for spec in specs:
            measured = statistics.median(seconds[spec.label])
            rows.append(
                {
                    "n_hidden": n_hidden,
                    "method": spec.label.removeprefix("SSD "),
                    "ms per training step": 1000 * measured,
                    "÷ lowrank": measured / reference,
                }
            )
    return rows


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Runs the three studies and writes their figures and tables under `out/beyond`."""
    config = QUICK if quick else FULL
    directory = common.output_dir(out, NAME)
    chosen = common.load_step_sizes()
    train, test = mnist.load_data(config.data)

    def plan(steps: int) -> EvalPlan:
        at = tuple(round(steps * i / config.ais_points) for i in range(1, config.ais_points + 1))
        return EvalPlan(
            train,
            test,
            every=config.eval_every,
            likelihood="ais",
            likelihood_at=at,
            ais_chains=config.data.ais_chains,
            ais_betas=config.data.ais_betas,
            ais_seed=config.seed,
        )

    adaptive = [common.execute(s, plan(config.steps)) for s in adaptive_runs(config, chosen)]
    accuracy = polar_accuracy(config, train)
    polar_quality = [
        common.execute(s, plan(config.polar_steps)) for s in polar_runs(config, chosen)
    ]
    timing = polar_timing(config, chosen, train)
    pcd = [common.execute(s, plan(config.steps)) for s in pcd_runs(config, chosen)]

    write_outputs(directory, adaptive, polar_quality, pcd, accuracy, timing)
    return {
        "adaptive": common.summary_rows(adaptive),
        "polar_accuracy": accuracy,
        "polar_quality": common.summary_rows(polar_quality),
        "polar_timing": timing,
        "pcd": common.summary_rows(pcd),
    }


def curve_figures(
    directory: Path, adaptive: Sequence[Any], polar_quality: Sequence[Any], pcd: Sequence[Any]
) -> None:
    """The three curve figures, from runs or from curves loaded back by `common.load_curves`."""
    panels = [
        ("test_recon", "test reconstruction error", "reconstruction error"),
        ("test_ll", "AIS test log-likelihood", "nats per example"),
    ]
    figure, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    colors = {c.label: {"color": f"C{i}"} for i, c in enumerate(adaptive)}  # same in both panels
    key, title, ylabel = panels[0]
    common.plot_metric(axes[0], adaptive, key, title=title, ylabel=ylabel, styles=colors)
    # A run whose likelihood collapses would flatten the others: show the others' range and say
    # which runs are off the scale.
    finite = [c for c in adaptive if min(c.series("test_ll")[1] or [0.0]) > LL_FLOOR]
    off_scale = [c.label for c in adaptive if c not in finite]
    title = "AIS test log-likelihood"
    if off_scale:
        title += f"\n(off scale, below {LL_FLOOR:g}: {', '.join(off_scale)})"
    common.plot_metric(axes[1], finite, "test_ll", title=title, ylabel=panels[1][2], styles=colors)
    figure.tight_layout()
    common.save_figure(figure, directory / "adaptive.png")
    common.curve_figure(polar_quality, panels, directory / "polar_methods.png")
    common.curve_figure(pcd, panels, directory / "pcd_vs_cd.png")


def write_outputs(
    directory: Path,
    adaptive: list[RunResult],
    polar_quality: list[RunResult],
    pcd: list[RunResult],
    accuracy: list[dict[str, Any]],
    timing: list[dict[str, Any]],
) -> None:
    curve_figures(directory, adaptive, polar_quality, pcd)
    common.write_table(common.summary_rows(adaptive), directory, "adaptive_summary")
    common.write_table(common.summary_rows(polar_quality), directory, "polar_quality")
    common.write_table(accuracy, directory, "polar_accuracy")
    common.write_table(timing, directory, "polar_timing")
    common.write_table(common.summary_rows(pcd), directory, "pcd_summary")
    common.write_curves([*adaptive, *polar_quality, *pcd], directory, "curves")
