"""The Gaussian RBMs of the MNIST and Frey Face experiments again, at smaller step sizes.

The step sizes come from 150–200-iteration tuning runs; over the full 1,500 iterations some
Gaussian RBMs trained with them become unstable (reconstruction errors of 1e4 and more). This
experiment reruns exactly those curves — same data, model, CD-k, seed and length — with every
step size divided by √10 (one step of the tuning grid), to see whether the comparison between
the optimizers holds once training is stable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from experiments import common, freyface, mnist
from experiments.common import EvalPlan, RunResult

logger = logging.getLogger(__name__)

NAME = "grbm"
BACKOFF = 10**0.5  # one half-decade step of the tuning grid


def run(out: Path, quick: bool = False) -> dict[str, Any]:
    """Reruns the GRBM curves of `mnist` and `freyface` at the tuned step sizes ÷ √10."""
    directory = common.output_dir(out, NAME)
    mn = mnist.QUICK if quick else mnist.FULL
    ff = freyface.QUICK if quick else freyface.FULL
    smaller = {key: lr / BACKOFF for key, lr in common.load_step_sizes().items()}

    train, test = mnist.load_data(mn)
    plan = mnist.eval_plan(mn, train, test, mn.steps, mn.eval_every)
    mnist_results = [
        common.execute(spec, plan)
        for spec in mnist.runs(mn, smaller)
        if spec.label.startswith("GRBM")
    ]
    train, test = freyface.load_data(ff)
    plan = EvalPlan(train, test, every=ff.eval_every)
    frey_results = [
        common.execute(spec, plan)
        for spec in freyface.runs(ff, smaller)
        if spec.label.startswith("GRBM")
    ]
    write_outputs(directory, mnist_results, frey_results)
    return {
        "mnist": common.summary_rows(mnist_results),
        "freyface": common.summary_rows(frey_results),
    }


def curve_figures(directory: Path, mnist_curves: Sequence[Any], frey_curves: Sequence[Any]) -> None:
    """The curve figures, from runs or from curves loaded back by `common.load_curves`;
    reconstruction errors on a log scale, since a diverging run spans several decades."""
    figure, axes = plt.subplots(1, 2, figsize=(8.4, 3.4))
    common.plot_metric(
        axes[0],
        mnist_curves,
        "test_recon",
        log_y=True,
        title="MNIST GRBM test (step sizes ÷ √10)",
        ylabel="reconstruction error",
    )
    common.plot_metric(
        axes[1],
        mnist_curves,
        "test_ll",
        title="MNIST GRBM AIS test log-density",
        ylabel="nats per example",
    )
    figure.tight_layout()
    common.save_figure(figure, directory / "mnist_grbm.png")
    common.curve_figure(
        frey_curves,
        [("test_recon", "Frey Face GRBM test (step sizes ÷ √10)", "reconstruction error")],
        directory / "freyface_grbm.png",
        log_y=True,
    )


def write_outputs(
    directory: Path, mnist_results: list[RunResult], frey_results: list[RunResult]
) -> None:
    curve_figures(directory, mnist_results, frey_results)
    mnist.variance_figure(mnist_results, directory / "mnist_variances.png")
    common.write_table(common.summary_rows(mnist_results), directory, "mnist_summary")
    common.write_table(common.summary_rows(frey_results), directory, "freyface_summary")
    common.write_curves(mnist_results, directory, "mnist_curves")
    common.write_curves(frey_results, directory, "freyface_curves")
