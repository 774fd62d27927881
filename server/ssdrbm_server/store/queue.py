"""The job queue: one list per tenant, served in rotation, so no tenant's backlog delays others.

Keys, all in the `{jobs}` slot (so each step below is one script):
- `{jobs}:queue:<tenant>` lists the tenant's queued job ids, oldest first, and
  `{jobs}:sweep-queue:<tenant>` its queued sweep runs, oldest first (priorities below);
- `{jobs}:tenants` holds exactly the tenants whose lists are not both empty, scored by the turn at
  which each was last served; a worker serves the lowest score (least recently served);
- `{jobs}:served` keeps each tenant's last turn (turns count up: `take` gives the next one), also
  while its list is empty, so a tenant that queues one job at a time re-enters the rotation at
  its old turn instead of jumping ahead of tenants that waited; only the newest `SERVED_KEPT`
  are kept (a dropped tenant counts as never served, which is what it has been for that long);
- `{jobs}:taken` holds `<job id> <worker>` -> when taken (ms): jobs popped but not yet
  acknowledged, the equivalent of a stream's pending entries;
- `{jobs}:ready` holds one token while work waits, so an idle worker blocks on it (BLPOP)
  instead of polling.

Jobs are queued by the job index (indexes.py), in the versioned step that marks them QUEUED: a
submit or release that is repeated queues the job once, and the list and the rotation change
together. Taking is one script: check that the tenant read is still the least recently served,
pop its next job, give the tenant the next turn (it leaves the rotation when its lists are now
empty) and record the job as taken. The order with the claim (job slot) makes a death safe:
1. take ({jobs} slot): the job moves from its tenant's list to `taken`;
2. claim (job slot, store/leases.py): the job hash decides; it refuses a job that is not QUEUED
   (cancelled, finished, deleted, or held by a valid lease), so a stale entry is harmless;
3. ack ({jobs} slot): the entry leaves `taken`; the job is tracked by its lease from now on.
A worker that dies after 1 leaves its entry in `taken`; `autoclaim` hands it to another worker
once it has been there a lease length, and that worker claims and acknowledges it (a claim that
already happened is refused, and the lease covers the job). Delivery is thus at least once, as
with the stream this replaces; duplicates (the same job queued by two versions) are harmless
for the same reason.

Fairness: a tenant that queues its first job enters the rotation at its last turn, below every
tenant served since, so each worker serves at most one other tenant's job before it (with W
workers, one job slot per worker), however many jobs the others have queued.

Priorities within a tenant: a tenant's turn takes its oldest job that is not a sweep's run
(`{jobs}:queue:<tenant>`); only when it has none does the turn take its oldest sweep run
(`{jobs}:sweep-queue:<tenant>`). A sweep queues many runs at once, and those must not starve the
same tenant's plain jobs: a plain job waits for the tenant's plain jobs queued before it, never
for its sweeps. With time slices (below), a plain job queued while the same tenant's sweep runs
hold every worker starts within one slice.

Time slices (worker/runner.py): a job or pack holds its worker for SSDRBM_SLICE_SECONDS at most
while `would_serve_other` says the rotation would serve other work once its jobs are back in
the queue. Then the jobs are checkpointed and released to the FRONT of their lists:
the take already gave their tenant its turn, which the release leaves as it is (a tenant that
left the rotation re-enters at that turn), so the job keeps its place and its tenant's turn is
not spent again; the waiting tenant, served less recently, is taken next. Work that would
only take the preempted job back (its own tenant is next, with nothing of higher priority
queued) is not worth a preemption: the job keeps its worker and its slice starts over.
"""

from __future__ import annotations

import logging

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.connection import RedisClient
from ssdrbm_server.store.indexes import NOW_MS

logger = logging.getLogger(__name__)

SERVED_KEPT = 10_000  # tenants whose last turn is remembered (bounds `{jobs}:served`)
_TAKE_ROUNDS = 8  # another worker served the tenant read first: read the rotation again
_JOB_ID_CHARS = 32  # a taken entry is `<job id> <worker>`; job ids have this fixed length

