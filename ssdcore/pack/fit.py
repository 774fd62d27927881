"""``fit`` for a pack: train every run to ``steps`` with :func:`ssdcore.fit`'s per-run policy.

Each run gets its own :class:`~ssdcore.blowup.BlowUpDetector`, healthy snapshot and backoff
count. A run that blows up (a metric, or its parameters turning non-finite) is rolled back to
its last healthy evaluation with every step size divided by
:data:`~ssdcore.blowup.BACKOFF_FACTOR`, while the other runs go on; once its
``max_backoffs`` are spent it is held where its last healthy evaluation left it and its
history ends with a ``{"event": "failed", ...}`` entry (fit would raise BlowUpError there).
A run that reaches ``steps`` is held while the others catch up.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ssdcore.blowup import (
    BACKOFF_FACTOR,
    DEFAULT_MAX_BACKOFFS,
    PARAMETERS,
    BlowUp,
    BlowUpDetector,
    suggested_lr,
)
from ssdcore.evaluation import reconstruction_error, saturated_hidden_fraction, spectral_norm
from ssdcore.pack.pack import TrainingPack
from ssdcore.pack.state import RunState
from ssdcore.training import DEFAULT_EVAL_EXAMPLES

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate_run(
    pack: TrainingPack,
    run: int,
    *,
    valid_data: Tensor | None = None,
    max_examples: int = DEFAULT_EVAL_EXAMPLES,
) -> dict[str, Any]:
    """The metrics the blow-up detector reads, keyed and computed as :meth:`Trainer.evaluate`'s
    (validation metrics on ``valid_data`` when given, else on the training data). For the full
    set, evaluate :func:`~ssdcore.pack.run_to_trainer`'s Trainer."""
    model = pack.model(run)
    train = pack.train_data[:max_examples]
    valid = train if valid_data is None else valid_data.to(pack.device)[:max_examples]
    return {
        "step": pack.step_counts[run],
        "reconstruction_error": float(reconstruction_error(model, valid)),
        "train_reconstruction_error": float(reconstruction_error(model, train)),
        "spectral_norm": float(spectral_norm(model.W)),
        "saturated_hidden_fraction": saturated_hidden_fraction(model, valid),
        "wall_time_s": pack.wall_times[run],
    }


@dataclass
class _RunProgress:
    valid_data: Tensor | None = None
    detector: BlowUpDetector = field(default_factory=BlowUpDetector)
    healthy: RunState | None = None
    backoffs: int = 0
    finished: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


def fit_pack(
    pack: TrainingPack,
    *,
    steps: int,
    eval_every: int | None = None,
    max_backoffs: int = DEFAULT_MAX_BACKOFFS,
    valid_data: Tensor | None = None,
) -> list[list[dict[str, Any]]]:
    """Train every run of ``pack`` to ``steps``; one metric history per run (as fit's)."""
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    every = eval_every if eval_every is not None else max(1, math.ceil(steps / 10))
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
    progress = [_RunProgress(valid_data=valid_data) for _ in range(pack.n_runs)]
    for run in range(pack.n_runs):
        _evaluate(pack, run, progress[run], steps, max_backoffs)
    while True:
        running = [r for r in range(pack.n_runs) if not progress[r].finished]
        if not running:
            return [p.history for p in progress]
        # Step until the first running run reaches its next evaluation (runs rolled back by a
        # backoff are behind the others, so their evaluations fall between theirs).
        chunk = min(
            _next_evaluation(pack.step_counts[r], every, steps) - pack.step_counts[r]
            for r in running
        )
        diverged = {event.run: event for event in pack.train_steps(chunk)}
        for run in running:
            step = pack.step_counts[run]
            if run in diverged:
                event = diverged[run]
                blowup = BlowUp(
                    event.step, PARAMETERS, math.nan, None, "non-finite", "", event.what
                )
                _handle_blowup(pack, run, progress[run], blowup, max_backoffs)
            elif step % every == 0 or step >= steps:
                _evaluate(pack, run, progress[run], steps, max_backoffs)


def _next_evaluation(step: int, every: int, steps: int) -> int:
    """The step of the evaluation after ``step``: the next multiple of ``every``, or the end."""
    return min(steps, (step // every + 1) * every)


def _evaluate(
    pack: TrainingPack, run: int, progress: _RunProgress, steps: int, max_backoffs: int
) -> None:
    metrics = {**evaluate_run(pack, run, valid_data=progress.valid_data), "total_steps": steps}
    blowup = progress.detector.observe(metrics)
    if blowup is not None:
        _handle_blowup(pack, run, progress, blowup, max_backoffs)
        return
    progress.healthy = pack.run_state(run)
    progress.history.append(metrics)
    if pack.step_counts[run] >= steps:
        progress.finished = True
        pack.hold(run)
    else:
        pack.release(run)


def _handle_blowup(
    pack: TrainingPack, run: int, progress: _RunProgress, blowup: BlowUp, max_backoffs: int
) -> None:
    """Back run ``run`` off to its healthy snapshot, or end it when its backoffs are spent."""
    old_lr = pack.lr(run)
    if progress.healthy is None or progress.backoffs >= max_backoffs:
        if progress.healthy is not None:
            pack.load_run_state(run, progress.healthy.copy())
        pack.hold(run)
        progress.finished = True
        progress.history.append(
            {
                "event": "failed",
                "step": blowup.step,
                "reason": blowup.describe(),
                "backoffs": progress.backoffs,
                "suggested_lr": suggested_lr(old_lr),
            }
        )
        logger.warning("pack run %d failed: %s", run, blowup.describe())
        return
    progress.backoffs += 1
    pack.load_run_state(run, progress.healthy.copy())
    pack.set_lr_scale(run, BACKOFF_FACTOR ** (-progress.backoffs))
    progress.history.append(
        {
            "event": "backoff",
            "step": blowup.step,
            "rolled_back_to": pack.step_counts[run],
            "old_lr": old_lr,
            "new_lr": pack.lr(run),
            "lr_scale": pack.lr_scale(run),
            "backoff": progress.backoffs,
            "reason": blowup.describe(),
        }
    )
    logger.warning(
        "pack run %d blow-up: %s; back to step %d with lr %.3g",
        run,
        blowup.describe(),
        pack.step_counts[run],
        pack.lr(run),
    )
