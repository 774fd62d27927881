"""MNIST with 500 hidden units: SSD with the transferable step rule against the baselines.

The question: with its step size set by the normalized rule (tuned at small n_h only, never at
500; docs/RESULTS.md §6), does the best SSD-family configuration reach or beat the best
baseline at n_h = 500, by the conservative likelihood bound and by reconstruction error?

Data and model as in ``experiments/mnist.py``: the 10k MNIST images, binarized, split 8k train /
2k test at random (seed 0); Bernoulli RBM, n_h = 500, CD-10, batch 100. Configurations:

- SGD, Nesterov (momentum 0.9), and both centered (``ssdcore.centering``, sliding factor 0.01);
  Adam (``torch.optim.Adam`` on the CD gradients, as in ``experiments/beyond.py``);
- SSD with the paper's rule at the n_h = 50 step (a reference: too long at 500, RESULTS §2);
- SSD with the normalized rule, plain, centered, as the hybrid SSD_W / SGD biases, and with
  PCD and parallel tempering (10 temperatures down to β = 0.5, one Gibbs sweep each per step:
  the same ten sweeps per step as CD-10).

Step sizes. Baselines from ``experiments/step_sizes.json``: SGD ``mnist-brbm/sgd``, Nesterov
``mnist-brbm/nesterov``, paper-rule SSD ``mnist-brbm/ssd`` (all tuned at n_h = 50) and Adam
``beyond/adam`` (tuned at n_h = 50 in the beyond setting); centered runs take their uncentered
step. Every normalized-rule SSD step is the library's default for that rule
(``ssdcore.step_sizes``, chosen at n_h = 32 in ``python -m experiments transfer``); the
hybrid's biases take the SGD step.

Two budgets. ``iterations``: every run ``Config.steps`` iterations. ``wall``: every run stops
when its training time (evaluation excluded) reaches that of the SGD run of the same seed at
equal iterations, measured in the same invocation (SGD's own wall-budget row is its
equal-iterations run). Training time is the process's CPU time (``TRAINING_CLOCK``), so the
budget holds on a machine shared with other work (docs/RESULTS.md §7's equal-time rows come from
``--time-only`` with this clock; a wall-clock budget on the loaded machine was discarded).

Measured: reconstruction error (train, test) every ``eval_every`` iterations; the certified
test log-likelihood pair (AIS with the data's base rates: upper; reverse AIS: lower) at the
``likelihood_fractions`` of the iteration budget and at the end of every run. Outputs (under
``docs/figures/large/``): ``runs`` (one row per run), ``summary`` (mean over seeds with their
spread), ``curves_<budget>``, ``recon.png`` and ``ll_bounds.png``; written again after every
run, so an interrupted invocation leaves what it finished.
``python -m experiments large [--pilot] [--time-only]``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

import ssdcore
from experiments import common, mnist
from experiments.common import EvalPlan, ModelSpec, RunResult, RunSpec, TorchOptimizer
from ssdcore.optim import OptimizerConfig
from ssdcore.step_sizes import default_lr
from ssdcore.tempering import TemperingConfig

logger = logging.getLogger(__name__)

NAME = "large"
# Training time is this process's CPU time, not wall time: on a machine shared with other work
# a wall-clock budget measures the load as much as the method (one torch thread, so CPU time is
# the time the training computed).
TRAINING_CLOCK = time.process_time
BUDGETS = ("iterations", "wall")
BUDGET_TITLES = {"iterations": "equal iterations", "wall": "equal wall time"}
FALLBACK_LR = {"sgd": 0.1, "nesterov": 0.01, "ssd": 1e-3, "adam": 1e-3}
# The normalized rule's one step size for a Bernoulli RBM (tuned at n_h = 32, RESULTS §6).
NORMALIZED_LR = default_lr("bernoulli", "ssd", None, "normalized")


@dataclass(frozen=True)
class Config:
    limit: int | None = None  # use only the first `limit` images (quick runs)
    n_hidden: int = 500
    cd_k: int = 10
    batch_size: int = 100
    steps: int = 2000
    eval_every: int = 100
    likelihood_fractions: tuple[float, ...] = (0.25, 0.5, 1.0)  # of `steps`, iteration budget
    ais_chains: int = 100
    ais_betas: int = 1000
    seeds: tuple[int, ...] = (0, 1, 2)
    budgets: tuple[str, ...] = BUDGETS
    temperatures: int = 10  # parallel tempering ladder, 1 down to `min_beta`
    # run only these configurations (labels of `methods`; SGD always runs: the time budget is
    # its); empty: all of them
    only: tuple[str, ...] = ()
    min_beta: float = 0.5

    def method(self) -> str:
        return common.ssd_method(mnist.IMAGE_SHAPE[0] * mnist.IMAGE_SHAPE[1], self.n_hidden, 100)

    def likelihood_steps(self) -> tuple[int, ...]:
        return tuple(sorted({round(f * self.steps) for f in self.likelihood_fractions}))


FULL = Config()
# One seed, both budgets: the first look at the question (docs/RESULTS.md §7).
PILOT = dataclasses.replace(FULL, seeds=(0,), likelihood_fractions=(0.5, 1.0))
QUICK = Config(
    limit=500,
    n_hidden=12,
    cd_k=1,
    batch_size=50,
    steps=6,
    eval_every=3,
    likelihood_fractions=(1.0,),
    ais_chains=8,
    ais_betas=20,
    seeds=(0,),
    temperatures=3,
)


@dataclass(frozen=True)
class Method:
    """One configuration: an optimizer, and whether it trains centered / with tempered PCD."""

    label: str
    optimizer: OptimizerConfig | TorchOptimizer
    centered: bool = False
    tempered: bool = False


def methods(config: Config, chosen: dict[str, float]) -> list[Method]:
    """Every configuration, SGD first (the wall budget is its time)."""

    def lr(key: str, fallback: str) -> float:
        return common.step_size(chosen, key, FALLBACK_LR[fallback])

    sgd = OptimizerConfig("sgd", lr=lr("mnist-brbm/sgd", "sgd"))
    nesterov = OptimizerConfig("nesterov", lr=lr("mnist-brbm/nesterov", "nesterov"), momentum=0.9)
    normalized = OptimizerConfig(
        "ssd", lr=NORMALIZED_LR, step_rule="normalized", method=config.method()
    )
    hybrid = OptimizerConfig(
        "sgd",
        lr=sgd.lr,
        per_parameter={"W": "ssd"},
        per_parameter_lr={"W": NORMALIZED_LR},
        step_rule="normalized",
        method=config.method(),
    )
    every = [
        Method("SGD", sgd),
        Method("Nesterov", nesterov),
        Method("Adam", TorchOptimizer("adam", lr("beyond/adam", "adam"))),
        Method("centered SGD", sgd, centered=True),
        Method("SSD normalized", normalized),
        Method("SSD_W normalized / SGD", hybrid),
        Method("centered SSD normalized", normalized, centered=True),
        Method("centered Nesterov", nesterov, centered=True),
        Method("SSD normalized PCD+PT", normalized, tempered=True),
        Method(
            "SSD paper (n_h = 50 step)",
            OptimizerConfig("ssd", lr=lr("mnist-brbm/ssd", "ssd"), method=config.method()),
        ),
    ]
    unknown = sorted(set(config.only) - {m.label for m in every})
    if unknown:
        raise ValueError(f"Config.only: unknown configurations {unknown}")
    return [m for m in every if not config.only or m.label in {"SGD", *config.only}]


@dataclass(frozen=True)
class LargeRun:
    """A run of one method at one seed under one budget (`wall_seconds` None: iterations)."""

    method: Method
    spec: RunSpec
    config: Config
    wall_seconds: float | None = None

    @property
    def budget(self) -> str:
        return "iterations" if self.wall_seconds is None else "wall"


def run_spec(method: Method, config: Config, seed: int) -> RunSpec:
    tempered = method.tempered
    return RunSpec(
        label=method.label,
        model=ModelSpec("bernoulli", config.n_hidden),
        optimizer=method.optimizer,
        steps=config.steps,
        batch_size=config.batch_size,
        # tempered PCD: one sweep per temperature, as many sweeps per step as CD-k
        cd_k=1 if tempered else config.cd_k,
        persistent=tempered,
        seed=seed,
        centered=method.centered,
        tempering=(
            TemperingConfig(n_temperatures=config.temperatures, min_beta=config.min_beta)
            if tempered
            else None
        ),
    )


def execute(run: LargeRun, plan: EvalPlan) -> RunResult:
    """Trains `run` to its iteration count, or until its training time reaches `wall_seconds`.

    Measures at `plan.steps(...)` and where it stops; the stopping point always gets the
    likelihood bounds. Only training is timed; under a time budget the steps are taken one at a
    time so that the run stops at the first step past the budget.
    """
    spec = run.spec
    common.seed_everything(spec.seed)
    model = spec.model.build(plan.train.shape[1])
    trainer = common.make_trainer(model, plan.train, spec)
    records: list[dict[str, float]] = []
    train_seconds = 0.0
    diverged_at = None
    checkpoints = plan.steps(spec.steps)
    for target in checkpoints:
        out_of_time = False
        try:
            while trainer.step_count < target:
                if run.wall_seconds is not None and train_seconds >= run.wall_seconds:
                    out_of_time = True
                    break
                chunk = 1 if run.wall_seconds is not None else target - trainer.step_count
                started = TRAINING_CLOCK()
                trainer.train_steps(chunk)
                train_seconds += TRAINING_CLOCK() - started
        except ssdcore.DivergenceError as error:
            logger.warning("%s diverged before step %d: %s", spec.label, target, error)
            diverged_at = trainer.step_count
            break
        step = trainer.step_count
        last = out_of_time or target == checkpoints[-1]
        at = plan if not last else dataclasses.replace(plan, likelihood_at=(step,))
        record = {"step": float(step), "train_seconds": train_seconds}
        record.update(at.measure(model, step))
        records.append(record)
        if not math.isfinite(record["test_recon"]):
            diverged_at = step
            break
        if out_of_time:
            break
    done = records[-1] if records else {}
    logger.info(
        "%s (seed %d, %s budget): %d steps in %.1f s, test recon %.4g, LL %.2f / %.2f",
        spec.label,
        spec.seed,
        run.budget,
        trainer.step_count,
        train_seconds,
        done.get("test_recon", math.nan),
        done.get("test_ll", math.nan),
        done.get("ll_lower", math.nan),
    )
    return RunResult(
        spec,
        records,
        model,
        train_seconds,
        diverged_at,
        extra={"budget": run.budget, "steps_done": trainer.step_count},
    )


def eval_plan(config: Config, train: torch.Tensor, test: torch.Tensor) -> EvalPlan:
    return EvalPlan(
        train=train,
        test=test,
        every=config.eval_every,
        likelihood="ais",
        likelihood_at=config.likelihood_steps(),
        ais_chains=config.ais_chains,
        ais_betas=config.ais_betas,
    )


# ---------------------------------------------------------------------------------------------
# Tables and figures


def run_rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per run: its budget, seed, where it stopped and its final measurements."""
    return [
        {
            "budget": r.extra["budget"],
            "run": r.label,
            "seed": r.spec.seed,
            "lr": _lr_text(r.spec),
            "steps": r.extra["steps_done"],
            "diverged": r.diverged_at is not None,
            "train_seconds": r.train_seconds,
            "train_recon": r.final("train_recon"),
            "test_recon": r.final("test_recon"),
            "ll_upper": r.final("test_ll"),
            "ll_upper_se": r.final("ll_stderr"),
            "ll_lower": r.final("ll_lower"),
            "ll_lower_se": r.final("ll_lower_stderr"),
            "ll_gap": r.final("ll_gap"),
        }
        for r in results
    ]


