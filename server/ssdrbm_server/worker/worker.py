"""The worker: takes jobs from the queue (or whose lease lapsed) and runs them, one job (or
pack) at a time in each of its slots (worker/slots.py), one claim loop each on one Redis client;
a stop stops every slot, each checkpointing and releasing its jobs.

Where a slot's next job comes from, in order:
1. a running job whose lease lapsed (its worker died), resumed from its last checkpoint;
2. at start, queue entries this slot's id took before a restart and never acknowledged;
3. entries another worker took and left unacknowledged for a lease length (it died between
   taking and claiming);
4. the next job of the least recently served tenant (store/queue.py), waiting briefly for one
   so that `stop()` is noticed quickly.
With SSDRBM_MAX_PACK_SIZE > 1, jobs with the same pack key then join it (worker/pack_claim.py)
and train as one pack; a job or pack gives its slot up at the end of an SSDRBM_SLICE_SECONDS
slice while other work waits (worker/runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions

from ssdrbm_server import tracing
from ssdrbm_server.config import Settings
from ssdrbm_server.keys import Keys
from ssdrbm_server.outage import redis_answered, redis_outage_for
from ssdrbm_server.readiness import beat_file
from ssdrbm_server.redis_checks import RedisWatch
from ssdrbm_server.store.connection import connect
from ssdrbm_server.store.leases import Lease, LeaseStore
from ssdrbm_server.store.pack_claims import PackClaims
from ssdrbm_server.store.queue import JobQueue
from ssdrbm_server.worker.leased_job import REDIS_DOWN, StopRequest
from ssdrbm_server.worker.metrics import WorkerMetrics
from ssdrbm_server.worker.pack_claim import claim_riders
from ssdrbm_server.worker.process import ChildProcess
from ssdrbm_server.worker.runner import Runner
from ssdrbm_server.worker.slots import slot_settings

logger = logging.getLogger(__name__)

REDIS_RETRY_S = 1.0
MAX_JOBS_PER_CHILD = 100  # a training process is replaced after this many jobs


def default_worker_id() -> str:
    """host-pid: unique among live workers, stable for the life of the process."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class Slot:
    """One slot of a worker: its settings (its own id, CPUs and torch threads) and the training
    process it keeps ready for its next job."""

    settings: Settings
    spare: ChildProcess | None = None

    @property
    def worker_id(self) -> str:  # the slot's id towards the queue and the leases
        return self.settings.worker_id