_TAKEN, _MOVED = b"taken", b"moved"

# KEYS: rotation, served, taken, ready, the tenant's list, its sweep runs' list. ARGV: tenant,
# worker, turns kept.
# Returns {'taken', entry} or {'moved', ''} (the tenant is no longer first: read again) or
# {'empty', ''} (a rotation entry without jobs, removed: cannot happen unless data was lost).
_TAKE = (
    NOW_MS
    + """
local first = redis.call('ZRANGE', KEYS[1], 0, 0)
if first[1] ~= ARGV[1] then return {'moved', ''} end
local job = redis.call('LPOP', KEYS[5])
if not job then job = redis.call('LPOP', KEYS[6]) end
local newest = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local turn = 1
if newest[2] then turn = tonumber(newest[2]) + 1 end
redis.call('ZADD', KEYS[2], turn, ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[3]) - 1)
if redis.call('LLEN', KEYS[5]) + redis.call('LLEN', KEYS[6]) > 0 then
  redis.call('ZADD', KEYS[1], turn, ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
-- One token while work is left (another idle worker wakes up), none once the queues are empty.
if redis.call('ZCARD', KEYS[1]) > 0 then
  redis.call('LPUSH', KEYS[4], '1')
  redis.call('LTRIM', KEYS[4], 0, 0)
else
  redis.call('DEL', KEYS[4])
end
if not job then return {'empty', ''} end
local entry = job .. ' ' .. ARGV[2]
redis.call('ZADD', KEYS[3], now, entry)
return {'taken', entry}
"""
)

# KEYS: taken. ARGV: worker, min idle ms, count, job id length. Entries taken that long ago
# pass to `worker`.
_RETAKE = (
    NOW_MS
    + """
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]),
                       'LIMIT', 0, tonumber(ARGV[3]))
local moved = {}
for _, entry in ipairs(old) do
  redis.call('ZREM', KEYS[1], entry)
  local mine = string.sub(entry, 1, tonumber(ARGV[4])) .. ' ' .. ARGV[1]
  redis.call('ZADD', KEYS[1], now, mine)
  table.insert(moved, mine)
end
return moved
"""
)


