"""Shared machinery of the experiments: seeding, data, runs with evaluation, tables, figures.

Every experiment builds a list of `RunSpec`s, hands them to `execute` with an `EvalPlan`, and
writes what came back with `write_table` and `save_figure`. Training goes through the library:
`ssdcore.Trainer` for every optimizer that `ssdcore.optim.OptimizerConfig` can describe, and a
small loop around `ssdcore.CDEstimator` for plain `torch.optim` optimizers (Adam, RMSprop) that
the library does not build.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # figures are files; never open a window
import matplotlib.pyplot as plt
import numpy as np
import torch
from PIL import Image

import ssdcore
from ssdcore.centering import CenteringConfig
from ssdcore.data import default_data_dir
from ssdcore.evaluation import (
    certified_log_likelihood,
    exact_log_partition,
    log_likelihood,
    reconstruction_error,
)
from ssdcore.optim import SSD, OptimizerConfig
from ssdcore.tempering import TemperingConfig

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "figures"
STEP_SIZES_PATH = Path(__file__).with_name("step_sizes.json")
# PNGs stay small so that the documentation stays light to clone.
FIGURE_DPI = 80
FIGURE_MAX_BYTES = 150_000


# ---------------------------------------------------------------------------------------------
# Seeds, data, step sizes


# Threads per experiment process. One thread is the fast choice on small, shared CPUs: on this
# project's 2-core machines under load, a CD-10 step at 784×50 took about 10× longer with two
# torch threads than with one (threads spin waiting for each other).
THREADS_ENV = "SSDRBM_EXPERIMENT_THREADS"


def configure_threads() -> int:
    """Sets torch's intra-op threads from `SSDRBM_EXPERIMENT_THREADS` (default 1)."""
    threads = int(os.environ.get(THREADS_ENV, "1"))
    torch.set_num_threads(threads)
    return threads


def ssd_method(n_visible: int, n_hidden: int, batch_size: int) -> str:
    """The faster of the two exact polar methods for a CD weight gradient of this shape.

    The low-rank step works on factors of rank 2·batch_size; it only pays when that rank is
    below min(n_visible, n_hidden). Otherwise a plain SVD of the (smaller) gradient is cheaper.
    Both give the same step to float precision.
    """
    return "lowrank" if 2 * batch_size < min(n_visible, n_hidden) else "svd"


