"""Blow-ups and their recovery: one rule for ``ssdcore.fit``, packed fitting and the service.

Divergence is more than NaN/Inf: a Gaussian RBM on Frey Face at SSD lr 0.01 ends with a
reconstruction error of 4e26 and ‖W‖₂ = 4.5e12, all finite. :class:`BlowUpDetector` watches
the metric dicts of :meth:`ssdcore.Trainer.evaluate` and reports a :class:`BlowUp` (step,
metric, value, reference). :class:`Recovery` answers it, by the same rule wherever a run trains:

- *Blow-up*: an evaluation the detector flags (every evaluation goes through it, the one before
  training included), or a step that turns a parameter NaN/Inf (:func:`blowup_from_error`).
- *Rollback point*: the run's state at its last evaluation that passed (its start before any).
  The service checkpoints that state before it records the backoff, so a job resumed after a
  crash resumes from the same point with the same backoff count.
- *Resume*: a checkpoint keeps :meth:`Recovery.state_dict` (the detector's references), and a
  run resumed from it judges its resume point against them without adding it
  (:meth:`Recovery.resume`), so later evaluations meet the uninterrupted run's references.
- *Step sizes*: after the n-th backoff every step size is its configured value × ``factor``⁻ⁿ
  (absolute, :meth:`ssdcore.Trainer.set_lr_scale`; a schedule's factor still applies).
- *Budget*: at most ``max_backoffs`` backoffs per run (0 turns backoff off); the next blow-up
  ends the run at its rollback point with a :class:`~ssdcore.blowup.BlowUpError` naming the
  step, the metric, the step size and :func:`suggested_lr` of it.
- *Events*: each backoff is one :class:`BackoffEvent`; ``fit``'s history entries are its
  :meth:`~BackoffEvent.history_entry` and the service's ``Backoff`` messages carry its fields.

Criteria, in the order they are checked: a metric is NaN or Inf; the reconstruction error is
RECONSTRUCTION_GROWTH times its best so far (the value before training included); ‖W‖₂ is
SPECTRAL_NORM_GROWTH times its reference (the first ‖W‖₂, at least SPECTRAL_NORM_FLOOR); at
least STUCK_FRACTION of the hidden units are stuck while ‖W‖₂ is STUCK_NORM_GROWTH times its
reference.

Calibration (each threshold's comment; ``tests/test_step_sizes.py`` and ``tests/test_blowup.py``
repeat short versions): 118 good runs (every built-in dataset × {Bernoulli, Gaussian of every
variance form} × {sgd, nesterov, ssd, ssd-preconditioned}, n_hidden 32 to 500) raised no alarm;
of 72 bad runs (at 100× and 10⁴× the step-size table's value and at lr 10⁶) all 48 at 10⁴× and
10⁶ are caught at their first evaluation, and 15 of 24 at 100× (the others stay within healthy
runs' errors and ‖W‖₂).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ssdcore.errors import BlowUpError, DivergenceError

__all__ = [
    "BACKOFF_FACTOR",
    "DEFAULT_MAX_BACKOFFS",
    "BackoffEvent",
    "BlowUp",
    "BlowUpDetector",
    "BlowUpError",
    "Recoverable",
    "Recovery",
    "blowup_from_error",
    "suggested_lr",
]

logger = logging.getLogger(__name__)

# --- thresholds (see the module docstring for the calibration runs) ---------------------------
# An order of magnitude: good runs rose at most 6.2× over their best error, blow-ups 11× (a
# Gaussian RBM on Frey Face with Nesterov at 100× its step) to 10²⁶×.
RECONSTRUCTION_GROWTH = 10.0
# Smallest best error the growth is measured against, so data that a model reconstructs almost
# exactly (an error near 0) does not turn rounding noise into a blow-up.
RECONSTRUCTION_FLOOR = 1e-3
# A run that ends with its error this many times its best drifted: no blow-up (a slow rise stays
# under RECONSTRUCTION_GROWTH), but its end is reported with a note (Recovery.drift). Twice is
# far above the evaluation noise of healthy runs (SGD on MNIST n_h 200: 1.26× its best).
DRIFT_GROWTH = 2.0
# Good runs reached ‖W‖₂ ≤ 141 from a reference of 1 (the floor), blow-ups of Bernoulli RBMs
# 7·10³ and more (Gaussian ones grow further still, after their error has given them away).
SPECTRAL_NORM_GROWTH = 1000.0
# ‖W‖₂ reference floor: the default initialization (std 0.01) gives 0.15-0.5; a model that
# starts at W = 0 must not make every later ‖W‖₂ an infinite growth. Calibrated on data of unit
# scale (binary, [0, 1] or standardized): W grows with the data's scale, so standardize.
SPECTRAL_NORM_FLOOR = 1.0
# "Almost all" hidden units stuck: the bad runs this criterion catches had 91-100% stuck.
STUCK_FRACTION = 0.9
# Stuck units alone are no blow-up: a Bernoulli RBM on binarized Frey Face with SGD settles with
# all of them "on" (carrying the visible biases) at any step size, so backing off cannot help;
# its ‖W‖₂ stays about 14-16, and Gaussian RBMs on binary data, whose small variances make
# units decisive, stay below 5. Stuck bad runs had ‖W‖₂ of 59 and more (margins: 3.2× above
# the good runs, 1.2× below the mildest bad one).
STUCK_NORM_GROWTH = 50.0

# --- backoff ------------------------------------------------------------------------------------
# Blow-ups a run may recover from (each divides the step sizes by BACKOFF_FACTOR); fit's and the
# service's job spec's defaults (server/ssdrbm_server/resolver.py fills them in).
DEFAULT_MAX_BACKOFFS = 3
# One backoff divides every step size by this: a decade, the granularity of the tuning grids.
BACKOFF_FACTOR = 10.0

# The "metric" of a blow-up seen by the trainer's own check: a parameter turned NaN or Inf.
PARAMETERS = "parameters"

# Metrics that are bookkeeping rather than measurements of the model.
_NOT_MEASUREMENTS = frozenset({"step", "total_steps", "wall_time_s", "samples_per_second"})


@dataclass(frozen=True)
class BlowUp:
    """A blown-up run: which metric, at which step, against which reference. ``criterion`` is
    ``"non-finite"`` (``reference`` is None), ``"growth"`` (``value`` is ``reference`` times a
    factor beyond the threshold) or ``"stuck"`` (``value`` is the stuck fraction, ``reference`` the
    limit STUCK_FRACTION it reached; ``detail`` gives ‖W‖₂)."""

    step: int
    metric: str
    value: float
    reference: float | None
    criterion: str
    reference_name: str = ""  # what the reference is, e.g. "its best so far"
    detail: str = ""

    def describe(self) -> str:
        """One line for logs and error messages, e.g. "reconstruction_error 4.1e+26 at step 300
        is 1.02e+24× its best so far (step 0) 402.1"."""
        where = f"{self.metric} {self.value:.3g} at step {self.step}"
        if self.criterion == "non-finite" and self.metric == PARAMETERS:
            return f"{self.detail or 'the parameters became NaN or Inf'} at step {self.step}"
        if self.criterion == "non-finite":
            text = f"{where} is not finite"
        elif self.criterion == "growth" and self.reference:
            ratio = self.value / self.reference
            text = f"{where} is {ratio:.3g}× {self.reference_name} {self.reference:.4g}"
        else:
            text = f"{where} reaches {self.reference_name} {self.reference:.3g}"
        return f"{text} ({self.detail})" if self.detail else text

    __str__ = describe


