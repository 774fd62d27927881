"""Typed views of the service's messages: jobs, metrics and the events of a metric stream.

The SDK hands these plain dataclasses to callers instead of protobuf messages, so code using it
reads ``event.metrics.reconstruction_error`` and ``job.state is JobState.SUCCEEDED``.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from ssdrbm.spec import (
    enum_member,
    enum_name,
    from_message,
    message_dict,
    message_time,
    optional_message,
)
from ssdrbm.v1 import rbm_pb2


class JobState(enum.StrEnum):
    """Where a job is in its life: QUEUED → RUNNING → SUCCEEDED | FAILED | CANCELLED | STOPPED
    (STOPPED: ended early by its sweep's early-stopping rule; its model is served)."""

    UNSPECIFIED = "unspecified"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        """True once the job can no longer change."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.STOPPED)

    @classmethod
    def from_proto(cls, value: int) -> JobState:
        """Map a ``ssdrbm.v1.JobState`` number to the enum (unknown numbers → UNSPECIFIED)."""
        return enum_member(cls, rbm_pb2.JobState, value)

    def to_proto(self) -> int:
        """The ``ssdrbm.v1.JobState`` number of this state."""
        return rbm_pb2.JobState.Value(f"JOB_STATE_{self.name}")


@dataclass(frozen=True)
class Metrics:
    """One evaluation of a job's model; ``None`` where the value was not computed."""

    step: int
    total_steps: int
    reconstruction_error: float
    spectral_norm: float
    wall_time_s: float
    samples_per_second: float
    train_reconstruction_error: float | None = None
    free_energy_gap: float | None = None
    pseudo_log_likelihood: float | None = None
    log_likelihood: float | None = None
    log_likelihood_stderr: float | None = None
    # AIS events: reverse AIS's conservative bound beside log_likelihood's optimistic AIS one
    log_likelihood_lower: float | None = None
    log_likelihood_lower_stderr: float | None = None
    log_likelihood_method: str | None = None  # "exact" or "ais"
    saturated_hidden_fraction: float | None = None  # share of hidden units stuck at 0 or 1
    lr: float | None = None  # step size in effect: optimizer.lr × schedule × backoff scale
    # Parallel tempering: running swap acceptance rate per neighbour pair (hottest pair last)
    pt_swap_rate_min: float | None = None
    pt_swap_rate_mean: float | None = None
    pt_swap_rates: tuple[float, ...] = ()

    @classmethod
    def from_proto(cls, message: rbm_pb2.Metrics) -> Metrics:
        method = enum_name(rbm_pb2.LogLikelihoodMethod, message.log_likelihood_method)
        return from_message(cls, message, log_likelihood_method=method)


@dataclass(frozen=True)
class MetricsEvent:
    """A metric stream event carrying an evaluation of the model."""

    job_id: str
    resume_token: str
    time: datetime | None
    metrics: Metrics


# The message of a SUCCEEDED job's last state event when its run ended as expected; any other
# message there says what its end showed (e.g. a drift, ssdcore.blowup.Recovery.drift).
FINISHED_MESSAGE = "finished"


@dataclass(frozen=True)
class StateEvent:
    """A metric stream event saying the job changed state (the last one is terminal)."""

    job_id: str
    resume_token: str
    time: datetime | None
    state: JobState
    message: str
    attempt: int
    step: int


@dataclass(frozen=True)
class BackoffEvent:
    """The run blew up at ``step`` and was rolled back to ``rollback_step``: the steps after it
    are trained again with every step size scaled from ``old_lr`` to ``new_lr``, and their
    metric events follow this one (so a step may appear twice, this event between)."""

    job_id: str
    resume_token: str
    time: datetime | None
    step: int
    rollback_step: int
    reason: str
    old_lr: float
    new_lr: float
    backoff: int  # 1 for the job's first
    max_backoffs: int


MetricEvent = MetricsEvent | StateEvent | BackoffEvent


def event_from_proto(message: rbm_pb2.MetricEvent) -> MetricEvent | None:
    """Convert a stream message; ``None`` for an event kind this SDK version does not know."""
    common = {
        "job_id": message.job_id,
        "resume_token": message.resume_token,
        "time": message_time(message, "time"),
    }
    kind = message.WhichOneof("event")
    if kind == "metrics":
        return MetricsEvent(metrics=Metrics.from_proto(message.metrics), **common)
    if kind == "state":
        state = JobState.from_proto(message.state.state)
        return from_message(StateEvent, message.state, state=state, **common)
    if kind == "backoff":
        return from_message(BackoffEvent, message.backoff, **common)
    return None


def format_wait(seconds: float) -> str:
    """A wait rounded as people say it: ``40 s``, ``3 min``, ``2 h 5 min``."""
    if seconds < 90:
        return f"{max(round(seconds), 0)} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"


@dataclass(frozen=True)
class QueuePlace:
    """Where a queued job stands: ``position`` jobs queued now go before it (0: it is next),
    and it is expected to start in about ``starts_in_s`` seconds (None: no estimate), as
    ``basis`` explains (``no_worker``: nothing is running the queue)."""

    position: int
    starts_in_s: float | None
    basis: str
    busy_slots: int
    slice_s: float
    no_worker: bool = False

    @classmethod
    def from_proto(cls, message: rbm_pb2.QueuePlace) -> QueuePlace:
        starts_in_s = optional_message(message, "starts_in_seconds", float)
        return from_message(cls, message, starts_in_s=starts_in_s, slice_s=message.slice_seconds)

    def summary(self) -> str:
        """``3 ahead; about 40 s`` (or why there is no estimate): the CLI's and the dashboard's
        words for it."""
        ahead = "next" if self.position == 0 else f"{self.position} ahead"
        if self.no_worker:
            return f"{ahead}; no worker is running"
        if self.starts_in_s is None:
            return f"{ahead}; no estimate yet"
        return f"{ahead}; about {format_wait(self.starts_in_s)}"


@dataclass(frozen=True)
class Job:
    """A training job's record as the service reports it."""

    id: str
    name: str
    state: JobState
    step: int
    total_steps: int
    attempt: int
    error: str
    checkpoint_step: int  # -1 until the first checkpoint
    worker: str
    n_visible: int
    created_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    latest_metrics: Metrics | None
    spec: dict[str, Any] = field(default_factory=dict)  # the request, every default filled in
    backoffs: int = 0  # blow-ups recovered from by rolling back with smaller step sizes
    # times the training process died or hung and the job resumed from its last checkpoint
    training_process_failures: int = 0
    # what the worker chose for its device, e.g. "device: cuda:0, method: newton-schulz (auto on
    # cuda), CUDA graph"
    runtime: str = ""
    # while QUEUED: its place in the queue and when it should start (None in other states)
    queue: QueuePlace | None = None

    @property
    def done(self) -> bool:
        """True once the job is SUCCEEDED, FAILED, CANCELLED or STOPPED."""
        return self.state.terminal

    @classmethod
    def from_proto(cls, message: rbm_pb2.Job) -> Job:
        return from_message(
            cls,
            message,
            state=JobState.from_proto(message.state),
            latest_metrics=optional_message(message, "latest_metrics", Metrics.from_proto),
            spec=message_dict(message.spec),
            runtime=message.runtime.summary,
            queue=optional_message(message, "queue", QueuePlace.from_proto),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary (times as ISO 8601 strings, state as its name)."""
        return to_jsonable(self)


def to_jsonable(value: Any) -> Any:
    """Turn the SDK's dataclasses, enums and datetimes into plain JSON values."""
    if hasattr(value, "__dataclass_fields__"):
        return {key: to_jsonable(item) for key, item in asdict(value).items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(item) for item in value]
    return value