def seed_everything(seed: int) -> None:
    """Seeds every random number generator an experiment touches (torch, numpy, random)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def data_dir() -> Path:
    """Directory with the real datasets: `SSDRBM_DATA_DIR`, else `../shared/data` of the repo."""
    return default_data_dir()


def load_step_sizes(path: Path = STEP_SIZES_PATH) -> dict[str, float]:
    """Step sizes chosen by `python -m experiments tuning` (key `setting/optimizer`)."""
    if not path.exists():
        return {}
    return {key: float(value) for key, value in json.loads(path.read_text())["chosen"].items()}


def step_size(chosen: dict[str, float], key: str, fallback: float) -> float:
    """The tuned step size for `key`, or `fallback` when tuning has not produced one."""
    if key not in chosen:
        logger.warning("no tuned step size for %s; using %g", key, fallback)
    return chosen.get(key, fallback)


# ---------------------------------------------------------------------------------------------
# Run specifications


@dataclass(frozen=True)
class ModelSpec:
    """Which RBM to train: `kind` is "bernoulli" or "gaussian" (with its `variance`)."""

    kind: str
    n_hidden: int
    variance: str = "diagonal"
    min_variance: float | None = None  # GRBM variance floor; None: the library's default

    def build(self, n_visible: int) -> ssdcore.RBM:
        if self.kind == "bernoulli":
            return ssdcore.BernoulliRBM(n_visible, self.n_hidden)
        if self.kind == "gaussian":
            floor = {} if self.min_variance is None else {"min_variance": self.min_variance}
            return ssdcore.GaussianRBM(n_visible, self.n_hidden, variance=self.variance, **floor)
        raise ValueError(f"unknown model kind {self.kind!r}: use 'bernoulli' or 'gaussian'")


@dataclass(frozen=True)
class TorchOptimizer:
    """A plain `torch.optim` optimizer (e.g. Adam) driven by the CD gradients."""

    name: str  # "adam" or "rmsprop"
    lr: float

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.name == "adam":
            return torch.optim.Adam(model.parameters(), lr=self.lr)
        if self.name == "rmsprop":
            return torch.optim.RMSprop(model.parameters(), lr=self.lr)
        raise ValueError(f"unknown torch optimizer {self.name!r}: use 'adam' or 'rmsprop'")


@dataclass(frozen=True)
class HybridOptimizer:
    """The paper's hybrids: SSD geometry for the parameters in `spectral`, SGD for the rest.

    Each geometry keeps its own step size (`lr` for the SSD group, `lr_euclidean` for the SGD
    group), the one tuned for plain SSD and plain SGD, because the two steps differ in scale by
    orders of magnitude and one shared value would freeze one group or blow up the other.
    """

    spectral: tuple[str, ...]
    lr: float
    lr_euclidean: float
    method: str = "lowrank"

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        named = dict(model.named_parameters())
        spectral = [p for n, p in named.items() if n in self.spectral]
        euclidean = [p for n, p in named.items() if n not in self.spectral]
        groups = []
        if spectral:
            groups.append({"params": spectral, "lr": self.lr})
        if euclidean:
            groups.append({"params": euclidean, "lr": self.lr_euclidean, "geometry": "euclidean"})
        return SSD(groups, lr=self.lr, method=self.method)


@dataclass(frozen=True)
class RunSpec:
    """One training curve: model, optimizer, CD settings, length and seed."""

    label: str
    model: ModelSpec
    optimizer: OptimizerConfig | TorchOptimizer | HybridOptimizer
    steps: int
    batch_size: int = 100
    cd_k: int = 1
    persistent: bool = False
    seed: int = 0
    centered: bool = False  # train centered (ssdcore.centering, default sliding factor)
    tempering: TemperingConfig | None = None  # parallel tempering of the PCD chains


class _TorchOptimizerTrainer:
    """The training loop of `ssdcore.Trainer`, for optimizers that OptimizerConfig cannot name
    (plain torch optimizers, and hybrids with one step size per geometry).

    Minibatches are drawn without replacement from a seeded permutation, reshuffled each epoch.
    """

    def __init__(self, model: ssdcore.RBM, data: torch.Tensor, spec: RunSpec):
        self.model = model
        self.data = data
        self.batch_size = spec.batch_size
        self.estimator = ssdcore.CDEstimator(
            model, k=spec.cd_k, persistent=spec.persistent, seed=spec.seed
        )
        self.optimizer = spec.optimizer.build(model)
        self.generator = torch.Generator().manual_seed(spec.seed)
        self.order = torch.randperm(len(data), generator=self.generator)
        self.position = 0
        self.step_count = 0

    def _next_batch(self) -> torch.Tensor:
        if self.position + self.batch_size > len(self.data):
            self.order = torch.randperm(len(self.data), generator=self.generator)
            self.position = 0
        index = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.data[index]

    def train_steps(self, n: int) -> None:
        for _ in range(n):
            self.optimizer.zero_grad(set_to_none=True)
            self.estimator.estimate(self._next_batch())
            self.optimizer.step()
            self.model.constrain_()  # e.g. keeps a GRBM's variances in their valid range
            self.step_count += 1
            if not all(torch.isfinite(p).all() for p in self.model.parameters()):
                raise ssdcore.DivergenceError(f"non-finite parameters at step {self.step_count}")


def make_trainer(model: ssdcore.RBM, train: torch.Tensor, spec: RunSpec) -> Any:
    """A trainer with `train_steps(n)` and `step_count` for `spec`'s optimizer."""
    if isinstance(spec.optimizer, TorchOptimizer | HybridOptimizer):
        if spec.centered or spec.tempering is not None:
            raise ValueError(
                f"{spec.label}: centering and tempering need an ssdcore OptimizerConfig"
            )
        return _TorchOptimizerTrainer(model, train, spec)
    return ssdcore.Trainer(
        model,
        train,
        optimizer=spec.optimizer,
        batch_size=spec.batch_size,
        cd_k=spec.cd_k,
        persistent=spec.persistent,
        seed=spec.seed,
        centering=CenteringConfig() if spec.centered else None,
        tempering=spec.tempering,
    )