def _growth(
    step: int,
    metric: str,
    metrics: Mapping[str, Any],
    limit: float,
    reference: float,
    reference_name: str,
) -> BlowUp | None:
    """A "growth" blow-up when ``metric`` (absent: none) is above ``limit``, a multiple of the
    ``reference`` it is reported against."""
    value = metrics.get(metric)
    if value is None or value <= limit:
        return None
    return BlowUp(step, metric, float(value), reference, "growth", reference_name)


class BlowUpDetector:
    """Watches metric dicts (``Trainer.evaluate()``) and reports the first blow-up it sees. Feed it
    every evaluation in order, starting with the one before training (:meth:`observe`). References
    (the best reconstruction error, the ‖W‖₂ reference) are taken from healthy evaluations only.
    :meth:`state_dict` is plain JSON: a checkpoint keeps it (through :meth:`Recovery.state_dict`) so
    that a resumed run judges as if never stopped."""

    def __init__(self) -> None:
        self.best_reconstruction_error: float | None = None
        self.best_step: int | None = None
        self.spectral_norm_reference: float | None = None
        self.observations = 0

    def observe(self, metrics: Mapping[str, Any]) -> BlowUp | None:
        """The blow-up these metrics show, or None (then they update the references)."""
        blowup = self.judge(metrics)
        if blowup is None:
            self._update(metrics, int(metrics.get("step", 0)))
        return blowup

    def judge(self, metrics: Mapping[str, Any]) -> BlowUp | None:
        """The blow-up these metrics show against the references, which stay as they are."""
        step = int(metrics.get("step", 0))
        return (
            _non_finite(metrics, step)
            or self._reconstruction_growth(metrics, step)
            or self._norm_growth(metrics, step)
            or self._stuck(metrics, step)
        )

    # --- criteria -------------------------------------------------------------------------

    def _reconstruction_growth(self, metrics: Mapping[str, Any], step: int) -> BlowUp | None:
        best = self.best_reconstruction_error
        if best is None:
            return None
        limit = RECONSTRUCTION_GROWTH * max(best, RECONSTRUCTION_FLOOR)
        against = f"its best so far (step {self.best_step})"
        return _growth(step, "reconstruction_error", metrics, limit, best, against)

    def _norm_growth(self, metrics: Mapping[str, Any], step: int) -> BlowUp | None:
        reference = self.spectral_norm_reference
        if reference is None:
            return None
        limit = SPECTRAL_NORM_GROWTH * reference
        against = f"its reference (the first ‖W‖₂ seen, at least {SPECTRAL_NORM_FLOOR:g})"
        return _growth(step, "spectral_norm", metrics, limit, reference, against)

    def _stuck(self, metrics: Mapping[str, Any], step: int) -> BlowUp | None:
        stuck = metrics.get("saturated_hidden_fraction")
        norm = metrics.get("spectral_norm")
        if stuck is None or norm is None or self.spectral_norm_reference is None:
            return None
        if stuck < STUCK_FRACTION or norm <= STUCK_NORM_GROWTH * self.spectral_norm_reference:
            return None
        ratio = norm / self.spectral_norm_reference
        return BlowUp(
            step,
            "saturated_hidden_fraction",
            float(stuck),
            STUCK_FRACTION,
            "stuck",
            "the stuck-unit limit",
            f"with ‖W‖₂ {norm:.3g}, {ratio:.3g}× its reference {self.spectral_norm_reference:.3g}",
        )

    def _update(self, metrics: Mapping[str, Any], step: int) -> None:
        self.observations += 1
        error = metrics.get("reconstruction_error")
        if error is not None and (
            self.best_reconstruction_error is None or error < self.best_reconstruction_error
        ):
            self.best_reconstruction_error = float(error)
            self.best_step = step
        norm = metrics.get("spectral_norm")
        if norm is not None and self.spectral_norm_reference is None:
            self.spectral_norm_reference = max(float(norm), SPECTRAL_NORM_FLOOR)

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The references as plain JSON types (finite floats, ints, None)."""
        return {
            "best_reconstruction_error": self.best_reconstruction_error,
            "best_step": self.best_step,
            "spectral_norm_reference": self.spectral_norm_reference,
            "observations": self.observations,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``ValueError`` naming a missing key)."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"blow-up detector state lacks {missing}")
        self.best_reconstruction_error = _optional_float(state["best_reconstruction_error"])
        self.best_step = None if state["best_step"] is None else int(state["best_step"])
        self.spectral_norm_reference = _optional_float(state["spectral_norm_reference"])
        self.observations = int(state["observations"])


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _non_finite(metrics: Mapping[str, Any], step: int) -> BlowUp | None:
    """The first measured metric that is NaN or Inf."""
    for name, value in metrics.items():
        if name in _NOT_MEASUREMENTS or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and not math.isfinite(value):
            return BlowUp(step, name, float(value), None, "non-finite")
    return None


def blowup_from_error(error: DivergenceError, step: int) -> BlowUp:
    """The :class:`BlowUp` of a :class:`~ssdcore.DivergenceError` raised by training. ``step`` is
    used when the error does not carry the step that failed (``error.step``)."""
    failed = error.step if error.step is not None else step
    return BlowUp(failed, PARAMETERS, math.nan, None, "non-finite", detail=error.what or str(error))


def suggested_lr(current_lr: float, factor: float = BACKOFF_FACTOR) -> float:
    """The step size to suggest after a blow-up at ``current_lr``: one backoff smaller."""
    if not (math.isfinite(current_lr) and current_lr > 0):
        raise ValueError(f"current_lr must be a finite number > 0, got {current_lr!r}")
    _check_factor(factor)
    return current_lr / factor


def _check_factor(factor: float) -> None:
    if not (isinstance(factor, int | float) and math.isfinite(factor) and factor > 1):
        raise ValueError(f"backoff factor must be a finite number > 1, got {factor!r}")


# --- recovery -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackoffEvent:
    """One backoff: the blow-up at ``step`` rolled the run back to ``rolled_back_to`` and its
    step size went from ``old_lr`` to ``new_lr`` (scale ``lr_scale``), its ``backoff``-th of
    ``max_backoffs``; ``reason`` is the blow-up's :meth:`BlowUp.describe`."""

    step: int
    rolled_back_to: int
    old_lr: float
    new_lr: float
    lr_scale: float
    backoff: int
    max_backoffs: int
    reason: str

    def history_entry(self) -> dict[str, Any]:
        """The entry ``fit`` and ``fit_pack`` put in a run's history: ``{"event": "backoff"}``
        and every field."""
        return {"event": "backoff", **asdict(self)}


