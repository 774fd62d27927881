"""One leased job as its worker keeps it (worker/runner.py keeps one per job, alone or
packed): its lease and cancel flag (``heartbeat``), its start message, and the fenced writes of
what the training process reports about it (``handle``). Redis outages are ridden out by
retrying while the training goes on; a lost lease raises LeaseLostError and nothing more is
written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from google.protobuf.message import DecodeError
from ssdrbm.events import FINISHED_MESSAGE
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server import tracing
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import REDIS_UNAVAILABLE, FailedPreconditionError
from ssdrbm_server.keys import Keys
from ssdrbm_server.outage import redis_answered, redis_outage_for
from ssdrbm_server.store.checkpoints import CheckpointStore
from ssdrbm_server.store.datasets import DatasetStore
from ssdrbm_server.store.fencing import FencedJob, LeaseLostError
from ssdrbm_server.store.leases import Lease, LeaseStore
from ssdrbm_server.store.lifecycle import Retention
from ssdrbm_server.store.records import NOT_PACKABLE, JobRecord, JobState
from ssdrbm_server.store.rungs import RungGate
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.metrics import WorkerMetrics, job_labels

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Unreachable, or full: writes succeed again once space is freed.
REDIS_DOWN = (*REDIS_UNAVAILABLE, redis.exceptions.OutOfMemoryError)
RETRY_DELAY_S = 0.5
# How a job left its runner other than by ending (the runner returns these or a JobState value).
RELEASED = "released"  # back in the queue, to resume from its last checkpoint
LOST = "lost"  # another worker took it over; nothing more was written
STOPPED_RELEASE = "worker stopped; resumes from the last checkpoint"  # its state event's message


@dataclass
class StopRequest:
    """Set by the worker when asked to stop; read by the runner."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    graceful: bool = True
    since: float = 0.0  # monotonic time of the first request

    def request(self, graceful: bool) -> None:
        """Ask the running job to stop (again: ``graceful=False`` hurries a graceful stop)."""
        if not self.event.is_set():
            self.since = time.monotonic()
        self.graceful = graceful
        self.event.set()

    def overdue(self, timeout_s: float) -> bool:
        """A stop was requested more than ``timeout_s`` ago."""
        return self.event.is_set() and time.monotonic() - self.since > timeout_s


