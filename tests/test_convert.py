"""Record → wire conversion (ssdrbm_server.convert) and what the SDK and CLI make of it."""

from __future__ import annotations

import dataclasses

from ssdrbm.cli.tables import job_details
from ssdrbm.events import Job

from ssdrbm_server.convert import job_to_proto
from ssdrbm_server.store.records import JobRecord, JobState


def _record(**changes: object) -> JobRecord:
    record = JobRecord(
        id="0" * 32,
        tenant="t",
        name="crashing",
        state=JobState.RUNNING,
        spec=b"",
        step=40,
        total_steps=100,
        attempt=3,
        error="",
        checkpoint_step=30,
        worker="w1",
        created_at=1_700_000_000.0,
        started_at=1_700_000_001.0,
        finished_at=None,
        n_visible=16,
        latest_metrics=b"",
        cancel_requested=False,
    )
    return dataclasses.replace(record, **changes)


def test_training_process_failures_reach_the_job_the_sdk_and_the_cli() -> None:
    message = job_to_proto(_record(child_failures=2))
    assert message.training_process_failures == 2
    job = Job.from_proto(message)
    assert job.training_process_failures == 2
    assert "training process failures: 2" in job_details(job)


def test_a_job_without_training_process_failures_shows_none() -> None:
    job = Job.from_proto(job_to_proto(_record()))
    assert job.training_process_failures == 0
    assert "training process failures" not in job_details(job)
