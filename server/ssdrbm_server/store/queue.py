"""The job queue: one list per tenant, served in rotation, so no tenant's backlog delays others.

Keys, all in the `{jobs}` slot (so each step below is one script):
- `{jobs}:queue:<tenant>` and `{jobs}:sweep-queue:<tenant>`: the tenant's queued plain jobs and
  sweep runs, oldest first; a turn takes a sweep run only when the tenant has no plain job, so a
  sweep's many runs never starve the same tenant's plain jobs;
- `{jobs}:tenants`: exactly the tenants with queued jobs, scored by the turn at which each was
  last served; a worker serves the lowest (least recently served);
- `{jobs}:served`: each tenant's last turn, also while its lists are empty, so a tenant that
  queues one job at a time re-enters at its old turn instead of jumping ahead (the newest
  `SERVED_KEPT` are kept; a dropped tenant counts as never served);
- `{jobs}:taken`: `<job id> <worker>` -> when taken (ms), popped but not yet acknowledged;
- `{jobs}:ready`: one token while work waits, so an idle worker blocks (BLPOP), not polls;
- `{jobs}:preempted-for:turns` and `{jobs}:preempted-for:jobs`: preemptions under way, each
  for the waiting work it frees a slot for (a tenant's next turn, or a plain job that goes
  before its tenant's sweep runs) -> until when (ms); a take of that turn or job ends it, and
  each key expires with its last claim.

Jobs are queued by the versioned index step that marks them QUEUED (indexes.py), so a repeated
submit or release queues a job once. A take is one script (the tenant read is still first: pop
its next job, give it the next turn, record the job as taken), then:
1. take ({jobs} slot): the job moves from its tenant's list to `taken`;
2. claim (job slot, store/leases.py): the job hash refuses a job that is not QUEUED (cancelled,
   finished, deleted, or held by a valid lease), so a stale entry is harmless;
3. ack ({jobs} slot): the entry leaves `taken`; the lease tracks the job from now on.
A worker that dies after 1 leaves its entry in `taken`; `autoclaim` hands it to another worker
after a lease length. Delivery is at least once; duplicates are harmless for the same reason.

Fairness: a tenant that queues its first job enters the rotation at its last turn, below every
tenant served since, so each worker serves at most one other tenant's job before it.

Time slices (worker/runner.py): a job or pack holds its worker for SSDRBM_SLICE_SECONDS at most
while `would_serve_other` says other work would be served once its jobs are back. They are then
released to the FRONT of their lists without giving their tenant a new turn, so the job keeps
its place and the waiting tenant is taken next. Work that would only take the preempted job
back is not worth a preemption: its slice starts over. Slots whose slices end together (one
worker's, or several workers') free one slot per waiting turn or job: the answer that
preempts also claims the work it frees a slot for, in the same script, and a later answer
counts only work no claim covers. A claim lasts until its work is taken, at most the
``claim_ms`` the worker gives (worker/runner.py), so a worker that dies mid-preemption holds
back the others' preemptions for a bounded time only.

A queued job's place (`places`, read-only): its position among the jobs queued now by the
rotation's rule (`served_before`), and its start estimated from the slots busy now
(`running_slots`, `slot_frees_in`, `estimate_start`): a forecast, since preempted jobs and
tenants served less recently can still go ahead of it.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.connection import Store, text
from ssdrbm_server.store.events import token_order
from ssdrbm_server.store.indexes import NOW_MS

logger = logging.getLogger(__name__)

SERVED_KEPT = 10_000  # tenants whose last turn is remembered (bounds `{jobs}:served`)
_TAKE_ROUNDS = 8  # another worker served the tenant read first: read the rotation again
_JOB_ID_CHARS = 32  # a taken entry is `<job id> <worker>`; job ids have this fixed length

_TAKEN, _MOVED = b"taken", b"moved"

# Reads of a queued job's place stay bounded: at most this many tenants of the rotation (a
# position past them is a lower bound) and this many running jobs (busy slots past them are
# not seen, so the estimate is the longer).
PLACE_TENANTS_READ = 1000
PLACE_LEASES_READ = 256
_RUNNING_FIELDS = ("tenant", "worker", "sweep_id", "step", "total_steps", "latest_metrics")

# KEYS: `take_keys`. ARGV: tenant, worker, turns kept.
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
redis.call('ZREM', KEYS[7], ARGV[1])
redis.call('ZREM', KEYS[8], job)
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


# KEYS: rotation, served, the claims on turns and on jobs, then each running tenant's list of
# plain jobs. ARGV: claim ms (0: only ask), then the running tenants, each followed by '1' when
# its running jobs here are all sweep runs, else '0'.
# Were those jobs put back at the front of their lists, the rotation would serve first, work no
# preemption under way frees a slot for yet being skipped:
# 1 another tenant's turn; 2 a plain job of the first of their tenants, whose running jobs are
# sweep runs; 0 those jobs again. With a claim ms, an answer 1 or 2 claims that turn or job for
# that long. One call, however many tenants wait: the tenants ahead and plain jobs read are at
# most one more than the claims.
_SERVES_OTHER = (
    NOW_MS
    + """
