"""Fenced writes: everything a worker writes about a job, refused once its attempt is stale.

Each write is one Lua script on the job's own slot that first checks the job is still RUNNING
under the writer's attempt: a worker that lost its lease (paused, partitioned, presumed dead)
and was replaced under a higher attempt gets `LeaseLostError`, and can never overwrite the newer
attempt's metrics, checkpoints or final state.

A metric event is refused unless its step exceeds the job's last published one, so a run
resumed from a checkpoint publishes only the steps the dead attempt had not; a backoff (the
worker rolled back itself) lowers that step, so the retrained steps are published again.

A heartbeat, an end and a release then bring the shared indexes in line as separate steps
(indexes.py explains why a death between them is safe); the fence never depends on them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.checkpoints import DEFAULT_KEEP, checkpoint_fields
from ssdrbm_server.store.connection import RedisClient, Store, pairs
from ssdrbm_server.store.events import (
    backoff_event_fields,
    event_values,
    metrics_event_fields,
    state_event_fields,
    xadd_event,
)
from ssdrbm_server.store.indexes import NOW_MS, JobIndex
from ssdrbm_server.store.leases import Lease
from ssdrbm_server.store.lifecycle import JobLifecycle, Retention
from ssdrbm_server.store.records import JobState

logger = logging.getLogger(__name__)

# Shared first lines of every fenced script: KEYS[1] is the job, ARGV[1] the writer's attempt,
# ARGV[2] the RUNNING state's name; a script's own arguments start at ARGV[3].
_FENCE = """
local fence = redis.call('HMGET', KEYS[1], 'attempt', 'state')
if fence[1] ~= ARGV[1] or fence[2] ~= ARGV[2] then
  return redis.error_reply('STALE attempt ' .. ARGV[1] .. ' but the job is at attempt '
    .. tostring(fence[1]) .. ', ' .. tostring(fence[2]))
end
"""

# KEYS: job. ARGV: attempt, RUNNING, lease ms. Returns {cancel flag, new lease deadline}.
_HEARTBEAT = (
    _FENCE
    + NOW_MS
    + """
local deadline = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'lease_deadline', string.format('%.0f', deadline))
return {tonumber(redis.call('HGET', KEYS[1], 'cancel_requested') or '0'), deadline}
"""
)

# KEYS: job. ARGV: attempt, RUNNING, then field/value pairs to set.
_UPDATE = _FENCE + "redis.call('HSET', KEYS[1], unpack(ARGV, 3))\nreturn 1\n"

# KEYS: job, events. ARGV: attempt, RUNNING, step, event (4 values; ARGV[5] is the metrics).
# Returns 1 when published, 0 when the step was already published (dropped).
_METRICS = (
    _FENCE
    + """
local last = tonumber(redis.call('HGET', KEYS[1], 'metric_step') or '-1')
if tonumber(ARGV[3]) <= last then return 0 end
"""
    + xadd_event("KEYS[2]", 4)
    + """
redis.call('HSET', KEYS[1], 'step', ARGV[3], 'metric_step', ARGV[3], 'latest_metrics', ARGV[5])
return 1
"""
)

# KEYS: job, events. ARGV: attempt, RUNNING, rollback step, event (4 values).
_BACKOFF = (
    _FENCE
    + xadd_event("KEYS[2]", 4)
    + """
redis.call('HSET', KEYS[1], 'step', ARGV[3], 'metric_step', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'backoffs', 1)
return 1
"""
)

# KEYS: job, checkpoint index, the new checkpoint, then the checkpoints to drop.
# ARGV: attempt, RUNNING, step, the steps to drop (one per dropped key), then the checkpoint's
# field/value pairs.
_CHECKPOINT = (
    _FENCE
    + """
local dropped = #KEYS - 3
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], unpack(ARGV, 4 + dropped))
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]), ARGV[3])
for i = 1, dropped do
  redis.call('DEL', KEYS[3 + i])
  redis.call('ZREM', KEYS[2], ARGV[3 + i])
end
redis.call('HSET', KEYS[1], 'checkpoint_step', ARGV[3])
return 1
"""
)

# KEYS: job, events, checkpoint index, the checkpoints the retention drops. ARGV: attempt,
# RUNNING, final state, finished at, error, event (4 values), then the dropped steps in order:
# the end and the trim are one step, so whoever sees the end sees only the checkpoints kept.
_FINISH = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finished_at', ARGV[4], 'error', ARGV[5])
for i = 4, #KEYS do
  redis.call('DEL', KEYS[i])
  redis.call('ZREM', KEYS[3], ARGV[6 + i])
end
"""
    + xadd_event("KEYS[2]", 6)
    + "return 1\n"
)

