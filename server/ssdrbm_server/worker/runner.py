"""Runs leased jobs in one training process: a job alone (a set of one), or a pack of
compatible jobs (worker/pack_claim.py, ssdcore.pack). Each job keeps its own ``LeasedJob``
(lease, fencing token, writes) and gets each message the process sends about it (a pack's
name the job's index, ``run``), so it is written the same way alone or packed.

- *Heartbeat.* Every ``heartbeat_s`` each lease is renewed and its cancel flag read. A
  cancelled job ends CANCELLED; a lost lease writes nothing more. Its run leaves the process:
  dropped from a pack whose other runs go on, or, the last run, with the process, killed.
- *Time slice.* After SSDRBM_SLICE_SECONDS, one queue call per slice asks whether other work
  waits (``would_serve_other``); if so the jobs are stopped and released to the FRONT of their
  tenants' lists ("preempted", a pack as a unit); if not, a new slice starts. The answer that
  preempts claims the waiting work it frees the slot for, so slots whose slices end together
  free one slot per waiting job, not one each.
- *Stop.* Graceful: every run checkpoints and each job is released. Immediate (or past
  SSDRBM_STOP_TIMEOUT_SECONDS): the process is killed and each job released to resume from
  its last checkpoint.
- *The process dies or hangs* (silent past SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS: killed):
  a retry, not a failure. A job alone counts it in ``child_failures`` and is released, to
  resume from its last checkpoint under a new attempt (its dead attempt is fenced off, on a
  worker that may have more memory); it ends FAILED at SSDRBM_MAX_TRAINING_PROCESS_FAILURES,
  with the cause and, for SIGKILL, the memory it needs. In a pack the culprit cannot be told,
  so the failure counts against no job: each is released to train alone from then on
  (``LeasedJob.train_alone``), where a failure is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterator

import redis.asyncio as aioredis
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server import logs, tracing
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import NotFoundError
from ssdrbm_server.keys import Keys
from ssdrbm_server.store.fencing import LeaseLostError
from ssdrbm_server.store.leases import Lease
from ssdrbm_server.store.queue import JobQueue
from ssdrbm_server.store.records import JobRecord, JobState
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.leased_job import LOST, REDIS_DOWN, LeasedJob, StopRequest
from ssdrbm_server.worker.metrics import WorkerMetrics
from ssdrbm_server.worker.process import ChildProcess, describe_exit

logger = logging.getLogger(__name__)

# Rough memory of a training process (training_memory_mb): the interpreter with torch loaded,
# and the parameter-sized arrays alive at once: the model, its gradient, up to two optimizer
# buffers, the polar step's work space, and the trainer states a checkpoint serialises.
PROCESS_BASE_MB = 400
PARAMETER_COPIES = 8
PREEMPTED = {  # the release message of a preempted job, by what waits (would_serve_other)
    1: "preempted: another tenant's job waits (its time slice, SSDRBM_SLICE_SECONDS, is "
    "over); resumes from its last checkpoint, first in its tenant's queue",
    2: "preempted: a job of its tenant waits, and sweep runs go after the tenant's other jobs "
    "(its time slice, SSDRBM_SLICE_SECONDS, is over); resumes from its last checkpoint, "
    "first among its tenant's sweep runs",
}
HUNG_ADVICE = (
    "if one evaluation legitimately takes longer, raise "
    "SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS or lower eval.ais_betas"
)


class Runner:
    """Runs leased jobs in one training process until each has ended, been released or lost
    its lease; one job trains alone, more train as one pack."""

    def __init__(
        self,
        redis: aioredis.Redis,
        leases: list[Lease],
        settings: Settings,
        stop: StopRequest,
        *,
        keys: Keys | None = None,
        child: ChildProcess | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.stop = stop
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        self.jobs = [
            LeasedJob(redis, lease, settings, stop, keys=keys, metrics=self.metrics)
            for lease in leases
        ]
        self.packed = len(leases) > 1  # trained as one pack; its messages name their run
        self.outcomes: list[str | None] = [None] * len(leases)
        self.runs: list[int] = []  # the job of each run of the start message (its index)
        self.child = child  # a ready training process, or None to start one
        self.idle_child: ChildProcess | None = None  # after run(): the child, if reusable
        self._given_at = 0.0  # monotonic time the child got the jobs; its silence counts from it
        self._slice_end = 0.0  # monotonic time the jobs' slice ends (they may be preempted)
        self._preempted = False  # asked to checkpoint and stop: other work waits
        self._queue = JobQueue(redis, keys=keys)
        # The child may take other jobs: it never got these, or it reported the end of each.
        self._child_idle = True

    @property
    def name(self) -> str:
        """How the log names the set: "job <id>" or "pack [<ids>]"."""
        ids = [job.lease.job_id for job in self.jobs]
        return f"pack {ids}" if self.packed else f"job {ids[0]}"

    def _open(self) -> list[int]:
        """The jobs still running here (no outcome yet)."""
        return [i for i, outcome in enumerate(self.outcomes) if outcome is None]

    async def run(self) -> list[str]:
        """Run the jobs; how each ended (a JobState value, RELEASED or LOST), in lease order."""
        with self._context():
            try:
                await self._run()
            except REDIS_DOWN:
                raise  # retried where they happen; an outage is never the jobs' failure
            except Exception as exc:
                # e.g. a bug: the open jobs fail with the reason, the worker goes on.
                logger.exception("%s: unexpected error", self.name)
                reason = f"internal error: {type(exc).__name__}: {exc}"[:500]
                for i in self._open():
                    await self._fail(i, reason)
            finally:
                await self._settle_child()
        return [outcome or LOST for outcome in self.outcomes]

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        """A job alone: its logs carry its id and tenant, and its span (the attempt) is a child
        of its StartTraining call's. A pack's log lines name their job where it is handled."""
        if self.packed:
            yield
            return
        job = self.jobs[0]
        attempt = tracing.span(
            "ssdrbm.worker.attempt",
            parent=tracing.context_from_traceparent(job.record.traceparent),
            attributes={"ssdrbm.job_id": job.lease.job_id, "ssdrbm.attempt": job.lease.attempt},
        )
        with self._job_context(0), attempt:
            yield

    def _job_context(self, i: int) -> contextlib.AbstractContextManager[None]:
        return logs.log_context(job_id=self.jobs[i].lease.job_id, tenant=self.jobs[i].record.tenant)

    async def _settle_child(self) -> None:
        """Keep an idle child for the next jobs; kill one that may still be training."""
        if self.child is None:
            return
        if self._child_idle and self.child.process.is_alive():
            self.idle_child = self.child
        else:
            await self.child.kill()
            self.child.close()

    async def _end(self, i: int, write: Callable[[LeasedJob], Awaitable[str]]) -> None:
        """Job i ends with one fenced write, as it returns; LOST instead when its lease was
        lost (nothing more is written for it)."""
        try:
            self.outcomes[i] = await write(self.jobs[i])
        except LeaseLostError as exc:
            logger.warning("%s; stopping work on it", exc)
            self.outcomes[i] = LOST

    async def _cancel(self, i: int, message: str) -> None:
        await self._end(i, lambda job: job.finish(JobState.CANCELLED, message=message))

    async def _fail(self, i: int, reason: str) -> None:
        await self._end(i, lambda job: job.finish(JobState.FAILED, error=reason))

    async def _run(self) -> None:
        for i, job in enumerate(self.jobs):
            if job.record.cancel_requested:
                await self._cancel(i, "cancelled before it resumed")
        for i in self._open():
            lease = self.jobs[i].lease
            with self._job_context(i):
                logger.info(
                    "job %s: attempt %d on %s", lease.job_id, lease.attempt, lease.worker_id
                )
        start = await self._start_message()
        if start is None:
            return
        if self.packed:
            logger.info("pack of %d: jobs %s", len(self.runs), self.name)
        if self.child is None or not self.child.process.is_alive():
            self.child = ChildProcess.for_settings(self.settings)
        self._child_idle = False
        self._given_at = time.monotonic()
        self._slice_end = self._given_at + self.settings.slice_seconds
        for run, i in enumerate(self.runs):
            self.jobs[i].stop_run = functools.partial(self._stop_run, run)
        self.child.send(start)
        await self._supervise(self.child)

    async def _start_message(self) -> protocol.Message | None:
        """The start message of the open jobs that can start (one that cannot, its data gone
        or its spec unreadable, ends FAILED alone); None when none can."""
        starts: list[protocol.Message] = []
        for i in self._open():
            try:
                starts.append(await self.jobs[i].start_message(with_dataset=not starts))
            except REDIS_DOWN:
                raise
            except Exception as exc:
                if isinstance(exc, NotFoundError):
                    reason = exc.message
                else:
                    logger.exception("job %s cannot start", self.jobs[i].lease.job_id)
                    reason = f"internal error: {type(exc).__name__}: {exc}"[:500]
                await self._fail(i, reason)
                continue
            self.runs.append(i)
        if not starts:
            return None
        return pack_start(starts) if self.packed else starts[0]

    async def _supervise(self, child: ChildProcess) -> None:
        next_beat = 0.0
        stop_deadline: float | None = None
        while self._open():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.settings.heartbeat_seconds
                await self._heartbeats()
                if not self._open():
                    return
                if now >= self._slice_end and not self._preempted:
                    await self._slice_over()
            if self.stop.event.is_set() or self._preempted:
                hurried = self.stop.event.is_set() and not self.stop.graceful
                if hurried or (stop_deadline and now > stop_deadline):
                    await child.kill()
                    await self._release_open()
                    return
                if stop_deadline is None:
                    child.send(protocol.Message(protocol.STOP))
                    stop_deadline = now + self.settings.stop_timeout_seconds
            silence = child.silent_for(self._given_at)
            if silence > child.allowed_silence(self.settings.child_heartbeat_timeout_seconds):
                await self._child_hung(child, silence)
                return
            try:
                timeout = max(0.01, next_beat - time.monotonic())
                message = await asyncio.wait_for(child.inbox.get(), timeout)
            except TimeoutError:
                continue
            if message is None:
                await self._child_exited(child)
                return
            await self._handle(message)
        # The process reported the end of every run: it is idle once it left its training loop,
        # which it does after the drops already sent (the pipe keeps their order before a new
        # start).
        self._child_idle = True

    async def _slice_over(self) -> None:
        """The slice has passed: preempt the jobs when other work waits; else a new one starts."""
        running: dict[str, bool] = {}  # each tenant: whether its jobs here are all sweep runs
        for i in self._open():
            record = self.jobs[i].record
            running[record.tenant] = running.get(record.tenant, True) and bool(record.sweep_id)
        try:
            # The claim on the work a preemption frees this slot for lasts a slice at most: the
            # slot usually takes that work long before (a checkpoint, a fraction of a second; a
            # slower one only lets another slot preempt for it too, as without claims), and a
            # slot told "no" for it asks again a slice later, when the claim of a worker that
            # died mid-preemption has lapsed.
            claim_ms = round(self.settings.slice_seconds * 1000)
            waiting = await self._queue.would_serve_other(running, claim_ms=claim_ms)
        except REDIS_DOWN:
            return  # asked again at the next heartbeat; the training goes on meanwhile
        if not waiting:
            self._slice_end = time.monotonic() + self.settings.slice_seconds
            return
        message = PREEMPTED[int(waiting)]
        logger.info("%s: preempted at its slice's end (%s)", self.name, message)
        for i in self._open():
            self.jobs[i].preempted = message
            self.metrics.preemptions.inc()
        self._preempted = True

    async def _heartbeats(self) -> None:
        """Renew each open job's lease and read its cancel flag."""
        for i in self._open():
            try:
                cancelled = await self.jobs[i].heartbeat()
            except LeaseLostError as exc:
                await self._lost(i, exc)
                continue
            if cancelled:
                await self._leave(i)
                await self._cancel(i, "cancelled on request")

    async def _lost(self, i: int, exc: LeaseLostError) -> None:
        logger.warning("%s; stopping work on it", exc)
        await self._leave(i)
        self.outcomes[i] = LOST

    async def _leave(self, i: int) -> None:
        """Job i's run stops as the worker ended the job (cancelled, lease lost): dropped from
        the pack while others train there; the last run takes the process with it (killed)."""
        assert self.child is not None
        if any(j != i for j in self._open()):
            self.child.send(protocol.Message(protocol.DROP, {"run": self.runs.index(i)}))
        else:
            await self.child.kill()

    def _stop_run(self, run: int) -> None:
        """A sweep's early stopping: the process checkpoints this run and stops it."""
        assert self.child is not None
        self.child.send(protocol.Message(protocol.STOP_RUN, {"run": run}))

    def _job_of(self, message: protocol.Message) -> int | None:
        """The job a message is about: a pack's name their run, a job alone's are its own."""
        if not self.packed:
            return self.runs[0]
        run = message.fields.get("run")
        if run is None or not 0 <= int(run) < len(self.runs):
            logger.error("message %r from the training process names no run", message.kind)
            return None
        return self.runs[int(run)]

    async def _handle(self, message: protocol.Message) -> None:
        if message.kind == protocol.PROGRESS:  # steps of every run: each job counts its own
            for i in self._open():
                await self.jobs[i].handle(message)
            return
        i = self._job_of(message)
        if i is None or self.outcomes[i] is not None:
            return  # the job left (cancelled, lease lost): nothing more is written for it
        try:
            with self._job_context(i):
                outcome = await self.jobs[i].handle(message)
        except LeaseLostError as exc:
            await self._lost(i, exc)
            return
        if outcome is not None:  # the process reported the run's end: it left there already
            self.outcomes[i] = outcome

    async def _release_open(self) -> None:
        """Release the open jobs the worker stopped (a stop or a preemption)."""
        for i in self._open():
            await self._end(i, LeasedJob.release_for_stop)

    async def _child_exited(self, child: ChildProcess) -> None:
        """The pipe closed before the end of every run was reported: the process died."""
        code = await child.join()
        if code is None:  # closed its pipe but lives on: not to be trusted with the jobs
            await child.kill()

        def hint(job: LeasedJob) -> str:
            if code != -signal.SIGKILL:
                return ""
            packed = f" (it trained in a pack of {len(self.jobs)} runs)" if self.packed else ""
            return memory_hint(job.record) + packed

        await self._child_failed(describe_exit(code), hint)

    async def _child_hung(self, child: ChildProcess, silence: float) -> None:
        logger.error(
            "%s: the training process %s sent nothing for %.1f s; killing it",
            self.name,
            child.process.pid,
            silence,
        )
        await child.kill()
        cause = (
            f"sent nothing for {silence:.0f} s (SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS "
            f"{self.settings.child_heartbeat_timeout_seconds:g}) and was killed as hung"
        )
        await self._child_failed(cause, lambda job: HUNG_ADVICE)

    async def _child_failed(self, cause: str, hint: Callable[[LeasedJob], str]) -> None:
        """A job alone counts the failure; several open jobs are each released to train alone."""
        open_jobs = self._open()
        shared = len(open_jobs) > 1
        if shared:
            self.metrics.process_failures.inc()
            logger.warning(
                "%s: the training process %s; its %d jobs will train alone",
                self.name,
                cause,
                len(open_jobs),
            )
        for i in open_jobs:
            job = self.jobs[i]
            try:
                if self.stop.event.is_set():  # the worker is stopping: not the job's fault
                    outcome = await job.release_for_stop()
                elif shared:
                    outcome = await job.train_alone(cause)
                else:
                    outcome = await job.child_failed(cause, hint=hint(job))
            except LeaseLostError:
                outcome = LOST
            self.outcomes[i] = outcome


