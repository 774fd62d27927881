"""Leases: which worker runs a job, until when, under which attempt number.

Claiming a job is one compare-and-set script: it succeeds only when the job is QUEUED, or
RUNNING with a lapsed lease, and its attempt is still the one the claimer read. It increases
the attempt, so every write of the previous holder is refused from then on (see fencing.py).
Deadlines live in the `jobs:leases` sorted set and are measured on the Redis clock (TIME), so
workers with skewed clocks agree on when a lease has lapsed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from ssdrbm_server.keys import Keys, is_job_id
from ssdrbm_server.store.events import state_event_fields
from ssdrbm_server.store.records import JobRecord, JobState, record_from_hash

logger = logging.getLogger(__name__)

# KEYS: job, leases, QUEUED set, RUNNING set, events
# ARGV: job id, worker id, expected attempt, lease ms, started at, event data, event time
_CLAIM = """
local current = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'started_at')
local state = current[1]
if state ~= 'QUEUED' and state ~= 'RUNNING' then
  redis.call('ZREM', KEYS[2], ARGV[1])  -- no lease can outlive its job
  if not state then return 'missing' end
  return 'finished'
end
if current[2] ~= ARGV[3] then return 'retry' end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
if state == 'RUNNING' then
  local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if deadline and tonumber(deadline) > now then return 'held' end
end
redis.call('HSET', KEYS[1], 'state', 'RUNNING', 'attempt', tonumber(ARGV[3]) + 1,
           'worker', ARGV[2])
if current[3] == '' or not current[3] then redis.call('HSET', KEYS[1], 'started_at', ARGV[5]) end
redis.call('SMOVE', KEYS[3], KEYS[4], ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[1])
redis.call('XADD', KEYS[5], '*', 'kind', 'state', 'data', ARGV[6], 'time', ARGV[7],
           'attempt', tonumber(ARGV[3]) + 1)
return 'claimed'
"""

_CLAIM_RETRIES = 5


@dataclass
class Lease:
    """A worker's hold on a job under one attempt number."""

    job_id: str
    worker_id: str
    attempt: int
    lease_ms: int
    record: JobRecord  # the job as it was when claimed (state RUNNING, this attempt)


async def redis_now_ms(redis: aioredis.Redis) -> int:
    """Milliseconds on the Redis server's clock."""
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


class LeaseStore:
    """Claims jobs and finds jobs whose lease lapsed."""

    def __init__(self, redis: aioredis.Redis, *, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._claim = redis.register_script(_CLAIM)

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
                await self.redis.zrem(self.keys.leases(), job_id)  # a stale lease, if any
                return None
            attempt = record.attempt + 1
            message = f"claimed by {worker_id}"
            if record.checkpoint_step >= 0:
                message += f", resuming from step {record.checkpoint_step}"
            start_step = max(record.checkpoint_step, 0)  # training restarts from here
            event = state_event_fields(
                JobState.RUNNING, attempt=attempt, step=start_step, message=message
            )
            outcome = await self._claim(
                keys=[
                    self.keys.job(job_id),
                    self.keys.leases(),
                    self.keys.jobs_in_state(JobState.QUEUED.value),
                    self.keys.jobs_in_state(JobState.RUNNING.value),
                    self.keys.events(job_id),
                ],
                args=[
                    job_id,
                    worker_id,
                    record.attempt,
                    lease_ms,
                    repr(time.time()),
                    event["data"],
                    event["time"],
                ],
            )
            outcome = outcome.decode()
            if outcome == "claimed":
                claimed = await self.load(job_id)
                assert claimed is not None
                logger.info("worker %s claimed job %s (attempt %d)", worker_id, job_id, attempt)
                return Lease(job_id, worker_id, attempt, lease_ms, claimed)
            if outcome != "retry":
                return None
        return None

    async def lapsed(self, *, limit: int = 10) -> list[str]:
        """Ids of running jobs whose lease deadline has passed."""
        now = await redis_now_ms(self.redis)
        ids = await self.redis.zrangebyscore(self.keys.leases(), "-inf", now, start=0, num=limit)
        return [job_id.decode() for job_id in ids]

    async def deadline_ms(self, job_id: str) -> int | None:
        """The job's lease deadline on the Redis clock, None if no lease."""
        score = await self.redis.zscore(self.keys.leases(), job_id)
        return None if score is None else int(score)
