"""The worker: takes jobs from the queue (or whose lease lapsed) and runs them one at a time.

Where the next job comes from, in order:
1. a running job whose lease lapsed (its worker died): taken over and resumed from its last
   checkpoint (`LeaseStore.lapsed`, a scan of the lease deadlines);
2. at start, queue entries this worker id took before a restart and never acknowledged;
3. queue entries another worker took and left unacknowledged for a lease length (that worker
   died between taking and claiming);
4. the next job of the least recently served tenant with queued jobs (tenants in rotation,
   store/queue.py: its oldest plain job, else its oldest sweep run), waiting briefly for one
   so that `stop()` is noticed quickly.
A job or pack gives its worker up at the end of an SSDRBM_SLICE_SECONDS slice while other work
waits (worker/runner.py), and the worker takes the next job as above.
Then, with SSDRBM_MAX_PACK_SIZE > 1, up to that many more jobs with the same pack key join it
(worker/pack_claim.py) and the jobs train as one pack in one process (worker/runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

import redis.asyncio as aioredis
import redis.exceptions

from ssdrbm_server import tracing
from ssdrbm_server.config import Settings
from ssdrbm_server.keys import Keys
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

logger = logging.getLogger(__name__)

REDIS_RETRY_S = 1.0
MAX_JOBS_PER_CHILD = 100  # a training process is replaced after this many jobs


def default_worker_id() -> str:
    """host-pid: unique among live workers, stable for the life of the process."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    """One worker: runs at most one job at a time (one per GPU), configured by ``Settings``."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: WorkerMetrics | None = None,
        redis_watch: RedisWatch | None = None,
    ) -> None:
        """``metrics``: where to count (the server's registry when the worker runs inside the
        server process); by default a registry of its own, ``self.metrics.registry``.
        ``redis_watch``: the server's, when the worker runs inside the server process, which
        checks Redis's settings for both; by default the worker checks them itself."""
        settings.check()
        self.settings = settings
        self.worker_id = settings.worker_id or default_worker_id()
        self.keys = Keys(settings.redis_prefix)
        self.jobs_run: list[tuple[str, str]] = []  # (job id, outcome), for logs and tests
        # asyncio events bind to a loop only when first awaited: safe to create here.
        self._stop = StopRequest()
        self._stopped = asyncio.Event()
        self._started = False
        self._spare: ChildProcess | None = None  # a training process started ahead of its job
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
        self._spare = ChildProcess.for_settings(self.settings)
        heartbeat = self._beat_heartbeat_file()
        logger.info("worker %s started", self.worker_id)
        check_pending = True
        try:
            while not self._stop.event.is_set():
                if not watch.fit:  # no new job Redis might lose; the ERROR comes with each check
                    await self._pause(REDIS_RETRY_S)
                    continue
                try:
                    lease = await self._next_lease(queue, leases, check_pending, watch)
                    # Entries taken while Redis turned unfit stay this worker's, unclaimed:
                    # read them first once it is fit again.
                    check_pending = not watch.fit
                    if lease is not None:
                        riders = (
                            await self._riders(client, lease, queue, leases) if watch.fit else []
                        )
                        await self._run_jobs(client, [lease, *riders])
                except REDIS_DOWN as exc:
                    logger.warning("worker %s: Redis unreachable (%s)", self.worker_id, exc)
                    await self._pause(REDIS_RETRY_S)
                except redis.exceptions.ResponseError:
                    logger.exception("worker %s: unexpected Redis reply", self.worker_id)
                    await self._pause(REDIS_RETRY_S)
                except Exception:
                    # A bug must not silently end the worker: log it, back off, go on.
                    logger.exception("worker %s: unexpected error", self.worker_id)
                    await self._pause(REDIS_RETRY_S)
        finally:
            for task in (heartbeat, redis_checks):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if self._spare is not None:
                await self._spare.kill()
                self._spare.close()
                self._spare = None
            await client.aclose()
            self._stopped.set()
            logger.info("worker %s stopped", self.worker_id)

    async def _watch_redis(
        self, client: aioredis.Redis
    ) -> tuple[RedisWatch, asyncio.Task[None] | None]:
        """The watch the claim loop consults, and its periodic check when this worker runs it
        (a worker alone: checked here first, RedisConfigError on a Redis that would lose jobs)."""
        if self._redis_watch is not None:
            return self._redis_watch, None
        watch = RedisWatch(
            client,
            self.settings,
            consequence=f"worker {self.worker_id} claims no new job (the one it runs goes on)",
        )
        await watch.check_at_start()
        return watch, asyncio.create_task(watch.run())

    def _beat_heartbeat_file(self) -> asyncio.Task[None] | None:
        """The file `healthcheck --worker` reads (readiness.py), if one is configured."""
        path = self.settings.worker_heartbeat_file
        if not path:
            return None
        return asyncio.create_task(beat_file(path, self.settings.heartbeat_seconds))

    async def _riders(
        self, client: aioredis.Redis, lease: Lease, queue: JobQueue, leases: LeaseStore
    ) -> list[Lease]:
        """The jobs that train beside ``lease``'s in one pack (none unless packing is on)."""
        if self.settings.max_pack_size <= 1 or not lease.record.pack_key:
            return []
        lease_ms = int(self.settings.lease_seconds * 1000)

        async def claim(job_id: str, takeover: bool) -> Lease | None:
            rider = await self._claim(leases, job_id, lease_ms, takeover=takeover)
            if rider is not None and takeover:
                self.metrics.lease_takeovers.inc()
            return rider

        return await claim_riders(
            lease,
            self.settings,
            worker_id=self.worker_id,
            queue=queue,
            leases=leases,
            claims=PackClaims(client, keys=self.keys),
            claim=claim,
        )

    async def _run_jobs(self, client: aioredis.Redis, leases: list[Lease]) -> None:
        """Train the jobs in one process: one alone, more as a pack."""
        child, self._spare = self._spare, None
        runner = Runner(
            client,
            leases,
            self.settings,
            self._stop,
            keys=self.keys,
            child=child,
            metrics=self.metrics,
        )
        outcomes = await runner.run()
        self.jobs_run += [(lease.job_id, o) for lease, o in zip(leases, outcomes, strict=True)]
        await self._keep_child(runner.idle_child)

    async def _keep_child(self, idle_child: ChildProcess | None) -> None:
        """Keep the job's training process for the next job, or have a fresh one ready."""
        self._spare = idle_child
        if self._spare is not None and self._spare.jobs_started >= MAX_JOBS_PER_CHILD:
            await self._spare.kill()  # start afresh now and then: no growth over months
            self._spare.close()
            self._spare = None
        if self._spare is None and not self._stop.event.is_set():
            self._spare = ChildProcess.for_settings(self.settings)  # ready for the next job

    async def _next_lease(
        self, queue: JobQueue, leases: LeaseStore, check_pending: bool, watch: RedisWatch
    ) -> Lease | None:
        """The next job to run, claimed; None when there is none, or when Redis turned unfit
        meanwhile (the blocking read below can outlast a check): nothing is claimed then."""
        lease_ms = int(self.settings.lease_seconds * 1000)
        for job_id in await leases.lapsed():
            if not watch.fit:
                return None
            lease = await self._claim(leases, job_id, lease_ms, takeover=True)
            if lease is not None:
                logger.info("took over job %s after its lease lapsed", job_id)
                self.metrics.lease_takeovers.inc()
                return lease
        entries = await queue.pending(self.worker_id, count=1) if check_pending else []
        entries = entries or await queue.autoclaim(self.worker_id, min_idle_ms=lease_ms, count=1)
        entries = entries or await queue.read(self.worker_id, block_ms=self.settings.worker_poll_ms)
        for entry_id, job_id in entries:
            if not watch.fit:
                return None  # the entry stays pending, this worker's, until Redis is fit
            lease = await self._claim(leases, job_id, lease_ms, takeover=False)
            # Acknowledge either way: a claimed job is now tracked by its lease, and an
            # unclaimable one is finished or held by a worker whose lease covers it.
            await queue.ack(entry_id)
            if lease is not None:
                return lease
        return None

    async def _claim(
        self, leases: LeaseStore, job_id: str, lease_ms: int, *, takeover: bool
    ) -> Lease | None:
        """Claim a job; once claimed, its wait in the queue (from the submit to the first claim)
        and the claim itself go into the metrics and the job's trace."""
        started = time.time()
        lease = await leases.claim(job_id, self.worker_id, lease_ms=lease_ms)
        if lease is None:
            return None
        claimed = time.time()
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

        graceful: the running job is checkpointed at its current step and released to the
        queue. Otherwise it is released at once and resumes from its last checkpoint.
        """
        self._stop.request(graceful)
        if self._started:
            await self._stopped.wait()
