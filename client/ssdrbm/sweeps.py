"""Sweeps in the SDK: the StartSweep request from plain arguments, and typed views of a sweep.

with Client() as client:
    sweep = client.start_sweep(n_hidden=25, steps=500, axes={"lr": [1e-3, 3e-3, 1e-2]}, seeds=3)
    for board in client.stream_sweep(sweep.id):  # the leaderboard, best run first
        print(board.runs[0].job_id, board.runs[0].rank_value)

Axes are named by the request field they vary (``optimizer.lr``, ``training.seed``, ...) or a
short name (``lr``, ``optimizer``, ``momentum``, ``seed``, ``cd_k``, ``n_hidden``, ``lr.W`` for
``optimizer.per_parameter_lr.W``); each takes a list of values, or a :class:`Range` to draw from
(``random=N``). The service resolves and checks every point before it creates any job.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ssdrbm.errors import InvalidArgument
from ssdrbm.events import JobState, Metrics
from ssdrbm.spec import (
    OPTIMIZERS,
    choose,
    enum_member,
    from_message,
    new_request_id,
    optional_message,
    set_given,
    training_request,
)
from ssdrbm.v1 import rbm_pb2

# short axis names -> the request field
AXIS_ALIASES = {
    "lr": "optimizer.lr",
    "optimizer": "optimizer.kind",
    "momentum": "optimizer.momentum",
    "seed": "training.seed",
    "cd_k": "training.cd_k",
    "n_hidden": "model.n_hidden",
}
PER_PARAMETER_ALIAS = "lr."  # "lr.W" -> optimizer.per_parameter_lr.W


@dataclass(frozen=True)
class Range:
    """Values to draw from in a random sweep: uniform in [low, high], or in log space."""

    low: float
    high: float
    log: bool = False


def axis_field(name: str) -> str:
    """The request field an axis name stands for."""
    if name.startswith(PER_PARAMETER_ALIAS):
        return "optimizer.per_parameter_lr." + name[len(PER_PARAMETER_ALIAS) :]
    return AXIS_ALIASES.get(name, name)


def _axis(name: str, values: Sequence[Any] | Range) -> rbm_pb2.SweepAxis:
    field = axis_field(name)
    axis = rbm_pb2.SweepAxis(field=field)
    if isinstance(values, Range):
        scale = rbm_pb2.AXIS_SCALE_LOG if values.log else rbm_pb2.AXIS_SCALE_LINEAR
        axis.range.CopyFrom(rbm_pb2.SweepRange(low=values.low, high=values.high, scale=scale))
    elif field == "optimizer.kind":
        axis.kinds.extend(choose(f"axes[{name}]", value, OPTIMIZERS) for value in values)
    else:
        try:
            axis.values.extend(float(value) for value in values)
        except (TypeError, ValueError):
            raise InvalidArgument(f"axes[{name}]: values must be numbers, got {values!r}") from None
    return axis


def sweep_request(
    *,
    axes: Mapping[str, Sequence[Any] | Range] | None = None,
    seeds: int | None = None,
    random: int | None = None,
    sample_seed: int | None = None,
    rank_by: str | None = None,
    early_stop: int | tuple[int, int] | Sequence[int] | None = None,
    rungs: Sequence[int] | None = None,
    name: str | None = None,
    request_id: str | None = None,
    validate_only: bool | None = None,
    **training: Any,
) -> rbm_pb2.StartSweepRequest:
    """The request for :meth:`ssdrbm.Client.start_sweep`.

    ``training`` takes :meth:`~ssdrbm.Client.start_training`'s keywords (the base every run
    shares). ``random=N`` draws N points (reproducible by ``sample_seed``) instead of the grid;
    ``early_stop=MIN_STEPS`` or ``(MIN_STEPS, ETA)`` (or explicit ``rungs``) turns on successive
    halving; ``rank_by`` names the metric the leaderboard and early stopping rank by; ``name``
    is the sweep's (its runs are named after it and their point).
    """
    base = training_request(**training)
    base.request_id = ""  # the sweep's request_id covers its runs
    request = rbm_pb2.StartSweepRequest(base=base, request_id=request_id or new_request_id())
    request.axes.extend(_axis(axis_name, values) for axis_name, values in (axes or {}).items())
    set_given(request, seeds=seeds, samples=random, seed=sample_seed, rank_metric=rank_by)
    set_given(request, name=name, validate_only=validate_only)
    if random is not None:
        request.mode = rbm_pb2.SWEEP_MODE_RANDOM
    if early_stop is not None:
        first, *rest = [early_stop] if isinstance(early_stop, int) else list(early_stop)
        request.early_stopping.min_steps = int(first)
        if rest:
            request.early_stopping.reduction_factor = int(rest[0])
    if rungs:
        request.early_stopping.rungs.extend(int(step) for step in rungs)
    return request


class SweepState(enum.StrEnum):
    """A sweep's state, read from its runs: RUNNING until every run ended."""

    UNSPECIFIED = "unspecified"  # a validate_only answer: nothing was created
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # every run's job was deleted or expired; only the record is left

    @property
    def terminal(self) -> bool:
        """True once every run ended (the sweep can no longer change)."""
        return self not in (SweepState.UNSPECIFIED, SweepState.RUNNING)

    @classmethod
    def from_proto(cls, value: int) -> SweepState:
        return enum_member(cls, rbm_pb2.SweepState, value)


@dataclass(frozen=True)
class SweepRun:
    """One run (job) of a sweep on the leaderboard; ``rank`` 1 is the best, None without a
    metric yet; ``expired``: its job was deleted or expired (state UNSPECIFIED, no metrics)."""

    job_id: str
    point: dict[str, str]
    state: JobState
    step: int
    total_steps: int
    metrics: Metrics | None
    rank: int | None
    rank_value: float | None
    error: str
    expired: bool = False

    @classmethod
    def from_proto(cls, message: rbm_pb2.SweepRun) -> SweepRun:
        ranked = message.rank > 0
        return from_message(
            cls,
            message,
            state=JobState.from_proto(message.state),
            metrics=optional_message(message, "latest_metrics", Metrics.from_proto),
            rank=message.rank if ranked else None,
            rank_value=message.rank_value if ranked else None,
        )


@dataclass(frozen=True)
class Sweep:
    """A sweep and its leaderboard: ``runs`` best first (runs without a metric last)."""

    id: str
    name: str
    state: SweepState
    runs: list[SweepRun]
    run_count: int
    best_job_id: str
    rank_metric: str
    rungs: list[int]
    reduction_factor: int
    cancel_requested: bool
    created_at: datetime | None

    @property
    def done(self) -> bool:
        """True once every run ended."""
        return self.state.terminal

    @classmethod
    def from_proto(cls, message: rbm_pb2.Sweep) -> Sweep:
        return from_message(
            cls,
            message,
            state=SweepState.from_proto(message.state),
            runs=[SweepRun.from_proto(run) for run in message.runs],
            rank_metric=message.request.rank_metric,
            rungs=list(message.request.early_stopping.rungs),
            reduction_factor=message.request.early_stopping.reduction_factor,
        )
