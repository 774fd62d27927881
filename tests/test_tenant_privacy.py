"""What one tenant can learn of others and of the deployment, over real gRPC.

- ListJobs page tokens are opaque and the tenant's own: another tenant's activity does not
  change them, a token handed to another tenant (or forged) is INVALID_ARGUMENT naming
  page_token, and paging returns every job of the caller exactly once.
- Job.worker is an opaque label, not the worker's id (host name and process id); the job
  record keeps the id.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
import redis
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.page_tokens import encode_page_token
from ssdrbm_server.store.records import worker_label
from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.service import RunningService

ALPHA, BETA = "alpha-secret-1", "beta-secret-2"
WAIT_S = 120.0


@pytest.fixture
def tenants(service_factory: Callable[..., RunningService]) -> RunningService:
    """Two tenants, alpha and beta; no worker (listing needs none)."""
    return service_factory(
        run_worker=False, auth_mode="token", auth_tokens=f"{ALPHA}=alpha,{BETA}=beta"
    )


def submit(stub, count: int) -> list[str]:
    return [stub.StartTraining(tiny_request()).job.id for _ in range(count)]


def list_page(stub, page_size: int, token: str = "") -> tuple[list[str], str]:
    response = stub.ListJobs(rbm_pb2.ListJobsRequest(page_size=page_size, page_token=token))
    return [job.id for job in response.jobs], response.next_page_token


def test_page_tokens_reveal_nothing_of_other_tenants(tenants: RunningService) -> None:
    alpha, beta = tenants.stub(token=ALPHA), tenants.stub(token=BETA)
    submit(beta, 3)
    _, beta_token = list_page(beta, 1)
    submit(alpha, 5)
    assert list_page(beta, 1)[1] == beta_token  # alpha's five jobs changed nothing for beta
    assert not beta_token.isdigit()  # opaque: no position to do arithmetic on

    error = rpc_error(lambda: list_page(alpha, 1, beta_token))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token" in error.details()
    forged = encode_page_token("mallory", 10**6)
    assert rpc_error(lambda: list_page(alpha, 1, forged)).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_paging_returns_every_job_of_the_caller_once(tenants: RunningService) -> None:
    alpha, beta = tenants.stub(token=ALPHA), tenants.stub(token=BETA)
    mine = submit(alpha, 5)
    submit(beta, 2)
    seen, token = [], ""
    while True:
        page, token = list_page(alpha, 2, token)
        seen.extend(page)
        if not token:
            break
    assert seen == mine[::-1]  # newest first, each once, none of beta's


def test_tenants_see_a_worker_label_and_records_keep_the_worker_id(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(worker_id="build-host-7.internal-1234")
    stub = running.stub()
    job_id = stub.StartTraining(tiny_request(steps=20)).job.id
    deadline = time.monotonic() + WAIT_S
    job = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id))
    while not job.worker and time.monotonic() < deadline:
        time.sleep(0.1)
        job = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id))
    assert job.worker == worker_label("build-host-7.internal-1234")
    assert "build-host" not in job.worker
    listed = stub.ListJobs(rbm_pb2.ListJobsRequest()).jobs
    assert [j.worker for j in listed] == [job.worker]
    # Nor do the state events of its metric stream name the host ("claimed by w-…").
    events = stub.StreamMetrics(rbm_pb2.StreamMetricsRequest(job_id=job_id, history_only=True))
    messages = [e.state.message for e in events if e.WhichOneof("event") == "state"]
    assert any(job.worker in message for message in messages), messages
    assert not any("build-host" in message for message in messages), messages
    client = redis.Redis.from_url(running.settings.redis_url)
    try:
        stored = client.hget(Keys(running.settings.redis_prefix).job(job_id), "worker")
    finally:
        client.close()
    assert stored == b"build-host-7.internal-1234"
