"""Pack case: aggregate throughput of packed training (ssdcore.pack) against the same runs one
after another through the same code path.

Each configuration trains M runs (different seeds and step sizes, as a sweep would), timed
round-robin in the same rounds: ``packed`` (one TrainingPack of M runs), ``sequential`` (M
packs of one run each, stepped in turn: the same code, no batching) and, in full runs,
``solo`` (M ssdcore.Trainer runs in turn: what the service runs today) and
``packed-one-stream`` (``independent_streams=False``: what per-run random streams cost). The
figure of record is the same-round ratio sequential / packed (``packed_x_faster`` on the
sequential case); throughput is model-iterations per second (one step of one run).

CPU cases: the paper's simulation model (100×16, CD-1, batch 100, 32 runs) and MNIST 784×50
CD-10 (batch 100, 16 runs), with SGD and SSD, as Bernoulli RBMs on binary data and as
diagonal-variance Gaussian RBMs on the same data standardized (no targets for those: the goals
are the Bernoulli packs'). GPU cases (CUDA only): 64 runs of 784×500 CD-10 batch 100, SGD and
SSD (Newton–Schulz), the packed step replayed as a CUDA graph. ``only`` keeps the
configurations whose label contains it (``python -m bench pack --only grbm``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench import data as bench_data
from bench.report import Case, Target
from bench.timing import interleaved_rounds, paired_ratio, synchronize
from ssdcore.cuda_graph import WARMUP_STEPS

logger = logging.getLogger(__name__)

BATCH_SIZE = 100
SIMULATION_SAMPLES = 5000
# Step sizes spread over a factor of 2 across the runs, as a step-size sweep would; small
# enough to stay finite for the timed steps (the cost of a step does not depend on them).
BASE_LR = {"sgd": 0.01, "ssd": 1e-4}
# Gaussian RBMs need ~100x smaller steps (SSD's, whose length grows with the nuclear norm of the
# gradient), SGD's ~1000x on standardized MNIST: its constant pixels start at the variance
# floor (precision 1e4) and its rare ones at standardized values up to ~100, and at 1e-4 one
# SGD step takes W to ~50 (1e-5: W stays below ~5 and every run finite over 80 CD-10 steps).
GAUSSIAN_BASE_LR = {"sgd": 1e-5, "ssd": 1e-6}
# The Gaussian cases' variance form: the one a pack runs with a parameter per visible unit.
GAUSSIAN_VARIANCE = "diagonal"
# Below this many seconds per call the rounds measure Python overhead noise.
MIN_CALL_SECONDS = 0.02


@dataclass(frozen=True)
class Config:
    """One measured configuration."""

    name: str  # e.g. "simulation"
    n_visible: int
    n_hidden: int
    cd_k: int
    n_runs: int
    optimizer: str  # sgd | ssd
    device: str  # cpu | cuda
    target: float | None  # x faster than sequential, the goal (None: a plain case)
    variance: str | None = None  # None: Bernoulli RBMs; else Gaussian RBMs of this variance form

    @property
    def model(self) -> str:
        return "bernoulli" if self.variance is None else f"grbm-{self.variance}"

    @property
    def label(self) -> str:
        kind = "" if self.variance is None else f" {self.model}"
        return (
            f"{self.name}{kind} {self.n_visible}x{self.n_hidden} CD-{self.cd_k} "
            f"{self.n_runs} runs {self.optimizer} ({self.device})"
        )


@dataclass(frozen=True)
class Plan:
    """What to measure: configurations, rounds, the time a round aims at, data size."""

    configs: tuple[Config, ...]
    rounds: int
    round_seconds: float
    mnist_limit: int | None
    with_solo: bool


def plan(quick: bool, cuda: bool, only: str | None = None) -> Plan:
    """Full: the figures of record; quick: tiny sizes that only check the suite runs. ``only``
    keeps the configurations whose label contains it."""
    gaussian = GAUSSIAN_VARIANCE
    if quick:
        configs = [
            Config("simulation", 100, 16, 1, 2, optimizer, "cpu", 10.0)
            for optimizer in ("sgd", "ssd")
        ]
        configs.append(Config("mnist", 784, 50, 1, 2, "ssd", "cpu", 1.5))
        configs.append(Config("simulation", 100, 16, 1, 2, "ssd", "cpu", None, gaussian))
        configs.append(Config("mnist", 784, 50, 2, 2, "sgd", "cpu", None, gaussian))
        full = None
    else:
        configs = []
        for optimizer in ("sgd", "ssd"):
            configs.append(Config("simulation", 100, 16, 1, 32, optimizer, "cpu", 10.0))
            configs.append(Config("mnist", 784, 50, 10, 16, optimizer, "cpu", 1.5))
            if cuda:
                configs.append(Config("mnist", 784, 500, 10, 64, optimizer, "cuda", 1.0))
        for optimizer in ("sgd", "ssd"):
            configs.append(Config("simulation", 100, 16, 1, 32, optimizer, "cpu", None, gaussian))
            configs.append(Config("mnist", 784, 50, 10, 16, optimizer, "cpu", None, gaussian))
        full = Plan((), rounds=5, round_seconds=0.5, mnist_limit=None, with_solo=True)
    if only is not None:
        configs = [config for config in configs if only in config.label]
        if not configs:
            raise ValueError(f"--only {only!r} matches no pack configuration")
    if full is None:
        return Plan(tuple(configs), rounds=2, round_seconds=0.0, mnist_limit=500, with_solo=False)
    return Plan(tuple(configs), full.rounds, full.round_seconds, full.mnist_limit, full.with_solo)


def _optimizer(config: Config, run: int):
    from ssdcore.optim import OptimizerConfig

    base = BASE_LR if config.variance is None else GAUSSIAN_BASE_LR
    lr = base[config.optimizer] * (1 + run / config.n_runs)
    if config.optimizer == "sgd":
        return OptimizerConfig("sgd", lr=lr)
    method = "newton-schulz" if config.device == "cuda" else "auto"
    return OptimizerConfig("ssd", lr=lr, method=method)


def _model(config: Config, run: int, data: torch.Tensor):
    """Run ``run``'s model; a Gaussian one starts from the data's means and variances."""
    import ssdcore

    generator = torch.Generator().manual_seed(run)
    if config.variance is None:
        model = ssdcore.BernoulliRBM(config.n_visible, config.n_hidden, generator=generator)
        return model.to(data.device)
    model = ssdcore.GaussianRBM(
        config.n_visible, config.n_hidden, config.variance, generator=generator
    )
    model.init_from_data(data.cpu())
    return model.to(data.device)


def _pack(config: Config, runs: range, data: torch.Tensor, *, independent: bool = True):
    from ssdcore.pack import PackRun, TrainingPack

    packed = [PackRun(_model(config, r, data), _optimizer(config, r), r) for r in runs]
    return TrainingPack(
        packed,
        data,
        batch_size=BATCH_SIZE,
        cd_k=config.cd_k,
        independent_streams=independent,
    )


def _solo(config: Config, run: int, data: torch.Tensor):
    import ssdcore

    return ssdcore.Trainer(
        _model(config, run, data),
        data,
        optimizer=_optimizer(config, run),
        batch_size=BATCH_SIZE,
        cd_k=config.cd_k,
        seed=run,
    )


def variants(config: Config, data: torch.Tensor, with_solo: bool) -> dict[str, Callable]:
    """``name -> train(steps)`` for each way of training the M runs (each call: steps per run)."""
    packed = _finite(_pack(config, range(config.n_runs), data))
    singles = [_finite(_pack(config, range(r, r + 1), data)) for r in range(config.n_runs)]
    result: dict[str, Callable[[int], object]] = {
        "packed": packed,
        "sequential": lambda steps: [single(steps) for single in singles],
    }
    if with_solo:
        # What each run's own random streams cost: one stream for the whole pack instead.
        result["packed-one-stream"] = _finite(
            _pack(config, range(config.n_runs), data, independent=False)
        )
        trainers = [_solo(config, r, data) for r in range(config.n_runs)]
        result["solo"] = lambda steps: [trainer.train_steps(steps) for trainer in trainers]
    return result


def _finite(pack) -> Callable[[int], object]:
    """``pack.train_steps`` that stops the benchmark when a run diverges: a frozen run skips
    its work, which would flatter the timing."""

    def train(steps: int) -> None:
        diverged = pack.train_steps(steps)
        if diverged:
            raise RuntimeError(f"bench pack: runs diverged ({diverged[0]}); lower the step sizes")

    return train


def _steps_per_call(train: Callable[[int], object], device: torch.device, seconds: float) -> int:
    synchronize(device)
    started = time.perf_counter()
    train(1)
    synchronize(device)
    elapsed = max(time.perf_counter() - started, 1e-6)
    return max(1, min(200, math.ceil(max(seconds, MIN_CALL_SECONDS) / elapsed)))


def measure(config: Config, data: torch.Tensor, plan_: Plan) -> list[Case]:
    """Time the variants of one configuration in shared rounds; one Case per variant."""
    device = data.device
    trains = variants(config, data, plan_.with_solo)
    for train in trains.values():
        # Warm-up: buffers, first-step branches and, on CUDA, the eager steps before capture
        # and the capture itself.
        train(WARMUP_STEPS + 1)
    steps = {name: _steps_per_call(t, device, plan_.round_seconds) for name, t in trains.items()}
    calls = {name: (lambda t=trains[name], n=steps[name]: t(n)) for name in trains}
    units = {name: steps[name] * config.n_runs for name in trains}  # model-iterations per call
    timings = interleaved_rounds(
        calls,
        warmup_calls=0,
        calls_per_round=1,
        rounds=plan_.rounds,
        device=device,
        units_per_call=units,
    )
    cases = []
    for name, timing in timings.items():
        ratios = {}
        if name != "packed":
            ratios["packed_x_faster"] = paired_ratio(timing, timings["packed"])
        cases.append(
            Case(
                suite="pack",
                name=f"{config.label}/{name}",
                config={
                    "model": config.name,
                    "rbm": config.model,
                    "size": f"{config.n_visible}x{config.n_hidden}",
                    "cd_k": config.cd_k,
                    "batch": BATCH_SIZE,
                    "runs": config.n_runs,
                    "optimizer": config.optimizer,
                    "device": config.device,
                    "torch_threads": torch.get_num_threads(),
                    "steps_per_round": steps[name],
                },
                metrics={
                    "model_iters_per_s": 1000.0 / timing.median_ms,
                    "ms_per_model_iter": timing.median_ms,
                    "rounds": len(timing.samples_s),
                },
                ratios=ratios,
            )
        )
    return cases


def load_data(config: Config, plan_: Plan) -> torch.Tensor:
    """The simulation's binary data (from the 100×16 generating RBM), or binarized MNIST; for
    Gaussian RBMs the same data standardized (per unit zero mean, unit variance)."""
    from ssdcore.data import preprocess

    if config.name == "simulation":
        from ssdcore.data import synthetic_rbm_data

        data = synthetic_rbm_data(config.n_visible, config.n_hidden, SIMULATION_SAMPLES, seed=0)
        if config.variance is not None:
            data = preprocess(data, "standardize")
    else:
        mode = "binarize" if config.variance is None else "standardize"
        data = bench_data.mnist(mode, limit=plan_.mnist_limit)
    return data.to(config.device)


def run(*, quick: bool = False, only: str | None = None) -> tuple[list[Case], list[Target]]:
    """Measure every configuration of the plan (those whose label contains ``only``, if
    given); return its cases and targets."""
    cuda = torch.cuda.is_available()
    plan_ = plan(quick, cuda, only)
    cases: list[Case] = []
    loaded: dict[tuple[str, str, bool], torch.Tensor] = {}
    for config in plan_.configs:
        key = (config.name, config.device, config.variance is None)
        if key not in loaded:
            loaded[key] = load_data(config, plan_)
        started = time.perf_counter()
        cases += measure(config, loaded[key], plan_)
        logger.info("pack: %s took %.0f s", config.label, time.perf_counter() - started)
    return cases, targets(cases, plan_, cuda, quick, only)


def targets(
    cases: list[Case], plan_: Plan, cuda: bool, quick: bool, only: str | None = None
) -> list[Target]:
    """Packed / sequential throughput goals, judged on this run's same-round ratios (not on
    the quick run's few runs, which only check that the suite works)."""
    result = []
    for config in plan_.configs:
        if config.target is None:
            continue
        sequential = next(c for c in cases if c.name == f"{config.label}/sequential")
        result.append(
            Target(
                "pack",
                f"{config.label}: packed x faster than sequential",
                None if quick else sequential.ratios["packed_x_faster"],
                config.target,
                ">=",
                "x",
                "quick run: too few runs to judge" if quick else "",
            )
        )
    if not cuda and only is None:
        for optimizer in ("sgd", "ssd"):
            result.append(
                Target(
                    "pack",
                    f"mnist 784x500 CD-10 64 runs {optimizer} (cuda): packed x faster than "
                    "sequential",
                    None,
                    1.0,
                    ">=",
                    "x",
                    "no GPU in this environment; not measured",
                )
            )
    return result
