"""The job queue: a Redis stream read by the workers' consumer group.

Entries carry one field, `job` (the job id); the job index adds them (indexes.py), in the same
step that marks the job QUEUED there, so a submit or release that is repeated queues it once.
Delivery is at least once: a worker acknowledges an entry only once it holds the job's lease
(or found the job finished or held by another worker), so an entry delivered to a worker that
died before claiming it is picked up again by `autoclaim`. The same job may be queued more than
once (a released job is queued again); the claim is a compare-and-set on the job's attempt, so
duplicates are harmless.
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from ssdrbm_server.keys import WORKER_GROUP, Keys
from ssdrbm_server.store.connection import RedisClient
from ssdrbm_server.store.indexes import QUEUE_FIELD

logger = logging.getLogger(__name__)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entries(raw: list) -> list[tuple[str, str]]:
    """(entry id, job id) pairs from a list of stream entries; deleted entries are skipped."""
    field = QUEUE_FIELD.encode()
    pairs = []
    for entry_id, fields in raw:
        if fields and field in fields:  # XAUTOCLAIM returns deleted entries as None
            pairs.append((_text(entry_id), fields[field].decode()))
    return pairs


class JobQueue:
    """Reading and acknowledging queued jobs as one consumer of the `workers` group."""

    def __init__(self, redis: RedisClient, *, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless they exist."""
        try:
            # From id 0: jobs submitted before any worker existed are still delivered.
            await self.redis.xgroup_create(self.keys.queue(), WORKER_GROUP, id="0", mkstream=True)
            logger.info("created consumer group %s on %s", WORKER_GROUP, self.keys.queue())
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def enqueue(self, job_id: str) -> str:
        """Add a job to the queue; returns the entry id."""
        return _text(await self.redis.xadd(self.keys.queue(), {QUEUE_FIELD: job_id}))

    async def read(self, consumer: str, *, block_ms: int, count: int = 1) -> list[tuple[str, str]]:
        """New entries for `consumer`, waiting up to block_ms; [] on timeout."""
        reply = await self.redis.xreadgroup(
            WORKER_GROUP, consumer, {self.keys.queue(): ">"}, count=count, block=block_ms
        )
        return _entries(reply[0][1]) if reply else []

    async def pending(self, consumer: str, *, count: int = 10) -> list[tuple[str, str]]:
        """Entries delivered to `consumer` earlier but never acknowledged (after a restart)."""
        reply = await self.redis.xreadgroup(
            WORKER_GROUP, consumer, {self.keys.queue(): "0"}, count=count
        )
        return _entries(reply[0][1]) if reply else []

    async def autoclaim(
        self, consumer: str, *, min_idle_ms: int, count: int = 10
    ) -> list[tuple[str, str]]:
        """Take over entries delivered to other consumers and left unacknowledged that long."""
        reply = await self.redis.xautoclaim(
            self.keys.queue(), WORKER_GROUP, consumer, min_idle_time=min_idle_ms, count=count
        )
        return _entries(reply[1])

    async def ack(self, entry_id: str) -> None:
        """Acknowledge an entry and drop it from the stream (the job record lives on)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.keys.queue(), WORKER_GROUP, entry_id)
            pipe.xdel(self.keys.queue(), entry_id)
            await pipe.execute()

    async def length(self) -> int:
        """Entries in the stream (waiting or delivered and not yet acknowledged)."""
        return int(await self.redis.xlen(self.keys.queue()))
