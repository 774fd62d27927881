"""The sweep record in Redis: one hash per sweep, its runs' job ids, the tenant's listing.

Every key is in the tenant's slot (keys.py), so a sweep is found only under its own tenant and
each step below is one script. A sweep is created before its jobs: the hash and its listing
position, then each job (request id ``sweep-<sweep id>-<point>``, so a repeat finds it) appended
at its point's index; a repeat of a StartSweep that died half-way (same request_id) resolves the
points again, identically, and creates the missing jobs. Its state is read from its runs
(service.py). A delete removes the runs' jobs first, then every key of the sweep in one script,
so a repeat finishes a delete that died half-way.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ssdrbm_server.errors import InvalidArgumentError, NotFoundError
from ssdrbm_server.keys import Keys, is_job_id, new_id
from ssdrbm_server.store.connection import RedisClient, Store, pairs
from ssdrbm_server.store.page_tokens import decode_page_token, encode_page_token

# KEYS: sweep hash, tenant listing, tenant sequence. ARGV: sweep id, then field/value pairs.
# Returns the sweep's listing position (its existing one when it exists already).
_CREATE = """
local seq = redis.call('HGET', KEYS[1], 'seq')
if seq then return tonumber(seq) end
seq = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], 'seq', seq, unpack(ARGV, 2))
redis.call('ZADD', KEYS[2], seq, ARGV[1])
return seq
"""

# KEYS: the sweep's runs, the sweep hash. ARGV: point index, job id. Appends once per index;
# -1 when the sweep is gone (deleted while being created: the caller removes the job).
_ADD_RUN = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('LLEN', KEYS[1]) == tonumber(ARGV[1]) then redis.call('RPUSH', KEYS[1], ARGV[2]) end
return redis.call('LLEN', KEYS[1])
"""

# KEYS: sweep hash, tenant listing, the request_id's idempotency key, the runs, then the
# sweep's other keys (decisions, rungs). ARGV: sweep id. Returns {1 when the sweep existed, else
# 0; the runs' job ids as they were}: runs a StartSweep appended after the caller read them.
_DELETE = """
local existed = redis.call('EXISTS', KEYS[1])
local runs = redis.call('LRANGE', KEYS[4], 0, -1)
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
redis.call('DEL', KEYS[1], unpack(KEYS, 4))
return {existed, runs}
"""


@dataclass
class SweepRecord:
    """One sweep as stored; ``points`` are the runs' axis values as text, in point order."""

    id: str
    tenant: str
    name: str
    request: bytes  # serialized ssdrbm.v1.StartSweepRequest, as resolved
    points: list[dict[str, str]]
    run_count: int
    job_ids: list[str]
    created_at: float
    seq: int
    rank_metric: str
    cancel_requested: bool
    error: str


def _not_found(sweep_id: str) -> NotFoundError:
    return NotFoundError.for_id("sweep", sweep_id, "check the id (ListSweeps shows your sweeps)")