# ---------------------------------------------------------------------------------------------
# Evaluation and execution


@dataclass(frozen=True)
class EvalPlan:
    """What to measure, and when.

    Reconstruction error is measured every `every` steps on `train` and `test`; the test
    log-likelihood at the steps in `likelihood_at` ("exact": hidden states enumerated, or "ais":
    AIS with the training data's base rates as `test_ll`, an optimistic stochastic bound, with
    reverse AIS's conservative one beside it as `ll_lower`).
    """

    train: torch.Tensor
    test: torch.Tensor
    every: int
    likelihood: str = "none"  # "none" | "exact" | "ais"
    likelihood_at: tuple[int, ...] = ()
    ais_chains: int = 100
    ais_betas: int = 1000
    ais_seed: int = 0
    # Reverse AIS on 100 test rows, 2 chains each: its error (std of the per-row offsets / √n)
    # stays a few tenths of a nat while a 784×500 evaluation costs tens of seconds, not minutes.
    reverse_chains: int = 2
    reverse_examples: int | None = 100

    def steps(self, total: int) -> list[int]:
        points = set(range(0, total + 1, self.every)) | {total}
        points |= {s for s in self.likelihood_at if s <= total}
        return sorted(points)

    def measure(self, model: ssdcore.RBM, step: int) -> dict[str, float]:
        with torch.no_grad():
            record = {
                "train_recon": float(reconstruction_error(model, self.train)),
                "test_recon": float(reconstruction_error(model, self.test)),
            }
            if self.likelihood != "none" and step in self.likelihood_at:
                record.update(self.log_likelihood(model))
        return record

    def log_likelihood(self, model: ssdcore.RBM) -> dict[str, float]:
        """``model``'s test log-likelihood record now (see the class docstring)."""
        started = time.perf_counter()
        if self.likelihood == "exact":
            value = float(log_likelihood(model, self.test, float(exact_log_partition(model))))
            record = {"test_ll": value, "ll_stderr": 0.0, "ll_lower": value, "ll_gap": 0.0}
        else:
            bounds = certified_log_likelihood(
                model,
                self.test,
                data=self.train,
                n_betas=self.ais_betas,
                ais_chains=self.ais_chains,
                reverse_chains=self.reverse_chains,
                max_examples=self.reverse_examples,
                seed=self.ais_seed,
            )
            record = {
                "test_ll": bounds.upper,
                "ll_stderr": bounds.upper_stderr,
                "ll_lower": bounds.lower,
                "ll_lower_stderr": bounds.lower_stderr,
                "ll_gap": bounds.gap,
            }
        return record | {
            "ll_seconds": time.perf_counter() - started,
        }


@dataclass
class RunResult:
    """A finished curve: one record per evaluation point, the model, and the training time."""

    spec: RunSpec
    records: list[dict[str, float]]
    model: ssdcore.RBM
    train_seconds: float
    diverged_at: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.spec.label

    def final(self, key: str) -> float:
        """The last recorded value of `key` (NaN when it was never measured)."""
        values = [r[key] for r in self.records if key in r]
        return values[-1] if values else math.nan

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(int(r["step"]), r[key]) for r in self.records if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    @property
    def ms_per_step(self) -> float:
        done = self.diverged_at if self.diverged_at is not None else self.spec.steps
        return 1000.0 * self.train_seconds / max(done, 1)


