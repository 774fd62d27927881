"""Taking queued jobs that fit a pack: named jobs out of their tenants' lists, not the oldest.

A worker that took a job the ordinary way (store/queue.py) may add queued jobs with the same
pack key to it. Those riders are taken by id, in the order the caller gives, with the same
bookkeeping as a take (out of the tenant's list, which leaves the rotation once empty, into
`{jobs}:taken`), so the claim, acknowledgement and a death in between are handled as for any
taken job. A rider does not spend its tenant's turn: it trains in capacity its worker had anyway,
so the rotation (no tenant waits behind another's backlog) is unchanged by packing.

Pack keys are read from the job records (`pack_key`, set at submit), over the first
SCAN_PER_TENANT entries of a tenant's lists: a bounded number of round trips per claim.
"""

from __future__ import annotations

from ssdrbm_server.store.connection import Store, text
from ssdrbm_server.store.indexes import NOW_MS
from ssdrbm_server.store.queue import take_keys, tenant_lists

SCAN_PER_TENANT = 256  # queued jobs of one tenant looked at for riders (from the oldest)
SCAN_TENANTS = 64  # tenants looked at for riders, in rotation order

# KEYS: as queue.py's take (`take_keys`; served is not touched). ARGV: tenant, job id, worker.
# Returns the taken entry, or '' when the job is in neither list (someone took it).
_TAKE_JOB = (
    NOW_MS
    + """
if redis.call('LREM', KEYS[5], 1, ARGV[2]) + redis.call('LREM', KEYS[6], 1, ARGV[2]) == 0 then
  return ''
end
if redis.call('LLEN', KEYS[5]) + redis.call('LLEN', KEYS[6]) == 0 then
  redis.call('ZREM', KEYS[1], ARGV[1])
end
if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[4]) end
redis.call('ZREM', KEYS[8], ARGV[2])  -- a preemption's claim on it ends (its turn's does not)
local entry = ARGV[2] .. ' ' .. ARGV[3]
redis.call('ZADD', KEYS[3], now, entry)
return entry
"""
)


class PackClaims(Store):
    """Finds and takes queued jobs with a given pack key."""

    async def tenants_in_order(self, first: str) -> list[str]:
        """``first``, then the tenants with queued jobs in rotation order (next served first)."""
        rotation = await self.redis.zrange(self.keys.queue_rotation(), 0, SCAN_TENANTS - 1)
        others = [text(t) for t in rotation if text(t) != first]
        return [first, *others]

    async def matching(self, tenant: str, pack_key: str, limit: int) -> list[str]:
        """Up to ``limit`` of the tenant's queued job ids with ``pack_key``, in the order its
        turns take them (its plain jobs, then its sweep runs; oldest first in each)."""
        if limit <= 0 or not pack_key:
            return []
        job_ids: list[str] = []
        for key in tenant_lists(self.keys, tenant):
            room = SCAN_PER_TENANT - len(job_ids)
            if room > 0:
                job_ids += [text(j) for j in await self.redis.lrange(key, 0, room - 1)]
        if not job_ids:
            return []
        # One key per call (job hashes live in their own slots): a pipeline, not a script.
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(self.keys.job(job_id), "pack_key")
            keys = await pipe.execute()
        found = [j for j, k in zip(job_ids, keys, strict=True) if k and text(k) == pack_key]
        return found[:limit]

    async def take(self, tenant: str, job_id: str, consumer: str) -> str | None:
        """Take one queued job by id; its taken entry, or None when it is no longer queued."""
        entry = await self.run(
            _TAKE_JOB, keys=take_keys(self.keys, tenant), args=[tenant, job_id, consumer]
        )
        return text(entry) or None
