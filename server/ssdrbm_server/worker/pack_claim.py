"""Which jobs join a claimed job's pack: the worker's side of packed training.

A worker claims one job as before (worker.py). If it has a pack key (ssdrbm_server/packing.py)
and SSDRBM_MAX_PACK_SIZE > 1, the worker claims up to ``room - 1`` more jobs with that key:
first running jobs whose lease lapsed (a dead worker's pack resumes as a pack, each job from its
own checkpoint), then queued jobs, one per tenant in turn, from the first job's tenant through
the rotation (store/pack_claims.py; riders spend no turn). ``room`` is SSDRBM_MAX_PACK_SIZE,
lowered so that the runs' memory (runner.run_memory_mb) fits SSDRBM_PACK_MEMORY_MB. Each rider
is claimed with the ordinary claim (its own attempt, lease and fencing token).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.config import Settings
from ssdrbm_server.store.leases import Lease, LeaseStore
from ssdrbm_server.store.pack_claims import PackClaims
from ssdrbm_server.store.queue import JobQueue
from ssdrbm_server.store.records import JobRecord
from ssdrbm_server.worker.runner import run_memory_mb

logger = logging.getLogger(__name__)

# claim(job_id, takeover) -> the lease, or None when the job cannot be claimed
Claim = Callable[[str, bool], Awaitable[Lease | None]]


async def _queued_in_turn(first: Lease, claims: PackClaims, wanted: int) -> list[tuple[str, str]]:
    """Queued jobs with the first job's key, one per tenant in turn (the first job's tenant,
    then the rotation's order), oldest first within a tenant: a tenant with a long backlog of
    compatible jobs does not keep another tenant's out of the pack."""
    if wanted <= 0:
        return []
    tenants = await claims.tenants_in_order(first.record.tenant)
    queued = [await claims.matching(t, first.record.pack_key, wanted) for t in tenants]
    order: list[tuple[str, str]] = []
    for depth in range(max((len(q) for q in queued), default=0)):
        order += [(t, q[depth]) for t, q in zip(tenants, queued, strict=True) if depth < len(q)]
    return order[: wanted * 2]  # room to skip a few taken meanwhile by another worker


def pack_room(record: JobRecord, settings: Settings) -> int:
    """How many runs a pack started from this job may hold (1: it trains alone)."""
    if settings.max_pack_size <= 1 or not record.pack_key:
        return 1
    try:
        request = rbm_pb2.StartTrainingRequest.FromString(record.spec)
    except DecodeError:
        return 1  # the runner fails it with the reason
    per_run = run_memory_mb(request, record.n_visible)
    by_memory = math.floor(settings.pack_memory_mb / per_run) if per_run > 0 else 1 << 30
    return max(1, min(settings.max_pack_size, by_memory))


async def claim_riders(
    first: Lease,
    settings: Settings,
    *,
    worker_id: str,
    queue: JobQueue,
    leases: LeaseStore,
    claims: PackClaims,
    claim: Claim,
) -> list[Lease]:
    """Claim the jobs that join ``first``'s pack (possibly none)."""
    wanted = pack_room(first.record, settings) - 1
    key = first.record.pack_key
    riders: list[Lease] = []
    if wanted <= 0:
        return riders
    for job_id in await leases.lapsed(limit=wanted):
        if len(riders) >= wanted:
            break
        record = await leases.load(job_id)
        if record is None or record.pack_key != key or job_id == first.job_id:
            continue
        lease = await claim(job_id, True)
        if lease is not None:
            logger.info("took over job %s into a pack after its lease lapsed", job_id)
            riders.append(lease)
    for tenant, job_id in await _queued_in_turn(first, claims, wanted - len(riders)):
        if len(riders) >= wanted:
            break
        entry = await claims.take(tenant, job_id, worker_id)
        if entry is None:
            continue  # another worker took it meanwhile
        lease = await claim(job_id, False)
        await queue.ack(entry)  # as for any taken entry: claimed, or not claimable
        if lease is not None:
            riders.append(lease)
    if riders:
        logger.info(
            "job %s trains in a pack of %d (%s)",
            first.job_id,
            len(riders) + 1,
            ", ".join(r.job_id for r in riders),
        )
    return riders
