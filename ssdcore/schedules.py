"""Step-size schedules: the factor by which a run's step sizes are multiplied at step ``t``.

One owner for every schedule the library and the service offer. The trainer sets each parameter
group's step size to

    base lr × schedule.factor(t) × backoff scale

before step ``t + 1`` (``t`` steps already taken), so a schedule and the blow-up backoff
(:mod:`ssdcore.blowup`, which sets the backoff scale) compose by multiplication and neither
undoes the other. The factor is a pure function of the step count, so a resumed run (which
restores its step count) continues on the same schedule exactly.

Kinds, with ``t`` counted after the warmup (``s = t - warmup_steps``):

- ``constant``: 1.
- ``exponential``: ``decay_rate ** (s / decay_steps)`` (``decay_rate`` per ``decay_steps`` steps).
- ``inverse-time``: ``1 / (1 + s / decay_steps)`` (the 1/t decay of stochastic approximation,
  with ``decay_steps`` the time constant τ at which the step has halved).
- ``cosine``: from 1 down to ``floor`` over ``horizon`` steps along half a cosine, then
  ``floor``; ``horizon`` 0 means the run's length, filled in by :meth:`Schedule.for_run`.

Every kind may start with a linear warmup: ``(t + 1) / (warmup_steps + 1)`` for the first
``warmup_steps`` steps, rising to 1 (so the first step is not a zero step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

SCHEDULE_KINDS = ("constant", "exponential", "inverse-time", "cosine")
# Defaults of the decay parameters when a request names only the kind (the service's too):
# exponential halves the step every 1,000 steps, inverse-time halves it after 1,000 steps,
# cosine ends at a tenth of the base step over the run's length.
DEFAULT_DECAY_RATE = 0.5
DEFAULT_DECAY_STEPS = 1_000
DEFAULT_FLOOR = 0.1


class DictForm:
    """The dict form of a settings dataclass (a schedule, an optimizer configuration)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (for checkpoints and job specs)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of :meth:`to_dict`. A key that is not a field is an error naming the class,
        the key and the known fields, so a checkpoint or spec written by another version fails
        loudly instead of losing a setting."""
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}; known are {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True)
class Schedule(DictForm):
    """A step-size schedule (see the module docstring for the formulas)."""

    kind: str = "constant"  # constant | exponential | inverse-time | cosine
    decay_rate: float = DEFAULT_DECAY_RATE  # exponential: factor per decay_steps, in (0, 1]
    decay_steps: int = DEFAULT_DECAY_STEPS  # exponential / inverse-time time constant, >= 1
    floor: float = DEFAULT_FLOOR  # cosine: the final factor, in [0, 1]
    horizon: int = 0  # cosine: steps to reach the floor; 0 = the run's length (for_run)
    warmup_steps: int = 0  # linear warmup before the decay, >= 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and how to fix it."""
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(
                f"Schedule.kind: unknown schedule {self.kind!r}; choose one of {SCHEDULE_KINDS}"
            )
        if not (_is_number(self.decay_rate) and 0 < self.decay_rate <= 1):
            raise ValueError(f"Schedule.decay_rate must be in (0, 1], got {self.decay_rate!r}")
        if not (_is_int(self.decay_steps) and self.decay_steps >= 1):
            raise ValueError(
                f"Schedule.decay_steps must be an integer >= 1, got {self.decay_steps!r}"
            )
        if not (_is_number(self.floor) and 0 <= self.floor <= 1):
            raise ValueError(f"Schedule.floor must be in [0, 1], got {self.floor!r}")
        if not (_is_int(self.horizon) and self.horizon >= 0):
            raise ValueError(
                f"Schedule.horizon must be an integer >= 0 (0: the run's length), "
                f"got {self.horizon!r}"
            )
        if not (_is_int(self.warmup_steps) and self.warmup_steps >= 0):
            raise ValueError(
                f"Schedule.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}"
            )

    @property
    def is_constant(self) -> bool:
        """Whether every step gets factor 1 (no decay, no warmup)."""
        return self.kind == "constant" and self.warmup_steps == 0

    @property
    def needs_horizon(self) -> bool:
        """Whether the run's length must still be filled in (:meth:`for_run`)."""
        return self.kind == "cosine" and self.horizon == 0

    def require_horizon(self, field: str = "optimizer.schedule") -> None:
        """ValueError naming ``field`` while a cosine's horizon is still to be filled in: a
        trainer cannot know the run's length (:meth:`for_run` fills it in; ``fit`` does)."""
        if self.needs_horizon:
            raise ValueError(
                f"{field}: a cosine schedule needs its horizon (steps to reach the floor); set "
                "it, or use Schedule.for_run(total_steps) (fit does)"
            )

    def for_run(self, total_steps: int) -> Schedule:
        """This schedule with ``horizon`` 0 replaced by the run's length (unchanged otherwise)."""
        if not self.needs_horizon:
            return self
        return dataclasses.replace(self, horizon=max(1, int(total_steps) - self.warmup_steps))

    def factor(self, step: int) -> float:
        """The step-size factor for the step taken after ``step`` steps (``step`` >= 0)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        since = step - self.warmup_steps
        if self.kind == "exponential":
            return self.decay_rate ** (since / self.decay_steps)
        if self.kind == "inverse-time":
            return 1.0 / (1.0 + since / self.decay_steps)
        if self.kind == "cosine":
            if self.horizon == 0:
                raise ValueError(
                    "Schedule('cosine') has no horizon: give horizon (steps to reach the floor) "
                    "or call for_run(total_steps) first"
                )
            progress = min(since / self.horizon, 1.0)
            return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0


def step_size(base: float, factor: float, lr_scale: float) -> float:
    """A configured step size ``base`` at a step: × the schedule's ``factor`` there × the
    backoff ``lr_scale``, multiplied in this order (a pack's run repeats its solo run's float
    operations)."""
    return base * (factor * lr_scale)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
