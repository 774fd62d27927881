"""The job record: its states, its fields, and how it is stored in a Redis hash."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum


class JobState(StrEnum):
    """Lifecycle of a job: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED | STOPPED.

    STOPPED: ended early by its sweep's early-stopping rule (ssdrbm_server/sweeps/); its model
    and checkpoints stay servable, as a SUCCEEDED job's do.

    A RUNNING job goes back to QUEUED when its worker releases it (SIGTERM) and to RUNNING again
    when a worker (re)claims it.
    """

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
    """One job as stored in `job:{id}`; times are Unix seconds."""

    id: str
    tenant: str
    name: str
    state: JobState
    spec: bytes  # serialized ssdrbm.v1.StartTrainingRequest, defaults filled in
    step: int  # latest step reported by the worker
    total_steps: int  # 0 until known (a job given in epochs learns it from its dataset)
    attempt: int  # fencing number: increases each time a worker (re)claims the job
    error: str  # why the job FAILED
    checkpoint_step: int  # -1 if none
    worker: str  # worker running (or that last ran) the job
    created_at: float
    started_at: float | None
    finished_at: float | None
    n_visible: int  # 0 until known
    latest_metrics: bytes  # serialized ssdrbm.v1.Metrics, b"" if none
    cancel_requested: bool
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


def _text(raw: dict[bytes, bytes], field: str, default: str = "") -> str:
    value = raw.get(field.encode())
    return default if value is None else value.decode()


def _int(raw: dict[bytes, bytes], field: str, default: int = 0) -> int:
    value = raw.get(field.encode())
    return default if value in (None, b"") else int(value)


def _optional_time(raw: dict[bytes, bytes], field: str) -> float | None:
    value = raw.get(field.encode())
    return None if value in (None, b"") else float(value)


def record_from_hash(job_id: str, raw: dict[bytes, bytes]) -> JobRecord:
    """Decode the HGETALL reply of `job:{id}` (bytes keys and values)."""
    return JobRecord(
        id=job_id,
        tenant=_text(raw, "tenant"),
        name=_text(raw, "name"),
        state=JobState(_text(raw, "state")),
        spec=raw.get(b"spec", b""),
        step=_int(raw, "step"),
        total_steps=_int(raw, "total_steps"),
        attempt=_int(raw, "attempt"),
        error=_text(raw, "error"),
        checkpoint_step=_int(raw, "checkpoint_step", -1),
        worker=_text(raw, "worker"),
        created_at=float(_text(raw, "created_at", "0")),
        started_at=_optional_time(raw, "started_at"),
        finished_at=_optional_time(raw, "finished_at"),
        n_visible=_int(raw, "n_visible"),
        latest_metrics=raw.get(b"latest_metrics", b""),
        cancel_requested=_int(raw, "cancel_requested") == 1,
        metric_step=_int(raw, "metric_step", -1),
        seq=_int(raw, "seq"),
        # Records written before these fields existed decode with the defaults.
        backoffs=_int(raw, "backoffs"),
        runtime=_text(raw, "runtime"),
        child_failures=_int(raw, "child_failures"),
        traceparent=_text(raw, "traceparent"),
        sweep_id=_text(raw, "sweep_id"),
        pack_key=_text(raw, "pack_key"),
    )


def new_job_fields(
    *,
    tenant: str,
    name: str,
    spec: bytes,
    total_steps: int,
    n_visible: int,
    created_at: float,
    traceparent: str = "",
    sweep_id: str = "",
    pack_key: str = "",
) -> dict[str, bytes | str | int | float]:
    """Hash fields of a freshly submitted job (QUEUED, attempt 0, no checkpoint)."""
    fields: dict[str, bytes | str | int | float] = {
        "tenant": tenant,
        "name": name,
        "state": JobState.QUEUED.value,
        "spec": spec,
        "step": 0,
        "total_steps": total_steps,
        "attempt": 0,
        "error": "",
        "checkpoint_step": -1,
        "worker": "",
        "created_at": repr(created_at),
        "started_at": "",
        "finished_at": "",
        "n_visible": n_visible,
        "latest_metrics": b"",
        "cancel_requested": 0,
        "metric_step": -1,
        "backoffs": 0,
        "runtime": "",
    }
    if traceparent:  # stored only when tracing is on
        fields["traceparent"] = traceparent
    if sweep_id:  # stored only for a sweep's runs
        fields["sweep_id"] = sweep_id
    if pack_key:  # stored only for jobs a pack can hold
        fields["pack_key"] = pack_key
    return fields


def worker_label(worker_id: str) -> str:
    """What tenants see of the worker that ran a job: a stable opaque label ("w-" and 8 hex
    digits of the id's sha256; "" for none). The id holds the host name and process id, which
    tell tenants about the deployment; records and logs keep it, and an operator matches the
    two by hashing the id."""
    if not worker_id:
        return ""
    return "w-" + hashlib.sha256(worker_id.encode()).hexdigest()[:8]
