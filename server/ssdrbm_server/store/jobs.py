"""Jobs as clients see them: submit (idempotent), get, list, cancel, counts.

A job's own keys (hash, event stream) and its tenant's (listing, sequence, active set,
idempotency keys) are in different Cluster slots, so a submit takes four single-slot steps; the
job is written first, expiring, and the expiry goes once the job is queued:

1. create (job slot): the hash (QUEUED) and its first event, expiring after `ADMISSION_TTL_S`.
   Dying here leaves an orphan nobody can name; it expires.
2. reserve (tenant slot, atomic): the idempotency key, the uploaded dataset (the tenant must
   still have it), the active-job limit, the listing position, the active set and the job's
   dataset reference. A repeated request id, a deleted dataset or a full tenant answers here
   and the orphan is deleted. From here on the job may be seen (ListJobs, the request id).
3. queue (`{jobs}` slot): the QUEUED state set and the tenant's queue, once per version
   (indexes.py). A cancelled or deleted job's entry is refused by the claim: harmless.
4. admit (job slot): the listing position into the hash, and the expiry removed.

A job still expiring after step 2 was not admitted (its submit died, unacknowledged); whoever
meets it next finishes steps 3 and 4: a repeat of the request id, a submit that finds the tenant
at its limit and checks its active jobs (dropping those ended or gone), a claim or a cancel.
Otherwise it expires, leaving a listing entry ListJobs skips. The limit check and the active set
are one atomic step, so the limit holds on Cluster; a removal a crash lost can only refuse a
submit early, never admit one beyond the limit.

A request id answers the job it created, in any state, for `idempotency_ttl_s`; once that job
is deleted, a repeat creates a new job (deleting it is the client's word that the submission is
over). On Cluster this holds by the order of the steps: a delete releases the key (lifecycle.py,
step 2) before it removes any key of the job, and a repeat reads the key, then the job, then the
key again: when the key still names the job, the record read is the answer; otherwise the
reservation runs again. So a repeat racing a delete answers the job as it was before the delete
began, or a new job; never a job already gone, and never an error.

An accepted job holds its uploaded dataset (`tenant:{<t>}:job_datasets`, taken in step 2 on the
slot of DeleteDataset's script, datasets.py, so one of the two goes first) until it leaves the
active set (indexes.py `leave_active`: its end, or its delete); a sweep's runs alike.

Cancel decides on the job hash alone (one script); the indexes follow (indexes.py). Delete and
retention are in lifecycle.py; a QUEUED or RUNNING job is deleted only with `force`: cancelled,
then removed at once without waiting for its worker, which finds the hash gone at its next
fenced write and stops.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from google.protobuf.message import DecodeError
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    tenant_subject,
)
from ssdrbm_server.keys import Keys, is_job_id, new_id
from ssdrbm_server.store.connection import RedisClient, Store, pairs
from ssdrbm_server.store.datasets import dataset_not_found
from ssdrbm_server.store.events import event_values, state_event_fields, xadd_event
from ssdrbm_server.store.indexes import JobIndex
from ssdrbm_server.store.lifecycle import REQUEST_ID_FIELD, JobLifecycle, Retention
from ssdrbm_server.store.page_tokens import decode_page_token, encode_page_token
from ssdrbm_server.store.records import JobRecord, JobState, new_job_fields, record_from_hash

logger = logging.getLogger(__name__)

# Far longer than a submit takes; how long an unadmitted job can be finished by another process.
ADMISSION_TTL_S = 3600

# KEYS: job, events. ARGV: expiry seconds, event (4 values), then the hash's field/value pairs.
# Returns 1 when created, 0 when the job already exists.
_CREATE = (
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
"""
    + xadd_event("KEYS[2]", 2)
    + """
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 1
"""
)

