"""Every Redis key of the service, built in one place.

Layout (prefix `ssdrbm:` by default, configurable so one Redis can host several deployments).
The part in braces is the key's hash tag: on Redis Cluster only it chooses the key's slot, so
keys with the same tag live together and one Lua script may use them all.

| key                               | type   | holds                                             |
| --------------------------------- | ------ | ------------------------------------------------- |
| `job:{<id>}`                      | hash   | the job record (ssdrbm_server/store/records.py)   |
| `job:{<id>}:metrics`              | stream | metric, backoff, state events; id = resume token  |
| `job:{<id>}:ckpts`                | zset   | steps of the retained checkpoints (score = step)  |
| `job:{<id>}:ckpt:<step>`          | hash   | one checkpoint: safetensors bytes, sha256, attempt |
| `{jobs}:queue:<t>`                | list   | the tenant's waiting job ids, oldest first        |
| `{jobs}:tenants`                  | zset   | tenants with waiting jobs -> last turn (rotation) |
| `{jobs}:served`                   | zset   | tenant -> its last turn (a counter, not a clock)  |
| `{jobs}:taken`                    | zset   | `<id> <worker>` -> when taken (ms), not yet acked |
| `{jobs}:ready`                    | list   | one token while jobs wait: wakes an idle worker   |
| `{jobs}:preempted-for:turns`      | zset   | tenant -> until (ms): a slot is freed for its turn |
| `{jobs}:preempted-for:jobs`       | zset   | job id -> until (ms): a slot is freed for that job |
| `{jobs}:leases`                   | zset   | running job id -> lease deadline (an index)       |
| `{jobs}:state:<STATE>`            | set    | job ids in that state (Prometheus counts)         |
| `{jobs}:versions`                 | hash   | job id -> version of the state the indexes show   |
| `{jobs}:forgotten`                | zset   | job id -> when it was forgotten (versions pruned) |
| `{jobs}:purge`                    | zset   | `<id> <tenant>` -> when to delete it (ms)         |
| `{jobs}:sweep_purge`              | zset   | `<sid> <tenant>` -> when its runs expire (ms)     |
| `tenant:{<t>}:jobs`               | zset   | the tenant's job ids by sequence (ListJobs paging) |
| `tenant:{<t>}:seq`                | string | counter giving the tenant's jobs their position   |
| `tenant:{<t>}:active`             | set    | the tenant's QUEUED + RUNNING job ids (limits)    |
| `tenant:{<t>}:job_datasets`       | hash   | active job id -> the uploaded dataset it uses     |
| `tenant:{<t>}:idem:<sha256(rid)>` | string | job id created for that StartTraining request_id  |
| `tenant:{<t>}:datasets`           | hash   | dataset id -> JSON: this tenant's name, size, time |
| `tenant:{<t>}:dataset_bytes`      | string | bytes of the tenant's datasets (per-tenant quota) |
| `tenant:{<t>}:sweeps`             | zset   | the tenant's sweep ids by sequence (ListSweeps)   |
| `tenant:{<t>}:sweep_seq`          | string | counter giving the tenant's sweeps their position |
| `tenant:{<t>}:sweep_idem:<sha256>`| string | sweep id created for that StartSweep request_id   |
| `tenant:{<t>}:sweep:<sid>`        | hash   | one sweep: request, points, rungs (sweeps/store)  |
| `tenant:{<t>}:sweep:<sid>:runs`   | list   | the sweep's job ids, in point order               |
| `tenant:{<t>}:sweep:<sid>:rung:<s>` | zset | job id -> signed rank value at rung step s (ASHA) |
| `tenant:{<t>}:sweep:<sid>:decisions` | hash | `<job> <step>` -> promote/stop, decided once     |
| `dataset:{<sha256>}`              | hash   | uploaded array: dtype, shape, blob, `complete`    |
| `dataset:{<sha256>}:tenants`      | set    | tenants referencing it (bytes go when empty)      |
| `upload:{<uid>}`                  | hash   | an upload's bytes: field `<i>` = chunk i (bounded) |

Five kinds of slot, so no script or MULTI ever spans two: one job's keys (`{<id>}`), one
tenant's keys (`{<t>}`), the global job indexes (`{jobs}`), one dataset's record and
references (`{<sha256>}`) and one upload's chunks (`{<uid>}`; ssdrbm_server/store/datasets.py
explains the order of the steps between them). The job hash is the source of
truth for a job's state, attempt and lease; `{jobs}:*` and `tenant:{<t>}:active` are indexes
that follow it in separate steps (ssdrbm_server/store/indexes.py explains the order).

Job, sweep and upload ids are 32 hex digits and dataset ids 64; ids from clients are checked against
those forms before any key is built, so a crafted id cannot name another key (e.g.
`x:metrics`). No part of a key may contain a brace: it would move the hash tag.
"""

from __future__ import annotations

import hashlib
import re
import uuid

DEFAULT_PREFIX = "ssdrbm:"

_JOB_ID = re.compile(r"[0-9a-f]{32}")
_DATASET_ID = re.compile(r"[0-9a-f]{64}")


def is_job_id(value: str) -> bool:
    """True when `value` has the form of a job id (so it is safe inside a key)."""
    return bool(_JOB_ID.fullmatch(value))


def new_id() -> str:
    """A new random id of the job id form (32 hex digits), for a job or a sweep."""
    return uuid.uuid4().hex


def is_dataset_id(value: str) -> bool:
    """True when `value` has the form of a dataset id (a sha256 hex digest)."""
    return bool(_DATASET_ID.fullmatch(value))


def _no_braces(what: str, value: str) -> str:
    # A brace in a prefix, tenant or id would change which part of the key is its hash tag,
    # silently putting a job's or tenant's keys into different Cluster slots.
    if "{" in value or "}" in value:
        raise ValueError(f"{what} {value!r} must not contain '{{' or '}}'")
    return value


