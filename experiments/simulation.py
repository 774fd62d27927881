"""The paper's simulation study (Fig. 3a–c), with the exact test log-likelihood of every curve.

Data: 5000 binary vectors (n_v = 100) sampled from an RBM with n_h = 25, W ~ N(0, 0.5) and zero
biases (`ssdcore.data.synthetic_rbm_data`); the first 4000 train, the last 1000 test. The trained
models have the generator's sizes, as in the paper.

- BRBM: SGD, SSD and the hybrids SSD_W/SGD (W spectral, the rest SGD) and SGD_W/SSD (W SGD, the
  rest l∞), each at a small and a large initial step size (Fig. 3a train, 3b test).
- GRBM with isotropic variance cI on the same binary data: SGD vs SSD (Fig. 3c).

Every curve also gets the exact test log-likelihood (the GRBM's log-density) at a few points
along it, including the end: `ssdcore.exact_log_partition` enumerates the 2^25 hidden states of
the trained models themselves, about 5 s per evaluation for the BRBM on one core (about 1 s for
the GRBM), so six points per curve add about 5 minutes to the run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

from experiments import common
from experiments.common import EvalPlan, HybridOptimizer, ModelSpec, RunResult, RunSpec
from ssdcore.data import synthetic_rbm_data
from ssdcore.optim import OptimizerConfig

logger = logging.getLogger(__name__)

NAME = "simulation"


@dataclass(frozen=True)
class Config:
    n_visible: int = 100
    n_hidden: int = 25
    n_train: int = 4000
    n_test: int = 1000
    steps: int = 5000
    batch_size: int = 100
    cd_k: int = 1
    eval_every: int = 100
    # where the exact test log-likelihood is taken, as fractions of the run (the end included)
    likelihood_fractions: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0)
    # "small" is the "large" (tuned) step size divided by this factor
    small_factor: float = 10.0
    seed: int = 0


FULL = Config()
QUICK = Config(
    n_visible=16,
    n_hidden=6,
    n_train=200,
    n_test=100,
    steps=30,
    batch_size=20,
    eval_every=10,
    likelihood_fractions=(0.5, 1.0),
)


def load_data(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) binary vectors drawn from the paper's synthetic RBM."""
    data = synthetic_rbm_data(
        n_visible=config.n_visible,
        n_hidden=config.n_hidden,
        n_samples=config.n_train + config.n_test,
        seed=config.seed,
    )
    return data[: config.n_train], data[config.n_train :]


def brbm_runs(config: Config, n_hidden: int, lr_sgd: float, lr_ssd: float) -> list[RunSpec]:
    """SGD, SSD and both hybrids at the large (tuned) and small step sizes."""
    model = ModelSpec("bernoulli", n_hidden)
    method = common.ssd_method(config.n_visible, n_hidden, config.batch_size)
    runs = []
    for size, factor in (("large", 1.0), ("small", 1.0 / config.small_factor)):
        sgd, ssd = lr_sgd * factor, lr_ssd * factor
        optimizers: dict[str, Any] = {
            "SGD": OptimizerConfig(name="sgd", lr=sgd),
            "SSD": OptimizerConfig(name="ssd", lr=ssd, method=method),
            "SSD_W/SGD": HybridOptimizer(("W",), ssd, sgd, method),
            "SGD_W/SSD": HybridOptimizer(("b", "a"), ssd, sgd, method),
        }
        for name, optimizer in optimizers.items():
            runs.append(
                RunSpec(
                    label=f"{name} ({size})",
                    model=model,
                    optimizer=optimizer,
                    steps=config.steps,
                    batch_size=config.batch_size,
                    cd_k=config.cd_k,
                    seed=config.seed,
                )
            )
    return runs


def grbm_runs(config: Config, n_hidden: int, lr_sgd: float, lr_ssd: float) -> list[RunSpec]:
    """GRBM with isotropic variance cI: SGD against SSD, each at its tuned step size."""
    model = ModelSpec("gaussian", n_hidden, variance="isotropic")
    return [
        RunSpec(
            "SGD",
            model,
            OptimizerConfig(name="sgd", lr=lr_sgd),
            config.steps,
            config.batch_size,
            config.cd_k,
            seed=config.seed,
        ),
        RunSpec(
            "SSD",
            model,
            OptimizerConfig(
                name="ssd",
                lr=lr_ssd,
                method=common.ssd_method(config.n_visible, n_hidden, config.batch_size),
            ),
            config.steps,
            config.batch_size,
            config.cd_k,
            seed=config.seed,
        ),
    ]


