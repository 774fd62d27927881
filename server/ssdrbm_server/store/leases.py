"""Leases: which worker runs a job, until when, under which attempt number.

A claim is one compare-and-set script on the job's slot: it succeeds only when the job is
QUEUED, or RUNNING with a lapsed lease, at the attempt the claimer read. It raises the attempt,
fencing off every later write of the previous holder (fencing.py), and records the deadline
in the job hash on the Redis clock (TIME), so workers with skewed clocks agree on it.

`{jobs}:leases` only indexes the deadlines (indexes.py). A claim runs in three steps, each safe
to die after: 1. `reserve_lease` puts the job into the index with a deadline no later than the
claim's (if the claim never happens, the entry lapses and leads another worker here); 2. the
claim script (the decision); 3. the index takes the real deadline and the RUNNING state
(versioned, so a late step 3 of a worker that has lost the job changes nothing).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ssdrbm_server.keys import Keys, is_job_id
from ssdrbm_server.store.connection import RedisClient, Store
from ssdrbm_server.store.events import event_values, state_event_fields, xadd_event
from ssdrbm_server.store.indexes import NOW_MS, JobIndex
from ssdrbm_server.store.records import JobRecord, JobState, record_from_hash, worker_label

logger = logging.getLogger(__name__)

# KEYS: job, events
# ARGV: expected attempt, worker id, lease ms, started at, QUEUED, RUNNING, event (4 values)
# Returns {outcome, lease deadline in ms (0 unless claimed)}.
_CLAIM = (
    """
local current = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'started_at', 'lease_deadline')
local state = current[1]
if not state then return {'missing', 0} end
if state ~= ARGV[5] and state ~= ARGV[6] then return {'finished', 0} end
if current[2] ~= ARGV[1] then return {'retry', 0} end
"""
    + NOW_MS
    + """
if state == ARGV[6] and tonumber(current[4] or '0') > now then return {'held', 0} end
local deadline = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'state', ARGV[6], 'attempt', tonumber(ARGV[1]) + 1,
           'worker', ARGV[2], 'lease_deadline', string.format('%.0f', deadline))
if current[3] == '' or not current[3] then redis.call('HSET', KEYS[1], 'started_at', ARGV[4]) end
"""
    + xadd_event("KEYS[2]", 7)
    + """
-- A submit that died before admitting the job left it expiring; a claimed job is kept.
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
return {'claimed', deadline}
"""
)

_CLAIM_RETRIES = 5


@dataclass
class Lease:
    """A worker's hold on a job under one attempt number."""

    job_id: str
    worker_id: str
    attempt: int
    lease_ms: int
    record: JobRecord  # the job as it was when claimed (state RUNNING, this attempt)


class LeaseStore(Store):
    """Claims jobs and finds jobs whose lease lapsed."""

    def __init__(self, redis: RedisClient, *, keys: Keys | None = None) -> None:
        super().__init__(redis, keys=keys)
        self.index = JobIndex(redis, self.keys)

    async def load(self, job_id: str) -> JobRecord | None:
        """The job's record whatever its tenant (workers act for every tenant)."""
        if not is_job_id(job_id):
            return None
        raw = await self.redis.hgetall(self.keys.job(job_id))
        return record_from_hash(job_id, raw) if raw else None

    async def claim(self, job_id: str, worker_id: str, *, lease_ms: int) -> Lease | None:
        """Take the job under a new attempt, or None when it is finished, gone, or held by a
        worker whose lease is still valid."""
        for _ in range(_CLAIM_RETRIES):
            record = await self.load(job_id)
            if record is None or record.state.is_terminal:
                await self._settle(job_id, record)
                return None
            await self.index.reserve_lease(job_id, lease_ms)
            outcome, deadline = await self.run(
                _CLAIM,
                keys=self.job_and_events(job_id),
                args=[
                    record.attempt,
                    worker_id,
                    lease_ms,
                    repr(time.time()),
                    JobState.QUEUED.value,
                    JobState.RUNNING.value,
                    *event_values(_claim_event(record, worker_id)),
                ],
            )
            outcome = outcome.decode()
            if outcome == "claimed":
                attempt = record.attempt + 1
                await self.index.follow(
                    job_id, record.tenant, JobState.RUNNING, attempt, lease_deadline=int(deadline)
                )
                claimed = await self.load(job_id)
                assert claimed is not None  # claimed jobs persist; only their worker ends them
                logger.info("worker %s claimed job %s (attempt %d)", worker_id, job_id, attempt)
                return Lease(job_id, worker_id, attempt, lease_ms, claimed)
            if outcome in ("missing", "finished"):
                await self._settle(job_id, await self.load(job_id))
            if outcome != "retry":
                return None
        return None

    async def _settle(self, job_id: str, record: JobRecord | None) -> None:
        """Repeat the index steps of a job found gone or finished: the process that ended it
        may have died before them (that is how a lease entry led here)."""
        if record is None:
            await self.index.forget(job_id)
        elif record.state.is_terminal:
            await self.index.follow(job_id, record.tenant, record.state, record.attempt)

    async def lapsed(self, *, limit: int = 10) -> list[str]:
        """Ids of running jobs whose indexed lease deadline has passed (the claim checks the
        job's own)."""
        return await self.index.lapsed(limit)

    async def deadline_ms(self, job_id: str) -> int | None:
        """The job's lease deadline on the Redis clock, None if it never had a lease."""
        value = await self.redis.hget(self.keys.job(job_id), "lease_deadline")
        return None if value in (None, b"") else int(value)


def _claim_event(record: JobRecord, worker_id: str) -> dict[str, bytes | str]:
    # Tenants read this event: they see the worker's opaque label, not its host and pid.
    message = f"claimed by {worker_label(worker_id)}"
    if record.checkpoint_step >= 0:
        message += f", resuming from step {record.checkpoint_step}"
    start_step = max(record.checkpoint_step, 0)  # training restarts from here
    return state_event_fields(
        JobState.RUNNING, attempt=record.attempt + 1, step=start_step, message=message
    )
