"""Core case: milliseconds per training iteration of ssdcore against the plain reference loop.

For each size and CD-k of the plan (784×50 and 784×500 at CD-1 and CD-10, and 784×100 at CD-1,
where the SSD step's own cost weighs most), every variant — both models (Bernoulli, and
Gaussian with diagonal variance), the project's SGD, Nesterov and SSD with each polar method, and
the reference loop's SGD, Nesterov and full-SVD SSD — is timed round-robin in the same rounds, so
the ratios between them (the figures of record) are measured under the same machine load.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench import data as bench_data
from bench.reference import ReferenceConfig, ReferenceLoop
from bench.report import Case, Target
from bench.timing import TensorMemory, Timing, interleaved_rounds, paired_ratio

logger = logging.getLogger(__name__)

BATCH_SIZE = 100
N_VISIBLE = 784
MODELS = ("bernoulli", "gaussian")
# Step sizes only keep the chains finite for the few hundred timed iterations; they do not
# change the cost of an iteration.
SGD_LR = 1e-3
SSD_LR = 1e-5
PROJECT_OPTIMIZERS: dict[str, dict[str, object]] = {
    "sgd": {"name": "sgd", "lr": SGD_LR},
    "nesterov": {"name": "nesterov", "lr": SGD_LR, "momentum": 0.9},
    "ssd-svd": {"name": "ssd", "lr": SSD_LR, "method": "svd"},
    "ssd-lowrank": {"name": "ssd", "lr": SSD_LR, "method": "lowrank"},
    "ssd-randomized": {"name": "ssd", "lr": SSD_LR, "method": "randomized"},
    "ssd-newton-schulz": {"name": "ssd", "lr": SSD_LR, "method": "newton-schulz"},
}
REFERENCE_OPTIMIZERS = {"sgd": SGD_LR, "nesterov": SGD_LR, "ssd": SSD_LR}
# On a GPU the project's step is replayed as a CUDA graph where it can be; these variants also
# run with `cuda_graph=False`, so the graph's own effect is measured in the same rounds.
EAGER_SUFFIX = "-eager"
GPU_EAGER_VARIANTS = ("sgd", "ssd-newton-schulz")
# The polar method `method="auto"` picks: exact low-rank on the CPU, Newton–Schulz on CUDA.
DEFAULT_POLAR = {"cpu": "ssd-lowrank", "cuda": "ssd-newton-schulz"}
# Data preprocessing per model: binary pixels for the Bernoulli RBM, [0, 1] for the Gaussian.
DATA_MODES = {"bernoulli": "binarize", "gaussian": "scale"}


# The SSD step's cost targets: SSD / SGD time per iteration of the Bernoulli RBM, one torch thread,
# at (hidden units, CD-k) -> the most SSD may cost. At CD-1 the polar step is the largest part of
# an SSD iteration; at CD-10 784x500 the paper reports 1.09.
SSD_COST_LIMITS = {(100, 1): 1.5, (500, 10): 1.2}


@dataclass(frozen=True)
class Plan:
    """How much to measure: (hidden units, CD-k) groups, rounds and the time each round aims at."""

    groups: tuple[tuple[int, int], ...]
    rounds: int
    round_seconds: float
    warmup_calls: int
    data_limit: int | None
    memory_steps: int

    @classmethod
    def full(cls) -> Plan:
        return cls(
            ((50, 1), (50, 10), (100, 1), (500, 1), (500, 10)),
            rounds=7,
            round_seconds=0.08,
            warmup_calls=1,
            data_limit=None,
            memory_steps=1,
        )

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            ((50, 1), (100, 1)),
            rounds=2,
            round_seconds=0.01,
            warmup_calls=1,
            data_limit=500,
            memory_steps=1,
        )


@dataclass(frozen=True)
class Variant:
    """One implementation × model × optimizer at a given size and CD-k."""

    impl: str  # project | reference
    model: str  # bernoulli | gaussian
    optimizer: str

    @property
    def name(self) -> str:
        return f"{self.impl}/{self.model}/{self.optimizer}"


def pick_device() -> torch.device:
    """CUDA when present (the project's code path picks it too), else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_project(
    variant: Variant, data: torch.Tensor, *, n_hidden: int, cd_k: int, seed: int = 0
) -> Callable[[int], object]:
    """An ssdcore Trainer for the variant; returns its `train_steps`."""
    import ssdcore
    from ssdcore.optim import OptimizerConfig

    n_visible = data.shape[1]
    if variant.model == "bernoulli":
        model = ssdcore.BernoulliRBM(n_visible, n_hidden)
    else:
        model = ssdcore.GaussianRBM(n_visible, n_hidden, variance="diagonal")
    model = model.to(data.device)
    eager = variant.optimizer.endswith(EAGER_SUFFIX)
    optimizer = OptimizerConfig(**PROJECT_OPTIMIZERS[variant.optimizer.removesuffix(EAGER_SUFFIX)])
    if not hasattr(ssdcore, "Trainer"):
        return _estimator_loop(model, optimizer, data, cd_k=cd_k, seed=seed)
    trainer = ssdcore.Trainer(
        model,
        data,
        optimizer=optimizer,
        batch_size=BATCH_SIZE,
        cd_k=cd_k,
        seed=seed,
        cuda_graph=False if eager else None,
    )
    return trainer.train_steps