# KEYS: job, events. ARGV: attempt, RUNNING, QUEUED, event (4 values).
_RELEASE = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'state', ARGV[3])  -- 'worker' keeps the last one that ran it
"""
    + xadd_event("KEYS[2]", 4)
    + "return 1\n"
)


class LeaseLostError(Exception):
    """The job is no longer RUNNING under this attempt: another worker took over, or it ended."""


class FencedJob(Store):
    """All writes of one worker attempt on one job."""

    def __init__(
        self,
        redis: RedisClient,
        lease: Lease,
        *,
        keys: Keys | None = None,
        retention: Retention | None = None,
    ) -> None:
        super().__init__(redis, keys=keys)
        self.lease = lease
        self.index = JobIndex(redis, self.keys)
        self.lifecycle = JobLifecycle(redis, self.keys, retention)
        self.job_id = lease.job_id
        self.attempt = lease.attempt
        self.tenant = lease.record.tenant

    async def _run(self, script: str, keys: list[str], args: list) -> Any:
        """Run a fenced script: the attempt and the RUNNING state go first."""
        try:
            return await self.run(script, keys, [self.attempt, JobState.RUNNING.value, *args])
        except ResponseError as exc:
            if str(exc).startswith("STALE"):
                raise LeaseLostError(f"job {self.job_id}: {exc}") from None
            raise

    async def heartbeat(self) -> bool:
        """Extend the lease by its length; returns True when a cancel was requested."""
        flag, deadline = await self._run(
            _HEARTBEAT, [self.keys.job(self.job_id)], [self.lease.lease_ms]
        )
        await self.index.follow(
            self.job_id, self.tenant, JobState.RUNNING, self.attempt, lease_deadline=int(deadline)
        )
        return flag == 1

    async def update(self, **fields: int | str) -> None:
        """Set job fields (e.g. n_visible, total_steps once the dataset is loaded, runtime)."""
        await self._run(_UPDATE, [self.keys.job(self.job_id)], pairs(fields))

    async def publish_metrics(self, step: int, metrics: bytes) -> bool:
        """Append a metric event; False (dropped) if this step was already published."""
        event = metrics_event_fields(metrics, attempt=self.attempt)
        published = await self._run(
            _METRICS, self.job_and_events(self.job_id), [step, *event_values(event)]
        )
        return published == 1

    async def backoff(self, *, rollback_step: int, event_data: bytes) -> None:
        """The worker rolled the job back to `rollback_step`: a backoff event, the job's step and
        last published metric step set back (the retrained steps are published again), and one
        more `backoffs`."""
        event = backoff_event_fields(event_data, attempt=self.attempt)
        await self._run(
            _BACKOFF, self.job_and_events(self.job_id), [rollback_step, *event_values(event)]
        )
        logger.info(
            "job %s backed off to step %d (attempt %d)", self.job_id, rollback_step, self.attempt
        )

    async def put_checkpoint(
        self,
        step: int,
        *,
        data: bytes,
        config_json: str,
        trainer_state: bytes,
        recovery_state: str = "",
        keep: int = DEFAULT_KEEP,
    ) -> None:
        """Store a checkpoint (sha256 computed here) and drop those beyond the newest `keep`.
        `recovery_state` is the blow-up recovery's state at `step` (JSON; see checkpoints.py),
        written in the same script as the trainer state it belongs to."""
        fields = checkpoint_fields(
            step=step,
            data=data,
            config_json=config_json,
            trainer_state=trainer_state,
            recovery_state=recovery_state,
            attempt=self.attempt,
        )
        index, drop, dropped = await self._beyond(keep, step)
        keys = [self.keys.job(self.job_id), index, self.keys.checkpoint(self.job_id, step)]
        await self._run(_CHECKPOINT, [*keys, *dropped], [step, *drop, *pairs(fields)])

    async def _beyond(self, keep: int, *new: int) -> tuple[str, list[int], list[str]]:
        """The checkpoint index, and the steps (and keys) beyond the newest `keep` with the
        ``new`` steps, read first so that a script gets every key it deletes: only this attempt
        writes checkpoints (the fence), so they cannot change in between."""
        index = self.keys.checkpoint_index(self.job_id)
        existing = [int(member) for member in await self.redis.zrange(index, 0, -1)]
        steps = sorted({*existing, *new})
        drop = steps[: max(0, len(steps) - keep)]  # oldest first
        return index, drop, [self.keys.checkpoint(self.job_id, old) for old in drop]

    async def finish(
        self, state: JobState, *, step: int, error: str = "", message: str = ""
    ) -> None:
        """End the job in a terminal state, with its state event, and drop the lease; then
        apply the retention (checkpoints trimmed, expiry; lifecycle.py has the order)."""
        if not state.is_terminal:
            raise ValueError(f"finish needs a terminal state, not {state}")
        event = state_event_fields(state, attempt=self.attempt, step=step, message=message or error)
        await self.lifecycle.expire_later(self.job_id, self.tenant, self.lease.record.sweep_id)
        index, drop, dropped = await self._beyond(self.lifecycle.retention.checkpoints_kept)
        await self._run(
            _FINISH,
            [*self.job_and_events(self.job_id), index, *dropped],
            [state.value, repr(time.time()), error, *event_values(event), *drop],
        )
        await self.index.follow(self.job_id, self.tenant, state, self.attempt)
        await self.lifecycle.ended(self.job_id)
        logger.info(
            "job %s %s at step %d (attempt %d)", self.job_id, state.value, step, self.attempt
        )

    async def release(self, *, step: int, message: str, front: bool = False) -> None:
        """Give the job back to the queue (QUEUED) for any worker to resume; `front` puts it
        first in its tenant's list (a preempted job keeps its place)."""
        event = state_event_fields(
            JobState.QUEUED, attempt=self.attempt, step=step, message=message
        )
        await self._run(
            _RELEASE,
            self.job_and_events(self.job_id),
            [JobState.QUEUED.value, *event_values(event)],
        )
        # A death before this step leaves the lease entry, which lapses and leads a worker to
        # claim the job: the same outcome as the queue entry this step adds.
        await self.index.follow(
            self.job_id,
            self.tenant,
            JobState.QUEUED,
            self.attempt,
            enqueue=True,
            front=front,
            sweep_run=bool(self.lease.record.sweep_id),
        )
        logger.info("job %s released at step %d (attempt %d)", self.job_id, step, self.attempt)