# KEYS: idempotency, tenant active set, tenant listing, tenant sequence, tenant datasets, tenant
# job datasets.
# ARGV: job id, use idempotency ("1"/"0"), max active (0 = no limit), max job records (0 = no
# limit), idempotency key TTL seconds (0 = none), uploaded dataset id ('' = none).
# Returns {1, id, seq} when reserved, {0, existing id, 0} for a repeated request id,
# {-1, "", 0} at the active-job limit, {-2, "", 0} at the job-record quota, {-3, "", 0} when the
# tenant has no such dataset (any more).
_RESERVE = """
if ARGV[2] == '1' then
  local existing = redis.call('GET', KEYS[1])
  if existing then return {0, existing, 0} end
end
if ARGV[6] ~= '' and redis.call('HEXISTS', KEYS[5], ARGV[6]) == 0 then return {-3, '', 0} end
local max_active = tonumber(ARGV[3])
if max_active > 0 and redis.call('SCARD', KEYS[2]) >= max_active then return {-1, '', 0} end
local max_records = tonumber(ARGV[4])
if max_records > 0 and redis.call('ZCARD', KEYS[3]) >= max_records then return {-2, '', 0} end
local seq = redis.call('INCR', KEYS[4])
redis.call('SADD', KEYS[2], ARGV[1])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[6], ARGV[1], ARGV[6]) end
redis.call('ZADD', KEYS[3], seq, ARGV[1])
if ARGV[2] == '1' then
  local ttl = tonumber(ARGV[5])
  if ttl > 0 then
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
  else
    redis.call('SET', KEYS[1], ARGV[1])
  end
end
return {1, ARGV[1], seq}
"""

# KEYS: job, events. ARGV: listing position. Returns 0 when the job expired meanwhile.
_ADMIT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'seq', ARGV[1])
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
return 1
"""

# KEYS: job, events
# ARGV: expected attempt, finished at, QUEUED, RUNNING, CANCELLED, event (4 values)
# A queued job is cancelled here; a running one is flagged for its worker to stop.
_CANCEL = (
    """
local state = redis.call('HGET', KEYS[1], 'state')
if state == ARGV[3] then
  if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 'retry' end
  redis.call('HSET', KEYS[1], 'state', ARGV[5], 'finished_at', ARGV[2])
"""
    + xadd_event("KEYS[2]", 6)
    + """
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
  return 'cancelled'
elseif state == ARGV[4] then
  redis.call('HSET', KEYS[1], 'cancel_requested', 1)
  return 'requested'
end
return 'finished'
"""
)

_CANCEL_RETRIES = 5
_SUBMIT_ROUNDS = 3  # reservations retried after a repair freed a slot or a request id
_LIST_BATCH = 200

# Replies of _RESERVE.
_RESERVED, _REPEATED, _AT_LIMIT, _AT_QUOTA, _NO_DATASET = 1, 0, -1, -2, -3


class _Found(NamedTuple):
    """What a repair needs to know of a job the tenant's keys name."""

    state: JobState | None  # None: the hash is gone
    attempt: int
    unadmitted: bool  # still expiring: its submit did not get past step 2 or 3


def uploaded_dataset(spec: bytes) -> str:
    """The uploaded dataset a job's spec trains on; "" for a built-in one or a spec that does not
    parse (its worker fails the job)."""
    try:
        dataset = rbm_pb2.StartTrainingRequest.FromString(spec).dataset
    except DecodeError:
        return ""
    return dataset.dataset_id if dataset.WhichOneof("source") == "dataset_id" else ""


def _not_found(job_id: str) -> NotFoundError:
    return NotFoundError.for_id("job", job_id, "check the id (ListJobs shows your jobs)")


