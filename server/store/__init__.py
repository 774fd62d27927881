"""Redis as the system of record: jobs, the queue, leases, events, checkpoints, datasets.

One module per concept; every key comes from server/keys.py. All stores are async
(`redis.asyncio`) and expect a client with `decode_responses=False` (bytes in, bytes out),
as `connect()` creates.
"""

from __future__ import annotations

from server.store.checkpoints import Checkpoint, CheckpointStore, CorruptCheckpointError
from server.store.connection import connect
from server.store.datasets import DatasetInfo, DatasetStore
from server.store.events import EventStore
from server.store.fencing import FencedJob, LeaseLostError
from server.store.jobs import JobStore
from server.store.leases import Lease, LeaseStore
from server.store.queue import JobQueue
from server.store.records import JobRecord, JobState

__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "CorruptCheckpointError",
    "DatasetInfo",
    "DatasetStore",
    "EventStore",
    "FencedJob",
    "JobQueue",
    "JobRecord",
    "JobState",
    "JobStore",
    "Lease",
    "LeaseLostError",
    "LeaseStore",
    "connect",
]
