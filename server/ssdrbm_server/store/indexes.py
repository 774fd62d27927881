"""The job indexes that live outside a job's own slot, and the order in which they follow it.

The job hash `job:{<id>}` is the only truth for a job's state, attempt and lease deadline; every
transition is one script on its slot. On Redis Cluster the shared indexes cannot join it:

- `{jobs}:state:<STATE>` sets (Prometheus counts), `{jobs}:leases` (where to look for lapsed
  leases), the queue (queue.py) and `{jobs}:versions` share the `{jobs}` tag, so one script
  (`_SYNC`) updates them together: a job is queued atomically with its QUEUED state;
- `tenant:{<t>}:active` (the per-tenant limit) and `tenant:{<t>}:job_datasets` (the uploaded
  dataset each active job holds, store/datasets.py) are left in one step (`leave_active`).

They are updated AFTER the job hash, as separate steps, by whoever made the transition. A death
(or a slow process) between the steps is safe by two rules:

1. Every index update is idempotent and versioned: `3 * attempt + rank` (RUNNING 0, QUEUED 1,
   terminal 2) strictly increases with every claim, release and end. `_SYNC` ignores a version
   older than the indexes show, so a late step of a process that lost the job (a stalled
   worker's heartbeat after a takeover) cannot put back an older state, lease or removal; a job
   is enqueued only when its version is new, so a repeated step does not queue it twice.
2. What a crash leaves is repaired by the next process that looks at the job, or is harmless:
   - the lease index is written BEFORE a claim makes the hash RUNNING (`reserve_lease`, a
     deadline no later than the claim's), so `lapsed()` finds every RUNNING job; an entry that
     outlives its job leads a worker to a claim that sees the job finished (and repeats its
     index steps) or QUEUED (and runs it);
   - for a job that ended, the active set is cleaned first and the lease entry removed last:
     while the entry exists, the claim that finds it repeats both;
   - a stale state set only skews the Prometheus counts until the job's next transition;
   - the active set is also repaired by a submit that finds the tenant at its limit (jobs.py).

A forgotten job (deleted, expired, or its submit died) keeps a tombstone version (`FORGOTTEN`)
for `TOMBSTONE_MS`, noted in `{jobs}:forgotten`; later forgets prune the old ones.

The lease index may show an earlier deadline than the hash (a heartbeat's index step not yet
done): the claim then answers "held", one wasted round trip. Deadlines are on the Redis clock
of the job's node, the index compared on the `{jobs}` node's: a clock difference shifts when a
takeover is tried, not whether the claim is right.
"""

from __future__ import annotations

from collections.abc import Sequence

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
# queue keys (rotation, served, ready, the tenant's list the job goes into).
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

    async def _sync(
        self,
        job_id: str,
        version: int,
        target: int = 0,
        lease: int | str = "",
        enqueue: str = "0",
        tenant: str = "",
        queue_keys: Sequence[str] = (),
    ) -> None:
        """One `_SYNC` (its KEYS and ARGV above)."""
        states = [self.keys.jobs_in_state(state.value) for state in JobState]
        keys = [self.keys.index_versions(), self.keys.leases(), *states, *queue_keys]
        await self.run(_SYNC, keys, [job_id, version, target, lease, enqueue, tenant])

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
        running = state is JobState.RUNNING and lease_deadline is not None
        lease = lease_deadline if running else ""
        target = list(JobState).index(state) + 1
        version = index_version(state, attempt)
        if not enqueue:
            await self._sync(job_id, version, target, lease)
            return
        queue_keys = [
            self.keys.queue_rotation(),
            self.keys.queue_served(),
            self.keys.queue_ready(),
            self.keys.queue_for(tenant, sweep_run=sweep_run),
        ]
        await self._sync(job_id, version, target, lease, "2" if front else "1", tenant, queue_keys)

    async def leave_active(self, tenant: str, job_id: str, *, unlist: bool = False) -> None:
        """The job no longer counts against its tenant's limit, and no longer holds the
        uploaded dataset it trains on; `unlist` (a delete) takes it off the listing too."""
        keys = [self.keys.tenant_active(tenant), self.keys.tenant_job_datasets(tenant)]
        if unlist:
            keys.append(self.keys.tenant_jobs(tenant))
        await self.run(_LEAVE_ACTIVE, keys=keys, args=[job_id])

    async def forget(self, job_id: str) -> None:
        """Drop a job whose hash is gone from the shared indexes for good."""
        await self._sync(job_id, FORGOTTEN)
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