def _lr_text(spec: RunSpec) -> str:
    optimizer = spec.optimizer
    if isinstance(optimizer, OptimizerConfig) and optimizer.per_parameter_lr:
        spectral = ", ".join(f"{k} {v:.3g}" for k, v in optimizer.per_parameter_lr.items())
        return f"{spectral} (SSD) / {optimizer.lr:.3g} (SGD)"
    return f"{optimizer.lr:.3g}"


def _spread(values: list[float]) -> float:
    """Sample standard deviation over seeds (NaN with one seed)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.stdev(finite) if len(finite) > 1 else math.nan


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if finite else math.nan


def _mean_stderr(values: list[float]) -> float:
    """Standard error of a mean of independent estimates with these standard errors."""
    finite = [v for v in values if math.isfinite(v)]
    return math.sqrt(sum(v * v for v in finite)) / len(finite) if finite else math.nan


def summary_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget and configuration: means over seeds, the bounds' standard errors, and the
    spread (standard deviation) over seeds of the reconstruction error and the lower bound."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["budget"], row["run"]), []).append(row)
    summary = []
    for (budget, label), group in groups.items():

        def column(key: str, group: list[dict[str, Any]] = group) -> list[float]:
            return [float(r[key]) for r in group]

        summary.append(
            {
                "budget": budget,
                "run": label,
                "lr": group[0]["lr"],
                "seeds": len(group),
                "steps": _mean(column("steps")),
                "diverged": sum(bool(r["diverged"]) for r in group),
                "train_seconds": _mean(column("train_seconds")),
                "test_recon": _mean(column("test_recon")),
                "test_recon_spread": _spread(column("test_recon")),
                "ll_upper": _mean(column("ll_upper")),
                "ll_upper_se": _mean_stderr(column("ll_upper_se")),
                "ll_lower": _mean(column("ll_lower")),
                "ll_lower_se": _mean_stderr(column("ll_lower_se")),
                "ll_lower_spread": _spread(column("ll_lower")),
                "ll_gap": _mean(column("ll_gap")),
            }
        )
    return summary


def recon_figure(results: Sequence[RunResult], budgets: Sequence[str], path: Path) -> Path:
    """Test reconstruction error: against iterations (iteration budget) and against training
    seconds (time budget); one colour per configuration, one line per seed."""
    figure, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 3.8), squeeze=False)
    labels = list(dict.fromkeys(r.label for r in results))
    colours = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    for axis, budget in zip(axes[0], budgets, strict=True):
        x_key = "step" if budget == "iterations" else "train_seconds"
        shown: set[str] = set()
        for result in (r for r in results if r.extra["budget"] == budget):
            xs = [r[x_key] for r in result.records if x_key in r and r["step"] > 0]
            ys = [r["test_recon"] for r in result.records if x_key in r and r["step"] > 0]
            label = None if result.label in shown else result.label
            shown.add(result.label)
            axis.plot(xs, ys, color=colours[result.label], label=label, linewidth=1.2)
        axis.set_title(f"test reconstruction error, {BUDGET_TITLES[budget]}", fontsize=10)
        axis.set_xlabel("iteration" if budget == "iterations" else "training seconds")
        axis.set_ylabel("squared error per image")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    figure.tight_layout()
    return common.save_figure(figure, path)


# How far below the best lower bound the likelihood figure's axis reaches; configurations
# further down are listed with their values at the axis's edge instead of stretching it.
BOUNDS_WINDOW_NATS = 40.0


def bounds_figure(summary: Sequence[dict[str, Any]], budgets: Sequence[str], path: Path) -> Path:
    """Final test log-likelihood per configuration as a bar from the lower (reverse AIS) to the
    upper (AIS) bound, mean over seeds, whiskers ±2 standard errors at each end."""
    figure, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 4.2), squeeze=False)
    for axis, budget in zip(axes[0], budgets, strict=True):
        rows = [r for r in summary if r["budget"] == budget and math.isfinite(r["ll_lower"])]
        if not rows:
            continue
        left = max(r["ll_lower"] for r in rows) - BOUNDS_WINDOW_NATS
        right = max(r["ll_upper"] for r in rows) + 3.0
        for position, row in enumerate(rows):
            lower, upper = row["ll_lower"], row["ll_upper"]
            if lower < left:  # off the axis: its values in words
                axis.text(left + 1, position + 0.3, f"{lower:.0f} / {upper:.0f}", fontsize=7)
            if upper < left:
                continue
            axis.barh(position, upper - lower, left=lower, height=0.5, color="tab:blue", alpha=0.5)
            axis.errorbar(
                [lower, upper],
                [position, position],
                xerr=[2 * row["ll_lower_se"], 2 * row["ll_upper_se"]],
                fmt="none",
                ecolor="black",
                capsize=2,
            )
        axis.set_yticks(range(len(rows)), [r["run"] for r in rows], fontsize=7)
        axis.set_xlim(left, right)
        axis.invert_yaxis()
        axis.set_title(f"test log-likelihood bounds (nats), {BUDGET_TITLES[budget]}", fontsize=9)
        axis.grid(alpha=0.3, axis="x")
    figure.tight_layout()
    return common.save_figure(figure, path)


def redraw_bounds(directory: Path) -> Path:
    """Redraws ``ll_bounds.png`` from a finished invocation's ``summary.json``."""
    summary = json.loads((directory / "summary.json").read_text())
    budgets = [b for b in BUDGETS if any(r["budget"] == b for r in summary)]
    return bounds_figure(summary, budgets, directory / "ll_bounds.png")


