"""Runs one claimed job in a training process and turns its reports into fenced writes.

While the child trains, the runner renews the lease and reads the cancel flag every
`heartbeat_s` (so a cancel takes effect within about that long), and writes what the child
sends: metric events, checkpoints, the final state. Redis outages are ridden out by retrying
(the child keeps training meanwhile); a lost lease (another worker took over) stops the child
at once without writing anything more.

A training process that dies (a signal such as the OOM killer's SIGKILL, or any exit without
reporting the job's end) or goes silent past SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS (it is
killed first) is a retry, not the job's failure: the runner counts it in the job's
`child_failures` (a fenced update) and releases the job to the queue with the fenced `release`
write, exactly as a graceful stop does. The next claim, by any worker, raises the attempt and
resumes from the last checkpoint with a fresh training process, so the existing guarantees
carry over unchanged: the dead process's attempt can write nothing more (fencing), and the
steps it had already published are dropped when recomputed (each step once in the stream).
Restarting in place under the same attempt would have needed its own resume path; going
through the queue also lets a job that ran out of memory here land on a roomier worker. The
job ends FAILED at SSDRBM_MAX_TRAINING_PROCESS_FAILURES, with the cause and, for SIGKILL, the
memory the model needs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions
from google.protobuf.message import DecodeError
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server import logs, tracing
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import FailedPreconditionError, NotFoundError
from ssdrbm_server.keys import Keys
from ssdrbm_server.store.checkpoints import CheckpointStore
from ssdrbm_server.store.datasets import DatasetStore
from ssdrbm_server.store.fencing import FencedJob, LeaseLostError
from ssdrbm_server.store.leases import Lease, LeaseStore
from ssdrbm_server.store.lifecycle import Retention
from ssdrbm_server.store.records import NOT_PACKABLE, JobRecord, JobState
from ssdrbm_server.store.rungs import RungGate
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.metrics import WorkerMetrics, job_labels
from ssdrbm_server.worker.process import ChildProcess, describe_exit

logger = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_DOWN = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.OutOfMemoryError,  # Redis full: writes succeed again once space is freed
)
RETRY_DELAY_S = 0.5
# How a job left a runner other than by ending (JobRunner.run returns these or a JobState value).
RELEASED = "released"  # back in the queue, to resume from its last checkpoint
LOST = "lost"  # another worker took it over; nothing more was written
STOPPED_RELEASE = "worker stopped; resumes from the last checkpoint"  # its state event's message
# Rough memory of a training process (training_memory_mb): the interpreter with torch loaded,
# and the parameter-sized arrays alive at once: the model, its gradient, up to two optimizer
# buffers, the polar step's work space, and the trainer states a checkpoint serialises.
PROCESS_BASE_MB = 400
PARAMETER_COPIES = 8


@dataclass
class StopRequest:
    """Set by the worker when it is asked to stop; read by the runner."""

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


class JobRunner:
    """Runs one leased job to its end, its release, or the loss of its lease."""

    def __init__(
        self,
        redis: aioredis.Redis,
        lease: Lease,
        settings: Settings,
        stop: StopRequest,
        *,
        keys: Keys | None = None,
        child: ChildProcess | None = None,
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
        self.child = child  # a ready training process, or None to start one
        # The child may take another job: it never got this one, or it reported the job's end.
        self._child_idle = True
        self.idle_child: ChildProcess | None = None  # after run(): the child, if reusable
        self._given_at = 0.0  # monotonic time the child got this job; its silence counts from it
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        try:
            spec = rbm_pb2.StartTrainingRequest.FromString(self.record.spec)
        except DecodeError:  # run() fails the job with the reason; its metrics go unlabelled
            spec = rbm_pb2.StartTrainingRequest()
        self._labels = job_labels(spec)
        self._batch_size = spec.training.batch_size
        self.rungs = RungGate(redis, self.keys, self.record)  # its sweep's early stopping

    async def run(self) -> str:
        """Run the job; returns how it ended (a JobState value, RELEASED or LOST).

        Its logs carry the job id and tenant, and its span (the training attempt) is a child
        of the StartTraining call that submitted it."""
        attempt = tracing.span(
            "ssdrbm.worker.attempt",
            parent=tracing.context_from_traceparent(self.record.traceparent),
            attributes={"ssdrbm.job_id": self.lease.job_id, "ssdrbm.attempt": self.lease.attempt},
        )
        with logs.log_context(job_id=self.lease.job_id, tenant=self.record.tenant), attempt:
            return await self._run_logged()

    async def _run_logged(self) -> str:
        try:
            return await self._run()
        except LeaseLostError as exc:
            logger.warning("%s; stopping work on it", exc)
            return LOST
        except REDIS_DOWN:
            raise  # retried where they happen; an outage is never the job's failure
        except Exception as exc:
            # e.g. a spec that cannot be parsed: the job fails, the worker goes on.
            logger.exception("job %s: unexpected error", self.lease.job_id)
            reason = f"internal error: {type(exc).__name__}: {exc}"[:500]
            await self.finish(JobState.FAILED, error=reason)
            return JobState.FAILED.value
        finally:
            await self._settle_child()

    async def _settle_child(self) -> None:
        """Keep an idle child for the next job; kill one that may still be training."""
        if self.child is None:
            return
        if self._child_idle and self.child.process.is_alive():
            self.idle_child = self.child
        else:
            await self.child.kill()
            self.child.close()

    async def _run(self) -> str:
        if self.record.cancel_requested:
            await self.finish(JobState.CANCELLED, message="cancelled before it resumed")
            return JobState.CANCELLED.value
        logger.info(
            "job %s: attempt %d on %s", self.lease.job_id, self.lease.attempt, self.lease.worker_id
        )
        try:
            start = await self.start_message()
        except NotFoundError as exc:
            await self.finish(JobState.FAILED, error=exc.message)
            return JobState.FAILED.value
        if self.child is None or not self.child.process.is_alive():
            self.child = ChildProcess.for_settings(self.settings)
        self._child_idle = False
        self._given_at = time.monotonic()
        self.child.send(start)
        return await self._supervise(self.child)

    async def heartbeat(self) -> bool:
        """Renew the job's lease (retried while Redis is down); True when a cancel was asked.
        LeaseLostError once another worker took the job over."""
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

    async def _supervise(self, child: ChildProcess) -> str:
        next_beat = 0.0
        stop_deadline: float | None = None
        while True:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.settings.heartbeat_seconds
                if await self.heartbeat():
                    await child.kill()
                    await self.finish(JobState.CANCELLED, message="cancelled on request")
                    return JobState.CANCELLED.value
            if self.stop.event.is_set():
                if not self.stop.graceful or (stop_deadline and now > stop_deadline):
                    await child.kill()
                    return await self.release_for_stop()
                if stop_deadline is None:
                    child.send(protocol.Message(protocol.STOP))
                    stop_deadline = now + self.settings.stop_timeout_seconds
            silence = child.silent_for(self._given_at)
            if silence > child.allowed_silence(self.settings.child_heartbeat_timeout_seconds):
                return await self._child_hung(child, silence)
            try:
                timeout = max(0.01, next_beat - time.monotonic())
                message = await asyncio.wait_for(child.inbox.get(), timeout)
            except TimeoutError:
                continue
            if message is None:
                return await self._child_exited(child)
            outcome = await self.handle(message)
            if outcome is not None:
                return outcome

    async def _child_exited(self, child: ChildProcess) -> str:
        """The pipe closed before the job's end was reported: the process died."""
        code = await child.join()
        if code is None:  # closed its pipe but lives on: not to be trusted with the job
            await child.kill()
        hint = self.memory_hint() if code == -signal.SIGKILL else ""
        return await self.child_failed(describe_exit(code), hint=hint)

    async def _child_hung(self, child: ChildProcess, silence: float) -> str:
        logger.error(
            "job %s: the training process %s sent nothing for %.1f s; killing it",
            self.lease.job_id,
            child.process.pid,
            silence,
        )
        await child.kill()
        cause = (
            f"sent nothing for {silence:.0f} s (SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS "
            f"{self.settings.child_heartbeat_timeout_seconds:g}) and was killed as hung"
        )
        hint = (
            "if one evaluation legitimately takes longer, raise "
            "SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS or lower eval.ais_betas"
        )
        return await self.child_failed(cause, hint=hint)

    async def child_failed(self, cause: str, *, hint: str) -> str:
        """Count a dead or hung training process against the job: release it to resume from
        its last checkpoint, or end it FAILED once the failures reach the limit (the reason
        ends with ``hint``, what to change)."""
        if self.stop.event.is_set():  # the worker is stopping: not the job's fault
            return await self.release_for_stop()
        failures = self.record.child_failures + 1
        limit = self.settings.max_training_process_failures
        await self._retry(lambda: self.job.update(child_failures=failures))
        self.metrics.process_failures.inc()
        logger.warning(
            "job %s: the training process %s (failure %d of %d)",
            self.lease.job_id,
            cause,
            failures,
            limit,
        )
        if failures >= limit:
            reason = (
                f"the training process failed {failures} times "
                f"(SSDRBM_MAX_TRAINING_PROCESS_FAILURES), the last time it {cause}"
            )
            await self.finish(JobState.FAILED, error=f"{reason}; {hint}" if hint else reason)
            return JobState.FAILED.value
        await self.release(
            f"the training process {cause} (failure {failures} of {limit}); "
            "resumes from the last checkpoint"
        )
        return RELEASED

    async def train_alone(self, cause: str) -> str:
        """The pack this job trained in lost its training process: release the job to resume
        from its last checkpoint, trained alone from now on (its pack key cleared), without
        counting the failure against it — any run of the pack, or the pack's size, may have
        caused it; alone, a failure is the job's own and counts as above."""
        if self.stop.event.is_set():  # the worker is stopping: not the job's fault
            return await self.release_for_stop()
        await self._retry(lambda: self.job.update(pack_key=NOT_PACKABLE))
        await self.release(
            f"the training process of its pack {cause}; not counted against this job, which "
            "trains alone from here on (a failure is then its own) and resumes from the last "
            "checkpoint"
        )
        return RELEASED

    def memory_hint(self) -> str:
        """What a SIGKILL most likely means (the OOM killer), with the memory the job needs."""
        request = rbm_pb2.StartTrainingRequest.FromString(self.record.spec)
        needed = training_memory_mb(request, self.record.n_visible)
        return (
            f"likely out of memory: the model needs about {needed} MB to train (plus its "
            "dataset); give the worker more memory or lower model.n_hidden or training.batch_size"
        )

    async def handle(self, message: protocol.Message) -> str | None:
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
                self._stop_early()
        elif kind == protocol.PROGRESS:
            self.metrics.trained(self._labels, fields["runs"], self._batch_size)
        elif kind == protocol.METRICS:
            self.step = int(fields["step"])
            await self._retry(lambda: self.job.publish_metrics(self.step, message.blobs["metrics"]))
            if await self._retry(lambda: self.rungs.check(self.step, message.blobs["metrics"])):
                self._stop_early()
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
            self._child_idle = True
            self.step = int(fields["step"])
            await self.finish(JobState.SUCCEEDED, message="finished")
            return JobState.SUCCEEDED.value
        elif kind == protocol.STOPPED:
            self.step = int(fields["step"])
            if self.rungs.stop_reason:  # early stopping: the run ends, its checkpoint kept
                self._child_idle = True
                await self.finish(JobState.STOPPED, message=self.rungs.stop_reason)
                return JobState.STOPPED.value
            return await self.release_for_stop()
        elif kind == protocol.FAILED:
            self._child_idle = True
            self.step = max(self.step, int(fields["step"]))
            await self.finish(JobState.FAILED, error=fields["reason"])
            return JobState.FAILED.value
        else:
            logger.error("unexpected message %r from the training process", kind)
        return None

    def _stop_early(self) -> None:
        """The sweep's early stopping ends this run: the child checkpoints and stops."""
        assert self.child is not None
        self.child.send(protocol.Message(protocol.STOP))

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

    async def finish(self, state: JobState, *, error: str = "", message: str = "") -> None:
        """End the job in ``state`` (fenced; a lost reply retried as done)."""

        async def write() -> None:
            await self.job.finish(state, step=self.step, error=error, message=message)

        await self._idempotent(write, state)
        self.metrics.jobs_finished.labels(state=state.value).inc()

    async def release(self, message: str) -> None:
        """Give the job back to the queue to resume from its last checkpoint (fenced)."""

        async def write() -> None:
            await self.job.release(step=self.step, message=message)

        await self._idempotent(write, JobState.QUEUED)

    async def release_for_stop(self) -> str:
        """Release the job because the worker is stopping (not the job's doing); RELEASED."""
        await self.release(STOPPED_RELEASE)
        return RELEASED

    async def _idempotent(self, write: Callable[[], Awaitable[None]], state: JobState) -> None:
        """A state change whose reply may have been lost: a retry that finds the change
        already made under this attempt counts as done."""
        retried = False
        while True:
            try:
                await write()
                return
            except LeaseLostError:
                if retried:
                    current = await LeaseStore(self.redis, keys=self.keys).load(self.lease.job_id)
                    if current and current.attempt == self.lease.attempt and current.state == state:
                        return
                raise
            except REDIS_DOWN as exc:
                retried = True
                await self._wait_for_redis(exc)

    async def _retry(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis operation, retrying while Redis is unreachable."""
        while True:
            try:
                return await operation()
            except REDIS_DOWN as exc:
                await self._wait_for_redis(exc)

    async def _wait_for_redis(self, exc: Exception) -> None:
        stopping_now = self.stop.event.is_set() and not self.stop.graceful
        if stopping_now or self.stop.overdue(self.settings.stop_timeout_seconds):
            # Stopping now, or a graceful stop that has waited its SSDRBM_STOP_TIMEOUT_SECONDS:
            # give the job up. It stays leased in Redis, the lease lapses and another worker
            # resumes it from its last checkpoint.
            raise LeaseLostError(f"job {self.lease.job_id}: Redis unreachable while stopping")
        logger.warning("job %s: Redis unreachable (%s); retrying", self.lease.job_id, exc)
        await asyncio.sleep(RETRY_DELAY_S)


def training_memory_mb(request: rbm_pb2.StartTrainingRequest, n_visible: int) -> int:
    """A rough estimate of a training process's memory for a job, dataset excluded (MB).

    PROCESS_BASE_MB + 4 bytes × (PARAMETER_COPIES × P + (2·cd_k + 4) · B · (V + H)), where P
    counts the parameters (V·H + V + H, plus a Gaussian model's variances: V diagonal, 1
    isotropic, V·V for a full precision) and the second term the CD chains (a visible and a
    hidden sample and mean per Gibbs sweep) and the low-rank gradient factors, for batch B; a
    Gaussian model adds 5 · B · V + 2 · V · H (noise, precision-weighted and centered rows,
    C⁻¹W and W ⊙ ∂L/∂W); parallel tempering adds K · B · (2V + 4H) for its K temperatures'
    chains and buffers.
    """
    return PROCESS_BASE_MB + round(run_memory_mb(request, n_visible))


def run_memory_mb(request: rbm_pb2.StartTrainingRequest, n_visible: int) -> float:
    """The model's own share of training_memory_mb (MB): what one more run of a pack adds."""
    n_hidden, training = request.model.n_hidden, request.training
    params = n_visible * n_hidden + n_visible + n_hidden
    chains = (2 * training.cd_k + 4) * training.batch_size * (n_visible + n_hidden)
    if request.model.kind == rbm_pb2.MODEL_KIND_GAUSSIAN:
        params += _variance_parameters(request.model.variance, n_visible)
        # Gaussian visibles: the noise draws (B·V), the rows v·C⁻¹ and v - b (2B·V each), and
        # the V×H products C⁻¹W and W ⊙ ∂L/∂W, solo and packed alike.
        chains += 5 * training.batch_size * n_visible + 2 * n_visible * n_hidden
    if training.HasField("parallel_tempering"):  # each temperature: its chains and buffers
        tempered = training.batch_size * (2 * n_visible + 4 * n_hidden)
        chains += training.parallel_tempering.temperatures * tempered
    return 4 * (PARAMETER_COPIES * params + chains) / 1e6


def _variance_parameters(variance: int, n_visible: int) -> int:
    """Entries of a Gaussian model's variance parameter (an unset form is the diagonal one)."""
    if variance == rbm_pb2.VARIANCE_KIND_FULL:
        return n_visible * n_visible
    if variance == rbm_pb2.VARIANCE_KIND_ISOTROPIC:
        return 1
    if variance == rbm_pb2.VARIANCE_KIND_IDENTITY:
        return 0
    return n_visible
