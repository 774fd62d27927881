"""scikit-learn case: ssdcore against `sklearn.neural_network.BernoulliRBM` on the same task.

Both train a 784×500 Bernoulli RBM on the same binarized MNIST images with PCD-1, batch 100, plain
SGD at scikit-learn's default step size 0.1, for the same number of epochs. scikit-learn runs in
float64 (what it computes in for the usual float64 arrays) and in float32 (which it keeps when
given float32); the project is compared with both. Each training run is repeated from scratch
with a new seed, the implementations taking turns; the median time per epoch is reported, and
every trained model is scored by the same ssdcore functions on held-out images.
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
SEED = 0  # the first run's seed; run i uses SEED + i
SKLEARN_VARIANTS = ("sklearn-float64", "sklearn-float32")


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


def train_project(train: torch.Tensor, epochs: int, seed: int) -> Trained:
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
        seed=seed,
    )
    steps = epochs * (train.shape[0] // BATCH_SIZE)
    start = time.perf_counter()
    trainer.train_steps(steps)
    if train.device.type == "cuda":
        torch.cuda.synchronize(train.device)
    return Trained((time.perf_counter() - start) / epochs, model)


def train_sklearn(train: np.ndarray, epochs: int, seed: int) -> Trained:
    """scikit-learn's BernoulliRBM.fit for `epochs` passes; its dtype follows `train`'s."""
    from sklearn.neural_network import BernoulliRBM

    rbm = BernoulliRBM(
        n_components=N_HIDDEN,
        learning_rate=LEARNING_RATE,
        batch_size=BATCH_SIZE,
        n_iter=epochs,
        random_state=seed,
    )
    start = time.perf_counter()
    rbm.fit(train)
    seconds = (time.perf_counter() - start) / epochs
    return Trained(seconds, as_ssdcore_model(rbm))


def as_ssdcore_model(rbm) -> torch.nn.Module:
    """A fitted scikit-learn BernoulliRBM as an ssdcore model, for scoring by ssdcore."""
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
    """Train each implementation `repeats` times in turn (seed = repeat); cases and targets."""
    plan = Plan.quick() if quick else Plan.full()
    images = bench_data.mnist("binarize", limit=plan.n_train + plan.n_valid)
    train, valid = images[: plan.n_train], images[plan.n_train :]
    device = pick_device()
    runners: dict[str, Callable[[int], Trained]] = {
        "ssdcore": lambda seed: train_project(train.to(device), plan.epochs, seed),
        "sklearn-float64": lambda seed: train_sklearn(
            train.numpy().astype(np.float64), plan.epochs, seed
        ),
        "sklearn-float32": lambda seed: train_sklearn(
            train.numpy().astype(np.float32), plan.epochs, seed
        ),
    }
    if not quick:  # an untimed first run pays one-off costs (library and thread start-up)
        for name, runner in runners.items():
            logger.info("sklearn case: warming up %s", name)
            runner(SEED)
    times: dict[str, list[float]] = {name: [] for name in runners}
    scores: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for repeat in range(plan.repeats):
        for name, runner in runners.items():
            logger.info("sklearn case: %s run %d", name, repeat + 1)
            trained = runner(SEED + repeat)
            times[name].append(trained.seconds_per_epoch)
            scores[name].append(score(trained.model, valid))
    results = {name: _summary(times[name], scores[name]) for name in runners}
    cases = [_case(name, plan, results) for name in runners]
    from bench import sklearn_race  # it scores scikit-learn's model with as_ssdcore_model

    race_case, race_target = sklearn_race.case_and_target(quick)  # SSD's default step, CD-1
    return [*cases, race_case], [*_targets(results), race_target]


def _summary(times: list[float], scores: list[dict[str, float]]) -> dict[str, float]:
    """Median time per epoch; mean and spread of the held-out scores over the seeds."""
    errors = [s["recon_error"] for s in scores]
    return {
        "s_per_epoch": statistics.median(times),
        "recon_error": statistics.mean(errors),
        "recon_error_sd": statistics.stdev(errors) if len(errors) > 1 else 0.0,
        "pseudo_ll": statistics.mean(s["pseudo_ll"] for s in scores),
        "runs": len(times),
    }


def _case(name: str, plan: Plan, results: dict[str, dict[str, float]]) -> Case:
    iterations = plan.n_train // BATCH_SIZE
    own = results[name]
    ratios = {}
    if name == "ssdcore":
        for other in SKLEARN_VARIANTS:
            ratios[f"x_faster_than_{other}"] = results[other]["s_per_epoch"] / own["s_per_epoch"]
            ratios[f"recon_error_over_{other}"] = own["recon_error"] / results[other]["recon_error"]
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
        metrics={"ms_per_iter": 1000 * own["s_per_epoch"] / iterations, **own},
        ratios=ratios,
        notes=[
            f"scores on {plan.n_valid} held-out images after {plan.epochs} epochs, by ssdcore's "
            "reconstruction_error (mean field) and pseudo_log_likelihood for every "
            "implementation; mean (and standard deviation) over one run per seed"
        ],
    )


def _targets(results: dict[str, dict[str, float]]) -> list[Target]:
    project = results["ssdcore"]
    targets = []
    for other in SKLEARN_VARIANTS:
        baseline = results[other]
        targets.append(Target(
            "sklearn", f"PCD-1 784x500 throughput vs scikit-learn {other.split('-')[1]}",
            baseline["s_per_epoch"] / project["s_per_epoch"], 3.0, ">=", "x",
        ))  # fmt: skip
        targets.append(Target(
            "sklearn", f"held-out reconstruction error / scikit-learn {other.split('-')[1]}'s",
            project["recon_error"] / baseline["recon_error"], 1.0, "<=", "x",
            f"standard deviation over seeds: ssdcore {project['recon_error_sd']:.2f}, "
            f"scikit-learn {baseline['recon_error_sd']:.2f}",
        ))  # fmt: skip
    return targets
