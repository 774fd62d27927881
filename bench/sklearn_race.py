"""Time to scikit-learn's reconstruction error: SSD at CD-1 with its default step (no step size
given) against `sklearn.neural_network.BernoulliRBM` at its defaults for 10 epochs.

Both train a 784×100 Bernoulli RBM on the same binarized MNIST images (8,000), on one thread.
scikit-learn's fit is timed whole, given float32 (which it keeps; its faster form, so the ratio
is the conservative one); its model is scored on 2,000 held-out images by ssdcore's
reconstruction error (mean-field, the same function for both). ssdcore then trains in chunks of
`CHUNK` steps, the clock running only while it trains, and stops at the first chunk whose
held-out error is at or below scikit-learn's. The ratio of record is scikit-learn's fit time over
ssdcore's training time to that point; each side runs `rounds` times (ssdcore with seeds 0, 1, …),
the sides taking turns, medians reported.

    python -m bench.sklearn_race [--rounds 3] [--max-steps 2000]   (also part of `bench sklearn`)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from bench import data as bench_data
from bench.report import Case, Target
from bench.sklearn_case import as_ssdcore_model
from ssdcore import BernoulliRBM, OptimizerConfig, Trainer
from ssdcore.evaluation.metrics import reconstruction_error

N_TRAIN, N_VALID, N_HIDDEN = 8000, 2000, 100
CHUNK = 10  # steps between two held-out evaluations (evaluation time is not counted)
GOAL = 15.0  # the target: ssdcore reaches scikit-learn's error at least this many times sooner


@dataclass(frozen=True)
class Race:
    sklearn_seconds: float  # median fit time, 10 epochs at scikit-learn's defaults, float32
    sklearn_error: float  # its held-out reconstruction error (median over rounds)
    ssd_seconds: float  # median training time to reach it
    ssd_steps: int  # median steps to reach it
    ratio: float  # sklearn_seconds / ssd_seconds
    rounds: int


def sklearn_fit(train: np.ndarray, valid: torch.Tensor, seed: int) -> tuple[float, float]:
    """scikit-learn's fit time (s) at its defaults and its model's held-out error."""
    from sklearn.neural_network import BernoulliRBM as SklearnRBM

    rbm = SklearnRBM(n_components=N_HIDDEN, n_iter=10, random_state=seed)
    started = time.perf_counter()
    rbm.fit(train)
    seconds = time.perf_counter() - started
    return seconds, reconstruction_error(as_ssdcore_model(rbm), valid)


def ssd_time_to(
    goal: float, train: torch.Tensor, valid: torch.Tensor, seed: int, max_steps: int
) -> tuple[float, int]:
    """Training seconds and steps until SSD at CD-1 (default step) reaches ``goal``."""
    torch.manual_seed(seed)
    model = BernoulliRBM(train.shape[1], N_HIDDEN)
    trainer = Trainer(model, train, optimizer=OptimizerConfig("ssd"), batch_size=100, seed=seed)
    seconds = 0.0
    while trainer.step_count < max_steps:
        started = time.perf_counter()
        trainer.train_steps(CHUNK)
        seconds += time.perf_counter() - started
        if reconstruction_error(trainer.model, valid) <= goal:
            return seconds, trainer.step_count
    return float("inf"), trainer.step_count


def race(rounds: int, max_steps: int, *, n_train: int = N_TRAIN, n_valid: int = N_VALID) -> Race:
    """The race, ``rounds`` times on the first ``n_train`` + ``n_valid`` images."""
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    images = bench_data.mnist("binarize", limit=n_train + n_valid)
    train, valid = images[:n_train], images[n_train:]
    train32 = train.numpy()
    sk_seconds, sk_errors, ssd_seconds, ssd_steps = [], [], [], []
    with threadpool_limits(limits=1):
        for seed in range(rounds):
            seconds, error = sklearn_fit(train32, valid, seed)
            sk_seconds.append(seconds)
            sk_errors.append(error)
            seconds, steps = ssd_time_to(error, train, valid, seed, max_steps)
            ssd_seconds.append(seconds)
            ssd_steps.append(steps)
    sklearn_s, ssd_s = statistics.median(sk_seconds), statistics.median(ssd_seconds)
    return Race(
        sklearn_seconds=sklearn_s,
        sklearn_error=statistics.median(sk_errors),
        ssd_seconds=ssd_s,
        ssd_steps=int(statistics.median(ssd_steps)),
        ratio=sklearn_s / ssd_s,
        rounds=rounds,
    )


def case_and_target(quick: bool) -> tuple[Case, Target]:
    """The race as `python -m bench sklearn` reports it (quick: one round on 1,000 images)."""
    sizes = {"n_train": 1000, "n_valid": 200} if quick else {}
    result = race(1 if quick else 3, 2000, **sizes)
    case = Case(
        "sklearn",
        "ssd-default-cd1-to-sklearn-error",
        {"hidden": N_HIDDEN, "chunk": CHUNK, "threads": 1, **sizes},
        {
            "sklearn_s": result.sklearn_seconds,
            "sklearn_recon_error": result.sklearn_error,
            "ssd_s": result.ssd_seconds,
            "ssd_steps": result.ssd_steps,
        },
        {"sooner": result.ratio},
    )
    target = Target(
        "sklearn",
        "SSD CD-1, default step, to scikit-learn's 10-epoch error: times sooner",
        result.ratio,
        GOAL,
        ">=",
        "x",
    )
    return case, target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sklearn_race", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=2000)
    args = parser.parse_args(argv)
    result = race(args.rounds, args.max_steps)
    print(json.dumps(asdict(result), indent=2))
    verdict = "met" if result.ratio >= GOAL else "missed"
    print(f"target ≥ {GOAL:.0f}× sooner than scikit-learn: {result.ratio:.1f}× ({verdict})")


if __name__ == "__main__":
    main()
