"""The end of a job's life: what a finished job keeps, when it expires, and deleting it.

A job's keys are in three kinds of Cluster slot (its own `{<id>}`, its tenant's `{<t>}`, the
shared `{jobs}`), so removing it takes single-slot steps, each idempotent, in an order that a
death between any two leaves nothing behind for good:

1. schedule (`{jobs}`): `{jobs}:purge` gets `<id> <tenant>`, due now for a delete, or
   `finished_job_ttl_seconds` after the end for an expiring job. While it exists, the sweeper
   (`sweep`, in every API process) repeats steps 2-6 once it is `SWEEP_GRACE_MS` overdue.
2. the request id (`{<t>}`): its idempotency key, when it still names this job
   (`release_request_id`); a repeat from here on creates a new job. It goes before any key of
   the job, so a repeat that reads the job and then finds the key still naming it answers a job
   that existed then (jobs.py); a forced delete releases it even before it cancels the job.
3. the job's own keys (`{<id>}`, one script): hash, metric stream, checkpoint index and every
   checkpoint, the script checking the index lists exactly the checkpoints given (else they
   are read again). From here on the job is NOT_FOUND; a worker still running it (a forced
   delete) has its next fenced write refused and stops.
4. the tenant's keys (`{<t>}`): active set, dataset reference, listing.
5. the shared indexes (`{jobs}`): indexes.py `forget`, whose tombstone stops a late step.
6. the schedule entry, last.

Steps 2 and 3 act only on an ended job of the tenant (or, forced, an active one): the state is
read before step 2 (an end is never undone) and checked again in step 3's script. The sweeper
never removes a QUEUED or RUNNING job: its entry came from a retention schedule before an end
that did not happen, or from a forced delete that died before step 3 (never acknowledged), so
the entry is dropped and the job lives on.

Retention (`expire_later` before the end is written, `ended` after): only the newest
`finished_checkpoints_kept` checkpoints stay (a worker's end drops the others in its own
step, store/fencing.py), and with a TTL every key of the job gets a Redis expiry, so its data
goes even if no sweeper runs. A death between the end and `ended` leaves no expiry (more
memory, nothing wrong): the sweeper still deletes the job at its time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ssdrbm_server.errors import UnavailableError
from ssdrbm_server.keys import Keys, is_job_id
from ssdrbm_server.outage import REDIS_OUTAGE
from ssdrbm_server.store.connection import RedisClient, Store
from ssdrbm_server.store.indexes import DUE, NOW_MS, JobIndex, schedule_script
from ssdrbm_server.store.records import ACTIVE_STATES, JobState

logger = logging.getLogger(__name__)

# How overdue a schedule entry must be before the sweeper takes it: far longer than the steps of
# a delete in progress take, so the sweeper never races one.
SWEEP_GRACE_MS = 60_000
SWEEP_INTERVAL_S = 5.0
SWEEP_BATCH = 100
_PURGE_RETRIES = 5
# The job hash field holding its StartTraining request_id, which names its idempotency key.
REQUEST_ID_FIELD = "request_id"

# On the `{jobs}` node's clock, as the sweep. A sweep's expiry moves later only, so it stands at
# the latest time ever asked: its last run's end plus the TTL.
_SCHEDULE, _SCHEDULE_LATER = schedule_script(), schedule_script("GT")

# KEYS: a schedule. ARGV: member, its time as read, delay ms (0: remove the entry). Acts only
# while the entry still has the time read, so a later schedule made meanwhile stands.
_SETTLE = (
    NOW_MS
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
if tonumber(ARGV[3]) > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"""
)

# Shared by the job-slot scripts: KEYS[3] is the checkpoint index, KEYS[4..] its checkpoints;
# ARGV[CKPT_ARG..] their steps in the same order. 'retry' when the index lists others.
_SAME_CHECKPOINTS = """
local given = {}
for i = CKPT_ARG, #ARGV do given[ARGV[i]] = true end
local listed = redis.call('ZRANGE', KEYS[3], 0, -1)
if #listed ~= #KEYS - 3 then return 'retry' end
for _, step in ipairs(listed) do
  if not given[step] then return 'retry' end
end
"""

# KEYS: job, events, checkpoint index, its checkpoints. ARGV: tenant, allow active ('1'/'0'),
# QUEUED, RUNNING, then the checkpoints' steps.
# Returns 'deleted', 'missing' (leftovers removed), 'active', 'other' (another tenant's) or
# 'retry'.
_DELETE = (
    "local CKPT_ARG = 5\n"
    + _SAME_CHECKPOINTS
    + """
local job = redis.call('HMGET', KEYS[1], 'tenant', 'state')
if job[1] and job[1] ~= ARGV[1] then return 'other' end
if job[1] and ARGV[2] ~= '1' and (job[2] == ARGV[3] or job[2] == ARGV[4]) then return 'active' end
redis.call('DEL', unpack(KEYS))
if job[1] then return 'deleted' end
return 'missing'
"""
)