@dataclass(frozen=True)
class Curve:
    """A curve read back from a `curves.json` file: enough to redraw a figure without a rerun."""

    label: str
    records: list[dict[str, float]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(int(r["step"]), r[key]) for r in self.records if not math.isnan(r[key])]
        return [p[0] for p in points], [p[1] for p in points]


def load_curves(path: Path) -> list[Curve]:
    """The curves of a `curves.json` written by `write_curves`, in their order."""
    grouped: dict[str, list[dict[str, float]]] = {}
    for row in json.loads(path.read_text()):
        grouped.setdefault(row["label"], []).append(row)
    return [Curve(label, records) for label, records in grouped.items()]


def execute(spec: RunSpec, plan: EvalPlan) -> RunResult:
    """Trains `spec` on `plan.train`, measuring at `plan.steps(...)`. Divergence ends the curve.

    Only `train_steps` is timed, so `train_seconds` excludes evaluation.
    """
    seed_everything(spec.seed)
    model = spec.model.build(plan.train.shape[1])
    trainer = make_trainer(model, plan.train, spec)
    records: list[dict[str, float]] = []
    train_seconds = 0.0
    diverged_at = None
    for step in plan.steps(spec.steps):
        started = time.perf_counter()
        try:
            trainer.train_steps(step - trainer.step_count)
        except ssdcore.DivergenceError as error:
            logger.warning("%s diverged before step %d: %s", spec.label, step, error)
            diverged_at = trainer.step_count
            break
        train_seconds += time.perf_counter() - started
        record = {"step": float(step), "train_seconds": train_seconds}
        record.update(plan.measure(model, step))
        records.append(record)
        if not math.isfinite(record["test_recon"]):
            diverged_at = step
            break
    logger.info(
        "%s: %d steps in %.1f s (%.2f ms/step), final test recon %.4g",
        spec.label,
        spec.steps,
        train_seconds,
        1000 * train_seconds / max(spec.steps, 1),
        records[-1]["test_recon"] if records else math.nan,
    )
    return RunResult(spec, records, model, train_seconds, diverged_at)


# ---------------------------------------------------------------------------------------------
# Output: tables and figures


def output_dir(root: Path, name: str) -> Path:
    """`root/name`, created."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """Rows of equal keys as a GitHub Markdown table."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_table(rows: Sequence[dict[str, Any]], directory: Path, name: str) -> str:
    """Writes `rows` as `name.md`, `.csv` and `.json` in `directory`; returns the Markdown."""
    directory.mkdir(parents=True, exist_ok=True)
    text = markdown_table(rows)
    (directory / f"{name}.md").write_text(text)
    (directory / f"{name}.json").write_text(json.dumps(list(rows), indent=1) + "\n")
    with open(directory / f"{name}.csv", "w", newline="") as handle:
        if rows:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return text