# KEYS: rotation, served, then each running tenant's list of plain jobs. ARGV: the running
# tenants, each followed by '1' when its running jobs here are all sweep runs, else '0'.
# Were those jobs put back at the front of their lists, the rotation would serve first:
# 1 another tenant; 2 a plain job of the first of their tenants, whose running jobs are sweep
# runs; 0 those jobs again. Read-only: one call, however many tenants wait.
_SERVES_OTHER = """
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if not first[1] then return 0 end
local mine, mine_score, mine_at = nil, nil, 0
for i = 1, #ARGV, 2 do
  local tenant = ARGV[i]
  -- a tenant out of the rotation re-enters it at its last turn (0: never served)
  local score = redis.call('ZSCORE', KEYS[1], tenant) or redis.call('ZSCORE', KEYS[2], tenant)
  score = tonumber(score or '0')
  if mine == nil or score < mine_score or (score == mine_score and tenant < mine) then
    mine, mine_score, mine_at = tenant, score, i
  end
end
local score = tonumber(first[2])
if score < mine_score or (score == mine_score and first[1] < mine) then return 1 end
if ARGV[mine_at + 1] == '1' and redis.call('LLEN', KEYS[2 + (mine_at + 1) / 2]) > 0 then
  return 2
end
return 0
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _pair(entry: bytes | str) -> tuple[str, str]:
    """(entry id, job id) of a taken entry."""
    entry = _text(entry)
    return entry, entry[:_JOB_ID_CHARS]


class JobQueue:
    """Taking and acknowledging queued jobs as one worker (`consumer`)."""

    def __init__(self, redis: RedisClient, *, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._take = redis.register_script(_TAKE)
        self._retake = redis.register_script(_RETAKE)
        self._serves_other = redis.register_script(_SERVES_OTHER)

    async def read(self, consumer: str, *, block_ms: int, count: int = 1) -> list[tuple[str, str]]:
        """Up to `count` jobs, each from the least recently served tenant with work, waiting up to
        block_ms for one; [] on timeout."""
        taken = await self._take_some(consumer, count)
        if taken or block_ms <= 0:
            return taken
        # A token is left by every enqueue and by a take that left work behind, so a job queued
        # after the take above wakes this wait at once.
        await self.redis.blpop([self.keys.queue_ready()], timeout=block_ms / 1000)
        return await self._take_some(consumer, count)

    async def _take_some(self, consumer: str, count: int) -> list[tuple[str, str]]:
        taken = []
        for _ in range(count):
            entry = await self._take_one(consumer)
            if entry is None:
                break
            taken.append(entry)
        return taken

    async def _take_one(self, consumer: str) -> tuple[str, str] | None:
        for _ in range(_TAKE_ROUNDS):
            first = await self.redis.zrange(self.keys.queue_rotation(), 0, 0)
            if not first:
                return None
            tenant = _text(first[0])
            status, entry = await self._take(
                keys=[
                    self.keys.queue_rotation(),
                    self.keys.queue_served(),
                    self.keys.queue_taken(),
                    self.keys.queue_ready(),
                    self.keys.tenant_queue(tenant),
                    self.keys.tenant_sweep_queue(tenant),
                ],
                args=[tenant, consumer, SERVED_KEPT],
            )
            if status == _TAKEN:
                return _pair(entry)
            if status != _MOVED:
                logger.warning("tenant %s was in the queue rotation without jobs", tenant)
        return None  # the rotation kept changing under us: the next round tries again

    async def would_serve_other(self, running: dict[str, bool]) -> int:
        """What the rotation would serve were the running jobs put back at the front of their
        lists (``running``: each of their tenants, and whether its jobs there are all sweep
        runs): 0 those jobs again (a preemption gains nothing), 1 another tenant's job, 2 a
        plain job of theirs (it goes before sweep runs)."""
        if not running:
            return 0
        tenants = sorted(running)
        keys = [self.keys.queue_rotation(), self.keys.queue_served()]
        keys += [self.keys.tenant_queue(tenant) for tenant in tenants]
        args = [part for t in tenants for part in (t, "1" if running[t] else "0")]
        return int(await self._serves_other(keys=keys, args=args))

    async def pending(self, consumer: str, *, count: int = 10) -> list[tuple[str, str]]:
        """Entries taken by `consumer` earlier and never acknowledged (after a restart)."""
        suffix = f" {consumer}"
        entries = await self.redis.zrange(self.keys.queue_taken(), 0, -1)
        mine = [_pair(entry) for entry in entries if _text(entry)[_JOB_ID_CHARS:] == suffix]
        return mine[:count]

    async def autoclaim(
        self, consumer: str, *, min_idle_ms: int, count: int = 10
    ) -> list[tuple[str, str]]:
        """Take over entries other consumers took and left unacknowledged that long."""
        moved = await self._retake(
            keys=[self.keys.queue_taken()], args=[consumer, min_idle_ms, count, _JOB_ID_CHARS]
        )
        return [_pair(entry) for entry in moved]

    async def ack(self, entry_id: str) -> None:
        """Drop a taken entry (the job record lives on)."""
        await self.redis.zrem(self.keys.queue_taken(), entry_id)

    async def length(self) -> int:
        """Jobs queued or taken and not yet acknowledged."""
        tenants = [_text(t) for t in await self.redis.zrange(self.keys.queue_rotation(), 0, -1)]
        lists = [self.keys.tenant_queue(t) for t in tenants]
        lists += [self.keys.tenant_sweep_queue(t) for t in tenants]
        queued = [await self.redis.llen(key) for key in lists]
        return sum(queued) + int(await self.redis.zcard(self.keys.queue_taken()))

    async def rotation(self) -> list[str]:
        """Tenants with queued jobs, the next to be served first."""
        tenants = await self.redis.zrange(self.keys.queue_rotation(), 0, -1)
        return [_text(tenant) for tenant in tenants]