class JobStore(Store):
    """Client-facing job operations; every method is scoped to a tenant where it reads a job."""

    def __init__(
        self, redis: RedisClient, *, keys: Keys | None = None, retention: Retention | None = None
    ) -> None:
        super().__init__(redis, keys=keys)
        self.index = JobIndex(redis, self.keys)
        self.lifecycle = JobLifecycle(redis, self.keys, retention)

    async def submit(
        self,
        tenant: str,
        spec: bytes,
        *,
        name: str,
        total_steps: int,
        request_id: str | None,
        n_visible: int = 0,
        max_active: int = 0,
        max_records: int = 0,
        idempotency_ttl_s: int = 0,
        traceparent: str = "",
        sweep_id: str = "",
        pack_key: str = "",
    ) -> tuple[JobRecord, bool]:
        """Record and enqueue a job; (job, created). A repeated `request_id` returns the
        original job, created=False. `max_active` > 0 (QUEUED + RUNNING jobs) and `max_records`
        > 0 (job records) refuse (ResourceExhaustedError) at the tenant's limit, checked
        atomically with the reservation. `traceparent` links the worker's spans to the calling
        trace; `sweep_id` tags a sweep's run."""
        job_id = new_id()
        fields = new_job_fields(
            tenant=tenant,
            name=name,
            spec=spec,
            total_steps=total_steps,
            n_visible=n_visible,
            created_at=time.time(),
            traceparent=traceparent,
            sweep_id=sweep_id,
            pack_key=pack_key,
        )
        fields[REQUEST_ID_FIELD] = request_id or ""  # a delete removes its idempotency key
        event = state_event_fields(JobState.QUEUED, attempt=0, step=0, message="submitted")
        args = [ADMISSION_TTL_S, *event_values(event), *pairs(fields)]
        await self.run(_CREATE, keys=self.job_and_events(job_id), args=args)
        limits = (max_active, max_records, idempotency_ttl_s)
        dataset_id = uploaded_dataset(spec)
        status, seq, existing = await self._reserve_job(
            tenant, job_id, request_id, limits, dataset_id
        )
        if status != _RESERVED:
            await self.redis.delete(*self.job_and_events(job_id))  # else it expires by itself
        if status == _NO_DATASET:
            raise dataset_not_found(dataset_id)  # deleted since the request was checked
        if status == _AT_LIMIT:
            raise ResourceExhaustedError(
                f"tenant already has {max_active} queued or running jobs; wait for one to finish "
                "or cancel one",
                limit="max_jobs_per_tenant",
                subject=tenant_subject(tenant),
            )
        if status == _AT_QUOTA:
            raise ResourceExhaustedError(
                f"tenant already has {max_records} job records (max_job_records_per_tenant); "
                "delete finished jobs you no longer need (DeleteJob, `ssdrbm delete JOB`)",
                limit="max_job_records_per_tenant",
                subject=tenant_subject(tenant),
            )
        if existing is not None:
            logger.info("repeated request id for tenant %s: job %s", tenant, existing.id)
            return existing, False
        await self._admit_job(tenant, job_id, seq, sweep_run=bool(sweep_id))
        logger.info("job %s submitted by tenant %s", job_id, tenant)
        return await self.get(tenant, job_id), True

    async def _reserve_job(
        self,
        tenant: str,
        job_id: str,
        request_id: str | None,
        limits: tuple[int, int, int],
        dataset_id: str,
    ) -> tuple[int, int, JobRecord | None]:
        """Step 2 (status, listing position, and for a repeated request id the job it answers),
        after repairing what stood in the way: a full tenant whose active set holds ended or
        vanished jobs, or a request id whose job is gone or expired before it was admitted."""
        keys = [
            self.keys.idempotency(tenant, request_id or ""),
            self.keys.tenant_active(tenant),
            self.keys.tenant_jobs(tenant),
            self.keys.tenant_sequence(tenant),
            self.keys.tenant_datasets(tenant),
            self.keys.tenant_job_datasets(tenant),
        ]
        args = [job_id, "1" if request_id else "0", *limits, dataset_id]
        for _ in range(_SUBMIT_ROUNDS):
            status, found_id, seq = await self.run(_RESERVE, keys=keys, args=args)
            if status == _REPEATED:
                existing = await self._answer(tenant, found_id.decode(), request_id or "")
                if existing is not None:
                    return status, seq, existing
            elif status != _AT_LIMIT or not await self._repair_active(tenant):
                return status, seq, None
        raise UnavailableError(f"tenant {tenant}'s jobs changed while submitting; retry")

    async def _answer(self, tenant: str, job_id: str, request_id: str) -> JobRecord | None:
        """The job a repeated request id answers, or None when the reservation must run again
        (module notes): the job is gone (its key is released here) or its delete began."""
        [found] = await self._probe([job_id])
        if found.state is None or found.unadmitted:
            await self._repair(tenant, job_id, found, request_id)
            if found.state is None:
                return None
        try:
            record = await self.get(tenant, job_id)
        except NotFoundError:
            return None  # deleted since: its key was released first
        if await self.redis.get(self.keys.idempotency(tenant, request_id)) != job_id.encode():
            return None  # its delete began after the read: the record may be gone already
        return record

    async def _admit_job(self, tenant: str, job_id: str, seq: int, *, sweep_run: bool) -> None:
        """Steps 3 and 4: queue the job (once, however often this runs), then keep it."""
        await self.index.follow(
            job_id, tenant, JobState.QUEUED, 0, enqueue=True, sweep_run=sweep_run
        )
        if not await self.run(_ADMIT, keys=self.job_and_events(job_id), args=[seq]):
            raise UnavailableError(f"job {job_id} expired before it was admitted; submit again")

    async def _probe(self, job_ids: list[str]) -> list[_Found]:
        """State, attempt and admission of each job, in one pipeline (split by node on Cluster)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self.keys.job(job_id), ["state", "attempt"])
                pipe.pttl(self.keys.job(job_id))
            replies = await pipe.execute()
        found = []
        for (state, attempt), ttl in zip(replies[::2], replies[1::2], strict=True):
            known = None if state is None else JobState(state.decode())
            found.append(_Found(known, int(attempt or 0), ttl > 0))
        return found

    async def _repair(
        self, tenant: str, job_id: str, found: _Found, request_id: str | None = None
    ) -> bool:
        """Finish what a dead process left of a job named by the tenant's keys; True when the
        job no longer counts as active (it ended, or its hash is gone and is forgotten)."""
        if found.state is None:
            if request_id:
                await self.lifecycle.release_request_id(tenant, job_id, request_id)
            await self.index.leave_active(tenant, job_id, unlist=True)
            await self.index.forget(job_id)
            return True
        if found.state.is_terminal:
            await self.index.follow(job_id, tenant, found.state, found.attempt)
            return True
        if found.unadmitted:
            seq = await self.redis.zscore(self.keys.tenant_jobs(tenant), job_id)
            sweep_run = bool(await self.redis.hget(self.keys.job(job_id), "sweep_id"))
            await self._admit_job(tenant, job_id, int(seq or 0), sweep_run=sweep_run)
        return False

    async def _repair_active(self, tenant: str) -> bool:
        """Check every job of the tenant's active set (at its limit): True when one was not
        active after all, so the reservation is worth another try."""
        job_ids = sorted(
            m.decode() for m in await self.redis.smembers(self.keys.tenant_active(tenant))
        )
        return len(await self.still_active(tenant, job_ids)) < len(job_ids)

    async def still_active(self, tenant: str, job_ids: list[str]) -> list[str]:
        """Those of the tenant's jobs that are QUEUED or RUNNING; the others leave the active set
        here (the index step of an end or a delete that a dead process left undone)."""
        active = []
        for job_id, found in zip(job_ids, await self._probe(job_ids), strict=True):
            if not await self._repair(tenant, job_id, found):
                active.append(job_id)
        return active

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
        below = decode_page_token(tenant, page_token)
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
            async with self.redis.pipeline(transaction=False) as pipe:
                for member, _ in ids:
                    pipe.hgetall(self.keys.job(member.decode()))
                replies = await pipe.execute()
            for (member, score), raw in zip(ids, replies, strict=True):
                below = int(score)
                record = record_from_hash(member.decode(), raw) if raw else None
                if record is None or (state is not None and record.state != state):
                    continue
                page.append(record)
                if len(page) == page_size:
                    break
            if len(ids) < batch and len(page) < page_size:
                return page, ""
        more = await self.redis.zrevrangebyscore(listing, f"({below}", "-inf", start=0, num=1)
        return page, (encode_page_token(tenant, below) if more else "")

    async def cancel(self, tenant: str, job_id: str) -> JobRecord:
        """Cancel a queued job at once; flag a running one for its worker to stop; a finished
        job is returned unchanged (its indexes are checked)."""
        for _ in range(_CANCEL_RETRIES):
            record = await self.get(tenant, job_id)
            if record.state.is_terminal:
                # Idempotent: repairs the indexes if whoever ended the job died before them.
                await self.index.follow(job_id, tenant, record.state, record.attempt)
                return record
            event = state_event_fields(
                JobState.CANCELLED,
                attempt=record.attempt,
                step=record.step,
                message="cancelled while queued",
            )
            if record.state is JobState.QUEUED:
                # before the end: see lifecycle
                await self.lifecycle.expire_later(job_id, tenant, record.sweep_id)
            outcome = await self.run(
                _CANCEL,
                keys=self.job_and_events(job_id),
                args=[
                    record.attempt,
                    repr(time.time()),
                    JobState.QUEUED.value,
                    JobState.RUNNING.value,
                    JobState.CANCELLED.value,
                    *event_values(event),
                ],
            )
            if outcome in (b"retry", b"finished"):
                continue  # the next round sees the new state
            logger.info("cancel of job %s: %s", job_id, outcome.decode())
            if outcome == b"cancelled":
                await self.index.follow(job_id, tenant, JobState.CANCELLED, record.attempt)
                await self.lifecycle.ended(job_id)
            return await self.get(tenant, job_id)
        # Workers kept claiming and releasing the job between our read and our write.
        raise UnavailableError(f"job {job_id} changed while it was being cancelled; retry")

    async def delete(self, tenant: str, job_id: str, *, force: bool = False) -> None:
        """Delete the job and every key it owns (lifecycle.py); NotFoundError when unknown or
        another tenant's. A QUEUED or RUNNING job needs `force`, else FailedPreconditionError."""
        record = await self.get(tenant, job_id)
        if not record.state.is_terminal:
            if not force:
                raise FailedPreconditionError(
                    f"job {job_id} is {record.state.value}; cancel it and delete it once it "
                    "ended, or pass force=true (`ssdrbm delete --force`) to cancel and delete "
                    "it now",
                    precondition="JOB_ACTIVE",
                    subject=f"job:{job_id}",
                )
            # Before the cancel: a repeat of its request id never answers the job this delete
            # cancelled (lifecycle.py, step 2; the purge's own release is then a no-op).
            await self.lifecycle.release_request_id(tenant, job_id)
            record = await self.cancel(tenant, job_id)
        if not await self.lifecycle.purge(job_id, tenant, allow_active=force):
            # Only without force, for a job that cannot go back from an end: a bug, not a race.
            raise FailedPreconditionError(f"job {job_id} is active again; retry the delete")

    async def untag_sweep(self, job_ids: list[str]) -> None:
        """The jobs leave their sweep as ordinary jobs (a sweep deleted with keep_runs)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hdel(self.keys.job(job_id), "sweep_id")
            await pipe.execute()

    async def count_active(self, tenant: str) -> int:
        return int(await self.redis.scard(self.keys.tenant_active(tenant)))

    async def count_by_state(self) -> dict[JobState, int]:
        """Jobs of all tenants by state (Prometheus)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for state in JobState:
                pipe.scard(self.keys.jobs_in_state(state.value))
            counts = await pipe.execute()
        return {state: int(n) for state, n in zip(JobState, counts, strict=True)}