def pack_start(starts: list[protocol.Message]) -> protocol.Message:
    """One start_pack message from the jobs' start messages: the settings, the upload's dtype,
    shape and data once (a pack's jobs train on the same), each job's fields, spec and
    checkpoint under its run's index."""
    fields: dict[str, object] = {}
    blobs: dict[str, bytes] = {}
    jobs: list[dict[str, object]] = []
    for run, start in enumerate(starts):
        job_fields = dict(start.fields)
        fields["settings"] = job_fields.pop("settings")
        for upload in ("dataset_dtype", "dataset_shape"):
            if upload in job_fields:
                fields[upload] = job_fields.pop(upload)
        jobs.append(job_fields)
        blobs[f"spec.{run}"] = start.blobs["spec"]
        if "resume" in start.blobs:
            blobs[f"resume.{run}"] = start.blobs["resume"]
        if "dataset" in start.blobs:
            blobs["dataset"] = start.blobs["dataset"]
    fields["jobs"] = jobs
    return protocol.Message(protocol.START_PACK, fields, blobs)


def memory_hint(record: JobRecord) -> str:
    """What a SIGKILL most likely means (the OOM killer), with the memory the job needs."""
    request = rbm_pb2.StartTrainingRequest.FromString(record.spec)
    needed = training_memory_mb(request, record.n_visible)
    return (
        f"likely out of memory: the model needs about {needed} MB to train (plus its "
        "dataset); give the worker more memory or lower model.n_hidden or training.batch_size"
    )


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
    if request.model.kind == rbm_pb2.MODEL_KIND_GAUSSIAN:  # its variances (unset: diagonal)
        params += {
            rbm_pb2.VARIANCE_KIND_FULL: n_visible * n_visible,
            rbm_pb2.VARIANCE_KIND_ISOTROPIC: 1,
            rbm_pb2.VARIANCE_KIND_IDENTITY: 0,
        }.get(request.model.variance, n_visible)
        # Gaussian visibles: the noise draws (B·V), the rows v·C⁻¹ and v - b (2B·V each), and
        # the V×H products C⁻¹W and W ⊙ ∂L/∂W, solo and packed alike.
        chains += 5 * training.batch_size * n_visible + 2 * n_visible * n_hidden
    if training.HasField("parallel_tempering"):  # each temperature: its chains and buffers
        tempered = training.batch_size * (2 * n_visible + 4 * n_hidden)
        chains += training.parallel_tempering.temperatures * tempered
    return 4 * (PARAMETER_COPIES * params + chains) / 1e6
