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
CD-10 (batch 100, 16 runs), with SGD and SSD. GPU cases (CUDA only): 64 runs of 784×500 CD-10
batch 100, SGD and SSD (Newton–Schulz), the packed step replayed as a CUDA graph.
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
    target: float  # x faster than sequential, the goal

    @property
    def label(self) -> str:
        return (
            f"{self.name} {self.n_visible}x{self.n_hidden} CD-{self.cd_k} {self.n_runs} runs "
            f"{self.optimizer} ({self.device})"
        )


@dataclass(frozen=True)
class Plan:
    """What to measure: configurations, rounds, the time a round aims at, data size."""

    configs: tuple[Config, ...]
    rounds: int
    round_seconds: float
    mnist_limit: int | None
    with_solo: bool


def plan(quick: bool, cuda: bool) -> Plan:
    """Full: the figures of record; quick: tiny sizes that only check the suite runs."""
    if quick:
        configs = [
            Config("simulation", 100, 16, 1, 2, optimizer, "cpu", 10.0)
            for optimizer in ("sgd", "ssd")
        ]
        configs.append(Config("mnist", 784, 50, 1, 2, "ssd", "cpu", 1.5))
        return Plan(tuple(configs), rounds=2, round_seconds=0.0, mnist_limit=500, with_solo=False)
    configs = []
    for optimizer in ("sgd", "ssd"):
        configs.append(Config("simulation", 100, 16, 1, 32, optimizer, "cpu", 10.0))
        configs.append(Config("mnist", 784, 50, 10, 16, optimizer, "cpu", 1.5))
        if cuda:
            configs.append(Config("mnist", 784, 500, 10, 64, optimizer, "cuda", 1.0))
    return Plan(tuple(configs), rounds=5, round_seconds=0.5, mnist_limit=None, with_solo=True)


def _optimizer(config: Config, run: int):
    from ssdcore.optim import OptimizerConfig

    lr = BASE_LR[config.optimizer] * (1 + run / config.n_runs)
    if config.optimizer == "sgd":
        return OptimizerConfig("sgd", lr=lr)
    method = "newton-schulz" if config.device == "cuda" else "auto"
    return OptimizerConfig("ssd", lr=lr, method=method)


def _model(config: Config, run: int, device: torch.device):
    import ssdcore

    generator = torch.Generator().manual_seed(run)
    return ssdcore.BernoulliRBM(config.n_visible, config.n_hidden, generator=generator).to(device)


def _pack(config: Config, runs: range, data: torch.Tensor, *, independent: bool = True):
    from ssdcore.pack import PackRun, TrainingPack

    packed = [PackRun(_model(config, r, data.device), _optimizer(config, r), r) for r in runs]
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
        _model(config, run, data.device),
        data,
        optimizer=_optimizer(config, run),
        batch_size=BATCH_SIZE,
        cd_k=config.cd_k,
        seed=run,
    )


def variants(config: Config, data: torch.Tensor, with_solo: bool) -> dict[str, Callable]:
    """``name -> train(steps)`` for each way of training the M runs (each call: steps per run)."""
    packed = _pack(config, range(config.n_runs), data)
    singles = [_pack(config, range(r, r + 1), data) for r in range(config.n_runs)]
    result: dict[str, Callable[[int], object]] = {
        "packed": packed.train_steps,
        "sequential": lambda steps: [single.train_steps(steps) for single in singles],
    }
    if with_solo:
        # What each run's own random streams cost: one stream for the whole pack instead.
        shared = _pack(config, range(config.n_runs), data, independent=False)
        result["packed-one-stream"] = shared.train_steps
        trainers = [_solo(config, r, data) for r in range(config.n_runs)]
        result["solo"] = lambda steps: [trainer.train_steps(steps) for trainer in trainers]
    return result


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
    """The simulation's binary data (from the 100×16 generating RBM), or binarized MNIST."""
    if config.name == "simulation":
        from ssdcore.data import synthetic_rbm_data

        data = synthetic_rbm_data(config.n_visible, config.n_hidden, SIMULATION_SAMPLES, seed=0)
    else:
        data = bench_data.mnist("binarize", limit=plan_.mnist_limit)
    return data.to(config.device)


def run(*, quick: bool = False) -> tuple[list[Case], list[Target]]:
    """Measure every configuration of the plan; return its cases and targets."""
    cuda = torch.cuda.is_available()
    plan_ = plan(quick, cuda)
    cases: list[Case] = []
    loaded: dict[tuple[str, str], torch.Tensor] = {}
    for config in plan_.configs:
        key = (config.name, config.device)
        if key not in loaded:
            loaded[key] = load_data(config, plan_)
        started = time.perf_counter()
        cases += measure(config, loaded[key], plan_)
        logger.info("pack: %s took %.0f s", config.label, time.perf_counter() - started)
    return cases, targets(cases, plan_, cuda, quick)


def targets(cases: list[Case], plan_: Plan, cuda: bool, quick: bool) -> list[Target]:
    """Packed / sequential throughput goals, judged on this run's same-round ratios (not on
    the quick run's few runs, which only check that the suite works)."""
    result = []
    for config in plan_.configs:
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
    if not cuda:
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
