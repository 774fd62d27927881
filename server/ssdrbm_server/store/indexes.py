"""The job indexes that live outside a job's own slot, and the order in which they follow it.

The job hash `job:{<id>}` is the only source of truth for a job's state, attempt and lease
deadline; every transition is one script on the job's slot (claim, fenced writes, cancel). On
Redis Cluster the indexes cannot join that script, because they are shared by all jobs:

- `{jobs}:state:<STATE>` sets (counts for Prometheus), `{jobs}:leases` (which running jobs to
  look at for a lapsed lease), the queue (work for the workers: the tenants' lists
  `{jobs}:queue:<t>` and their rotation, queue.py) and `{jobs}:versions` share the `{jobs}`
  tag, so one script (`_SYNC`) updates them together: a job is queued atomically with its
  QUEUED state, and its tenant joins the rotation in the same step;
- `tenant:{<t>}:active` (the per-tenant limit) is in the tenant's slot, with
  `tenant:{<t>}:job_datasets` (which uploaded dataset each active job uses, so that dataset
  cannot be deleted, store/datasets.py): a job leaves both in one step (`leave_active`).

They are updated AFTER the job hash, as separate steps, by whoever made the transition. Two
rules make a process death (or a slow process) between the steps safe:

1. Every index update is idempotent and versioned. A job's states follow a strictly
   increasing version, `3 * attempt + rank` with rank RUNNING 0, QUEUED 1, terminal 2: a claim
   (QUEUED or RUNNING at attempt a -> RUNNING at a + 1), a release (RUNNING at a -> QUEUED at
   a), an end (-> terminal at a) all raise it. `_SYNC` ignores a version older than the one the
   indexes already show, so a delayed step of a process that lost the job (e.g. a stalled
   worker's heartbeat after a takeover) cannot put back an older state, lease or removal. A
   job is added to its tenant's queue only when the version is new, so repeating a step does
   not enqueue the job twice.
2. Whatever a crash leaves behind is repaired by the next process that looks at the job, or
   is harmless:
   - the lease index is written BEFORE a claim makes the hash RUNNING (`reserve_lease`, with a
     deadline no later than the one the claim will set), so every RUNNING job can be found by
     `lapsed()`; a lease entry that outlives its job leads a worker to claim it, which sees the
     job finished (and repeats its index steps) or QUEUED (and runs it, as a release wanted);
   - for a job that ended, the tenant's active set is cleaned first and the lease entry
     removed last: while the entry exists, the claim that finds it repeats both steps;
   - a stale state set only skews the Prometheus counts until the job's next transition;
   - the tenant's active set is also repaired by the submit that finds the tenant at its limit
     (ssdrbm_server/store/jobs.py), so a lost removal never blocks a tenant for good.

A forgotten job (deleted, expired, or its submit died) keeps a tombstone version (`FORGOTTEN`)
for `TOMBSTONE_MS`, noted in `{jobs}:forgotten`; later forgets prune the old tombstones, so the
versions hash does not grow with every job ever deleted.

The lease index may show an earlier deadline than the job hash (a heartbeat's index step not yet
done): `lapsed()` then offers a job whose claim answers "held", which costs one round trip.
Deadlines are on the Redis clock of the job's node; the index is compared with the clock of the
`{jobs}` node, so a clock difference between nodes shifts when a takeover is tried, not whether
the claim is right.
"""

from __future__ import annotations

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.connection import RedisClient, Store
from ssdrbm_server.store.records import JobState

# A missing job's version: above any real one, so no late step can index it again.
FORGOTTEN = 2**52
# How long a forgotten job's version stays: far longer than the gap between a process's fenced
# step and its index step, the only time a late step can arrive (its fenced step needs the hash).
TOMBSTONE_MS = 3_600_000
_TOMBSTONE_PRUNE = 16  # tombstones pruned per forget: keeps up with any rate of forgets

_RANK = {JobState.RUNNING: 0, JobState.QUEUED: 1}
_TERMINAL_RANK = 2

