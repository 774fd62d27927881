"""scikit-learn case: ssdcore against `sklearn.neural_network.BernoulliRBM` on the same task.

Both train a 784×500 Bernoulli RBM on the same binarized MNIST images with PCD-1, batch 100, plain
SGD at scikit-learn's default step size 0.1, for the same number of epochs. scikit-learn runs in
float64 (what it computes in for the usual float64 arrays) and in float32 (which it keeps when
given float32): the faster of the two is the baseline of record. Each training run is repeated
from scratch, the implementations taking turns, and the median time per epoch is reported. Both
trained models are then scored by the same ssdcore functions on held-out images.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from bench import data as bench_data
from bench.core import pick_device
from bench.report import Case, Target

logger = logging.getLogger(__name__)

N_HIDDEN = 500
BATCH_SIZE = 100
LEARNING_RATE = 0.1  # scikit-learn's default
SEED = 0


@dataclass(frozen=True)
class Plan:
    """Training images, held-out images, epochs per run and repetitions of each run."""

    n_train: int
    n_valid: int
    epochs: int
    repeats: int

    @classmethod
    def full(cls) -> Plan:
        return cls(n_train=2000, n_valid=1000, epochs=10, repeats=3)

    @classmethod
    def quick(cls) -> Plan:
        return cls(n_train=300, n_valid=200, epochs=2, repeats=1)


@dataclass
class Trained:
    """A finished training run: seconds per epoch and the trained parameters as an ssdcore model."""

    seconds_per_epoch: float
    model: torch.nn.Module


def train_project(train: torch.Tensor, epochs: int) -> Trained:
    """ssdcore: Trainer with PCD-1, batch 100, SGD at 0.1, `epochs` passes over `train`."""
    import ssdcore
    from ssdcore.optim import OptimizerConfig

    model = ssdcore.BernoulliRBM(train.shape[1], N_HIDDEN).to(train.device)
    trainer = ssdcore.Trainer(
        model,
        train,
        optimizer=OptimizerConfig(name="sgd", lr=LEARNING_RATE),
        batch_size=BATCH_SIZE,
        cd_k=1,
        persistent=True,
        seed=SEED,
    )
    steps = epochs * (train.shape[0] // BATCH_SIZE)
    start = time.perf_counter()
    trainer.train_steps(steps)
    if train.device.type == "cuda":
        torch.cuda.synchronize(train.device)
    return Trained((time.perf_counter() - start) / epochs, model)


def train_sklearn(train: np.ndarray, epochs: int) -> Trained:
    """scikit-learn's BernoulliRBM.fit for `epochs` passes; its dtype follows `train`'s."""
    from sklearn.neural_network import BernoulliRBM

    rbm = BernoulliRBM(
        n_components=N_HIDDEN,
        learning_rate=LEARNING_RATE,
        batch_size=BATCH_SIZE,
        n_iter=epochs,
        random_state=SEED,
    )
    start = time.perf_counter()
    rbm.fit(train)
    seconds = (time.perf_counter() - start) / epochs
    return Trained(seconds, _as_ssdcore_model(rbm))


def _as_ssdcore_model(rbm) -> torch.nn.Module:
    # scikit-learn stores W as (n_hidden, n_visible); ssdcore's W is (n_visible, n_hidden).
    import ssdcore

    model = ssdcore.BernoulliRBM(rbm.components_.shape[1], rbm.components_.shape[0])
    with torch.no_grad():
        model.W.copy_(torch.as_tensor(rbm.components_.T, dtype=torch.float32))
        model.a.copy_(torch.as_tensor(rbm.intercept_hidden_, dtype=torch.float32))
        model.b.copy_(torch.as_tensor(rbm.intercept_visible_, dtype=torch.float32))
    return model


def score(model: torch.nn.Module, valid: torch.Tensor) -> dict[str, float]:
    """Held-out reconstruction error and pseudo-log-likelihood, by the same ssdcore code for all."""
    from ssdcore.evaluation import pseudo_log_likelihood, reconstruction_error

    model = model.to(valid.device)
    torch.manual_seed(SEED)
    with torch.no_grad():
        return {
            "recon_error": float(reconstruction_error(model, valid)),
            "pseudo_ll": float(pseudo_log_likelihood(model, valid)),
        }


def run(*, quick: bool = False) -> tuple[list[Case], list[Target]]:
    """Train each implementation `repeats` times in turn; return the cases and the targets."""
    plan = Plan.quick() if quick else Plan.full()
    images = bench_data.mnist("binarize", limit=plan.n_train + plan.n_valid)
    train, valid = images[: plan.n_train], images[plan.n_train :]
    device = pick_device()
    runners: dict[str, Callable[[], Trained]] = {
        "ssdcore": lambda: train_project(train.to(device), plan.epochs),
        "sklearn-float64": lambda: train_sklearn(train.numpy().astype(np.float64), plan.epochs),
        "sklearn-float32": lambda: train_sklearn(train.numpy().astype(np.float32), plan.epochs),
    }
    for name, runner in runners.items():
        if not quick:  # an untimed first run pays one-off costs (library and thread start-up)
            logger.info("sklearn case: warming up %s", name)
            runner()
    times: dict[str, list[float]] = {name: [] for name in runners}
    last: dict[str, Trained] = {}
    for repeat in range(plan.repeats):
        for name, runner in runners.items():
            logger.info("sklearn case: %s run %d", name, repeat + 1)
            last[name] = runner()
            times[name].append(last[name].seconds_per_epoch)
    seconds = {name: statistics.median(values) for name, values in times.items()}
    scores = {name: score(trained.model, valid) for name, trained in last.items()}
    baseline = min(("sklearn-float64", "sklearn-float32"), key=seconds.__getitem__)
    cases = [_case(name, plan, seconds, scores, baseline, len(times[name])) for name in runners]
    return cases, _targets(seconds, scores, baseline)


def _case(name, plan: Plan, seconds, scores, baseline: str, runs: int) -> Case:
    iterations = plan.n_train // BATCH_SIZE
    ratios = {}
    if name == "ssdcore":
        for other in ("sklearn-float64", "sklearn-float32"):
            ratios[f"x_faster_than_{other}"] = seconds[other] / seconds[name]
        ratios["recon_error_over_sklearn"] = (
            scores[name]["recon_error"] / scores[baseline]["recon_error"]
        )
    return Case(
        suite="sklearn",
        name=name,
        config={
            "size": f"784x{N_HIDDEN}",
            "algorithm": "PCD-1 SGD lr 0.1",
            "batch": BATCH_SIZE,
            "train_images": plan.n_train,
            "valid_images": plan.n_valid,
            "epochs": plan.epochs,
        },
        metrics={
            "s_per_epoch": seconds[name],
            "ms_per_iter": 1000 * seconds[name] / iterations,
            "runs": runs,
            **scores[name],
        },
        ratios=ratios,
        notes=[
            f"scores on {plan.n_valid} held-out images after {plan.epochs} epochs, by ssdcore's "
            "reconstruction_error and pseudo_log_likelihood for every implementation; "
            f"baseline of record: the faster scikit-learn dtype ({baseline})"
        ],
    )


def _targets(seconds, scores, baseline: str) -> list[Target]:
    return [
        Target(
            "sklearn",
            f"PCD-1 784x500 throughput vs scikit-learn ({baseline})",
            seconds[baseline] / seconds["ssdcore"],
            3.0,
            ">=",
            "x",
        ),
        Target(
            "sklearn",
            f"held-out reconstruction error / scikit-learn's ({baseline})",
            scores["ssdcore"]["recon_error"] / scores[baseline]["recon_error"],
            1.0,
            "<=",
            "x",
        ),
    ]
