"""PNG figures of a job: metric curves, weight filters, W histogram, reconstructions, variances;
of a sweep: one metric curve per run.

matplotlib is imported inside :func:`write_figures` only, so the rest of the CLI never pays for it
(and works where it is not installed: the ``[plot]`` extra adds it, see :func:`require_matplotlib`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ssdrbm.cli.funnel import MissingExtra
from ssdrbm.client import Client
from ssdrbm.events import Metrics, MetricsEvent
from ssdrbm.model_file import ExportedModel

MAX_EXAMPLES = 8  # reconstructions shown beside their inputs
MAX_FILTERS = 100  # hidden units drawn as filters (a 10×10 grid)

# Image sizes of the built-in datasets whose pixel count is not a perfect square.
KNOWN_IMAGE_SHAPES = {560: (28, 20)}  # Frey Face: 28 rows × 20 columns


def guess_image_shape(n_visible: int) -> tuple[int, int] | None:
    """(height, width) when ``n_visible`` pixels look like an image, else None."""
    if n_visible in KNOWN_IMAGE_SHAPES:
        return KNOWN_IMAGE_SHAPES[n_visible]
    side = math.isqrt(n_visible)
    return (side, side) if side * side == n_visible and side >= 4 else None


def tile_images(images: np.ndarray, shape: tuple[int, int], columns: int) -> np.ndarray:
    """Arrange (N, H*W) images into one (rows*(H+1)-1, columns*(W+1)-1) canvas with NaN gaps."""
    height, width = shape
    rows = max(1, math.ceil(len(images) / columns))
    canvas = np.full((rows * (height + 1) - 1, columns * (width + 1) - 1), np.nan)
    for index, image in enumerate(images):
        row, column = divmod(index, columns)
        top, left = row * (height + 1), column * (width + 1)
        canvas[top : top + height, left : left + width] = image.reshape(height, width)
    return canvas


def metric_history(client: Client, job_id: str) -> list[Metrics]:
    """The job's recorded metrics, oldest first: its metric stream's history."""
    events = client.stream_metrics(job_id, follow=False)
    return [event.metrics for event in events if isinstance(event, MetricsEvent)]


def _metric_series(history: Sequence[Metrics], name: str) -> tuple[list[int], list[float]]:
    points = [(m.step, getattr(m, name)) for m in history if getattr(m, name) is not None]
    return [step for step, _ in points], [value for _, value in points]


def _plot_metrics(plt: Any, history: Sequence[Metrics], path: Path) -> Path | None:
    panels = [
        ("reconstruction error", ["reconstruction_error", "train_reconstruction_error"]),
        ("log-likelihood", ["log_likelihood", "log_likelihood_lower", "pseudo_log_likelihood"]),
        ("free-energy gap", ["free_energy_gap"]),
        ("spectral norm ‖W‖₂", ["spectral_norm"]),
    ]
    panels = [(title, names) for title, names in panels if any(
        _metric_series(history, name)[0] for name in names
    )]  # fmt: skip
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    for axis, (title, names) in zip(axes[0], panels, strict=True):
        for name in names:
            steps, values = _metric_series(history, name)
            if steps:
                axis.plot(steps, values, marker=".", label=name.replace("_", " "))
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.legend(fontsize="small")
    return _save_figure(plt, figure, path)


def _save_figure(plt: Any, figure: Any, path: Path) -> Path:
    """Lay the figure out, write it as a PNG at ``path`` and free it (pyplot keeps every open
    figure otherwise); returns ``path``."""
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _plot_filters(plt: Any, weights: np.ndarray, shape: tuple[int, int], path: Path) -> Path:
    filters = weights[:, :MAX_FILTERS].T  # (H, V): one image per hidden unit
    columns = math.ceil(math.sqrt(len(filters)))
    canvas = tile_images(filters, shape, columns)
    limit = float(np.nanmax(np.abs(canvas))) or 1.0
    figure, axis = plt.subplots(figsize=(8, 8 * canvas.shape[0] / canvas.shape[1]))
    axis.imshow(canvas, cmap="RdBu_r", vmin=-limit, vmax=limit)
    axis.set_title(f"weight filters ({len(filters)} of {weights.shape[1]} hidden units)")
    axis.axis("off")
    return _save_figure(plt, figure, path)


def _plot_histogram(plt: Any, weights: np.ndarray, path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.hist(weights.ravel(), bins=100)
    axis.set_title(f"W entries ({weights.shape[0]}×{weights.shape[1]})")
    axis.set_xlabel("value")
    axis.set_ylabel("count")
    return _save_figure(plt, figure, path)


def _plot_reconstructions(
    plt: Any,
    inputs: np.ndarray,
    reconstructions: np.ndarray,
    shape: tuple[int, int] | None,
    path: Path,
) -> Path:
    inputs = inputs.reshape(len(inputs), -1)[:MAX_EXAMPLES]
    reconstructions = reconstructions.reshape(len(reconstructions), -1)[:MAX_EXAMPLES]
    figure, axes = plt.subplots(2, len(inputs), figsize=(1.6 * len(inputs), 3.6), squeeze=False)
    for column, (x, y) in enumerate(zip(inputs, reconstructions, strict=True)):
        for row, vector in enumerate((x, y)):
            axis = axes[row][column]
            if shape is not None:
                axis.imshow(vector.reshape(shape), cmap="gray")
            else:
                axis.imshow(vector[None, :], aspect="auto", cmap="gray")
            axis.set_xticks([])
            axis.set_yticks([])
        axes[0][column].set_title(f"#{column}", fontsize="small")
    axes[0][0].set_ylabel("input")
    axes[1][0].set_ylabel("reconstruction")
    return _save_figure(plt, figure, path)


def _plot_variances(
    plt: Any, variances: np.ndarray, shape: tuple[int, int] | None, path: Path
) -> Path:
    figure, axis = plt.subplots(figsize=(5, 4))
    if shape is not None:
        image = axis.imshow(variances.reshape(shape), cmap="viridis")
        figure.colorbar(image, ax=axis)
        axis.axis("off")
    else:
        axis.bar(np.arange(len(variances)), variances)
        axis.set_xlabel("visible unit")
    axis.set_title("learned visible variances")
    return _save_figure(plt, figure, path)


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (the Agg backend: never needs a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib() -> None:
    """MissingExtra naming the [plot] extra when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as error:
        if (error.name or "matplotlib").split(".")[0] != "matplotlib":
            raise  # matplotlib is there but broken: its own error says more
        raise MissingExtra("plot", "matplotlib") from None


