"""Runs a pack of leased jobs in one training process, each job kept as leased as a solo one.

Every job of the pack has its own :class:`~ssdrbm_server.worker.runner.JobRunner` (its lease,
fencing token and writes), and the pack runner hands each child message to the runner of the
job it names (``run``), which writes it exactly as for a solo job: metric events (each step once
in the job's stream), Backoff events, checkpoints, the runtime and the final state. What the
pack runner adds is the sharing of one process:

- *Heartbeat.* Every ``heartbeat_s`` each job's lease is renewed and its cancel flag read, job
  by job. A cancelled job ends CANCELLED and its run leaves the pack (``drop``); a job whose lease
  was lost (fencing refused the write: another worker took it over) writes nothing more and
  leaves the pack too. The other runs go on.
- *A run's end.* Finished, failed (blow-up with its backoffs spent, bad spec) or stopped: the
  child reports it for that run; the others go on.
- *Stop.* Graceful: the child checkpoints every run and each job is released to the queue, as
  a solo job is. Immediate (or overdue): the process is killed and each job released.
- *The process dies or hangs.* Which run caused it cannot be told (one run's data or spec, or
  the pack's size: the OOM killer), so the failure is counted against no job: each job still
  in the pack is released to resume from its own checkpoint and trains alone from then on (its
  pack key cleared, ``JobRunner.train_alone``), where a failure is its own and counts towards
  SSDRBM_MAX_TRAINING_PROCESS_FAILURES as for any solo job. One job that crashes its process
  thus fails alone after its retries, and its pack-mates finish. With one job left in the
  pack, the failure is that job's and counts at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from ssdrbm_server import logs
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import NotFoundError
from ssdrbm_server.keys import Keys
from ssdrbm_server.store.fencing import LeaseLostError
from ssdrbm_server.store.leases import Lease
from ssdrbm_server.store.records import JobState
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.metrics import WorkerMetrics
from ssdrbm_server.worker.process import ChildProcess, describe_exit
from ssdrbm_server.worker.runner import (
    LOST,
    REDIS_DOWN,
    RELEASED,
    STOPPED_RELEASE,
    JobRunner,
    StopRequest,
)

logger = logging.getLogger(__name__)

# Ends the child reported itself: its run has already left the pack there.
_CHILD_ENDS = frozenset({protocol.FINISHED, protocol.FAILED, protocol.STOPPED})


class RunChannel:
    """What a pack member's JobRunner sees as its training process: a stop it sends (a sweep's
    early stopping, ssdrbm_server/store/rungs.py) stops its own run only."""

    def __init__(self, child: ChildProcess, run: int) -> None:
        self.child, self.run = child, run

    def send(self, message: protocol.Message) -> None:
        if message.kind == protocol.STOP:
            message = protocol.Message(protocol.STOP_RUN, {"run": self.run})
        self.child.send(message)


class PackRunner:
    """Runs leased jobs as one pack until each has ended, been released or lost its lease."""

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
        self.members = [
            JobRunner(redis, lease, settings, stop, keys=keys, metrics=self.metrics)
            for lease in leases
        ]
        self.outcomes: list[str | None] = [None] * len(leases)
        self.child = child
        self.idle_child: ChildProcess | None = None  # after run(): the child, if reusable
        self._given_at = 0.0
        self._child_idle = True

    @property
    def job_ids(self) -> list[str]:
        return [member.lease.job_id for member in self.members]

    def _open(self) -> list[int]:
        return [i for i, outcome in enumerate(self.outcomes) if outcome is None]

    async def run(self) -> list[str]:
        """Run the pack; how each job ended (as JobRunner.run's outcome), in lease order."""
        try:
            await self._run()
        except REDIS_DOWN:
            raise  # retried where they happen; an outage is never the jobs' failure
        except Exception as exc:
            logger.exception("pack %s: unexpected error", self.job_ids)
            reason = f"internal error: {type(exc).__name__}: {exc}"[:500]
            for i in self._open():
                await self._write(i, lambda m: m.finish(JobState.FAILED, error=reason))
                self._close(i, JobState.FAILED.value)
        finally:
            await self._settle_child()
        return [outcome or LOST for outcome in self.outcomes]

    async def _settle_child(self) -> None:
        if self.child is None:
            return
        if self._child_idle and self.child.process.is_alive():
            self.idle_child = self.child
        else:
            await self.child.kill()
            self.child.close()

    def _close(self, i: int, outcome: str) -> None:
        self.outcomes[i] = outcome

    async def _write(self, i: int, write: Callable[[JobRunner], Awaitable[None]]) -> None:
        """One fenced write for job i; a lost lease closes it (nothing more is written)."""
        try:
            await write(self.members[i])
        except LeaseLostError as exc:
            logger.warning("%s; it leaves its pack", exc)
            self._close(i, LOST)

    # --- start ----------------------------------------------------------------------------

    async def _run(self) -> None:
        for i, member in enumerate(self.members):
            if member.record.cancel_requested:
                await self._write(
                    i,
                    lambda m: m.finish(JobState.CANCELLED, message="cancelled before it resumed"),
                )
                if self.outcomes[i] is None:
                    self._close(i, JobState.CANCELLED.value)
        start = await self._start_message()
        if start is None:
            return
        logger.info("pack of %d: jobs %s", len(self._open()), self.job_ids)
        if self.child is None or not self.child.process.is_alive():
            self.child = ChildProcess.for_settings(self.settings)
        self._child_idle = False
        self._given_at = time.monotonic()
        for run, i in enumerate(self._runs):
            self.members[i].child = RunChannel(self.child, run)  # type: ignore[assignment]
        self.child.send(start)
        await self._supervise(self.child)

    async def _start_message(self) -> protocol.Message | None:
        """One start_pack message: each open job's fields, spec and checkpoint, and the data
        once (every job of a pack trains on the same)."""
        jobs: list[dict[str, Any]] = []
        blobs: dict[str, bytes] = {}
        fields: dict[str, Any] = {}
        self._runs: list[int] = []  # run index in the message -> member index
        for i in self._open():
            member = self.members[i]
            try:
                message = await member.start_message(with_dataset=not jobs)
            except REDIS_DOWN:
                raise
            except Exception as exc:  # this job cannot start (its data is gone, ...): it alone
                reason = (
                    exc.message
                    if isinstance(exc, NotFoundError)
                    else f"internal error: {type(exc).__name__}: {exc}"[:500]
                )
                await self._write(i, lambda m, r=reason: m.finish(JobState.FAILED, error=r))
                self._close(i, JobState.FAILED.value)
                continue
            run = len(jobs)
            job_fields = dict(message.fields)
            fields["settings"] = job_fields.pop("settings")
            for upload in ("dataset_dtype", "dataset_shape"):
                if upload in job_fields:
                    fields[upload] = job_fields.pop(upload)
            jobs.append(job_fields)
            blobs[f"spec.{run}"] = message.blobs["spec"]
            if "resume" in message.blobs:
                blobs[f"resume.{run}"] = message.blobs["resume"]
            if "dataset" in message.blobs:
                blobs["dataset"] = message.blobs["dataset"]
            self._runs.append(i)
        if not jobs:
            return None
        fields["jobs"] = jobs
        return protocol.Message(protocol.START_PACK, fields, blobs)

    # --- supervision ----------------------------------------------------------------------

    async def _supervise(self, child: ChildProcess) -> None:
        next_beat = 0.0
        stop_deadline: float | None = None
        while self._open():
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.settings.heartbeat_seconds
                await self._heartbeats(child)
                if not self._open():
                    break
            if self.stop.event.is_set():
                if not self.stop.graceful or (stop_deadline and now > stop_deadline):
                    await child.kill()
                    await self._release_open(STOPPED_RELEASE)
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
            await self._handle(child, message)
        # Every job has ended here; the process is idle once it left the pack loop too, which
        # it does after the drops already sent (the pipe keeps their order before a new start).
        self._child_idle = True

    async def _heartbeats(self, child: ChildProcess) -> None:
        """Renew each open job's lease and read its cancel flag."""
        for i in self._open():
            member = self.members[i]
            try:
                cancelled = await member.heartbeat()
            except LeaseLostError as exc:
                logger.warning("%s; it leaves its pack", exc)
                self._drop(child, i, LOST)
                continue
            if cancelled:
                self._drop(child, i, JobState.CANCELLED.value)
                await self._write(
                    i, lambda m: m.finish(JobState.CANCELLED, message="cancelled on request")
                )

    def _drop(self, child: ChildProcess, i: int, outcome: str) -> None:
        """Job i leaves the pack: nothing more is written for it, its run stops in the child."""
        self._close(i, outcome)
        child.send(protocol.Message(protocol.DROP, {"run": self._runs.index(i)}))

    async def _handle(self, child: ChildProcess, message: protocol.Message) -> None:
        if message.kind == protocol.PROGRESS:  # steps of every run: each job counts its own
            for i in self._open():
                await self.members[i].handle(message)
            return
        run = message.fields.get("run")
        if run is None or not 0 <= int(run) < len(self._runs):
            logger.error("message %r from the training process names no run", message.kind)
            return
        i = self._runs[int(run)]
        if self.outcomes[i] is not None:
            return  # the job left the pack (cancelled, lease lost): nothing more for it
        member = self.members[i]
        context = logs.log_context(job_id=member.lease.job_id, tenant=member.record.tenant)
        try:
            with context:  # its log lines name the job, as a solo job's do
                outcome = await member.handle(message)
        except LeaseLostError as exc:
            logger.warning("%s; it leaves its pack", exc)
            self._drop(child, i, LOST)
            return
        if outcome is None:
            return
        if message.kind in _CHILD_ENDS:
            self._close(i, outcome)
        else:  # ended by the worker's side (e.g. a per-job hook): its run leaves the pack
            self._drop(child, i, outcome)

    async def _release_open(self, message: str) -> None:
        for i in self._open():
            await self._write(i, lambda m: m.release(message))
            if self.outcomes[i] is None:
                self._close(i, RELEASED)

    # --- the process died or hung ----------------------------------------------------------

    async def _child_exited(self, child: ChildProcess) -> None:
        code = await child.join()
        if code is None:
            await child.kill()
        size = len(self.members)

        def hint(member: JobRunner) -> str:
            if code != -signal.SIGKILL:
                return ""
            return f"{member.memory_hint()} (it trained in a pack of {size} runs)"

        await self._child_failed(describe_exit(code), hint)

    async def _child_hung(self, child: ChildProcess, silence: float) -> None:
        logger.error(
            "pack %s: the training process %s sent nothing for %.1f s; killing it",
            self.job_ids,
            child.process.pid,
            silence,
        )
        await child.kill()
        cause = (
            f"sent nothing for {silence:.0f} s (SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS "
            f"{self.settings.child_heartbeat_timeout_seconds:g}) and was killed as hung"
        )
        advice = (
            "if one evaluation legitimately takes longer, raise "
            "SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS or lower eval.ais_betas"
        )
        await self._child_failed(cause, lambda member: advice)

    async def _child_failed(self, cause: str, hint: Callable[[JobRunner], str]) -> None:
        """Each open job is released to train alone (see the module docstring); a last job
        left alone in the pack counts the failure as a solo job does."""
        open_runs = self._open()
        shared = len(open_runs) > 1
        if shared:
            self.metrics.process_failures.inc()
            logger.warning(
                "pack %s: the training process %s; its %d jobs will train alone",
                self.job_ids,
                cause,
                len(open_runs),
            )
        for i in open_runs:
            member = self.members[i]
            try:
                if shared:
                    outcome = await member.train_alone(cause)
                else:
                    outcome = await member.child_failed(cause, hint=hint(member))
            except LeaseLostError:
                outcome = LOST
            self._close(i, outcome)
