"""Every Redis key of the service, built in one place.

Layout (prefix `ssdrbm:` by default, configurable so one Redis can host several deployments):

| key                             | type   | holds                                               |
| ------------------------------- | ------ | --------------------------------------------------- |
| `job:{id}`                      | hash   | the job record (ssdrbm_server/store/records.py)    |
| `job:{id}:metrics`              | stream | metric and state events; entry id = resume token    |
| `job:{id}:ckpts`                | zset   | steps of the retained checkpoints (score = step)    |
| `job:{id}:ckpt:{step}`          | hash   | one checkpoint: safetensors bytes, sha256, attempt  |
| `jobs:queue`                    | stream | jobs waiting for a worker; consumer group `workers` |
| `jobs:leases`                   | zset   | running job id -> lease deadline (Redis ms clock)   |
| `jobs:seq`                      | string | counter giving each job its listing position        |
| `jobs:state:{STATE}`            | set    | job ids in that state (Prometheus counts)           |
| `tenant:{t}:jobs`               | zset   | the tenant's job ids by sequence (ListJobs paging)  |
| `tenant:{t}:active`             | set    | the tenant's QUEUED + RUNNING job ids (limits)      |
| `tenant:{t}:datasets`           | hash   | dataset id -> the name this tenant gave it          |
| `dataset:{sha256}`              | hash   | uploaded array: raw bytes, dtype, shape             |
| `idem:{t}:{sha256(request_id)}` | string | job id created for that StartTraining request_id    |

Job ids are 32 hex digits and dataset ids 64; ids from clients are checked against those forms
before any key is built, so a crafted id cannot name another key (e.g. `x:metrics`).
"""

from __future__ import annotations

import hashlib
import re

DEFAULT_PREFIX = "ssdrbm:"
WORKER_GROUP = "workers"

_JOB_ID = re.compile(r"[0-9a-f]{32}")
_DATASET_ID = re.compile(r"[0-9a-f]{64}")


def is_job_id(value: str) -> bool:
    """True when `value` has the form of a job id (so it is safe inside a key)."""
    return bool(_JOB_ID.fullmatch(value))


def is_dataset_id(value: str) -> bool:
    """True when `value` has the form of a dataset id (a sha256 hex digest)."""
    return bool(_DATASET_ID.fullmatch(value))


class Keys:
    """Builds the service's Redis keys under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if prefix and not prefix.endswith(":"):
            prefix += ":"
        self.prefix = prefix

    # --- jobs ---
    def job(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}:metrics"

    def checkpoint_index(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}:ckpts"

    def checkpoint(self, job_id: str, step: int) -> str:
        return f"{self.prefix}job:{job_id}:ckpt:{step}"

    def checkpoint_prefix(self, job_id: str) -> str:
        """`checkpoint(job_id, step)` without the step (Lua scripts append it)."""
        return f"{self.prefix}job:{job_id}:ckpt:"

    def queue(self) -> str:
        return f"{self.prefix}jobs:queue"

    def leases(self) -> str:
        return f"{self.prefix}jobs:leases"

    def job_sequence(self) -> str:
        return f"{self.prefix}jobs:seq"

    def jobs_in_state(self, state: str) -> str:
        return f"{self.prefix}jobs:state:{state}"

    def state_set_prefix(self) -> str:
        """`jobs_in_state(state)` without the state (Lua scripts append it)."""
        return f"{self.prefix}jobs:state:"

    # --- tenants ---
    def tenant_jobs(self, tenant: str) -> str:
        return f"{self.prefix}tenant:{tenant}:jobs"

    def tenant_active(self, tenant: str) -> str:
        return f"{self.prefix}tenant:{tenant}:active"

    def tenant_datasets(self, tenant: str) -> str:
        return f"{self.prefix}tenant:{tenant}:datasets"

    def idempotency(self, tenant: str, request_id: str) -> str:
        # Hashed: a request id is free text (any length, any character, ':' included).
        digest = hashlib.sha256(request_id.encode()).hexdigest()
        return f"{self.prefix}idem:{tenant}:{digest}"

    # --- datasets ---
    def dataset(self, dataset_id: str) -> str:
        return f"{self.prefix}dataset:{dataset_id}"
