"""The serving RPCs' short-lived job-record cache: it saves Redis reads without weakening
tenancy, FAILED_PRECONDITION before a first checkpoint, or serving newer checkpoints."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest
import redis
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.keys import Keys
from ssdrbm_server.recent_jobs import JOB_RECORD_TTL_S, RecentJobs
from ssdrbm_server.store.records import JobRecord, JobState
from tests.fixtures.jobs import finish_with_checkpoint, float_tensor, rpc_error, tiny_request
from tests.fixtures.service import RunningService

ALPHA, BETA = "alpha-secret-1", "beta-secret-2"


def record(
    job_id: str = "a" * 32, *, tenant: str = "alpha", checkpoint_step: int = 10
) -> JobRecord:
    return JobRecord(
        id=job_id, tenant=tenant, name="", state=JobState.RUNNING, spec=b"", step=10,
        total_steps=40, attempt=1, error="", checkpoint_step=checkpoint_step, worker="w",
        created_at=0.0, started_at=0.0, finished_at=None, n_visible=16, latest_metrics=b"",
        cancel_requested=False,
    )  # fmt: skip


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_record_is_kept_for_its_lifetime_only() -> None:
    clock = Clock()
    recent = RecentJobs(ttl_s=0.5, clock=clock)
    recent.put("alpha", record())
    assert recent.get("alpha", "a" * 32) == record()
    clock.now += 0.49
    assert recent.get("alpha", "a" * 32) == record()
    clock.now += 0.02
    assert recent.get("alpha", "a" * 32) is None
    assert len(recent) == 0


def test_a_record_answers_only_the_tenant_that_read_it() -> None:
    recent = RecentJobs(clock=Clock())
    recent.put("alpha", record())
    assert recent.get("beta", "a" * 32) is None


def test_a_job_without_a_checkpoint_is_not_kept() -> None:
    recent = RecentJobs(clock=Clock())
    recent.put("alpha", record(checkpoint_step=-1))
    assert recent.get("alpha", "a" * 32) is None


def test_expired_and_surplus_records_are_dropped() -> None:
    clock = Clock()
    recent = RecentJobs(ttl_s=0.5, capacity=3, clock=clock)
    for index in range(5):
        recent.put("alpha", record(f"{index:032d}"))
    assert len(recent) == 3
    assert recent.get("alpha", f"{0:032d}") is None  # the oldest went first
    assert recent.get("alpha", f"{4:032d}") is not None
    clock.now += 1.0
    recent.put("alpha", record("b" * 32))
    assert len(recent) == 1
    newer = replace(record("b" * 32), checkpoint_step=20)
    recent.put("alpha", newer)
    assert recent.get("alpha", "b" * 32) == newer


@pytest.fixture
def secured(service_factory: Callable[..., RunningService]) -> RunningService:
    return service_factory(
        run_worker=False, auth_mode="token", auth_tokens=f"{ALPHA}=alpha,{BETA}=beta"
    )


def reconstruct(stub, job_id: str) -> rbm_pb2.ReconstructResponse:
    return stub.Reconstruct(
        rbm_pb2.ReconstructRequest(job_id=job_id, input=float_tensor(1, 16), mean_field=True),
        timeout=10,
    )


def hidden(stub, job_id: str) -> rbm_pb2.SampleHiddenResponse:
    return stub.SampleHidden(
        rbm_pb2.SampleHiddenRequest(job_id=job_id, input=float_tensor(1, 16)), timeout=10
    )


def add_newer_checkpoint(redis_url: str, job_id: str, *, old: int, new: int) -> None:
    """A second, intact checkpoint at step ``new`` (the model of ``old``), named by the job."""
    client = redis.Redis.from_url(redis_url)
    try:
        saved = client.hgetall(Keys().checkpoint(job_id, old))
        client.hset(Keys().checkpoint(job_id, new), mapping={**saved, b"step": str(new).encode()})
        client.zadd(Keys().checkpoint_index(job_id), {str(new): new})
        client.hset(Keys().job(job_id), "checkpoint_step", new)
    finally:
        client.close()


def test_a_served_job_stays_not_found_for_another_tenant(
    secured: RunningService, redis_url: str
) -> None:
    alpha, beta = secured.stub(token=ALPHA), secured.stub(token=BETA)
    job = alpha.StartTraining(tiny_request()).job
    finish_with_checkpoint(redis_url, job.id, step=10)
    assert reconstruct(alpha, job.id).checkpoint_step == 10  # alpha's lookup is now cached
    assert hidden(alpha, job.id).checkpoint_step == 10
    for call in (lambda: reconstruct(beta, job.id), lambda: hidden(beta, job.id)):
        error = rpc_error(call)
        assert error.code() is grpc.StatusCode.NOT_FOUND, error.details()


def test_a_newer_checkpoint_is_served_within_the_cache_lifetime(
    secured: RunningService, redis_url: str
) -> None:
    alpha = secured.stub(token=ALPHA)
    job = alpha.StartTraining(tiny_request()).job
    finish_with_checkpoint(redis_url, job.id, step=10)
    assert reconstruct(alpha, job.id).checkpoint_step == 10
    add_newer_checkpoint(redis_url, job.id, old=10, new=20)
    time.sleep(JOB_RECORD_TTL_S + 0.1)  # let the cached record lapse
    assert reconstruct(alpha, job.id).checkpoint_step == 20
    assert hidden(alpha, job.id).checkpoint_step == 20


def test_the_first_checkpoint_is_served_right_after_failed_precondition(
    secured: RunningService, redis_url: str
) -> None:
    alpha = secured.stub(token=ALPHA)
    job = alpha.StartTraining(tiny_request()).job
    for call in (lambda: reconstruct(alpha, job.id), lambda: hidden(alpha, job.id)):
        error = rpc_error(call)
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error.details()
    finish_with_checkpoint(redis_url, job.id, step=10)
    # No waiting: a job without a checkpoint is never cached.
    assert reconstruct(alpha, job.id).checkpoint_step == 10