# Milliseconds on this node's clock (a script may call TIME since Redis 5: effects replication).
NOW_MS = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""

# KEYS: versions, leases, one state set per JobState (in enum order), then, to enqueue, the
# queue keys (`_queue_keys`: rotation, served, ready, the tenant's list the job goes into).
# ARGV: job id, version, target (1-based position of the state set, 0 = none), lease deadline
# ('' = no lease), enqueue ('0': no, '1': at the back of the tenant's list, '2': at its front),
# tenant.
# Returns 1 when applied, 0 when the indexes already show a newer version.
# Enqueueing appends the job to its tenant's list; a tenant new to the rotation enters it at its
# last turn (0: never served), so it is served before every tenant served since (queue.py).
_SYNC = """
local stored = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local version = tonumber(ARGV[2])
if version < stored then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local enqueue = ARGV[5] ~= '0'
local last_state = #KEYS
if enqueue then last_state = #KEYS - 4 end
local target = tonumber(ARGV[3])
for i = 3, last_state do
  if i - 2 == target then
    redis.call('SADD', KEYS[i], ARGV[1])
  else
    redis.call('SREM', KEYS[i], ARGV[1])
  end
end
if ARGV[4] == '' then
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
end
if enqueue and version > stored then
  local rotation, served = KEYS[#KEYS - 3], KEYS[#KEYS - 2]
  local ready, list = KEYS[#KEYS - 1], KEYS[#KEYS]
  if ARGV[5] == '2' then
    redis.call('LPUSH', list, ARGV[1])
  else
    redis.call('RPUSH', list, ARGV[1])
  end
  if not redis.call('ZSCORE', rotation, ARGV[6]) then
    redis.call('ZADD', rotation, redis.call('ZSCORE', served, ARGV[6]) or 0, ARGV[6])
  end
  redis.call('LPUSH', ready, '1')
  redis.call('LTRIM', ready, 0, 0)
end
return 1
"""

# KEYS: versions, forgotten. ARGV: job id, how long a tombstone stays (ms), prune limit.
# Notes when the job was forgotten and prunes the oldest tombstones whose time has passed, so
# deleted and expired jobs do not leave a version behind for good.
_TOMBSTONE = (
    NOW_MS
    + """
redis.call('ZADD', KEYS[2], 'NX', now, ARGV[1])
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[2]),
                       'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(old) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
return #old
"""
)


def schedule_script(only: str = "") -> str:
    """A script that sets a member's time in a set of times (deadlines, schedules) on this
    node's clock. KEYS: the set. ARGV: delay ms, member. The member's time becomes now + delay;
    ``only`` "LT" moves an existing time earlier only (a lease deadline), "GT" later only; a
    missing member is always added."""
    flag = f"'{only}', " if only else ""
    return NOW_MS + f"redis.call('ZADD', KEYS[1], {flag}now + tonumber(ARGV[1]), ARGV[2])\n"


_RESERVE_LEASE = schedule_script("LT")

# KEYS: a set of times on this node's clock. ARGV: grace ms, limit. Members whose time passed
# more than the grace ago, each followed by its time.
DUE = (
    NOW_MS
    + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]),
                  'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[2]))