def _estimator_loop(model, optimizer_config, data, *, cd_k: int, seed: int):
    # The core's own step (CDEstimator + optimizer) for trees where Trainer is not in yet.
    import ssdcore
    from ssdcore.optim import build_optimizer

    estimator = ssdcore.CDEstimator(model, k=cd_k, seed=seed)
    optimizer = build_optimizer(model, optimizer_config)
    generator = torch.Generator(device=data.device).manual_seed(seed)

    def run(steps: int) -> None:
        for _ in range(steps):
            index = torch.randint(
                0, data.shape[0], (BATCH_SIZE,), device=data.device, generator=generator
            )
            estimator.estimate(data[index])
            optimizer.step()

    return run


def build_reference(
    variant: Variant, data: torch.Tensor, *, n_hidden: int, cd_k: int, seed: int = 0
) -> Callable[[int], object]:
    """The plain reference loop for the variant; returns a `run(steps)` function."""
    config = ReferenceConfig(
        model=variant.model,
        n_visible=data.shape[1],
        n_hidden=n_hidden,
        batch_size=BATCH_SIZE,
        cd_k=cd_k,
        optimizer=variant.optimizer,
        lr=REFERENCE_OPTIMIZERS[variant.optimizer],
    )
    loop = ReferenceLoop(config, data, seed=seed)

    def run(steps: int) -> None:
        for _ in range(steps):
            loop.step()

    return run


class Runner:
    """Runs a variant's steps, rebuilding it if training diverges (timing needs no convergence).

    The project raises DivergenceError on NaN/Inf; the plain loop fails in `torch.bernoulli` with
    a RuntimeError once its probabilities turn NaN. Either way the variant starts afresh and the
    restart is reported with the case.
    """

    def __init__(self, build: Callable[[], Callable[[int], object]]):
        self._build = build
        self._run = build()
        self.restarts = 0

    def __call__(self, steps: int) -> None:
        from ssdcore import DivergenceError

        try:
            self._run(steps)
        except (DivergenceError, RuntimeError):
            logger.warning("rebuilding a diverged variant", exc_info=True)
            self.restarts += 1
            self._run = self._build()


def variants(device: torch.device) -> list[Variant]:
    """Every variant measured at one size and CD-k, in a stable order."""
    result = []
    for model in MODELS:
        result += [Variant("project", model, name) for name in PROJECT_OPTIMIZERS]
        if device.type == "cuda":
            result += [
                Variant("project", model, name + EAGER_SUFFIX) for name in GPU_EAGER_VARIANTS
            ]
        result += [Variant("reference", model, name) for name in REFERENCE_OPTIMIZERS]
    return result


def _builder(variant: Variant, data: torch.Tensor, n_hidden: int, cd_k: int):
    build = build_project if variant.impl == "project" else build_reference
    return lambda: build(variant, data, n_hidden=n_hidden, cd_k=cd_k)