# KEYS: job, events, checkpoint index, its checkpoints oldest first. ARGV: checkpoints kept,
# TTL seconds (0 = none), QUEUED, RUNNING, then the checkpoints' steps in the same order.
_RETAIN = (
    "local CKPT_ARG = 5\n"
    + _SAME_CHECKPOINTS
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state == ARGV[3] or state == ARGV[4] then return 'active' end
local drop = math.max(0, #KEYS - 3 - tonumber(ARGV[1]))
for i = 1, drop do
  redis.call('DEL', KEYS[3 + i])
  redis.call('ZREM', KEYS[3], ARGV[CKPT_ARG + i - 1])
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ttl) end
  for i = 4 + drop, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
end
return 'kept'
"""
)

# KEYS: an idempotency key. ARGV: job id. Deleted only while it names that job: a key a repeat
# already moved to a new job stays.
_RELEASE_REQUEST_ID = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class _RetentionSettings(Protocol):
    finished_checkpoints_kept: int
    finished_job_ttl_seconds: float


@dataclass(frozen=True)
class Retention:
    """What a job keeps once it ended."""

    checkpoints_kept: int = 1  # the newest checkpoints kept (at least 1: serving needs it)
    job_ttl_s: int = 0  # seconds from its end until the job is deleted; 0 keeps it

    @classmethod
    def from_settings(cls, settings: _RetentionSettings) -> Retention:
        return cls(
            checkpoints_kept=max(1, settings.finished_checkpoints_kept),
            job_ttl_s=int(settings.finished_job_ttl_seconds),
        )


def schedule_member(item_id: str, tenant: str) -> str:
    """A schedule entry: a job's or sweep's id and its tenant."""
    return f"{item_id} {tenant}"  # ids have no space, so the first one splits them


def split_member(member: bytes | str) -> tuple[str, str]:
    """(id, tenant) of a schedule entry."""
    text = member.decode() if isinstance(member, bytes) else member
    item_id, _, tenant = text.partition(" ")
    return item_id, tenant


class JobLifecycle(Store):
    """Retention when a job ends; deleting a job (now or when it expires); the sweeper."""

    def __init__(self, redis: RedisClient, keys: Keys, retention: Retention | None = None) -> None:
        super().__init__(redis, keys=keys)
        self.retention = retention or Retention()
        self.index = JobIndex(redis, keys)

    async def expire_later(self, job_id: str, tenant: str, sweep_id: str = "") -> None:
        """Before a job's end is written: schedule its deletion `job_ttl_s` from now (when
        the retention has one), so a death right after the end cannot leave it for good; a
        sweep's run also moves its sweep's expiry to at least as late (sweeps/expiry.py)."""
        if self.retention.job_ttl_s <= 0:
            return
        delay_ms = self.retention.job_ttl_s * 1000
        await self.schedule(job_id, tenant, delay_ms=delay_ms)
        if sweep_id:
            await self.run(
                _SCHEDULE_LATER,
                keys=[self.keys.sweep_purge_schedule()],
                args=[delay_ms, schedule_member(sweep_id, tenant)],
            )

    async def ended(self, job_id: str) -> None:
        """After a job's end is written: trim its checkpoints and set its keys' expiry."""
        kept, ttl_s = self.retention.checkpoints_kept, self.retention.job_ttl_s
        if await self._on_job_slot(job_id, _RETAIN, kept, ttl_s) is None:
            logger.warning("job %s: checkpoints kept changing; retention skipped", job_id)

    async def schedule(self, job_id: str, tenant: str, *, delay_ms: int) -> None:
        """Step 1: the job is to be deleted `delay_ms` from now (by the sweeper, if nobody
        deletes it sooner)."""
        await self.run(
            _SCHEDULE,
            keys=[self.keys.purge_schedule()],
            args=[delay_ms, schedule_member(job_id, tenant)],
        )

    async def purge(self, job_id: str, tenant: str, *, allow_active: bool = False) -> bool:
        """Delete every key of the job, in the order of the module notes; False when it was
        QUEUED or RUNNING and `allow_active` is off (the job is left as it was)."""
        await self.schedule(job_id, tenant, delay_ms=0)
        owner, state, request_id = await self.redis.hmget(
            self.keys.job(job_id), ["tenant", "state", REQUEST_ID_FIELD]
        )
        active = state is not None and JobState(state.decode()) in ACTIVE_STATES
        if owner is not None and (owner.decode() != tenant or (active and not allow_active)):
            await self._unschedule(job_id, tenant)
            return False
        await self.release_request_id(tenant, job_id, (request_id or b"").decode())
        outcome = await self._delete_job_keys(job_id, tenant, allow_active)
        if outcome in ("active", "other"):
            await self._unschedule(job_id, tenant)  # not after the check above: a bug
            return False
        await self.index.leave_active(tenant, job_id, unlist=True)  # step 4
        await self.index.forget(job_id)
        await self._unschedule(job_id, tenant)
        logger.info("job %s of tenant %s deleted (%s)", job_id, tenant, outcome)
        return True

    async def release_request_id(
        self, tenant: str, job_id: str, request_id: str | None = None
    ) -> None:
        """Step 2: the request id (read from the job when not given) no longer names the job,
        so a repeat creates a new one."""
        if request_id is None:
            raw = await self.redis.hget(self.keys.job(job_id), REQUEST_ID_FIELD)
            request_id = raw.decode() if raw else ""
        if request_id:
            idempotency = self.keys.idempotency(tenant, request_id)
            await self.run(_RELEASE_REQUEST_ID, keys=[idempotency], args=[job_id])

    async def _delete_job_keys(self, job_id: str, tenant: str, allow_active: bool) -> str:
        """Step 3, read again while a worker writes a checkpoint in between."""
        outcome = await self._on_job_slot(job_id, _DELETE, tenant, int(allow_active))
        if outcome is None:
            raise UnavailableError(f"job {job_id} kept writing checkpoints while deleted; retry")
        return outcome.decode()

    async def _on_job_slot(self, job_id: str, script: str, *args: str | int) -> bytes | None:
        """One of the job-slot scripts (`_SAME_CHECKPOINTS`) on the job's own keys, its
        checkpoints as read now (oldest first) included, with ``args``, QUEUED, RUNNING and
        their steps; read again while a worker writes a checkpoint in between. Its outcome, or
        None when the checkpoints kept changing."""
        index = self.keys.checkpoint_index(job_id)
        for _ in range(_PURGE_RETRIES):
            steps = sorted(int(member) for member in await self.redis.zrange(index, 0, -1))
            keys = [self.keys.job(job_id), self.keys.events(job_id), index]
            keys += [self.keys.checkpoint(job_id, step) for step in steps]
            states = (JobState.QUEUED.value, JobState.RUNNING.value)
            outcome = await self.run(script, keys, [*args, *states, *steps])
            if outcome != b"retry":
                return outcome
        return None

    async def _unschedule(self, job_id: str, tenant: str) -> None:
        await self.redis.zrem(self.keys.purge_schedule(), schedule_member(job_id, tenant))

    async def due(self, schedule: str, *, grace_ms: int, limit: int) -> list[tuple[bytes, int]]:
        """Entries of ``schedule`` more than ``grace_ms`` overdue, with their times (ms)."""
        flat = await self.run(DUE, keys=[schedule], args=[grace_ms, limit])
        return [(flat[i], int(float(flat[i + 1]))) for i in range(0, len(flat), 2)]

    async def settle(self, schedule: str, member: bytes, due_ms: int, *, later_ms: int = 0) -> bool:
        """Remove an entry read as due at ``due_ms`` (or move it ``later_ms`` from now), unless
        it was scheduled again meanwhile; True when it acted."""
        return await self.run(_SETTLE, keys=[schedule], args=[member, due_ms, later_ms]) == 1

    async def sweep(self, *, limit: int = SWEEP_BATCH, grace_ms: int = SWEEP_GRACE_MS) -> int:
        """Delete the jobs whose schedule entry is `grace_ms` overdue (expired jobs, and deletes
        a dead process left half done); returns how many entries it settled."""
        entries = await self.due(self.keys.purge_schedule(), grace_ms=grace_ms, limit=limit)
        for member, _ in entries:
            job_id, tenant = split_member(member)
            if not is_job_id(job_id):
                await self.redis.zrem(self.keys.purge_schedule(), member)
                continue
            await self.purge(job_id, tenant)
        return len(entries)


async def repeat_forever(
    step: Callable[[], Awaitable[int]], what: str, stopped: asyncio.Event | None = None
) -> None:
    """Run ``step`` every `SWEEP_INTERVAL_S`, at once again while it settles a full batch (a
    background task of each API process: the job sweeper, the sweep expiry)."""
    while stopped is None or not stopped.is_set():
        try:
            while await step() == SWEEP_BATCH:
                pass  # more are due: go on without waiting
            REDIS_OUTAGE.ended()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            REDIS_OUTAGE.noticed(exc, by=what)  # skipped this time
        except Exception:
            logger.exception("%s failed; trying again later", what)
        await asyncio.sleep(SWEEP_INTERVAL_S)