class Keys:
    """Builds the service's Redis keys under one prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if prefix and not prefix.endswith(":"):
            prefix += ":"
        self.prefix = _no_braces("key prefix", prefix)

    # --- one job: hash tag {<id>} ---
    def job(self, job_id: str) -> str:
        return f"{self.prefix}job:{{{_no_braces('job id', job_id)}}}"

    def events(self, job_id: str) -> str:
        return f"{self.job(job_id)}:metrics"

    def checkpoint_index(self, job_id: str) -> str:
        return f"{self.job(job_id)}:ckpts"

    def checkpoint(self, job_id: str, step: int) -> str:
        return f"{self.job(job_id)}:ckpt:{int(step)}"

    # --- the global job indexes: hash tag {jobs} ---
    # The per-tenant queues live in the {jobs} slot, not the tenant's: the versioned index step
    # (store/indexes.py) then queues a job atomically with its state, and the worker's take picks
    # a tenant and pops its job in one script (store/queue.py).
    def tenant_queue(self, tenant: str) -> str:
        return f"{self.prefix}{{jobs}}:queue:{_no_braces('tenant', tenant)}"

    def tenant_sweep_queue(self, tenant: str) -> str:
        """The tenant's queued sweep runs, served after its other jobs (store/queue.py)."""
        return f"{self.prefix}{{jobs}}:sweep-queue:{_no_braces('tenant', tenant)}"

    def queue_for(self, tenant: str, *, sweep_run: bool = False) -> str:
        """The list a queued job of the tenant goes into (a sweep's run or not)."""
        return self.tenant_sweep_queue(tenant) if sweep_run else self.tenant_queue(tenant)

    def queue_rotation(self) -> str:
        return f"{self.prefix}{{jobs}}:tenants"

    def queue_served(self) -> str:
        return f"{self.prefix}{{jobs}}:served"

    def queue_taken(self) -> str:
        return f"{self.prefix}{{jobs}}:taken"

    def queue_ready(self) -> str:
        return f"{self.prefix}{{jobs}}:ready"

    # Preemptions under way, each for the waiting work it frees a slot for (store/queue.py).
    def preempted_for_turns(self) -> str:
        return f"{self.prefix}{{jobs}}:preempted-for:turns"

    def preempted_for_jobs(self) -> str:
        return f"{self.prefix}{{jobs}}:preempted-for:jobs"

    def leases(self) -> str:
        return f"{self.prefix}{{jobs}}:leases"

    def jobs_in_state(self, state: str) -> str:
        return f"{self.prefix}{{jobs}}:state:{state}"

    def index_versions(self) -> str:
        return f"{self.prefix}{{jobs}}:versions"

    def forgotten(self) -> str:
        return f"{self.prefix}{{jobs}}:forgotten"

    def purge_schedule(self) -> str:
        return f"{self.prefix}{{jobs}}:purge"

    def sweep_purge_schedule(self) -> str:
        return f"{self.prefix}{{jobs}}:sweep_purge"

    # --- one tenant: hash tag {<t>} ---
    def _tenant(self, tenant: str) -> str:
        return f"{self.prefix}tenant:{{{_no_braces('tenant', tenant)}}}"

    def tenant_jobs(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:jobs"

    def tenant_sequence(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:seq"

    def tenant_active(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:active"

    def tenant_datasets(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:datasets"

    # In the tenant's slot with its datasets and active set: a submit takes the reference in
    # the step that accepts the job, and a delete of the dataset checks it in one step too.
    def tenant_job_datasets(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:job_datasets"

    def idempotency(self, tenant: str, request_id: str) -> str:
        # Hashed: a request id is free text (any length, any character, ':' included).
        digest = hashlib.sha256(request_id.encode()).hexdigest()
        return f"{self._tenant(tenant)}:idem:{digest}"

    def tenant_dataset_bytes(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:dataset_bytes"

    # A sweep's keys share its tenant's slot: the ASHA decision script reads the sweep's
    # settings and its rung in one step (ssdrbm_server/store/rungs.py).
    def tenant_sweeps(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:sweeps"

    def tenant_sweep_sequence(self, tenant: str) -> str:
        return f"{self._tenant(tenant)}:sweep_seq"

    def sweep_idempotency(self, tenant: str, request_id: str) -> str:
        digest = hashlib.sha256(request_id.encode()).hexdigest()
        return f"{self._tenant(tenant)}:sweep_idem:{digest}"

    def sweep(self, tenant: str, sweep_id: str) -> str:
        return f"{self._tenant(tenant)}:sweep:{_no_braces('sweep id', sweep_id)}"

    def sweep_runs(self, tenant: str, sweep_id: str) -> str:
        return f"{self.sweep(tenant, sweep_id)}:runs"

    def sweep_rung(self, tenant: str, sweep_id: str, step: int) -> str:
        return f"{self.sweep(tenant, sweep_id)}:rung:{int(step)}"

    def sweep_decisions(self, tenant: str, sweep_id: str) -> str:
        return f"{self.sweep(tenant, sweep_id)}:decisions"

    # --- one dataset: hash tag {<sha256>} ---
    def dataset(self, dataset_id: str) -> str:
        return f"{self.prefix}dataset:{{{_no_braces('dataset id', dataset_id)}}}"

    def dataset_tenants(self, dataset_id: str) -> str:
        return f"{self.dataset(dataset_id)}:tenants"

    # --- one upload's chunks: hash tag {<uid>} ---
    def upload(self, upload_id: str) -> str:
        return f"{self.prefix}upload:{{{_no_braces('upload id', upload_id)}}}"