"""
)


# KEYS: tenant active set, tenant job datasets, and the tenant listing when the job leaves it
# too. ARGV: job id. The job's dataset reference goes with its place in the active set.
_LEAVE_ACTIVE = """
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if KEYS[3] then redis.call('ZREM', KEYS[3], ARGV[1]) end
return 1
"""


def index_version(state: JobState, attempt: int) -> int:
    """The version of a job's state: strictly increasing over the job's life (see above)."""
    return 3 * attempt + _RANK.get(state, _TERMINAL_RANK)


class JobIndex(Store):
    """Brings the shared indexes in line with a state the job hash has already taken."""

    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        super().__init__(redis, keys=keys)

    def _global_keys(self) -> list[str]:
        states = [self.keys.jobs_in_state(state.value) for state in JobState]
        return [self.keys.index_versions(), self.keys.leases(), *states]

    def _queue_keys(self, tenant: str, sweep_run: bool) -> list[str]:
        return [
            self.keys.queue_rotation(),
            self.keys.queue_served(),
            self.keys.queue_ready(),
            self.keys.queue_for(tenant, sweep_run=sweep_run),
        ]

    async def _apply(
        self,
        job_id: str,
        version: int,
        target: int,
        lease_deadline: int | None,
        enqueue_for: str | None,
        front: bool = False,
        sweep_run: bool = False,
    ) -> None:
        """One `_SYNC`; `enqueue_for` names the tenant whose queue gets the job (None: none),
        at the back of its list or, `front`, at its front; a sweep's run goes into the
        tenant's list of sweep runs (store/queue.py)."""
        queue_keys = [] if enqueue_for is None else self._queue_keys(enqueue_for, sweep_run)
        await self.run(
            _SYNC,
            keys=[*self._global_keys(), *queue_keys],
            args=[
                job_id,
                version,
                target,
                "" if lease_deadline is None else lease_deadline,
                "0" if enqueue_for is None else "2" if front else "1",
                enqueue_for or "",
            ],
        )

    async def follow(
        self,
        job_id: str,
        tenant: str,
        state: JobState,
        attempt: int,
        *,
        lease_deadline: int | None = None,
        enqueue: bool = False,
        front: bool = False,
        sweep_run: bool = False,
    ) -> None:
        """Index the job as `state` at `attempt`, which its hash shows (or showed) already.

        RUNNING takes the lease deadline the hash holds; `enqueue` adds a queue entry when this
        state is new to the indexes (a submitted or released job), at the front of its tenant's
        list with `front` (a preempted job keeps its place); `sweep_run`: a sweep's run, queued
        behind the tenant's other jobs (store/queue.py). Safe to repeat.
        """
        if state.is_terminal:
            # Before the lease entry goes: while it exists, a claimer comes back here.
            await self.leave_active(tenant, job_id)
        target = list(JobState).index(state) + 1
        lease = lease_deadline if state is JobState.RUNNING else None
        queue_for = tenant if enqueue else None
        version = index_version(state, attempt)
        await self._apply(job_id, version, target, lease, queue_for, front, sweep_run)

    async def leave_active(self, tenant: str, job_id: str, *, unlist: bool = False) -> None:
        """The job no longer counts against its tenant's limit, and no longer holds the
        uploaded dataset it trains on; `unlist` (a delete) takes it off the listing too."""
        keys = [self.keys.tenant_active(tenant), self.keys.tenant_job_datasets(tenant)]
        if unlist:
            keys.append(self.keys.tenant_jobs(tenant))
        await self.run(_LEAVE_ACTIVE, keys=keys, args=[job_id])

    async def forget(self, job_id: str) -> None:
        """Drop a job whose hash is gone (expired unfinished submit, lost data) from the shared
        indexes for good."""
        await self._apply(job_id, FORGOTTEN, 0, None, None)
        await self.run(
            _TOMBSTONE,
            keys=[self.keys.index_versions(), self.keys.forgotten()],
            args=[job_id, TOMBSTONE_MS, _TOMBSTONE_PRUNE],
        )

    async def reserve_lease(self, job_id: str, lease_ms: int) -> None:
        """Make sure the lease index holds the job with a deadline no later than a claim made
        now would set; called before the claim, so no RUNNING job is ever missing from it."""
        await self.run(_RESERVE_LEASE, keys=[self.keys.leases()], args=[lease_ms, job_id])

    async def lapsed(self, limit: int) -> list[str]:
        """Ids whose indexed lease deadline has passed (the claim decides on the hash's)."""
        flat = await self.run(DUE, keys=[self.keys.leases()], args=[0, limit])
        return [job_id.decode() for job_id in flat[::2]]  # without their deadlines
