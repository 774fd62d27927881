"""Redis as the system of record: jobs, the queue, leases, events, checkpoints, datasets; one
module per concept, every key from ssdrbm_server/keys.py. The stores are async and expect a
client with bytes replies, as `connect()` creates.
"""

from __future__ import annotations

from ssdrbm_server.store.checkpoints import Checkpoint, CheckpointStore, CorruptCheckpointError
from ssdrbm_server.store.connection import connect
from ssdrbm_server.store.datasets import DatasetInfo, DatasetStore
from ssdrbm_server.store.events import EventStore
from ssdrbm_server.store.fencing import FencedJob, LeaseLostError
from ssdrbm_server.store.jobs import JobStore
from ssdrbm_server.store.leases import Lease, LeaseStore
from ssdrbm_server.store.queue import JobQueue
from ssdrbm_server.store.records import JobRecord, JobState

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