if redis.call('ZCARD', KEYS[1]) == 0 then return 0 end
local claim_ms = tonumber(ARGV[1])
if claim_ms > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
end
local function claimed(key, member)
  return tonumber(redis.call('ZSCORE', key, member) or '0') > now
end
local function serve(answer, key, member)
  if claim_ms > 0 then
    redis.call('ZADD', key, now + claim_ms, member)
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIREAT', key, last[2])
  end
  return answer
end
local mine, mine_score, mine_at = nil, nil, 0
for i = 2, #ARGV, 2 do
  local tenant = ARGV[i]
  -- a tenant out of the rotation re-enters it at its last turn (0: never served)
  local score = redis.call('ZSCORE', KEYS[1], tenant) or redis.call('ZSCORE', KEYS[2], tenant)
  score = tonumber(score or '0')
  if mine == nil or score < mine_score or (score == mine_score and tenant < mine) then
    mine, mine_score, mine_at = tenant, score, i
  end
end
-- each tenant ahead of theirs has one turn before them
local ahead = redis.call('ZRANGE', KEYS[1], 0, redis.call('ZCARD', KEYS[3]), 'WITHSCORES')
for i = 1, #ahead, 2 do
  local tenant, score = ahead[i], tonumber(ahead[i + 1])
  if score > mine_score or (score == mine_score and tenant >= mine) then break end
  if not claimed(KEYS[3], tenant) then return serve(1, KEYS[3], tenant) end
end
if ARGV[mine_at + 1] == '1' then
  local plain = redis.call('LRANGE', KEYS[4 + mine_at / 2], 0, redis.call('ZCARD', KEYS[4]))
  for _, job in ipairs(plain) do
    if not claimed(KEYS[4], job) then return serve(2, KEYS[4], job) end
  end
end
return 0
"""
)


# KEYS: any key of the {jobs} slot (the script runs there: on a cluster, TIME has no key to
# route by). The Redis clock in ms, which leases are measured on.
_NOW = NOW_MS + "return now\n"


def _pair(entry: bytes | str) -> tuple[str, str]:
    """(entry id, job id) of a taken entry."""
    entry = text(entry)
    return entry, entry[:_JOB_ID_CHARS]


def tenant_lists(keys: Keys, tenant: str) -> list[str]:
    """The tenant's two lists, in the order its turns take them: plain jobs, sweep runs."""
    return [keys.tenant_queue(tenant), keys.tenant_sweep_queue(tenant)]


def take_keys(keys: Keys, tenant: str) -> list[str]:
    """The KEYS of the scripts that take a job of ``tenant``: rotation, served, taken, ready,
    its two lists, then the preemptions' claims on turns and on jobs (a take ends its own)."""
    shared = [keys.queue_rotation(), keys.queue_served(), keys.queue_taken(), keys.queue_ready()]
    claims = [keys.preempted_for_turns(), keys.preempted_for_jobs()]
    return [*shared, *tenant_lists(keys, tenant), *claims]


