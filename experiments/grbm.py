"""The Gaussian RBMs of the MNIST and Frey Face experiments again, at smaller step sizes.

The step sizes come from 150–200-iteration tuning runs; over the full 1,500 iterations some
Gaussian RBMs trained with them become unstable (reconstruction errors of 1e4 and more). This
experiment reruns exactly those curves — same data, model, CD-k, seed and length — with every
step size divided by √10 (one step of the tuning grid), to see whether the comparison between
the optimizers holds once training is stable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

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


def write_outputs(
    directory: Path, mnist_results: list[RunResult], frey_results: list[RunResult]
) -> None:
    common.curve_figure(
        mnist_results,
        [
            ("test_recon", "MNIST GRBM test (step sizes ÷ √10)", "reconstruction error"),
            ("test_ll", "MNIST GRBM AIS test log-density", "nats per example"),
        ],
        directory / "mnist_grbm.png",
    )
    mnist.variance_figure(mnist_results, directory / "mnist_variances.png")
    common.curve_figure(
        frey_results,
        [("test_recon", "Frey Face GRBM test (step sizes ÷ √10)", "reconstruction error")],
        directory / "freyface_grbm.png",
    )
    common.write_table(common.summary_rows(mnist_results), directory, "mnist_summary")
    common.write_table(common.summary_rows(frey_results), directory, "freyface_summary")
    common.write_curves([*mnist_results, *frey_results], directory, "curves")
