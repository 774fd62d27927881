"""Fenced writes: everything a worker writes about a job, refused once its attempt is stale.

Each write is one Lua script that first checks the job is still RUNNING under the writer's
attempt number. A worker that lost its lease (paused, partitioned, presumed dead) and was
replaced by another under a higher attempt gets `LeaseLostError` and must stop; it can never
overwrite the newer attempt's metrics, checkpoints or final state.

Metric events are also refused when their step does not exceed the job's last published metric
step, so a run resumed from a checkpoint never repeats a step in the stream: it recomputes the
steps after its checkpoint and publishes only those the dead attempt had not.
"""

from __future__ import annotations

import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.checkpoints import DEFAULT_KEEP, checkpoint_fields
from ssdrbm_server.store.events import metrics_event_fields, state_event_fields
from ssdrbm_server.store.leases import Lease
from ssdrbm_server.store.records import JobState

logger = logging.getLogger(__name__)

# Shared first lines of every fenced script: KEYS[1] is the job, ARGV[1] the writer's attempt.
_FENCE = """
local fence = redis.call('HMGET', KEYS[1], 'attempt', 'state')
if fence[1] ~= ARGV[1] or fence[2] ~= 'RUNNING' then
  return redis.error_reply('STALE attempt ' .. ARGV[1] .. ' but the job is at attempt '
    .. tostring(fence[1]) .. ', ' .. tostring(fence[2]))
end
"""

# KEYS: job, leases. ARGV: attempt, job id, lease ms. Returns the cancel flag.
_HEARTBEAT = (
    _FENCE
    + """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
return tonumber(redis.call('HGET', KEYS[1], 'cancel_requested') or '0')
"""
)

# KEYS: job. ARGV: attempt, then field/value pairs to set.
_UPDATE = _FENCE + "redis.call('HSET', KEYS[1], unpack(ARGV, 2))\nreturn 1\n"

# KEYS: job, events. ARGV: attempt, step, metrics, event time.
# Returns 1 when published, 0 when the step was already published (dropped).
_METRICS = (
    _FENCE
    + """
local last = tonumber(redis.call('HGET', KEYS[1], 'metric_step') or '-1')
if tonumber(ARGV[2]) <= last then return 0 end
redis.call('XADD', KEYS[2], '*', 'kind', 'metrics', 'data', ARGV[3], 'time', ARGV[4],
           'attempt', ARGV[1])
redis.call('HSET', KEYS[1], 'step', ARGV[2], 'metric_step', ARGV[2], 'latest_metrics', ARGV[3])
return 1
"""
)

# KEYS: job, checkpoint index. ARGV: attempt, step, keep, checkpoint key prefix, then the
# checkpoint's field/value pairs. Older checkpoints beyond `keep` are deleted.
_CHECKPOINT = (
    _FENCE
    + """
local key = ARGV[4] .. ARGV[2]
redis.call('DEL', key)
redis.call('HSET', key, unpack(ARGV, 5))
redis.call('ZADD', KEYS[2], tonumber(ARGV[2]), ARGV[2])
local surplus = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
if surplus > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, surplus - 1)) do
    redis.call('DEL', ARGV[4] .. old)
    redis.call('ZREM', KEYS[2], old)
  end
end
redis.call('HSET', KEYS[1], 'checkpoint_step', ARGV[2])
return 1
"""
)

# KEYS: job, RUNNING set, final state set, tenant active set, leases, events.
# ARGV: attempt, job id, state, finished at, error, event data, event time.
_FINISH = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finished_at', ARGV[4], 'error', ARGV[5])
redis.call('SMOVE', KEYS[2], KEYS[3], ARGV[2])
redis.call('SREM', KEYS[4], ARGV[2])
redis.call('ZREM', KEYS[5], ARGV[2])
redis.call('XADD', KEYS[6], '*', 'kind', 'state', 'data', ARGV[6], 'time', ARGV[7],
           'attempt', ARGV[1])
return 1
"""
)

# KEYS: job, RUNNING set, QUEUED set, leases, events, queue.
# ARGV: attempt, job id, event data, event time.
_RELEASE = (
    _FENCE
    + """
redis.call('HSET', KEYS[1], 'state', 'QUEUED')  -- 'worker' keeps the last one that ran it
redis.call('SMOVE', KEYS[2], KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[2])
redis.call('XADD', KEYS[5], '*', 'kind', 'state', 'data', ARGV[3], 'time', ARGV[4],
           'attempt', ARGV[1])