class Recoverable(Protocol):
    """What :class:`Recovery` acts on: a :class:`~ssdcore.Trainer`, or one run of a pack
    (:class:`ssdcore.pack.RunInPack`). ``restore`` leaves the snapshot usable for another
    rollback; ``set_lr_scale`` is absolute (configured value × ``scale``)."""

    @property
    def lr(self) -> float: ...

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...

    def set_lr_scale(self, scale: float) -> None: ...


class Recovery:
    """The blow-up rule (module docstring) for one run: its detector, its rollback point and
    the backoffs it took.

    Feed every evaluation to :meth:`check`, the one before training first (a run resumed from
    a checkpoint: :meth:`resume` instead); answer a blow-up (from :meth:`check`, or
    :func:`blowup_from_error` of a failed step) with :meth:`recover`.
    ``backoffs`` counts backoffs taken before (a resumed job's); :attr:`lr_scale` is the scale
    they give. ``lr_setting`` and ``max_backoffs_setting`` name the settings in the give-up
    message (the service says ``optimizer.lr`` and ``training.max_backoffs``); ``label`` names
    the run in the log (e.g. "pack run 2").
    """

    def __init__(
        self,
        *,
        max_backoffs: int = DEFAULT_MAX_BACKOFFS,
        factor: float = BACKOFF_FACTOR,
        backoffs: int = 0,
        lr_setting: str = "lr",
        max_backoffs_setting: str = "max_backoffs",
        label: str = "",
    ) -> None:
        if not (isinstance(max_backoffs, int) and max_backoffs >= 0):
            raise ValueError(f"max_backoffs must be an integer >= 0, got {max_backoffs!r}")
        if not (isinstance(backoffs, int) and backoffs >= 0):
            raise ValueError(f"backoffs must be an integer >= 0, got {backoffs!r}")
        _check_factor(factor)
        self.max_backoffs = max_backoffs
        self.factor = float(factor)
        self.backoffs = backoffs
        self.lr_setting = lr_setting
        self.max_backoffs_setting = max_backoffs_setting
        self.label = label
        self.detector = BlowUpDetector()
        self.healthy_step: int | None = None  # the rollback point's step, None before any
        self._healthy: Any = None

    @property
    def lr_scale(self) -> float:
        """What the backoffs taken so far multiply every step size by: factor⁻ⁿ."""
        return self.factor ** (-self.backoffs)

    def drift(self, metrics: Mapping[str, Any]) -> str | None:
        """A note for a run that ends at ``metrics`` (its last evaluation, checked) with its
        reconstruction error DRIFT_GROWTH times its best or more, or None. Such a run is not a
        blow-up, and its outcome stands; the note says it is worse than it was and what to try.
        """
        best = self.detector.best_reconstruction_error
        error = metrics.get("reconstruction_error")
        if best is None or error is None or not math.isfinite(error):
            return None
        reference = max(best, RECONSTRUCTION_FLOOR)
        if error < DRIFT_GROWTH * reference:
            return None
        # No step size is suggested: the drift measured in docs/RESULTS.md §9 came at 1e-4
        # and at 3e-5 but not at 3e-4, so a smaller step is not the sure fix a blow-up's is.
        return (
            f"the reconstruction error ended at {error:.4g}, {error / reference:.1f}× its "
            f"best {best:.4g} (step {self.detector.best_step}): the run drifted without blowing "
            f"up; train {self.detector.best_step} steps, or try another {self.lr_setting}"
        )

    def check(self, metrics: Mapping[str, Any], run: Recoverable) -> BlowUp | None:
        """The blow-up ``metrics`` (an evaluation of ``run`` now) show, or None: then the run
        is healthy here and this is its rollback point."""
        blowup = self.detector.observe(metrics)
        if blowup is None:
            self._mark_healthy(metrics, run)
        return blowup

    def resume(
        self, state: Mapping[str, Any], metrics: Mapping[str, Any], run: Recoverable
    ) -> BlowUp | None:
        """:meth:`check` for the evaluation of a run resumed from a checkpoint that kept
        ``state`` (:meth:`state_dict` then): ``metrics`` are judged against the references
        without being added to them (the checkpointed step is an evaluation they hold already,
        or one the uninterrupted run never made). ``ValueError`` for a foreign ``state``."""
        self.load_state_dict(state)
        blowup = self.detector.judge(metrics)
        if blowup is None:
            self._mark_healthy(metrics, run)
        return blowup

    def _mark_healthy(self, metrics: Mapping[str, Any], run: Recoverable) -> None:
        self._healthy = run.snapshot()
        self.healthy_step = int(metrics.get("step", 0))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of the run keeps of this rule (plain JSON): the detector's
        references; the backoffs taken are the caller's to count."""
        return {"detector": self.detector.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`state_dict` output (``ValueError`` naming what is missing)."""
        if not isinstance(state, Mapping) or not isinstance(state.get("detector"), Mapping):
            raise ValueError("blow-up recovery state lacks its 'detector' references")
        self.detector.load_state_dict(state["detector"])

    def recover(self, blowup: BlowUp, run: Recoverable) -> BackoffEvent:
        """Roll ``run`` back to its last healthy evaluation with every step size divided by the
        factor once more, and say so; raise :class:`~ssdcore.blowup.BlowUpError` (``run`` put
        back to that evaluation) once ``max_backoffs`` are spent or none was healthy."""
        old_lr = run.lr
        if self._healthy is None or self.backoffs >= self.max_backoffs:
            if self._healthy is not None:
                run.restore(self._healthy)
            raise self._give_up(blowup, old_lr)
        self.backoffs += 1
        run.restore(self._healthy)
        run.set_lr_scale(self.lr_scale)
        assert self.healthy_step is not None
        event = BackoffEvent(
            step=blowup.step,
            rolled_back_to=self.healthy_step,
            old_lr=old_lr,
            new_lr=run.lr,
            lr_scale=self.lr_scale,
            backoff=self.backoffs,
            max_backoffs=self.max_backoffs,
            reason=blowup.describe(),
        )
        logger.warning(
            "%sblow-up: %s; back to step %d with lr %.3g (backoff %d of %d)",
            f"{self.label}: " if self.label else "",
            event.reason,
            event.rolled_back_to,
            event.new_lr,
            event.backoff,
            event.max_backoffs,
        )
        return event

    def _give_up(self, blowup: BlowUp, lr: float) -> BlowUpError:
        suggestion = suggested_lr(lr, self.factor)
        if self.max_backoffs == 0:
            spent = f"with backoff off ({self.max_backoffs_setting} 0)"
        else:
            plural = "" if self.backoffs == 1 else "s"
            spent = (
                f"after {self.backoffs} backoff{plural} (each dividing the step sizes by "
                f"{self.factor:g})"
            )
        message = (
            f"training blew up {spent}: {blowup.describe()}; its step size was {lr:.3g}; "
            f"try {self.lr_setting} = {suggestion:.3g} or smaller"
        )
        return BlowUpError(message, blowup=blowup, suggested_lr=suggestion)
