"""Model names and versions of the Open Inference Protocol in the service's terms.

A model is a job of the caller's tenant, named by its id or, as an alias, by the job's ``name``
when exactly one of the tenant's jobs has it. A model version is a checkpoint step; ""
means the latest checkpoint. Lookups are scoped by tenant, so another tenant's job is
NOT_FOUND, exactly as in ssdrbm.v1.
"""

from __future__ import annotations

import time

from ssdrbm_server.errors import InvalidArgumentError, NotFoundError
from ssdrbm_server.keys import is_job_id
from ssdrbm_server.recent_jobs import JOB_RECORD_TTL_S, RecentJobs
from ssdrbm_server.store.checkpoints import CheckpointStore
from ssdrbm_server.store.jobs import JobStore
from ssdrbm_server.store.records import JobRecord

LATEST = ""
MAX_NAME_LENGTH = 256
NAME_SCAN_PAGE = 1000  # jobs read per listing page while looking a name up
MAX_NAMES_KEPT = 1024


class ModelNames:
    """Resolves model names (job id or unique job name) and versions (checkpoint steps)."""

    def __init__(
        self, jobs: JobStore, checkpoints: CheckpointStore, recent_jobs: RecentJobs
    ) -> None:
        self.jobs = jobs
        self.checkpoints = checkpoints
        # Shared with RBMService, so a deleted job is forgotten by both at once.
        self.recent_jobs = recent_jobs
        # (tenant, name) → (expiry, job id): a hot alias costs no listing scan per call; kept
        # as briefly as job records are, so a new job taking the same name shows up as quickly.
        self._aliases: dict[tuple[str, str], tuple[float, str]] = {}

    async def job(self, tenant: str, name: str) -> JobRecord:
        """The tenant's job called ``name`` (its id, or its unique name)."""
        _check_name(name)
        if is_job_id(name):
            try:
                return await self.recent_jobs.read(tenant, name, self.jobs.get)
            except NotFoundError:
                pass  # a name may look like an id; try it as one
        job_id = self._alias(tenant, name) or await self._find_name(tenant, name)
        return await self.recent_jobs.read(tenant, job_id, self.jobs.get)

    async def versions(self, job: JobRecord) -> list[int]:
        """The checkpoint steps that can be served (retained), oldest first."""
        if job.checkpoint_step < 0:
            return []
        return await self.checkpoints.list_steps(job.id)

    def _alias(self, tenant: str, name: str) -> str | None:
        entry = self._aliases.get((tenant, name))
        if entry is None or entry[0] <= time.monotonic():
            return None
        return entry[1]

    async def _find_name(self, tenant: str, name: str) -> str:
        """The id of the tenant's one job named ``name``, scanning its listing."""
        found: list[str] = []
        token = ""
        while True:
            page, token = await self.jobs.list(
                tenant, page_size=NAME_SCAN_PAGE, page_token=token, state=None
            )
            found += [job.id for job in page if job.name == name]
            if len(found) > 1:
                raise InvalidArgumentError(
                    "model name",
                    f"{name!r} names more than one of your jobs (e.g. {found[0]} and "
                    f"{found[1]}); use the job id as the model name",
                )
            if not token:
                break
        if not found:
            raise NotFoundError(
                f"model {name!r} not found: use a job id, or the name of one of your jobs",
                resource_type="model",
                resource_name=name,
            )
        if len(self._aliases) >= MAX_NAMES_KEPT:
            self._aliases.clear()  # rare: many names in half a second; start afresh
        self._aliases[(tenant, name)] = (time.monotonic() + JOB_RECORD_TTL_S, found[0])
        return found[0]


def parse_version(version: str) -> int:
    """The checkpoint step a model version names (0 for "" = the latest)."""
    if version == LATEST:
        return 0
    if not (version.isascii() and version.isdigit()) or int(version) < 1:
        raise InvalidArgumentError(
            "model version",
            f"must be a checkpoint step (a positive integer, see ModelMetadata's versions) or "
            f"empty for the latest, got {version!r}",
        )
    return int(version)


def _check_name(name: str) -> None:
    if not name:
        raise InvalidArgumentError("model name", "is required: use a job id or a job's name")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgumentError(
            "model name", f"is longer than {MAX_NAME_LENGTH} characters; use the job id"
        )
