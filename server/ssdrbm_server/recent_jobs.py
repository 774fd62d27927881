"""A short-lived cache of job records for the serving RPCs.

Reading a job's record (tenant check, latest checkpoint step) from Redis on every call cost a
round trip and about a tenth of the server's CPU per batch-1 request, so a hot job's record is
reused for ``ttl_s`` (0.5 s): a new checkpoint is served at most that long after its record
names it. Entries are keyed by (tenant, job id); misses and jobs without a checkpoint are not
kept, so NOT_FOUND and FAILED_PRECONDITION are always decided by a fresh read.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from ssdrbm_server.store.records import JobRecord

JOB_RECORD_TTL_S = 0.5
MAX_RECENT_JOBS = 1024


class RecentJobs:
    """Job records read in the last ``ttl_s`` seconds, by (tenant, job id)."""

    def __init__(
        self,
        ttl_s: float = JOB_RECORD_TTL_S,
        capacity: int = MAX_RECENT_JOBS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._clock = clock
        # Insertion order is expiry order (one lifetime for all), so the oldest entry is first.
        self._records: OrderedDict[tuple[str, str], tuple[float, JobRecord]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, tenant: str, job_id: str) -> JobRecord | None:
        """The record ``tenant`` read for ``job_id`` within the lifetime, or None."""
        entry = self._records.get((tenant, job_id))
        if entry is None:
            return None
        expires, record = entry
        if self._clock() >= expires:
            del self._records[(tenant, job_id)]
            return None
        return record

    async def read(
        self, tenant: str, job_id: str, load: Callable[[str, str], Awaitable[JobRecord]]
    ) -> JobRecord:
        """The record kept for ``job_id``, else ``load(tenant, job_id)``'s, then kept."""
        record = self.get(tenant, job_id)
        if record is None:
            record = await load(tenant, job_id)
            self.put(tenant, record)
        return record

    def forget(self, tenant: str, job_id: str) -> None:
        """Drop ``job_id`` (deleted): the next lookup reads the store and finds it gone."""
        self._records.pop((tenant, job_id), None)

    def put(self, tenant: str, record: JobRecord) -> None:
        """Keep ``record`` (just read from the store for ``tenant``) if it can serve a model."""
        if record.checkpoint_step < 0:
            return  # the first checkpoint must be seen as soon as it exists
        now = self._clock()
        key = (tenant, record.id)
        self._records.pop(key, None)
        self._records[key] = (now + self.ttl_s, record)
        while self._records:
            oldest_expiry, _ = next(iter(self._records.values()))
            if len(self._records) <= self.capacity and oldest_expiry > now:
                break
            self._records.popitem(last=False)
