"""``fit`` for a pack: train every run to ``steps`` under :func:`ssdcore.fit`'s blow-up rule.

Each run has its own :class:`~ssdcore.blowup.Recovery`, acting on it through
:class:`RunInPack`: a run that blows up is rolled back with smaller steps while the others go
on; once its backoffs are spent it is held at its last healthy evaluation and its history ends
with a ``{"event": "failed", ...}`` entry (where fit would raise). A run that reaches ``steps``
is held while the others catch up; one that ends drifted is logged as fit logs it.
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
    BlowUpError,
    Recovery,
)
from ssdcore.pack.pack import RunDivergence, TrainingPack
from ssdcore.pack.state import RunState
from ssdcore.training import DEFAULT_EVAL_EXAMPLES, evaluation_spacing, run_metrics

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
    train = pack.train_data[:max_examples]
    valid = train if valid_data is None else valid_data.to(pack.device)[:max_examples]
    return run_metrics(pack.model(run), train, valid, pack.step_counts[run], pack.wall_times[run])


@dataclass(frozen=True)
class RunInPack:
    """Run ``run`` of ``pack`` as :class:`~ssdcore.blowup.Recovery` acts on it: its step size,
    its scale, and its :class:`~ssdcore.pack.RunState` as the snapshot."""

    pack: TrainingPack
    run: int

    @property
    def lr(self) -> float:
        return self.pack.lr(self.run)

    def snapshot(self) -> RunState:
        return self.pack.run_state(self.run)

    def restore(self, snapshot: RunState) -> None:
        self.pack.load_run_state(self.run, snapshot.copy())  # the snapshot stays usable

    def set_lr_scale(self, scale: float) -> None:
        self.pack.set_lr_scale(self.run, scale)


def divergence_blowup(event: RunDivergence) -> BlowUp:
    """The :class:`~ssdcore.blowup.BlowUp` of a run the pack froze (its parameters turned
    NaN/Inf), as :func:`~ssdcore.blowup.blowup_from_error` gives a solo trainer's."""
    return BlowUp(event.step, PARAMETERS, math.nan, None, "non-finite", detail=event.what)


@dataclass
class _RunProgress:
    recovery: Recovery
    valid_data: Tensor | None = None
    finished: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


def fit_pack(
    pack: TrainingPack,
    *,
    steps: int,
    eval_every: int | None = None,
    max_backoffs: int = DEFAULT_MAX_BACKOFFS,
    backoff_factor: float = BACKOFF_FACTOR,
    valid_data: Tensor | None = None,
) -> list[list[dict[str, Any]]]:
    """Train every run of ``pack`` to ``steps``; one metric history per run (as fit's)."""
    every = evaluation_spacing(steps, eval_every)
    progress = [
        _RunProgress(
            Recovery(max_backoffs=max_backoffs, factor=backoff_factor, label=f"pack run {run}"),
            valid_data,
        )
        for run in range(pack.n_runs)
    ]
    for run in range(pack.n_runs):
        _evaluate(pack, run, progress[run], steps)
    while True:
        running = [r for r in range(pack.n_runs) if not progress[r].finished]
        if not running:
            return [p.history for p in progress]
        # Step until the first running run reaches its next evaluation (runs rolled back by a
        # backoff are behind the others, so their evaluations fall between theirs).
        counts = [pack.step_counts[r] for r in running]  # each to its next multiple or the end
        chunk = min(min(steps, (step // every + 1) * every) - step for step in counts)
        diverged = {event.run: event for event in pack.train_steps(chunk)}
        for run in running:
            step = pack.step_counts[run]
            if run in diverged:
                _handle_blowup(pack, run, progress[run], divergence_blowup(diverged[run]))
            elif step % every == 0 or step >= steps:
                _evaluate(pack, run, progress[run], steps)


def _evaluate(pack: TrainingPack, run: int, progress: _RunProgress, steps: int) -> None:
    metrics = {**evaluate_run(pack, run, valid_data=progress.valid_data), "total_steps": steps}
    blowup = progress.recovery.check(metrics, RunInPack(pack, run))
    if blowup is not None:
        _handle_blowup(pack, run, progress, blowup)
        return
    progress.history.append(metrics)
    if pack.step_counts[run] >= steps:
        progress.finished = True
        pack.hold(run)
        drift = progress.recovery.drift(metrics)
        if drift is not None:  # as fit logs it for a run alone
            logger.warning("pack run %d: %s", run, drift)
    else:
        pack.release(run)


def _handle_blowup(pack: TrainingPack, run: int, progress: _RunProgress, blowup: BlowUp) -> None:
    """Back run ``run`` off to its last healthy evaluation, or end it once its backoffs are
    spent (held at that evaluation)."""
    try:
        event = progress.recovery.recover(blowup, RunInPack(pack, run))
    except BlowUpError as error:
        pack.hold(run)
        progress.finished = True
        progress.history.append(
            {
                "event": "failed",
                "step": blowup.step,
                "reason": blowup.describe(),
                "backoffs": progress.recovery.backoffs,
                "suggested_lr": error.suggested_lr,
                "message": str(error),
            }
        )
        logger.warning("pack run %d failed: %s", run, error)
        return
    progress.history.append(event.history_entry())
