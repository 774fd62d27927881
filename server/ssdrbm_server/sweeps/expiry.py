"""Sweep records go with their runs: a finished-job TTL after the last run's end.

With SSDRBM_FINISHED_JOB_TTL_SECONDS, each job is deleted that long after its end
(store/lifecycle.py), and each run's end moves its sweep's entry in `{jobs}:sweep_purge` to at
least its own expiry (`JobLifecycle.expire_later`: only ever later). Every API process takes
the entries `SWEEP_GRACE_MS` overdue and asks the sweep service what is left (`expire_if_done`):
nothing of its jobs: the sweep's keys are deleted (GetSweep is then NOT_FOUND), then the entry;
a job still QUEUED or RUNNING: the entry is removed (that run's end schedules the sweep again);
a job ended but still stored: the entry moves on by the grace; no sweep: the entry is removed.
An entry is removed or moved only while it holds the time read (`JobLifecycle.settle`), so a
run's end in between is never lost. Without a TTL sweeps stay until DeleteSweep.
"""

from __future__ import annotations

import logging

from ssdrbm_server.store.lifecycle import SWEEP_BATCH, SWEEP_GRACE_MS, JobLifecycle, split_member
from ssdrbm_server.sweeps.service import WAITING, SweepService

logger = logging.getLogger(__name__)


class SweepExpiry:
    """Deletes sweeps whose runs' jobs have all expired."""

    def __init__(self, service: SweepService, lifecycle: JobLifecycle) -> None:
        self.service = service
        self.lifecycle = lifecycle
        self.schedule = lifecycle.keys.sweep_purge_schedule()

    async def expire_due(self, *, limit: int = SWEEP_BATCH, grace_ms: int = SWEEP_GRACE_MS) -> int:
        """Settle the entries `grace_ms` overdue; returns how many were taken."""
        entries = await self.lifecycle.due(self.schedule, grace_ms=grace_ms, limit=limit)
        for member, due_ms in entries:
            sweep_id, tenant = split_member(member)
            found = await self.service.expire_if_done(tenant, sweep_id)  # GONE for a bad id
            later_ms = SWEEP_GRACE_MS if found == WAITING else 0
            await self.lifecycle.settle(self.schedule, member, due_ms, later_ms=later_ms)
        return len(entries)
