"""The job record: its states, its fields, and how it is stored in a Redis hash."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from enum import StrEnum


class JobState(StrEnum):
    """Lifecycle of a job: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED | STOPPED, and
    RUNNING -> QUEUED when its worker releases it. STOPPED: ended early by its sweep's early
    stopping (ssdrbm_server/sweeps/); servable, as a SUCCEEDED job is."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    STOPPED = "STOPPED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.STOPPED}
)
ACTIVE_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})


NOT_PACKABLE = ""  # the pack key of a job that trains alone


@dataclass
class JobRecord:
    """One job as stored in `job:{id}`, field for field (times are Unix seconds); a field
    missing from the hash (written before the field existed) reads as its default."""

    id: str
    tenant: str = ""
    name: str = ""
    state: JobState = JobState.QUEUED
    spec: bytes = b""  # serialized ssdrbm.v1.StartTrainingRequest, defaults filled in
    step: int = 0  # latest step reported by the worker
    total_steps: int = 0  # 0 until known (a job given in epochs learns it from its dataset)
    attempt: int = 0  # fencing number: increases each time a worker (re)claims the job
    error: str = ""  # why the job FAILED
    checkpoint_step: int = -1  # -1 if none
    worker: str = ""  # worker running (or that last ran) the job
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    n_visible: int = 0  # 0 until known
    latest_metrics: bytes = b""  # serialized ssdrbm.v1.Metrics, b"" if none
    cancel_requested: bool = False
    metric_step: int = -1  # step of the latest metric event; later events must exceed it
    seq: int = 0  # position in the tenant's listing (creation order)
    backoffs: int = 0  # times the worker rolled the job back to a checkpoint and went on
    runtime: str = ""  # JSON set by the worker: the device-dependent choices of this run
    # times its training process died (a signal, an unexpected exit) or hung; the job is
    # retried from its last checkpoint until SSDRBM_MAX_TRAINING_PROCESS_FAILURES
    child_failures: int = 0
    # W3C trace context of the StartTraining call ("" without tracing): the worker's spans
    # join that trace (ssdrbm_server/tracing.py)
    traceparent: str = ""
    sweep_id: str = ""  # the sweep that created the job ("" for none)
    # Jobs with equal non-empty keys can be trained together in one pack (set at submit by
    # ssdrbm_server/packing.py; NOT_PACKABLE for a job that trains alone, and set so by the
    # worker once a pack's training process failed with the job in it)
    pack_key: str = NOT_PACKABLE


# Each field's hash value by its type: decoded, and encoded for a new job's hash.
_DECODE = {
    "str": bytes.decode,
    "bytes": bytes,
    "int": int,
    "float": float,
    "float | None": float,
    "bool": lambda value: int(value) == 1,
    "JobState": lambda value: JobState(value.decode()),
}
_ENCODE = {
    "JobState": lambda state: state.value,
    "float": repr,
    "float | None": lambda value: "" if value is None else repr(value),
    "bool": int,
}
# Fields a new job's hash leaves out: its id (in the key), its listing position (set when it is
# admitted), and those never set at submit; the last three are stored only when tracing is on,
# for a sweep's runs and for jobs a pack can hold.
_NOT_AT_SUBMIT = ("id", "seq", "child_failures")
_ONLY_WHEN_SET = ("traceparent", "sweep_id", "pack_key")


def record_from_hash(job_id: str, raw: dict[bytes, bytes]) -> JobRecord:
    """Decode the HGETALL reply of `job:{id}` (bytes keys and values); an empty value of a
    number or time reads as the field's default. A hash without a state is not a job record
    (ValueError), never a job that reads as QUEUED."""
    if not raw.get(b"state"):
        raise ValueError(f"job:{job_id} has no state: not a job record")
    values = {}
    for field in fields(JobRecord)[1:]:
        value = raw.get(field.name.encode())
        if value is not None and (value != b"" or field.type in ("str", "bytes")):
            values[field.name] = _DECODE[field.type](value)
    return JobRecord(id=job_id, **values)


def new_job_fields(**given: object) -> dict[str, object]:
    """Hash fields of a freshly submitted job (QUEUED, attempt 0, no checkpoint), from the
    JobRecord fields ``given`` (tenant, name, spec, total_steps, n_visible, created_at, ...)."""
    record = JobRecord(id="", **given)  # type: ignore[arg-type]
    hash_fields: dict[str, object] = {}
    for field in fields(JobRecord):
        value = getattr(record, field.name)
        if field.name in _NOT_AT_SUBMIT or (field.name in _ONLY_WHEN_SET and not value):
            continue
        hash_fields[field.name] = _ENCODE.get(field.type, lambda v: v)(value)
    return hash_fields


def worker_label(worker_id: str) -> str:
    """What tenants see of the worker that ran a job: a stable opaque label ("w-" and 8 hex
    digits of the id's sha256; "" for none). The id holds the host name and process id, which
    tell tenants about the deployment; records and logs keep it, and an operator matches the
    two by hashing the id."""
    if not worker_id:
        return ""
    return "w-" + hashlib.sha256(worker_id.encode()).hexdigest()[:8]