def write_figures(
    directory: Path,
    *,
    history: Sequence[Metrics],
    model: ExportedModel,
    inputs: np.ndarray | None = None,
    reconstructions: np.ndarray | None = None,
    image_shape: tuple[int, int] | None = None,
) -> list[Path]:
    """Write every figure that applies to ``directory``; returns the PNG paths written."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    weights = model.weights.astype(np.float64)
    n_visible = weights.shape[0]
    if image_shape is not None and image_shape[0] * image_shape[1] != n_visible:
        raise ValueError(
            f"--image-shape {image_shape[0]}x{image_shape[1]} does not match n_visible={n_visible}"
        )
    shape = image_shape or guess_image_shape(n_visible)
    written = [
        _plot_metrics(plt, history, directory / "metrics.png"),
        _plot_histogram(plt, weights, directory / "weights_histogram.png"),
    ]
    if shape is not None:
        written.append(_plot_filters(plt, weights, shape, directory / "filters.png"))
    if inputs is not None and reconstructions is not None:
        written.append(
            _plot_reconstructions(
                plt, inputs, reconstructions, shape, directory / "reconstructions.png"
            )
        )
    if any(name in model.parameters for name in ("log_var", "precision")):
        written.append(
            _plot_variances(plt, model.visible_variance(), shape, directory / "variances.png")
        )
    return [path for path in written if path is not None]


@dataclass(frozen=True)
class SweepCurve:
    """One run of a sweep: its label (the point), its metric history, whether it is the best."""

    label: str
    history: Sequence[Metrics]
    best: bool = False


# Runs per legend column; more runs add columns to the right of the axes.
LEGEND_ROWS = 24
# Part of the colormap the runs are drawn from: its very ends are too pale or too dark beside
# the best run's black.
RUN_COLOURS = ("turbo", 0.05, 0.95)


def run_colours(count: int) -> list[tuple[float, float, float, float]]:
    """``count`` distinct colours, one per run, sampled evenly along a colormap."""
    import matplotlib

    name, low, high = RUN_COLOURS
    colormap = matplotlib.colormaps[name]
    return [colormap(value) for value in np.linspace(low, high, count)] if count else []


def sweep_figure(curves: Sequence[SweepCurve], metric: str) -> Any:
    """The sweep's figure: the metric over steps, one curve per run in its own colour, the best
    run on top in a thick black line, and the legend outside the axes (right) so that it
    covers no curve."""
    figure, axis = _pyplot().subplots(figsize=(7, 4.5))
    others = [curve for curve in curves if not curve.best]
    best = [curve for curve in curves if curve.best]
    for curve, colour in zip(others, run_colours(len(others)), strict=True):
        steps, values = _metric_series(curve.history, metric)
        axis.plot(steps, values, label=curve.label, color=colour, alpha=0.85)
    for curve in best:  # last, on top
        steps, values = _metric_series(curve.history, metric)
        axis.plot(steps, values, label=f"{curve.label} (best)", color="black", linewidth=2.8)
    axis.set_title(f"sweep: {metric.replace('_', ' ')} per run")
    axis.set_xlabel("step")
    axis.legend(
        fontsize="x-small",
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0.0,
        ncols=max(1, math.ceil(len(curves) / LEGEND_ROWS)),
    )
    figure.tight_layout()
    return figure


def write_sweep_figure(directory: Path, curves: Sequence[SweepCurve], metric: str) -> Path:
    """``sweep.png`` (:func:`sweep_figure`); returns its path."""
    figure = sweep_figure(curves, metric)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sweep.png"
    figure.savefig(path, dpi=100, bbox_inches="tight")  # widened to hold the legend
    _pyplot().close(figure)
    return path
