"""Store records → wire messages (Job, MetricEvent, JobState)."""

from __future__ import annotations

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.store.events import token_order
from ssdrbm_server.store.queue import QueuePlace
from ssdrbm_server.store.records import JobRecord, JobState, worker_label

_STATE_TO_PROTO = {state: rbm_pb2.JobState.Value(f"JOB_STATE_{state.value}") for state in JobState}
_PROTO_TO_STATE = {number: state for state, number in _STATE_TO_PROTO.items()}
TERMINAL_PROTO_STATES = frozenset(
    number for state, number in _STATE_TO_PROTO.items() if state.is_terminal
)


def state_to_proto(state: JobState) -> int:
    return _STATE_TO_PROTO[state]


def state_from_proto(number: int) -> JobState | None:
    """The job state of a wire enum number; None for JOB_STATE_UNSPECIFIED (no filter)."""
    return _PROTO_TO_STATE.get(number)


def _timestamp(seconds: float | None) -> Timestamp | None:
    if seconds is None:
        return None
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def job_to_proto(record: JobRecord, place: QueuePlace | None = None) -> rbm_pb2.Job:
    """The wire Job for a stored record (a queued one with its place in the queue)."""
    job = rbm_pb2.Job(
        id=record.id,
        name=record.name,
        state=state_to_proto(record.state),
        step=record.step,
        total_steps=record.total_steps,
        attempt=record.attempt,
        error=record.error,
        checkpoint_step=record.checkpoint_step,
        worker=worker_label(record.worker),
        created_at=_timestamp(record.created_at),
        started_at=_timestamp(record.started_at),
        finished_at=_timestamp(record.finished_at),
        n_visible=record.n_visible,
    )
    job.spec.ParseFromString(record.spec)
    if record.latest_metrics:
        job.latest_metrics.ParseFromString(record.latest_metrics)
    job.backoffs = record.backoffs
    job.training_process_failures = record.child_failures
    job.sweep_id = record.sweep_id
    if record.runtime:
        json_format.Parse(record.runtime, job.runtime)
    if place is not None:
        job.queue.CopyFrom(queue_place_to_proto(place))
    return job


def queue_place_to_proto(place: QueuePlace) -> rbm_pb2.QueuePlace:
    message = rbm_pb2.QueuePlace(
        position=place.position,
        basis=place.basis,
        busy_slots=place.busy_slots,
        slice_seconds=place.slice_s,
        no_worker=place.no_worker,
    )
    if place.starts_in_s is not None:
        message.starts_in_seconds = place.starts_in_s
    return message


def event_to_proto(job_id: str, token: str, kind: str, data: bytes) -> rbm_pb2.MetricEvent:
    """The wire MetricEvent for one stream entry (kind "metrics", "state" or "backoff"), timed
    when the entry was written."""
    written_ms, _ = token_order(token)  # the entry id: "<ms>-<seq>"
    time = _timestamp(written_ms / 1000)
    event = rbm_pb2.MetricEvent(resume_token=token, job_id=job_id, time=time)
    getattr(event, _EVENT_FIELDS[kind]).ParseFromString(data)
    return event


# stream entry kind -> the MetricEvent field that carries it
_EVENT_FIELDS = {"metrics": "metrics", "state": "state", "backoff": "backoff"}


def is_terminal_event(event: rbm_pb2.MetricEvent) -> bool:
    """True for the state event that ends a job's stream."""
    return event.WhichOneof("event") == "state" and event.state.state in TERMINAL_PROTO_STATES
