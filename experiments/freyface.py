"""Frey Face (paper Fig. 4): n_h = 200, BRBM and GRBM with SSD and Nesterov SGD.

The 1965 faces (28 × 20 pixels) scaled to [0, 1], split 80/20 at random. Both models see the same
scaled pixels — the BRBM reads them as Bernoulli means, the GRBM (learned diagonal variance) as
real values — so their reconstruction errors are on one scale, as in the paper's figure.
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
from experiments.common import EvalPlan, ModelSpec, RunResult, RunSpec
from experiments.mnist import optimizer_config
from ssdcore.data import load_frey_face, preprocess, split

logger = logging.getLogger(__name__)

NAME = "freyface"
IMAGE_SHAPE = (28, 20)
OPTIMIZERS = ("Nesterov", "SSD")
MODELS = {"BRBM": ("bernoulli", "freyface-brbm"), "GRBM": ("gaussian", "freyface-grbm")}
FALLBACK_LR = {"Nesterov": 0.01, "SSD": 1e-3}


@dataclass(frozen=True)
class Config:
    limit: int | None = None
    test_fraction: float = 0.2
    n_hidden: int = 200
    cd_k: int = 10
    batch_size: int = 100
    steps: int = 1500
    eval_every: int = 50
    min_variance: float = 1e-3  # GRBM variance floor (pixel variances are about 1e-2)
    seed: int = 0

    def model(self, kind: str) -> ModelSpec:
        return ModelSpec(kind, self.n_hidden, variance="diagonal", min_variance=self.min_variance)


FULL = Config()
QUICK = Config(limit=300, n_hidden=10, cd_k=1, batch_size=50, steps=10, eval_every=5)


def load_data(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test): Frey faces scaled to [0, 1], split at random with the experiment's seed."""
    faces = load_frey_face(common.data_dir() / "freyface" / "frey_rawface.mat")
    if config.limit is not None:
        faces = faces[: config.limit]
    return split(preprocess(faces, "scale"), config.test_fraction, seed=config.seed)


def runs(config: Config, chosen: dict[str, float]) -> list[RunSpec]:
    specs = []
    for model_name, (kind, key) in MODELS.items():
        for optimizer in OPTIMIZERS:
            lr = common.step_size(chosen, f"{key}/{optimizer.lower()}", FALLBACK_LR[optimizer])
            specs.append(
                RunSpec(
                    label=f"{model_name} {optimizer}",
                    model=config.model(kind),
                    optimizer=optimizer_config(
                        optimizer,
                        lr,
                        common.ssd_method(
                            IMAGE_SHAPE[0] * IMAGE_SHAPE[1], config.n_hidden, config.batch_size
                        ),
                    ),
                    steps=config.steps,
                    batch_size=config.batch_size,
                    cd_k=config.cd_k,
                    seed=config.seed,
                )
            )
    return specs


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Runs the Frey Face experiment and writes its figures and tables under `out/freyface`."""
    config = QUICK if quick else FULL
    directory = common.output_dir(out, NAME)
    chosen = common.load_step_sizes()
    train, test = load_data(config)
    logger.info("Frey Face: %d train, %d test images", len(train), len(test))
    plan = EvalPlan(train, test, every=config.eval_every)
    results = [common.execute(spec, plan) for spec in runs(config, chosen)]
    write_outputs(directory, results, test)
    return {"summary": common.summary_rows(results)}


def reconstructions_figure(results: list[RunResult], test: torch.Tensor, path: Path) -> Path:
    """Eight test faces (top row) and their mean-field reconstructions by each model."""
    faces = test[:8]
    rows = [("data", faces)]
    with torch.no_grad():
        for result in results:
            rows.append((result.label, result.model.reconstruct(faces, k=1, mean_field=True)))
    figure, axes = plt.subplots(len(rows), 1, figsize=(6.0, 1.1 * len(rows)), squeeze=False)
    for axis, (label, images) in zip(axes[:, 0], rows, strict=True):
        strip = torch.cat([img.reshape(IMAGE_SHAPE) for img in images.clamp(0, 1)], dim=1)
        axis.imshow(strip.numpy(), cmap="gray", vmin=0, vmax=1)
        axis.set_ylabel(label, rotation=0, ha="right", fontsize=8)
        axis.set_xticks([])
        axis.set_yticks([])
    figure.tight_layout()
    return common.save_figure(figure, path)


def curve_figures(directory: Path, curves: Sequence[Any]) -> None:
    """Fig. 4 from runs or from curves loaded back by `common.load_curves`; log scale, since a
    diverging run would otherwise flatten the others."""
    common.curve_figure(
        curves,
        [
            ("train_recon", "Frey Face train (n_h = 200)", "reconstruction error"),
            ("test_recon", "Frey Face test (n_h = 200)", "reconstruction error"),
        ],
        directory / "fig4_recon.png",
        log_y=True,
    )


def write_outputs(directory: Path, results: list[RunResult], test: torch.Tensor) -> None:
    curve_figures(directory, results)
    reconstructions_figure(results, test, directory / "reconstructions.png")
    common.write_table(common.summary_rows(results), directory, "summary")
    common.write_curves(results, directory, "curves")