def served_before(index: int, rank: int, lengths: Sequence[int]) -> int:
    """Jobs the rotation serves before a job ``index``-th (from 0) in its tenant's order, that
    tenant ``rank``-th in the rotation, ``lengths`` each rotation tenant's queued jobs: one
    job per turn, each tenant's turn coming again after every other tenant's (the take above)."""
    ahead = index
    for other, length in enumerate(lengths):
        if other != rank:
            ahead += min(length, index + 1 if other < rank else index)
    return ahead


@dataclass(frozen=True)
class RunningSlot:
    """A worker slot training jobs now (one worker id; a pack's jobs share it)."""

    worker: str
    tenants: dict[str, bool]  # each tenant of its jobs -> all its jobs here are sweep runs
    remaining_s: float | None  # until its jobs end at their pace so far; None: no pace yet


@dataclass(frozen=True)
class QueuePlace:
    """Where a queued job stands (see the module's docstring)."""

    position: int
    starts_in_s: float | None  # None: no estimate, `basis` says why
    basis: str
    busy_slots: int
    slice_s: float
    no_worker: bool = False


def estimate_start(
    position: int, frees_in_s: Sequence[float | None], slice_s: float
) -> tuple[float | None, str]:
    """When the job with ``position`` jobs ahead starts, and how that was estimated, from each
    busy slot's time until it takes the next job (``frees_in_s``, None: not known): each job
    ahead holds the first free slot for one slice at most, and the job starts at the
    (position + 1)-th free slot (S slots yielding at their slices' ends: ceil((position + 1) / S)
    slices at most)."""
    known = [free for free in frees_in_s if free is not None]
    slots = f"{len(frees_in_s)} busy slot{'s' if len(frees_in_s) != 1 else ''}"
    if not known:
        return None, (
            f"{slots}, each running jobs until they end, at a pace not measured yet; no estimate"
        )
    heapq.heapify(known)
    start = 0.0
    for turn in range(position + 1):
        start = heapq.heappop(known)
        if turn < position:
            heapq.heappush(known, start + slice_s)
    return start, (
        f"{slots}, {slice_s:g} s slices: running jobs end at their pace so far or yield at "
        "their slice's end when other work waits; each job ahead counted as one slice (one "
        "that nothing preempts, its tenant's own work alone waiting, can hold its slot longer)"
    )


def slot_frees_in(slot: RunningSlot, yields: bool, slice_s: float) -> float | None:
    """A busy slot's time until it takes the next job: when its jobs end, or at its slice's end
    at the latest when it yields then (how far into its slice it is, is not known: a whole one)."""
    if not yields:
        return slot.remaining_s
    return slice_s if slot.remaining_s is None else min(slot.remaining_s, slice_s)


def _remaining_s(step: int, total_steps: int, metrics: bytes) -> float | None:
    """Seconds a running job has left at its pace so far (its latest metrics' time per step)."""
    if not metrics or total_steps <= 0:
        return None
    latest = rbm_pb2.Metrics.FromString(metrics)
    if latest.step <= 0 or latest.wall_time_s <= 0:
        return None
    return max(total_steps - max(step, latest.step), 0) * latest.wall_time_s / latest.step


def _number(value: bytes | None) -> int:
    return int(value) if value not in (None, b"") else 0