redis.call('XADD', KEYS[6], '*', 'job', ARGV[2])
return 1
"""
)


class LeaseLostError(Exception):
    """The job is no longer RUNNING under this attempt: another worker took over, or it ended."""


class FencedJob:
    """All writes of one worker attempt on one job."""

    def __init__(self, redis: aioredis.Redis, lease: Lease, *, keys: Keys | None = None) -> None:
        self.redis = redis
        self.lease = lease
        self.keys = keys or Keys()
        self.job_id = lease.job_id
        self.attempt = lease.attempt
        self.tenant = lease.record.tenant
        self._heartbeat = redis.register_script(_HEARTBEAT)
        self._update = redis.register_script(_UPDATE)
        self._metrics = redis.register_script(_METRICS)
        self._checkpoint = redis.register_script(_CHECKPOINT)
        self._finish = redis.register_script(_FINISH)
        self._release = redis.register_script(_RELEASE)

    async def _run(self, script, keys: list[str], args: list) -> int:
        try:
            return await script(keys=keys, args=[self.attempt, *args])
        except ResponseError as exc:
            if str(exc).startswith("STALE"):
                raise LeaseLostError(f"job {self.job_id}: {exc}") from None
            raise

    async def heartbeat(self) -> bool:
        """Extend the lease by its length; returns True when a cancel was requested."""
        flag = await self._run(
            self._heartbeat,
            [self.keys.job(self.job_id), self.keys.leases()],
            [self.job_id, self.lease.lease_ms],
        )
        return flag == 1

    async def update(self, **fields: int | str) -> None:
        """Set job fields (e.g. n_visible, total_steps once the dataset is loaded)."""
        args: list[int | str] = []
        for name, value in fields.items():
            args += [name, value]
        await self._run(self._update, [self.keys.job(self.job_id)], args)

    async def publish_metrics(self, step: int, metrics: bytes) -> bool:
        """Append a metric event; False (dropped) if this step was already published."""
        event = metrics_event_fields(metrics, attempt=self.attempt)
        published = await self._run(
            self._metrics,
            [self.keys.job(self.job_id), self.keys.events(self.job_id)],
            [step, metrics, event["time"]],
        )
        return published == 1

    async def put_checkpoint(
        self,
        step: int,
        *,
        data: bytes,
        config_json: str,
        trainer_state: bytes,
        keep: int = DEFAULT_KEEP,
    ) -> None:
        """Store a checkpoint (sha256 computed here) and drop those beyond the newest `keep`."""
        fields = checkpoint_fields(
            step=step,
            data=data,
            config_json=config_json,
            trainer_state=trainer_state,
            attempt=self.attempt,
        )
        args: list[int | str | bytes] = [step, keep, self.keys.checkpoint_prefix(self.job_id)]
        for name, value in fields.items():
            args += [name, value]
        await self._run(
            self._checkpoint,
            [self.keys.job(self.job_id), self.keys.checkpoint_index(self.job_id)],
            args,
        )

    async def finish(
        self, state: JobState, *, step: int, error: str = "", message: str = ""
    ) -> None:
        """End the job in a terminal state, with its state event, and drop the lease."""
        if not state.is_terminal:
            raise ValueError(f"finish needs a terminal state, not {state}")
        event = state_event_fields(state, attempt=self.attempt, step=step, message=message or error)
        await self._run(
            self._finish,
            [
                self.keys.job(self.job_id),
                self.keys.jobs_in_state(JobState.RUNNING.value),
                self.keys.jobs_in_state(state.value),
                self.keys.tenant_active(self.tenant),
                self.keys.leases(),
                self.keys.events(self.job_id),
            ],
            [self.job_id, state.value, repr(time.time()), error, event["data"], event["time"]],
        )
        logger.info(
            "job %s %s at step %d (attempt %d)", self.job_id, state.value, step, self.attempt
        )

    async def release(self, *, step: int, message: str) -> None:
        """Give the job back to the queue (QUEUED) for any worker to resume."""
        event = state_event_fields(
            JobState.QUEUED, attempt=self.attempt, step=step, message=message
        )
        await self._run(
            self._release,
            [
                self.keys.job(self.job_id),
                self.keys.jobs_in_state(JobState.RUNNING.value),
                self.keys.jobs_in_state(JobState.QUEUED.value),
                self.keys.leases(),
                self.keys.events(self.job_id),
                self.keys.queue(),
            ],
            [self.job_id, event["data"], event["time"]],
        )
        logger.info("job %s released at step %d (attempt %d)", self.job_id, step, self.attempt)