def _steps_per_call(runner: Runner, device: torch.device, round_seconds: float) -> int:
    # Calibrate from one timed step after the warm-up, so every round lasts about as long.
    start = time.perf_counter()
    runner(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = max(time.perf_counter() - start, 1e-6)
    return max(1, min(200, math.ceil(round_seconds / seconds)))


def measure_group(
    n_hidden: int, cd_k: int, datasets: dict[str, torch.Tensor], plan: Plan
) -> list[Case]:
    """Time all variants at one size and CD-k in shared rounds; one Case per variant."""
    device = next(iter(datasets.values())).device
    group = variants(device)
    builders = {v.name: _builder(v, datasets[v.model], n_hidden, cd_k) for v in group}
    runners = {name: Runner(build) for name, build in builders.items()}
    for runner in runners.values():
        runner(plan.warmup_calls)
    steps = {name: _steps_per_call(r, device, plan.round_seconds) for name, r in runners.items()}
    calls = {name: (lambda r=runners[name], n=steps[name]: r(n)) for name in runners}
    timings = interleaved_rounds(
        calls,
        warmup_calls=0,
        calls_per_round=1,
        rounds=plan.rounds,
        device=device,
        units_per_call=steps,
    )
    memory = measure_memory(builders, plan.memory_steps, device)
    cases = []
    for variant in group:
        case = _case(variant, n_hidden, cd_k, timings, memory[variant.name], steps[variant.name])
        if runners[variant.name].restarts:
            case.notes.append(
                f"{variant.name} 784x{n_hidden} CD-{cd_k}: rebuilt "
                f"{runners[variant.name].restarts}x after divergence"
            )
        cases.append(case)
    return cases


def measure_memory(
    builders: dict[str, Callable[[], Callable[[int], object]]], steps: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Per variant, the peak tensor memory of setting it up (construction and first step, when
    buffers are allocated) and of `steps` further steps (the steady working set), in MiB."""
    result: dict[str, dict[str, float]] = {}
    with TensorMemory(device) as memory:
        for name, build in builders.items():
            with memory.phase(f"{name}:setup"):
                run = build()
                run(1)
            with memory.phase(f"{name}:step"):
                run(steps)
            del run
    for name in builders:
        result[name] = {
            "setup_mib": memory.peaks[f"{name}:setup"],
            "step_mib": memory.peaks[f"{name}:step"],
        }
    return result


def _reference_of(variant: Variant) -> str:
    optimizer = variant.optimizer.removesuffix(EAGER_SUFFIX)
    family = "ssd" if optimizer.startswith("ssd") else optimizer
    return f"reference/{variant.model}/{family}"


def _ratios(variant: Variant, timings: dict[str, Timing]) -> dict[str, float | None]:
    """Same-round ratios: the median over rounds of (this variant / the other) per round."""
    own = timings[variant.name]
    ratios: dict[str, float | None] = {}
    if variant.impl == "project":
        ratios["x_faster_than_reference"] = paired_ratio(timings[_reference_of(variant)], own)
    eager = variant.optimizer.endswith(EAGER_SUFFIX)
    if eager:
        graphed = f"{variant.impl}/{variant.model}/{variant.optimizer.removesuffix(EAGER_SUFFIX)}"
        ratios["x_slower_than_graph"] = paired_ratio(own, timings[graphed])
    if variant.optimizer.startswith("ssd"):
        sgd = f"{variant.impl}/{variant.model}/sgd{EAGER_SUFFIX if eager else ''}"
        ratios["ssd_over_sgd"] = paired_ratio(own, timings[sgd])
    if variant.model == "gaussian":
        brbm = timings[f"{variant.impl}/bernoulli/{variant.optimizer}"]
        ratios["grbm_over_brbm"] = paired_ratio(own, brbm)
    return ratios


def _case(
    variant: Variant,
    n_hidden: int,
    cd_k: int,
    timings: dict[str, Timing],
    memory: dict[str, float],
    steps: int,
) -> Case:
    timing = timings[variant.name]
    return Case(
        suite="core",
        name=variant.name,
        config={
            "size": f"{N_VISIBLE}x{n_hidden}",
            "cd_k": cd_k,
            "batch": BATCH_SIZE,
            "steps_per_round": steps,
        },
        metrics={
            "ms_per_iter": timing.median_ms,
            "min_ms": timing.min_ms,
            "rounds": len(timing.samples_s),
            **memory,
        },
        ratios=_ratios(variant, timings),
    )


def load_datasets(plan: Plan, device: torch.device) -> dict[str, torch.Tensor]:
    """Binarized MNIST for the Bernoulli model and [0, 1]-scaled MNIST for the Gaussian."""
    return {
        model: bench_data.mnist(mode, limit=plan.data_limit).to(device)
        for model, mode in DATA_MODES.items()
    }


def run(*, quick: bool = False) -> tuple[list[Case], list[Target]]:
    """Measure every core configuration of the plan; return its cases and targets."""
    plan = Plan.quick() if quick else Plan.full()
    device = pick_device()
    datasets = load_datasets(plan, device)
    cases: list[Case] = []
    for n_hidden, cd_k in plan.groups:
        started = time.perf_counter()
        cases += measure_group(n_hidden, cd_k, datasets, plan)
        logger.info("core: 784x%d CD-%d took %.0f s", n_hidden, cd_k, time.perf_counter() - started)
    return cases, targets(cases, device)


def _find(cases: list[Case], name: str, size: str, cd_k: int) -> Case | None:
    for case in cases:
        if case.name == name and case.config["size"] == size and case.config["cd_k"] == cd_k:
            return case
    return None


def targets(cases: list[Case], device: torch.device) -> list[Target]:
    """The core goals, judged on the ratios measured in this run (None where not measured)."""
    result = []
    polar = DEFAULT_POLAR[device.type]
    for model in MODELS:
        sgd = _find(cases, f"project/{model}/sgd", "784x50", 10)
        result.append(
            Target(
                "core",
                f"{model} CD-10 784x50 SGD: x faster than the plain loop",
                sgd.ratios["x_faster_than_reference"] if sgd else None,
                4.5,
                ">=",
                "x",
            )
        )
    for size, limit in (("784x500", 1.05), ("784x50", 1.10)):
        for model in MODELS:
            ssd = _find(cases, f"project/{model}/{polar}", size, 10)
            result.append(
                Target(
                    "core",
                    f"{model} CD-10 {size}: SSD ({polar}) / SGD time",
                    ssd.ratios["ssd_over_sgd"] if ssd else None,
                    limit,
                    "<=",
                    "x",
                )
            )
    for size in ("784x50", "784x500"):
        for optimizer in ("sgd", polar):
            grbm = _find(cases, f"project/gaussian/{optimizer}", size, 10)
            result.append(
                Target(
                    "core",
                    f"GRBM / BRBM time, {optimizer} CD-10 {size}",
                    grbm.ratios["grbm_over_brbm"] if grbm else None,
                    1.2,
                    "<=",
                    "x",
                )
            )
    result += ssd_cost_targets(cases, polar)
    for target in result:
        if target.measured is None and not target.why:
            target.why = (
                "configuration not part of this run (--quick measures 784x50 and 784x100 at "
                "CD-1 only)"
            )
    on_gpu = device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if on_gpu else "GPU"
    for optimizer in ("sgd", "ssd-newton-schulz", "ssd-lowrank"):
        case = _find(cases, f"project/bernoulli/{optimizer}", "784x500", 10)
        result.append(
            Target(
                "core",
                f"{gpu}: CD-10 784x500 batch 100 {optimizer}, ms per iteration",
                case.metrics["ms_per_iter"] if (case and on_gpu) else None,
                1.0,
                "<=",
                " ms",
                "" if on_gpu else "no GPU in this environment; not measured",
            )
        )
    return result


def ssd_cost_targets(cases: list[Case], polar: str) -> list[Target]:
    """What an SSD iteration costs next to an SGD one (Bernoulli RBM, SSD_COST_LIMITS), from the
    pair's same-round ratio; the goal is for one torch thread, which ``--threads 1`` gives."""
    threads = torch.get_num_threads()
    result = []
    for (n_hidden, cd_k), limit in SSD_COST_LIMITS.items():
        size = f"{N_VISIBLE}x{n_hidden}"
        ssd = _find(cases, f"project/bernoulli/{polar}", size, cd_k)
        target = Target(
            "core",
            f"bernoulli CD-{cd_k} {size}, one thread: SSD ({polar}) / SGD time per iteration",
            ssd.ratios["ssd_over_sgd"] if ssd else None,
            limit,
            "<=",
            "x",
        )
        if threads != 1 and ssd:
            target.why = f"measured with {threads} torch threads; the goal is for one"
        elif target.met is False:
            target.why = (
                f"where the step's time goes: python -m bench.ssd_cost --hidden {n_hidden} "
                f"--k {cd_k} (docs/PERFORMANCE.md, the SSD step at CD-1)"
            )
        result.append(target)
    return result