class Worker:
    """One worker: runs up to one job (or pack) per slot at once, configured by ``Settings``."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: WorkerMetrics | None = None,
        redis_watch: RedisWatch | None = None,
    ) -> None:
        """Inside the server process, ``metrics`` and ``redis_watch`` are the server's (its
        registry, its checks of Redis's settings); by default the worker has its own."""
        settings.check()
        self.settings = settings
        self.worker_id = settings.worker_id or default_worker_id()
        self.keys = Keys(settings.redis_prefix)
        self.jobs_run: list[tuple[str, str]] = []  # (job id, outcome), for logs and tests
        # asyncio events bind to a loop only when first awaited: safe to create here.
        self._stop = StopRequest()
        self._stopped = asyncio.Event()
        self._started = False
        self.slots = [Slot(slot) for slot in slot_settings(settings, self.worker_id)]
        self.metrics = metrics if metrics is not None else WorkerMetrics()
        self._redis_watch = redis_watch

    async def run(self) -> None:
        """Take and run jobs until `stop()`."""
        if self._started:
            raise RuntimeError(f"worker {self.worker_id} is already running")
        self._started = True
        client = connect(self.settings.redis_url, cluster=self.settings.redis_cluster)
        try:
            watch, redis_checks = await self._watch_redis(client)
        except BaseException:  # a Redis that would lose jobs: this worker must not start
            await client.aclose()
            self._stopped.set()
            raise
        queue = JobQueue(client, keys=self.keys)
        leases = LeaseStore(client, keys=self.keys)
        for slot in self.slots:  # a training process started ahead of each slot's first job
            slot.spare = ChildProcess.for_settings(slot.settings)
        path = self.settings.worker_heartbeat_file  # what `healthcheck --worker` reads
        heartbeat = (
            asyncio.create_task(beat_file(path, self.settings.heartbeat_seconds)) if path else None
        )
        self.metrics.slots.inc(len(self.slots))
        logger.info("worker %s started with %s", self.worker_id, self._describe_slots())
        try:
            async with asyncio.TaskGroup() as slots:
                for slot in self.slots:
                    slots.create_task(self._serve(slot, client, queue, leases, watch))
        finally:
            self.metrics.slots.dec(len(self.slots))
            for task in (heartbeat, redis_checks):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            for slot in self.slots:
                if slot.spare is not None:
                    await slot.spare.kill()
                    slot.spare.close()
                    slot.spare = None
            await client.aclose()
            self._stopped.set()
            logger.info("worker %s stopped", self.worker_id)

    def _describe_slots(self) -> str:
        """The slots for the log: how many, and each one's CPUs when they were split."""
        if len(self.slots) == 1:
            return "1 slot"
        shares = ", ".join(
            f"{slot.worker_id} on CPUs {slot.settings.training_cpus}" for slot in self.slots
        )
        return f"{len(self.slots)} slots ({shares})"

    async def _serve(
        self,
        slot: Slot,
        client: aioredis.Redis,
        queue: JobQueue,
        leases: LeaseStore,
        watch: RedisWatch,
    ) -> None:
        """One slot's loop: take and run jobs until `stop()`."""
        check_pending = True
        while not self._stop.event.is_set():
            if not watch.fit:  # no new job Redis might lose; the ERROR comes with each check
                await self._pause(REDIS_RETRY_S)
                continue
            try:
                lease = await self._next_lease(slot, queue, leases, check_pending, watch)
                redis_answered()
                # Entries taken while Redis turned unfit stay this slot's, unclaimed: read
                # them first once it is fit again.
                check_pending = not watch.fit
                if lease is not None:
                    riders = (
                        await self._riders(slot, client, lease, queue, leases) if watch.fit else []
                    )
                    await self._run_jobs(slot, client, [lease, *riders])
            except REDIS_DOWN as exc:
                redis_outage_for(exc).noticed(exc, by=f"worker {slot.worker_id}")
                await self._pause(REDIS_RETRY_S)
            except Exception as exc:  # a bug must not silently end the slot: log, back off, go on
                reply = isinstance(exc, redis.exceptions.ResponseError)
                what = "unexpected Redis reply" if reply else "unexpected error"
                logger.exception("worker %s: %s", slot.worker_id, what)
                await self._pause(REDIS_RETRY_S)

    async def _watch_redis(
        self, client: aioredis.Redis
    ) -> tuple[RedisWatch, asyncio.Task[None] | None]:
        """The watch the claim loop consults, and its periodic check when this worker runs it
        (checked here first: RedisConfigError on a Redis that would lose jobs)."""
        if self._redis_watch is not None:
            return self._redis_watch, None
        watch = RedisWatch(
            client,
            self.settings,
            consequence=f"worker {self.worker_id} claims no new job (the one it runs goes on)",
        )
        await watch.check_at_start()
        return watch, asyncio.create_task(watch.run())

    async def _riders(
        self, slot: Slot, client: aioredis.Redis, lease: Lease, queue: JobQueue, leases: LeaseStore
    ) -> list[Lease]:
        """The jobs that train beside ``lease``'s in one pack (none unless packing is on:
        pack_claim.pack_room)."""
        lease_ms = int(self.settings.lease_seconds * 1000)
        return await claim_riders(
            lease,
            slot.settings,
            worker_id=slot.worker_id,
            queue=queue,
            leases=leases,
            claims=PackClaims(client, keys=self.keys),
            claim=lambda job_id, takeover: self._claim(
                leases, job_id, slot.worker_id, lease_ms, takeover=takeover
            ),
        )

    async def _run_jobs(self, slot: Slot, client: aioredis.Redis, leases: list[Lease]) -> None:
        """Train the jobs in the slot's process: one alone, more as a pack."""
        child, slot.spare = slot.spare, None
        runner = Runner(
            client,
            leases,
            slot.settings,
            self._stop,
            keys=self.keys,
            child=child,
            metrics=self.metrics,
        )
        self.metrics.busy_slots.inc()
        try:
            outcomes = await runner.run()
        finally:
            self.metrics.busy_slots.dec()
        self.jobs_run += [(lease.job_id, o) for lease, o in zip(leases, outcomes, strict=True)]
        # Keep the training process for the slot's next job, or have a fresh one ready.
        slot.spare = runner.idle_child
        if slot.spare is not None and slot.spare.jobs_started >= MAX_JOBS_PER_CHILD:
            await slot.spare.kill()  # start afresh now and then: no growth over months
            slot.spare.close()
            slot.spare = None
        if slot.spare is None and not self._stop.event.is_set():
            slot.spare = ChildProcess.for_settings(slot.settings)  # ready for the next job

    async def _next_lease(
        self,
        slot: Slot,
        queue: JobQueue,
        leases: LeaseStore,
        check_pending: bool,
        watch: RedisWatch,
    ) -> Lease | None:
        """The next job to run, claimed; None when there is none, or when Redis turned unfit
        meanwhile (the blocking read below can outlast a check): nothing is claimed then."""
        lease_ms = int(self.settings.lease_seconds * 1000)
        for job_id in await leases.lapsed():
            if not watch.fit:
                return None
            lease = await self._claim(leases, job_id, slot.worker_id, lease_ms, takeover=True)
            if lease is not None:
                logger.info("took over job %s after its lease lapsed", job_id)
                return lease
        worker_id = slot.worker_id
        entries = await queue.pending(worker_id, count=1) if check_pending else []
        entries = entries or await queue.autoclaim(worker_id, min_idle_ms=lease_ms, count=1)
        entries = entries or await queue.read(worker_id, block_ms=self.settings.worker_poll_ms)
        for entry_id, job_id in entries:
            if not watch.fit:
                return None  # the entry stays pending, this slot's, until Redis is fit
            lease = await self._claim(leases, job_id, worker_id, lease_ms, takeover=False)
            # Acknowledge either way: a claimed job is now tracked by its lease, and an
            # unclaimable one is finished or held by a worker whose lease covers it.
            await queue.ack(entry_id)
            if lease is not None:
                return lease
        return None

    async def _claim(
        self, leases: LeaseStore, job_id: str, worker_id: str, lease_ms: int, *, takeover: bool
    ) -> Lease | None:
        """Claim a job for the slot ``worker_id``; its queue wait (submit to first claim), a
        takeover and the claim go into the metrics and the job's trace."""
        started = time.time()
        lease = await leases.claim(job_id, worker_id, lease_ms=lease_ms)
        if lease is None:
            return None
        claimed = time.time()
        if takeover:
            self.metrics.lease_takeovers.inc()
        record = lease.record
        parent = tracing.context_from_traceparent(record.traceparent)
        if lease.attempt == 1:
            self.metrics.queue_wait.observe(max(0.0, started - record.created_at))
            tracing.record_span(
                "ssdrbm.queue",
                parent=parent,
                start_s=record.created_at,
                end_s=started,
                attributes={"ssdrbm.job_id": job_id},
            )
        tracing.record_span(
            "ssdrbm.worker.claim",
            parent=parent,
            start_s=started,
            end_s=claimed,
            attributes={
                "ssdrbm.job_id": job_id,
                "ssdrbm.attempt": lease.attempt,
                "ssdrbm.takeover": takeover,
            },
        )
        return lease

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.event.wait(), seconds)

    async def stop(self, graceful: bool = True) -> None:
        """Stop taking jobs and return once `run()` has ended (at once if it never started).
        graceful: the running jobs are checkpointed at their current step and released;
        otherwise released at once, to resume from their last checkpoint."""
        self._stop.request(graceful)
        if self._started:
            await self._stopped.wait()