def write_outputs(directory: Path, results: Sequence[RunResult], config: Config) -> dict[str, Any]:
    rows = run_rows(results)
    summary = summary_rows(rows)
    common.write_table(rows, directory, "runs")
    common.write_table(summary, directory, "summary")
    budgets = [b for b in config.budgets if any(r.extra["budget"] == b for r in results)]
    for budget in budgets:
        of_budget = [r for r in results if r.extra["budget"] == budget]
        common.write_curves(of_budget, directory, f"curves_{budget}")
    if budgets:
        recon_figure(results, budgets, directory / "recon.png")
        bounds_figure(summary, budgets, directory / "ll_bounds.png")
    return {"runs": rows, "summary": summary}


# ---------------------------------------------------------------------------------------------
# The experiment


def run(
    out: Path, *, quick: bool = False, pilot: bool = False, time_only: bool = False
) -> dict[str, Any]:
    """The experiment; ``time_only`` runs the time budget alone (SGD's equal-iterations run,
    which sets it, then every other configuration under it)."""
    config = QUICK if quick else PILOT if pilot else FULL
    if time_only:
        config = dataclasses.replace(config, budgets=("wall",))
    train, test = mnist.load_data(mnist.Config(limit=config.limit))
    plan = eval_plan(config, train, test)
    chosen = common.load_step_sizes()
    directory = common.output_dir(out, NAME)
    results: list[RunResult] = []
    outputs: dict[str, Any] = {}
    for seed in config.seeds:
        sgd_seconds = None
        for method in methods(config, chosen):
            if "iterations" not in config.budgets and method.label != "SGD":
                continue
            spec = run_spec(method, config, seed)
            result = execute(LargeRun(method, spec, config), plan)
            results.append(result)
            if method.label == "SGD":
                sgd_seconds = result.train_seconds
            outputs = write_outputs(directory, results, config)
        if "wall" not in config.budgets:
            continue
        for method in methods(config, chosen):
            spec = run_spec(method, config, seed)
            if method.label == "SGD":
                # SGD's time budget is its own equal-iterations run.
                sgd = next(r for r in results if r.spec == spec)
                results.append(dataclasses.replace(sgd, extra={**sgd.extra, "budget": "wall"}))
                continue
            results.append(execute(LargeRun(method, spec, config, sgd_seconds), plan))
            outputs = write_outputs(directory, results, config)
    outputs = write_outputs(directory, results, config)
    return {
        "config": dataclasses.asdict(config),
        "normalized_lr": NORMALIZED_LR,
        **outputs,
    }