class JobQueue(Store):
    """Taking and acknowledging queued jobs as one worker (`consumer`)."""

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
            tenant = text(first[0])
            status, entry = await self.run(
                _TAKE, keys=take_keys(self.keys, tenant), args=[tenant, consumer, SERVED_KEPT]
            )
            if status == _TAKEN:
                return _pair(entry)
            if status != _MOVED:
                logger.warning("tenant %s was in the queue rotation without jobs", tenant)
        return None  # the rotation kept changing under us: the next round tries again

    async def _now_ms(self) -> int:
        return int(await self.run(_NOW, keys=[self.keys.queue_rotation()]))

    async def would_serve_other(self, running: dict[str, bool], *, claim_ms: int = 0) -> int:
        """What the rotation would serve were the running jobs put back at the front of their
        lists (``running``: each of their tenants, and whether its jobs there are all sweep
        runs), besides work a preemption under way already frees a slot for: 0 those jobs
        again (a preemption gains nothing), 1 another tenant's job, 2 a plain job of theirs
        (it goes before sweep runs). With ``claim_ms`` the caller preempts on an answer other
        than 0: that work is claimed for it until taken, for ``claim_ms`` at most."""
        if not running:
            return 0
        tenants = sorted(running)
        keys = [self.keys.queue_rotation(), self.keys.queue_served()]
        keys += [self.keys.preempted_for_turns(), self.keys.preempted_for_jobs()]
        keys += [self.keys.tenant_queue(tenant) for tenant in tenants]
        args = [claim_ms, *(part for t in tenants for part in (t, "1" if running[t] else "0"))]
        return int(await self.run(_SERVES_OTHER, keys=keys, args=args))

    async def pending(self, consumer: str, *, count: int = 10) -> list[tuple[str, str]]:
        """Entries taken by `consumer` earlier and never acknowledged (after a restart)."""
        suffix = f" {consumer}"
        entries = await self.redis.zrange(self.keys.queue_taken(), 0, -1)
        mine = [_pair(entry) for entry in entries if text(entry)[_JOB_ID_CHARS:] == suffix]
        return mine[:count]

    async def autoclaim(
        self, consumer: str, *, min_idle_ms: int, count: int = 10
    ) -> list[tuple[str, str]]:
        """Take over entries other consumers took and left unacknowledged that long."""
        moved = await self.run(
            _RETAKE,
            keys=[self.keys.queue_taken()],
            args=[consumer, min_idle_ms, count, _JOB_ID_CHARS],
        )
        return [_pair(entry) for entry in moved]

    async def ack(self, entry_id: str) -> None:
        """Drop a taken entry (the job record lives on)."""
        await self.redis.zrem(self.keys.queue_taken(), entry_id)

    async def length(self) -> int:
        """Jobs queued or taken and not yet acknowledged."""
        tenants = await self.rotation()
        queued = [await self.redis.llen(key) for t in tenants for key in tenant_lists(self.keys, t)]
        return sum(queued) + int(await self.redis.zcard(self.keys.queue_taken()))

    async def positions(self, tenant: str, job_ids: Sequence[str]) -> dict[str, int]:
        """Each of the tenant's queued ``job_ids``' position (`served_before`); a job not in its
        tenant's lists (being taken, or not queued) is left out. Bounded reads: the first
        PLACE_TENANTS_READ tenants of the rotation, their lists' lengths, the tenant's lists."""
        tenants = await self.rotation(PLACE_TENANTS_READ)
        if tenant not in tenants and len(tenants) == PLACE_TENANTS_READ:
            return dict.fromkeys(job_ids, PLACE_TENANTS_READ)  # past the tenants read: at least
        if tenant not in tenants or not job_ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in tenants:
                for key in tenant_lists(self.keys, name):
                    pipe.llen(key)
            for key in tenant_lists(self.keys, tenant):
                pipe.lrange(key, 0, -1)
            replies = await pipe.execute()
        lengths = [replies[i] + replies[i + 1] for i in range(0, 2 * len(tenants), 2)]
        order = [text(job) for job in replies[-2] + replies[-1]]  # the tenant's turns take
        index_of = {job: index for index, job in reversed(list(enumerate(order)))}
        rank = tenants.index(tenant)
        return {
            job: served_before(index_of[job], rank, lengths) for job in job_ids if job in index_of
        }

    async def running_slots(self) -> list[RunningSlot]:
        """The slots training jobs now: jobs with a live lease (up to PLACE_LEASES_READ),
        grouped by the worker id that holds them."""
        now_ms = await self._now_ms()
        running = await self.redis.zrangebyscore(
            self.keys.leases(), f"({now_ms}", "+inf", start=0, num=PLACE_LEASES_READ
        )
        if not running:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for job in running:
                pipe.hmget(self.keys.job(text(job)), _RUNNING_FIELDS)
            rows = await pipe.execute()
        slots: dict[str, tuple[dict[str, bool], list[float | None]]] = {}
        for tenant, worker, sweep_id, step, total, metrics in rows:
            if not worker or not tenant:  # deleted meanwhile
                continue
            tenants, remaining = slots.setdefault(text(worker), ({}, []))
            name = text(tenant)
            tenants[name] = tenants.get(name, True) and bool(sweep_id)
            remaining.append(_remaining_s(_number(step), _number(total), metrics or b""))
        return [
            RunningSlot(
                worker=worker,
                tenants=tenants,
                remaining_s=None if None in remaining else max(remaining),  # type: ignore[type-var]
            )
            for worker, (tenants, remaining) in slots.items()
        ]

    async def queued_for(self, job_ids: Sequence[str]) -> dict[str, float]:
        """Seconds each queued job has waited since it was queued (submitted, or put back): its
        stream's newest entry is the state event that queued it, while it stays queued."""
        now_ms = await self._now_ms()
        async with self.redis.pipeline(transaction=False) as pipe:
            for job in job_ids:
                pipe.xrevrange(self.keys.events(job), count=1)
            replies = await pipe.execute()
        waited = {}
        for job, newest in zip(job_ids, replies, strict=True):
            if newest:
                entry_ms, _ = token_order(text(newest[0][0]))
                waited[job] = max(now_ms - entry_ms, 0) / 1000
        return waited

    async def backlog(self) -> dict[str, tuple[int, float]]:
        """Each tenant with queued jobs (the first PLACE_TENANTS_READ of the rotation) -> its
        queued jobs and the longest wait among the heads of its two lists."""
        tenants = await self.rotation(PLACE_TENANTS_READ)
        async with self.redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                for key in tenant_lists(self.keys, tenant):
                    pipe.llen(key)
                    pipe.lindex(key, 0)
            replies = await pipe.execute()
        heads = [text(job) for job in replies[1::2] if job]
        waited = await self.queued_for(heads) if heads else {}
        backlog = {}
        for i, tenant in enumerate(tenants):
            depth_plain, head_plain, depth_sweep, head_sweep = replies[4 * i : 4 * i + 4]
            waits = [waited.get(text(head), 0.0) for head in (head_plain, head_sweep) if head]
            backlog[tenant] = (depth_plain + depth_sweep, max(waits, default=0.0))
        return backlog

    async def places(
        self, tenant: str, job_ids: Sequence[str], *, slice_s: float, idle_after_s: float
    ) -> dict[str, QueuePlace]:
        """The place of each of the tenant's queued ``job_ids`` (module notes). With no slot
        busy, a job that has waited ``idle_after_s`` says no worker is running (an idle one
        takes a job at once); one queued more recently is about to start."""
        if not job_ids:
            return {}
        positions, slots = await asyncio.gather(
            self.positions(tenant, job_ids), self.running_slots()
        )
        # Slots of the same tenants get the same answer; the questions go out together.
        running = {frozenset(slot.tenants.items()): slot.tenants for slot in slots}
        answers = await asyncio.gather(*(self.would_serve_other(t) for t in running.values()))
        yields = {key: bool(answer) for key, answer in zip(running, answers, strict=True)}
        frees = [
            slot_frees_in(slot, yields[frozenset(slot.tenants.items())], slice_s) for slot in slots
        ]
        waited = await self.queued_for(job_ids) if not slots else {}
        places = {}
        for job in job_ids:
            position = positions.get(job, 0)  # not in its list: a worker is taking it now
            if slots:
                starts_in, basis = estimate_start(position, frees, slice_s)
                places[job] = QueuePlace(position, starts_in, basis, len(slots), slice_s)
                continue
            idle = waited.get(job, 0.0) >= idle_after_s
            basis = (
                f"no worker is running: no job has run for the {waited.get(job, 0):.0f} s this "
                "one has waited"
                if idle
                else "no job is running: an idle worker takes it at once"
            )
            starts_in = None if idle else 0.0
            places[job] = QueuePlace(position, starts_in, basis, 0, slice_s, no_worker=idle)
        return places

    async def rotation(self, limit: int = 0) -> list[str]:
        """Tenants with queued jobs, the next to be served first (the first ``limit``; 0: all)."""
        tenants = await self.redis.zrange(self.keys.queue_rotation(), 0, limit - 1)
        return [text(tenant) for tenant in tenants]