class SweepStore(Store):
    """Sweep records of each tenant."""

    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        super().__init__(redis, keys=keys)

    async def reserve_id(self, tenant: str, request_id: str, ttl_s: int) -> tuple[str, bool]:
        """(sweep id, new): a fresh id, or the one an earlier StartSweep with this request_id
        got (kept ``ttl_s`` seconds when > 0)."""
        sweep_id = new_id()
        if not request_id:
            return sweep_id, True
        key = self.keys.sweep_idempotency(tenant, request_id)
        if await self.redis.set(key, sweep_id, nx=True, ex=ttl_s or None):
            return sweep_id, True
        existing = await self.redis.get(key)
        if existing is None:  # expired between the two commands
            return await self.reserve_id(tenant, request_id, ttl_s)
        return existing.decode(), False

    async def create(
        self,
        tenant: str,
        sweep_id: str,
        *,
        name: str,
        request: bytes,
        points: list[dict[str, str]],
        rungs: list[int],
        eta: int,
        rank_metric: str,
    ) -> None:
        """Write the sweep's record and listing position (once; a repeat changes nothing)."""
        fields: dict[str, bytes | str | int] = {
            "tenant": tenant,
            "name": name,
            "request": request,
            "points": json.dumps(points),
            "run_count": len(points),
            "created_at": repr(time.time()),
            "rank_metric": rank_metric,
            # read by the worker's RungGate (store/rungs.py)
            "rungs": ",".join(str(step) for step in rungs),
            "eta": eta,
            "cancel_requested": 0,
            "error": "",
        }
        await self.run(
            _CREATE,
            keys=[
                self.keys.sweep(tenant, sweep_id),
                self.keys.tenant_sweeps(tenant),
                self.keys.tenant_sweep_sequence(tenant),
            ],
            args=[sweep_id, *pairs(fields)],
        )

    async def add_run(self, tenant: str, sweep_id: str, index: int, job_id: str) -> bool:
        """Record the job of point ``index`` (appended once, in point order); False when the
        sweep is gone (a DeleteSweep while it was being created)."""
        keys = [self.keys.sweep_runs(tenant, sweep_id), self.keys.sweep(tenant, sweep_id)]
        return await self.run(_ADD_RUN, keys=keys, args=[index, job_id]) != -1

    async def mark(self, tenant: str, sweep_id: str, *, cancel: bool, error: str = "") -> None:
        """Flag the sweep cancelled (and why, when it could not be created whole)."""
        fields: dict[str, str | int] = {"cancel_requested": int(cancel)}
        if error:
            fields["error"] = error
        await self.redis.hset(self.keys.sweep(tenant, sweep_id), mapping=fields)

    async def delete(self, tenant: str, sweep_id: str, request_id: str) -> list[str]:
        """Remove the sweep's record, runs list, rung and decision keys, listing position and
        (when it still names this sweep) its request_id's key, in one step; NotFoundError when
        it was already gone (a concurrent delete). Returns the runs' job ids as the step found
        them; the jobs are the caller's (after this step no run can be added: ``add_run``)."""
        sweep_key = self.keys.sweep(tenant, sweep_id)
        rungs = (await self.redis.hget(sweep_key, "rungs") or b"").decode()
        keys = [
            sweep_key,
            self.keys.tenant_sweeps(tenant),
            self.keys.sweep_idempotency(tenant, request_id),
            self.keys.sweep_runs(tenant, sweep_id),
            self.keys.sweep_decisions(tenant, sweep_id),
            *(self.keys.sweep_rung(tenant, sweep_id, int(s)) for s in rungs.split(",") if s),
        ]
        existed, runs = await self.run(_DELETE, keys=keys, args=[sweep_id])
        if not existed:
            raise _not_found(sweep_id)
        return [job_id.decode() for job_id in runs]

    async def get(self, tenant: str, sweep_id: str) -> SweepRecord:
        """The sweep; NotFoundError when unknown or another tenant's."""
        if not is_job_id(sweep_id):
            raise _not_found(sweep_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.sweep(tenant, sweep_id))
            pipe.lrange(self.keys.sweep_runs(tenant, sweep_id), 0, -1)
            raw, runs = await pipe.execute()
        if not raw or raw.get(b"tenant", b"").decode() != tenant:
            raise _not_found(sweep_id)
        return SweepRecord(
            id=sweep_id,
            tenant=tenant,
            name=raw.get(b"name", b"").decode(),
            request=raw.get(b"request", b""),
            points=json.loads(raw.get(b"points", b"[]")),
            run_count=int(raw.get(b"run_count", 0)),
            job_ids=[job_id.decode() for job_id in runs],
            created_at=float(raw.get(b"created_at", 0)),
            seq=int(raw.get(b"seq", 0)),
            rank_metric=raw.get(b"rank_metric", b"").decode(),
            cancel_requested=raw.get(b"cancel_requested") == b"1",
            error=raw.get(b"error", b"").decode(),
        )

    async def list(
        self, tenant: str, *, page_size: int, page_token: str
    ) -> tuple[list[SweepRecord], str]:
        """One page of the tenant's sweeps, newest first, and the next page's token ("" at the
        end); the tokens are ListJobs' (store/page_tokens.py), over the sweeps' positions."""
        if page_size < 1:
            raise InvalidArgumentError("page_size", "must be at least 1")
        below = decode_page_token(tenant, page_token)
        upper = "+inf" if below is None else f"({below}"
        listing = self.keys.tenant_sweeps(tenant)
        ids = await self.redis.zrevrangebyscore(
            listing, upper, "-inf", start=0, num=page_size + 1, withscores=True
        )
        page = []
        for member, _score in ids[:page_size]:
            try:
                page.append(await self.get(tenant, member.decode()))
            except NotFoundError:
                continue  # listed but gone
        more = len(ids) > page_size
        return page, encode_page_token(tenant, int(ids[page_size - 1][1])) if more else ""