def eval_plan(config: Config, train: torch.Tensor, test: torch.Tensor) -> EvalPlan:
    """Reconstruction errors every `eval_every` steps, the exact test log-likelihood at
    `likelihood_fractions` of the run."""
    at = tuple(sorted({round(config.steps * f) for f in config.likelihood_fractions}))
    return EvalPlan(train, test, every=config.eval_every, likelihood="exact", likelihood_at=at)


STYLES = {
    f"{name} ({size})": {"color": color, "linestyle": "-" if size == "large" else "--"}
    for name, color in (("SGD", "C0"), ("SSD", "C3"), ("SSD_W/SGD", "C1"), ("SGD_W/SSD", "C2"))
    for size in ("large", "small")
}


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Runs the simulation study and writes its figures and tables under `out/simulation`."""
    config = QUICK if quick else FULL
    directory = common.output_dir(out, NAME)
    chosen = common.load_step_sizes()
    train, test = load_data(config)
    plan = eval_plan(config, train, test)

    lr = {
        key: common.step_size(chosen, f"simulation-{key}", fallback)
        for key, fallback in (
            ("brbm/sgd", 0.1),
            ("brbm/ssd", 1e-3),
            ("grbm/sgd", 0.01),
            ("grbm/ssd", 1e-4),
        )
    }
    brbm_specs = brbm_runs(config, config.n_hidden, lr["brbm/sgd"], lr["brbm/ssd"])
    grbm_specs = grbm_runs(config, config.n_hidden, lr["grbm/sgd"], lr["grbm/ssd"])
    curves = {
        "brbm": [common.execute(spec, plan) for spec in brbm_specs],
        "grbm": [common.execute(spec, plan) for spec in grbm_specs],
    }

    write_outputs(directory, config, curves)
    return {key: common.summary_rows(results) for key, results in curves.items()} | {
        "step_sizes": lr
    }


def curve_figures(directory: Path, config: Config, curves: dict[str, Sequence[Any]]) -> None:
    """The four figures, from runs or from curves loaded back by `common.load_curves`."""
    h = config.n_hidden
    common.curve_figure(
        curves["brbm"],
        [
            ("train_recon", f"(a) BRBM train, n_h = {h}", "reconstruction error"),
            ("test_recon", f"(b) BRBM test, n_h = {h}", "reconstruction error"),
        ],
        directory / "fig3ab_brbm_recon.png",
        styles=STYLES,
    )
    common.curve_figure(
        curves["grbm"],
        [
            ("train_recon", f"(c) GRBM (cI) train, n_h = {h}", "reconstruction error"),
            ("test_recon", f"(c) GRBM (cI) test, n_h = {h}", "reconstruction error"),
        ],
        directory / "fig3c_grbm_recon.png",
    )
    likelihood_figure(
        curves["brbm"],
        f"BRBM exact test log-likelihood, n_h = {h}",
        directory / "brbm_exact_ll.png",
        zoom=(-40.0, -37.5),
        styles=STYLES,
    )
    likelihood_figure(
        curves["grbm"],
        f"GRBM (cI) exact test log-density, n_h = {h}",
        directory / "grbm_exact_ll.png",
        zoom=(-45.0, -33.0),
    )


def likelihood_figure(
    curves: Sequence[Any],
    title: str,
    path: Path,
    *,
    zoom: tuple[float, float],
    styles: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """The exact test log-likelihood twice: on its full range, where the runs that lose
    likelihood set the scale, and on the `zoom` range, where the others differ by tenths."""
    figure, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    for axis, suffix in zip(axes, ("", " (zoom)"), strict=True):
        common.plot_metric(
            axis, curves, "test_ll", title=title + suffix, ylabel="nats per example", styles=styles
        )
    axes[1].set_ylim(*zoom)
    axes[1].get_legend().remove()
    figure.tight_layout()
    return common.save_figure(figure, path)


def write_outputs(directory: Path, config: Config, curves: dict[str, list[RunResult]]) -> None:
    curve_figures(directory, config, curves)
    for key, results in curves.items():
        common.write_table(common.summary_rows(results), directory, f"{key}_summary")
    common.write_curves([*curves["brbm"], *curves["grbm"]], directory, "curves")