class LeasedJob:
    """One leased job's heartbeat, start message and fenced writes."""

    def __init__(
        self,
        redis: aioredis.Redis,
        lease: Lease,
        settings: Settings,
        stop: StopRequest,
        *,
        keys: Keys | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self.lease = lease
        self.settings = settings
        self.stop = stop
        retention = Retention.from_settings(settings)  # applied when the job ends
        self.job = FencedJob(redis, lease, keys=self.keys, retention=retention)
        self.record: JobRecord = lease.record
        self.step = max(lease.record.checkpoint_step, 0)
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        try:
            spec = rbm_pb2.StartTrainingRequest.FromString(self.record.spec)
        except DecodeError:  # the runner fails the job with the reason; its metrics go unlabelled
            spec = rbm_pb2.StartTrainingRequest()
        self._labels = job_labels(spec)
        self._batch_size = spec.training.batch_size
        self.rungs = RungGate(redis, self.keys, self.record)  # its sweep's early stopping
        # Asks the training process to checkpoint this job's run and stop it (set by the runner).
        self.stop_run: Callable[[], None] = lambda: None
        # Why the runner preempted the job at its slice's end ("": it was not): the message of
        # its release, which puts it back at the front of its tenant's queue.
        self.preempted = ""

    async def heartbeat(self) -> bool:
        """Renew the job's lease; True when a cancel was asked (LeaseLostError once lost)."""
        return await self._retry(self.job.heartbeat)

    async def start_message(self, *, with_dataset: bool = True) -> protocol.Message:
        """The job's start message; ``with_dataset=False`` leaves an uploaded dataset out (a
        pack sends its shared data once)."""
        request = rbm_pb2.StartTrainingRequest.FromString(self.record.spec)
        fields: dict[str, Any] = {
            "settings": dataclasses.asdict(self.settings),
            "backoffs": self.record.backoffs,
            "total_steps": self.record.total_steps,
            "n_visible": self.record.n_visible,
            "log_context": {"job_id": self.lease.job_id, "tenant": self.record.tenant},
        }
        blobs = {"spec": self.record.spec}
        if with_dataset and request.dataset.WhichOneof("source") == "dataset_id":
            info, data = await self._retry(
                lambda: DatasetStore(self.redis, keys=self.keys).load(
                    self.record.tenant, request.dataset.dataset_id
                )
            )
            fields.update(dataset_dtype=info.dtype, dataset_shape=list(info.shape))
            blobs["dataset"] = data
        if self.record.checkpoint_step >= 0:
            checkpoints = CheckpointStore(self.redis, keys=self.keys)
            try:
                checkpoint = await self._retry(
                    lambda: checkpoints.latest(self.lease.job_id, with_trainer_state=True)
                )
                blobs["resume"] = checkpoint.trainer_state
                fields["recovery_state"] = checkpoint.recovery_state
                self.step = checkpoint.step
                logger.info("job %s resumes from step %d", self.lease.job_id, checkpoint.step)
            except FailedPreconditionError as exc:
                logger.error("job %s: %s; training starts over", self.lease.job_id, exc.message)
                self.step = 0
        return protocol.Message(protocol.START, fields, blobs)

    async def child_failed(self, cause: str, *, hint: str) -> str:
        """Count a dead or hung training process against the job: release it to resume from
        its last checkpoint, or end it FAILED once the failures reach the limit (the reason
        ends with ``hint``, what to change)."""
        failures = self.record.child_failures + 1
        limit = self.settings.max_training_process_failures
        await self._retry(lambda: self.job.update(child_failures=failures))
        self.metrics.process_failures.inc()
        job_id = self.lease.job_id
        logger.warning(
            "job %s: the training process %s (failure %d of %d)", job_id, cause, failures, limit
        )
        if failures >= limit:
            reason = (
                f"the training process failed {failures} times "
                f"(SSDRBM_MAX_TRAINING_PROCESS_FAILURES), the last time it {cause}"
            )
            return await self.finish(JobState.FAILED, error=f"{reason}; {hint}" if hint else reason)
        await self.release(
            f"the training process {cause} (failure {failures} of {limit}); "
            "resumes from the last checkpoint"
        )
        return RELEASED

    async def train_alone(self, cause: str) -> str:
        """The job's pack lost its training process: release the job, trained alone from now on
        (its pack key cleared), without counting the failure against it (any run of the pack,
        or its size, may have caused it)."""
        await self._retry(lambda: self.job.update(pack_key=NOT_PACKABLE))
        await self.release(
            f"the training process of its pack {cause}; not counted against this job, which "
            "trains alone from here on (a failure is then its own) and resumes from the last "
            "checkpoint"
        )
        return RELEASED

    async def handle(self, message: protocol.Message) -> str | None:
        """Write what the training process reported about this job; how the job ended (a
        JobState value or RELEASED) when the message ends it, else None."""
        fields, kind = message.fields, message.kind
        if kind == protocol.STARTED:
            self.step = int(fields["start_step"])
            await self._retry(lambda: self.job.update(runtime=fields["runtime"]))
            logger.info(
                "job %s training from step %d of %d (%s)",
                self.lease.job_id,
                self.step,
                self.record.total_steps,
                fields["runtime"],
            )
            if await self._retry(lambda: self.rungs.stopped_at_or_before(self.step)):
                self.stop_run()
        elif kind == protocol.PROGRESS:
            self.metrics.trained(self._labels, fields["runs"], self._batch_size)
        elif kind == protocol.METRICS:
            self.step = int(fields["step"])
            await self._retry(lambda: self.job.publish_metrics(self.step, message.blobs["metrics"]))
            if await self._retry(lambda: self.rungs.check(self.step, message.blobs["metrics"])):
                self.stop_run()
        elif kind == protocol.BACKOFF:
            self.step = int(fields["rollback_step"])
            self.metrics.backoffs.inc()
            await self._retry(
                lambda: self.job.backoff(
                    rollback_step=self.step, event_data=message.blobs["backoff"]
                )
            )
        elif kind == protocol.CHECKPOINT:
            await self._checkpoint(message)
        elif kind == protocol.FINISHED:
            self.step = int(fields["step"])
            note = fields.get("note") or FINISHED_MESSAGE  # or what the run's end showed
            return await self.finish(JobState.SUCCEEDED, message=note)
        elif kind == protocol.STOPPED:
            self.step = int(fields["step"])
            if self.rungs.stop_reason:  # early stopping: the run ends, its checkpoint kept
                return await self.finish(JobState.STOPPED, message=self.rungs.stop_reason)
            return await self.release_for_stop()
        elif kind == protocol.FAILED:
            self.step = max(self.step, int(fields["step"]))
            return await self.finish(JobState.FAILED, error=fields["reason"])
        else:
            logger.error("unexpected message %r from the training process", kind)
        return None

    async def _checkpoint(self, message: protocol.Message) -> None:
        step = int(message.fields["step"])
        started = time.perf_counter()
        with tracing.span("ssdrbm.worker.checkpoint", attributes={"ssdrbm.step": step}):
            await self._retry(
                lambda: self.job.put_checkpoint(
                    step,
                    data=message.blobs["model"],
                    config_json=message.fields["config_json"],
                    trainer_state=message.blobs["trainer"],
                    recovery_state=message.fields.get("recovery_state", ""),
                    keep=self.settings.checkpoint_keep,
                )
            )
        self.metrics.checkpoint_write.observe(time.perf_counter() - started)

    async def finish(self, state: JobState, *, error: str = "", message: str = "") -> str:
        """End the job in ``state`` (fenced; a lost reply retried as done); the state's value."""
        await self._retry(
            lambda: self.job.finish(state, step=self.step, error=error, message=message),
            ends_as=state,
        )
        self.metrics.jobs_finished.labels(state=state.value).inc()
        return state.value

    async def release(self, message: str, *, front: bool = False) -> None:
        """Give the job back to the queue to resume from its last checkpoint (fenced); `front`
        keeps its place at the front of its tenant's list (a preempted job)."""
        await self._retry(
            lambda: self.job.release(step=self.step, message=message, front=front),
            ends_as=JobState.QUEUED,
        )

    async def release_for_stop(self) -> str:
        """Release the job its worker stopped (stopping, or preempted at its slice's end: back
        at the front of its tenant's queue); RELEASED."""
        if self.preempted and not self.stop.event.is_set():
            await self.release(self.preempted, front=True)
        else:
            await self.release(STOPPED_RELEASE)
        return RELEASED

    async def _retry(
        self, operation: Callable[[], Awaitable[T]], *, ends_as: JobState | None = None
    ) -> T | None:
        """Run a Redis operation, retrying while Redis is unreachable. ``ends_as``: a state
        change whose reply may have been lost; a retry refused because the change was already
        made under this attempt counts as done."""
        retried = False
        while True:
            try:
                result = await operation()
            except LeaseLostError:
                if retried and ends_as is not None:
                    current = await LeaseStore(self.redis, keys=self.keys).load(self.lease.job_id)
                    if (
                        current
                        and current.attempt == self.lease.attempt
                        and current.state == ends_as
                    ):
                        return None
                raise
            except REDIS_DOWN as exc:
                retried = True
                await self._wait_for_redis(exc)
            else:
                redis_answered()
                return result

    async def _wait_for_redis(self, exc: Exception) -> None:
        stopping_now = self.stop.event.is_set() and not self.stop.graceful
        if stopping_now or self.stop.overdue(self.settings.stop_timeout_seconds):
            # Stopping now, or a graceful stop that has waited its SSDRBM_STOP_TIMEOUT_SECONDS:
            # give the job up. It stays leased in Redis, the lease lapses and another worker
            # resumes it from its last checkpoint.
            raise LeaseLostError(f"job {self.lease.job_id}: Redis unreachable while stopping")
        redis_outage_for(exc).noticed(exc, by=f"job {self.lease.job_id}'s writes")
        await asyncio.sleep(RETRY_DELAY_S)
