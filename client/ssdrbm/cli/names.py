"""A job named on the command line: by its id, or by its name when exactly one of the caller's jobs
has it, as the service resolves model names for inference. The service's job calls take ids
only, so a name is looked up in the caller's listing (ListJobs)."""

from __future__ import annotations

import itertools

from ssdrbm.cli.funnel import UsageError
from ssdrbm.client import Client
from ssdrbm.errors import NotFound
from ssdrbm.events import Job

NAME_SCAN_PAGE = 1000  # jobs per listing page while looking a name up


def find_job(client: Client, id_or_name: str) -> Job:
    """The caller's job ``id_or_name`` names: an id first, then a unique job name.

    NotFound (the service's, for the id) when neither names a job; UsageError when the name is
    shared by several jobs, naming two of them.
    """
    try:
        return client.get_job(id_or_name)
    except NotFound:
        named = jobs_named(client, id_or_name, at_most=2)
        if not named:
            raise
    if len(named) > 1:
        raise UsageError(
            f"{id_or_name!r} names more than one of your jobs (e.g. {named[0].id} and "
            f"{named[1].id}); use the job id"
        )
    return named[0]


def job_id(client: Client, id_or_name: str) -> str:
    """The id of the job ``id_or_name`` names (see :func:`find_job`)."""
    return find_job(client, id_or_name).id


def jobs_named(client: Client, name: str, *, at_most: int) -> list[Job]:
    """Up to ``at_most`` of the caller's jobs called ``name``, newest first."""
    named = (job for job in client.list_jobs(page_size=NAME_SCAN_PAGE) if job.name == name)
    return list(itertools.islice(named, at_most))