def write_curves(results: Sequence[RunResult], directory: Path, name: str) -> None:
    """Every record of every run as one long CSV/JSON table (label, step, metrics...)."""
    keys = [
        "step",
        "train_seconds",
        "train_recon",
        "test_recon",
        "test_ll",
        "ll_stderr",
        "ll_lower",
        "ll_gap",
    ]
    rows = [
        {"label": r.label} | {k: record.get(k, math.nan) for k in keys}
        for r in results
        for record in r.records
    ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(rows) + "\n")
    with open(directory / f"{name}.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["label", *keys])
        writer.writeheader()
        writer.writerows(rows)


def save_figure(figure: plt.Figure, path: Path) -> Path:
    """Saves `figure` as a small PNG and closes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=FIGURE_DPI, bbox_inches="tight")
    plt.close(figure)
    shrink_png(path)
    size = path.stat().st_size
    if size > FIGURE_MAX_BYTES:
        logger.warning("%s is %d bytes, above the %d-byte budget", path, size, FIGURE_MAX_BYTES)
    return path


def shrink_png(path: Path) -> None:
    """Rewrites a PNG with a 256-colour palette: figures here are line plots and grey images,
    which lose nothing visible, and the file gets 2–4× smaller than matplotlib's RGBA."""
    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    palette.save(path, optimize=True)


def plot_metric(
    axis: plt.Axes,
    results: Sequence[RunResult],
    key: str,
    *,
    title: str,
    ylabel: str,
    styles: dict[str, dict[str, Any]] | None = None,
    log_y: bool = False,
    from_step: int = 0,
) -> None:
    """One line per run of metric `key` against iterations (those at or after `from_step`)."""
    for result in results:
        points = [(s, v) for s, v in zip(*result.series(key), strict=True) if s >= from_step]
        steps, values = [s for s, _ in points], [v for _, v in points]
        if steps:
            style = (styles or {}).get(result.label, {})
            axis.plot(
                steps, values, label=result.label, marker="." if len(steps) < 12 else None, **style
            )
    axis.set_title(title, fontsize=10)
    axis.set_xlabel("iteration")
    axis.set_ylabel(ylabel)
    if log_y:
        axis.set_yscale("log")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)


def curve_figure(
    results: Sequence[RunResult],
    panels: Sequence[tuple[str, str, str]],
    path: Path,
    *,
    styles: dict[str, dict[str, Any]] | None = None,
    log_y: bool = False,
    first_steps: dict[str, int] | None = None,
) -> Path:
    """A row of panels (metric key, title, y label), each with one line per run; a metric in
    `first_steps` is drawn from that step on."""
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for axis, (key, title, ylabel) in zip(axes[0], panels, strict=True):
        first = (first_steps or {}).get(key, 0)
        plot_metric(
            axis,
            results,
            key,
            title=title,
            ylabel=ylabel,
            styles=styles,
            log_y=log_y,
            from_step=first,
        )
    figure.tight_layout()
    return save_figure(figure, path)


def summary_rows(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """The final value of each metric per run, and its training time per step."""
    return [
        {
            "run": r.label,
            "lr": _learning_rate(r.spec),
            "steps": r.spec.steps if r.diverged_at is None else f"diverged at {r.diverged_at}",
            "train_recon": r.final("train_recon"),
            "test_recon": r.final("test_recon"),
            "test_ll": r.final("test_ll"),
            "ll_lower": r.final("ll_lower"),
            "ll_gap": r.final("ll_gap"),
            "ms_per_step": r.ms_per_step,
        }
        for r in results
    ]


def _learning_rate(spec: RunSpec) -> str:
    if isinstance(spec.optimizer, HybridOptimizer):
        return f"{spec.optimizer.lr:.3g} (SSD) / {spec.optimizer.lr_euclidean:.3g} (SGD)"
    return f"{spec.optimizer.lr:.3g}"


def image_grid(images: np.ndarray, shape: tuple[int, int], columns: int) -> np.ndarray:
    """Tiles (N, H*W) rows into one (rows*H, columns*W) image with a 1-pixel gap, each scaled to
    [0, 1] by its own range so that every filter shows its pattern."""
    height, width = shape
    rows = math.ceil(len(images) / columns)
    grid = np.ones((rows * (height + 1), columns * (width + 1)), dtype=np.float32)
    for i, image in enumerate(images):
        tile = image.reshape(height, width)
        low, high = float(tile.min()), float(tile.max())
        tile = (tile - low) / (high - low) if high > low else np.zeros_like(tile)
        r, c = divmod(i, columns)
        grid[
            r * (height + 1) : r * (height + 1) + height, c * (width + 1) : c * (width + 1) + width
        ] = tile
    return grid
