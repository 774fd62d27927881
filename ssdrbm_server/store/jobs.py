"""Jobs as clients see them: submit (idempotent), get, list, cancel, counts.

Every transition is one Lua script, so a job's hash, its state sets, its listing, its event
stream and the queue never disagree, even when two gRPC servers act on the same job at once.
"""

from __future__ import annotations

import logging
import time
import uuid

import redis.asyncio as aioredis

from ssdrbm_server.errors import (
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from ssdrbm_server.keys import Keys, is_job_id
from ssdrbm_server.store.events import state_event_fields
from ssdrbm_server.store.records import JobRecord, JobState, new_job_fields, record_from_hash

logger = logging.getLogger(__name__)

# KEYS: job, tenant listing, QUEUED set, tenant active set, queue, events, sequence, idempotency
# ARGV: job id, use idempotency ("1"/"0"), max active (0 = no limit), event data, event time,
#       then the job's hash fields as name/value pairs.
# Returns {1, id} when created, {0, existing id} for a repeated request id, {-1, ""} at the limit.
_SUBMIT = """
if ARGV[2] == '1' then
  local existing = redis.call('GET', KEYS[8])
  if existing then return {0, existing} end
end
local max_active = tonumber(ARGV[3])
if max_active > 0 and redis.call('SCARD', KEYS[4]) >= max_active then
  return {-1, ''}
end
local seq = redis.call('INCR', KEYS[7])
redis.call('HSET', KEYS[1], 'seq', seq, unpack(ARGV, 6))
redis.call('ZADD', KEYS[2], seq, ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('XADD', KEYS[6], '*', 'kind', 'state', 'data', ARGV[4], 'time', ARGV[5], 'attempt', '0')
redis.call('XADD', KEYS[5], '*', 'job', ARGV[1])
if ARGV[2] == '1' then redis.call('SET', KEYS[8], ARGV[1]) end
return {1, ARGV[1]}
"""

# KEYS: job, QUEUED set, CANCELLED set, tenant active set, events
# ARGV: expected attempt, finished at, event data, event time
# A queued job is cancelled here; a running one is flagged for its worker to stop.
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'QUEUED' then
  if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 'retry' end
  local id = string.match(KEYS[1], '([^:]+)$')
  redis.call('HSET', KEYS[1], 'state', 'CANCELLED', 'finished_at', ARGV[2])
  redis.call('SMOVE', KEYS[2], KEYS[3], id)
  redis.call('SREM', KEYS[4], id)
  redis.call('XADD', KEYS[5], '*', 'kind', 'state', 'data', ARGV[3], 'time', ARGV[4],
             'attempt', ARGV[1])
  return 'cancelled'
elseif state == 'RUNNING' then
  redis.call('HSET', KEYS[1], 'cancel_requested', 1)
  return 'requested'
end
return 'finished'
"""

_CANCEL_RETRIES = 5
_LIST_BATCH = 200


def new_job_id() -> str:
    """A random job id: 32 hex digits."""
    return uuid.uuid4().hex


def _not_found(job_id: str) -> NotFoundError:
    return NotFoundError(f"job {job_id[:64]!r} not found; check the id (ListJobs shows your jobs)")


def _parse_page_token(page_token: str) -> int | None:
    """The listing position to continue below, or None for the first page."""
    if page_token == "":
        return None
    if not (page_token.isascii() and page_token.isdigit()) or len(page_token) > 18:
        raise InvalidArgumentError(
            "page_token", "not a token from ListJobs; pass next_page_token unchanged or leave empty"
        )
    return int(page_token)


class JobStore:
    """Client-facing job operations; every method is scoped to a tenant where it reads a job."""

    def __init__(self, redis: aioredis.Redis, *, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._submit = redis.register_script(_SUBMIT)
        self._cancel = redis.register_script(_CANCEL)

    async def submit(
        self,
        tenant: str,
        spec: bytes,
        *,
        name: str,
        total_steps: int,
        request_id: str | None,
        max_active: int = 0,
    ) -> tuple[JobRecord, bool]:
        """Record and enqueue a job atomically; returns (job, created).

        A repeated `request_id` of the same tenant returns the original job with created=False.
        `max_active` > 0 refuses (ResourceExhaustedError) when the tenant already has that many
        QUEUED + RUNNING jobs, checked in the same atomic step.
        """
        job_id = new_job_id()
        created_at = time.time()
        fields = new_job_fields(
            tenant=tenant, name=name, spec=spec, total_steps=total_steps, created_at=created_at
        )
        event = state_event_fields(JobState.QUEUED, attempt=0, step=0, message="submitted")
        use_idempotency = bool(request_id)
        keys = [
            self.keys.job(job_id),
            self.keys.tenant_jobs(tenant),
            self.keys.jobs_in_state(JobState.QUEUED.value),
            self.keys.tenant_active(tenant),
            self.keys.queue(),
            self.keys.events(job_id),
            self.keys.job_sequence(),
            self.keys.idempotency(tenant, request_id or ""),
        ]
        args: list[bytes | str | int | float] = [
            job_id,
            "1" if use_idempotency else "0",
            max_active,
            event["data"],
            event["time"],
        ]
        for field, value in fields.items():
            args += [field, value]
        status, returned_id = await self._submit(keys=keys, args=args)
        if status == -1:
            raise ResourceExhaustedError(
                f"tenant already has {max_active} queued or running jobs; wait for one to finish "
                "or cancel one"
            )
        returned_id = returned_id.decode()
        if status == 0:
            logger.info("repeated request id for tenant %s: job %s", tenant, returned_id)
        else:
            logger.info("job %s submitted by tenant %s", returned_id, tenant)
        return await self.get(tenant, returned_id), status == 1

    async def get(self, tenant: str, job_id: str) -> JobRecord:
        """The job's record; NotFoundError when unknown or owned by another tenant."""
        if not is_job_id(job_id):
            raise _not_found(job_id)
        raw = await self.redis.hgetall(self.keys.job(job_id))
        if not raw or raw.get(b"tenant", b"").decode() != tenant:
            raise _not_found(job_id)
        return record_from_hash(job_id, raw)

    async def list(
        self, tenant: str, *, page_size: int, page_token: str, state: JobState | None
    ) -> tuple[list[JobRecord], str]:
        """One page of the tenant's jobs, newest first, and the token of the next page ("" at
        the end). With `state`, only jobs in that state."""
        if page_size < 1:
            raise InvalidArgumentError("page_size", "must be at least 1")
        below = _parse_page_token(page_token)
        listing = self.keys.tenant_jobs(tenant)
        page: list[JobRecord] = []
        while len(page) < page_size:
            batch = max(page_size - len(page), _LIST_BATCH) if state else page_size - len(page)
            upper = "+inf" if below is None else f"({below}"
            ids = await self.redis.zrevrangebyscore(
                listing, upper, "-inf", start=0, num=batch, withscores=True
            )
            if not ids:
                return page, ""
            records = await self._load_many([member.decode() for member, _ in ids])
            for (_member, score), record in zip(ids, records, strict=True):
                below = int(score)
                if record is None or (state is not None and record.state != state):
                    continue
                page.append(record)
                if len(page) == page_size:
                    break
            if len(ids) < batch and len(page) < page_size:
                return page, ""
        more = await self.redis.zrevrangebyscore(listing, f"({below}", "-inf", start=0, num=1)
        return page, (str(below) if more else "")

    async def _load_many(self, job_ids: list[str]) -> list[JobRecord | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self.keys.job(job_id))
            replies = await pipe.execute()
        return [
            record_from_hash(job_id, raw) if raw else None
            for job_id, raw in zip(job_ids, replies, strict=True)
        ]

    async def cancel(self, tenant: str, job_id: str) -> JobRecord:
        """Cancel a queued job at once; ask a running job's worker to stop (it ends CANCELLED
        within seconds); a finished job is returned unchanged."""
        for _ in range(_CANCEL_RETRIES):
            record = await self.get(tenant, job_id)
            if record.state.is_terminal:
                return record
            event = state_event_fields(
                JobState.CANCELLED,
                attempt=record.attempt,
                step=record.step,
                message="cancelled while queued",
            )
            outcome = await self._cancel(
                keys=[
                    self.keys.job(job_id),
                    self.keys.jobs_in_state(JobState.QUEUED.value),
                    self.keys.jobs_in_state(JobState.CANCELLED.value),
                    self.keys.tenant_active(tenant),
                    self.keys.events(job_id),
                ],
                args=[record.attempt, repr(time.time()), event["data"], event["time"]],
            )
            if outcome != b"retry":
                logger.info("cancel of job %s: %s", job_id, outcome.decode())
                return await self.get(tenant, job_id)
        # Workers kept claiming and releasing the job between our read and our write.
        raise UnavailableError(f"job {job_id} changed while it was being cancelled; retry")

    async def count_active(self, tenant: str) -> int:
        """The tenant's QUEUED + RUNNING jobs."""
        return int(await self.redis.scard(self.keys.tenant_active(tenant)))

    async def count_by_state(self) -> dict[JobState, int]:
        """Jobs of all tenants by state (for Prometheus)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for state in JobState:
                pipe.scard(self.keys.jobs_in_state(state.value))
            counts = await pipe.execute()
        return {state: int(n) for state, n in zip(JobState, counts, strict=True)}
