"""Job lifecycle through the service: DeleteJob (SDK, CLI), retention, the per-tenant record
quota, Redis configuration checks at start, a full Redis, and a delete soak with a real worker."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis
from ssdrbm import Client
from ssdrbm import errors as client_errors
from ssdrbm.cli import main
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.v1 import rbm_pb2

from bench.load import SOAK_MEMORY_TOLERANCE_BYTES, SOAK_TOMBSTONE_BYTES, keyspace_bytes
from ssdrbm_server.config import Settings
from ssdrbm_server.redis_checks import RedisConfigError, check_redis_config
from ssdrbm_server.store import connect
from tests.fixtures.jobs import finish_with_checkpoint, float_tensor, rpc_error, tiny_request

SOAK_JOBS = 30
SOAK_BATCH = 15  # under the per-tenant active-job limit of the test settings (16)
# The keys' own sizes (bench.load.keyspace_bytes; the allocator's total moved by up to ±90 KB
# between two readings of the same data): 30 deleted jobs leave their version tombstones for an
# hour (2.9 KB measured), one job left behind costs about 70 KB (record, stream, checkpoints).
SOAK_MEMORY_TOLERANCE = SOAK_MEMORY_TOLERANCE_BYTES + SOAK_TOMBSTONE_BYTES * SOAK_JOBS


def key_names(redis_url: str) -> list[bytes]:
    return sorted(redis.Redis.from_url(redis_url).keys("*"))


def test_delete_job_removes_it_everywhere_and_serving_forgets_it(service_factory, redis_url):
    running = service_factory(run_worker=False)
    stub = running.stub()
    job_id = stub.StartTraining(tiny_request(request_id="one")).job.id
    finish_with_checkpoint(redis_url, job_id)
    sample = rbm_pb2.SampleHiddenRequest(job_id=job_id, input=float_tensor(2, 16))
    assert stub.SampleHidden(sample).output.shape == [2, 8]  # now in the serving caches

    stub.DeleteJob(rbm_pb2.DeleteJobRequest(job_id=job_id))
    for call in (
        lambda: stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id)),
        lambda: stub.SampleHidden(sample),
        lambda: stub.DeleteJob(rbm_pb2.DeleteJobRequest(job_id=job_id)),
        lambda: stub.StreamMetrics(rbm_pb2.StreamMetricsRequest(job_id=job_id)),
    ):
        assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND
    assert stub.ListJobs(rbm_pb2.ListJobsRequest()).jobs == []
    assert not [key for key in key_names(redis_url) if job_id.encode() in key]
    # The request id names no job any more: repeating it creates a new one.
    again = stub.StartTraining(tiny_request(request_id="one"))
    assert again.created and again.job.id != job_id


def test_another_tenants_job_is_not_found(service_factory, redis_url):
    running = service_factory(run_worker=False, auth_mode="token", auth_tokens="ta=a,tb=b")
    job_id = running.stub(token="ta").StartTraining(tiny_request()).job.id
    other = running.stub(token="tb")
    error = rpc_error(lambda: other.DeleteJob(rbm_pb2.DeleteJobRequest(job_id=job_id, force=True)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert running.stub(token="ta").GetJob(rbm_pb2.GetJobRequest(job_id=job_id)).id == job_id


def test_an_unfinished_job_needs_force(service_factory, redis_url):
    running = service_factory(run_worker=False)
    with Client(running.target) as client:
        job = client.start_training(n_hidden=4, steps=40)
        with pytest.raises(client_errors.FailedPrecondition, match="force"):
            client.delete_job(job.id)
        assert main(["--target", running.target, "delete", job.id]) != ExitCode.OK
        assert main(["--target", running.target, "delete", job.id, "--force"]) == ExitCode.OK
        with pytest.raises(client_errors.NotFound):
            client.get_job(job.id)


def test_a_running_job_deleted_with_force_stops_its_worker(service, redis_url):
    with Client(service.target) as client:
        job = client.start_training(n_hidden=4, steps=1_000_000, eval_every=10)
        while client.get_job(job.id).state != "running":
            pass  # the worker claims it within its poll interval
        client.delete_job(job.id, force=True)
        with pytest.raises(client_errors.NotFound):
            client.get_job(job.id)
        # The worker finds the job gone at its next write, stops it and takes the next job.
        after = client.start_training(n_hidden=4, steps=20, eval_every=10)
        assert client.wait(after.id, timeout=90).state == "succeeded"
    assert not [key for key in key_names(redis_url) if job.id.encode() in key]


def test_a_finished_job_keeps_only_its_last_checkpoint(service):
    stub = service.stub()
    with Client(service.target) as client:
        job = client.start_training(n_hidden=4, steps=60, eval_every=10, checkpoint_every=20)
        assert client.wait(job.id, timeout=90).state == "succeeded"
    # The end and the trim are one step: a job seen ended already has only its kept checkpoint.
    steps = service.run_in_loop(service.service.stores.checkpoints.list_steps(job.id))
    assert steps == [60]
    exported = list(stub.ExportModel(rbm_pb2.ExportModelRequest(job_id=job.id)))
    assert exported[0].header.step == 60


def test_the_job_record_quota_names_itself_and_the_fix(service_factory):
    running = service_factory(run_worker=False, max_job_records_per_tenant=2)
    stub = running.stub()
    first = stub.StartTraining(tiny_request()).job.id
    stub.StartTraining(tiny_request())
    error = rpc_error(lambda: stub.StartTraining(tiny_request()))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_job_records_per_tenant" in error.details() and "delete" in error.details()
    stub.DeleteJob(rbm_pb2.DeleteJobRequest(job_id=first, force=True))
    stub.StartTraining(tiny_request())


def check(url: str, **settings) -> None:
    async def main_() -> None:
        client = connect(url)
        try:
            await check_redis_config(client, Settings(redis_url=url, **settings))
        finally:
            await client.aclose()

    asyncio.run(main_())


def test_redis_that_would_lose_jobs_is_refused_at_start(redis_factory, service_factory):
    volatile = redis_factory(appendonly=False)
    with pytest.raises(RedisConfigError, match="appendonly yes"):
        check(volatile.url)
    check(volatile.url, allow_no_persistence=True)
    with pytest.raises(RuntimeError, match="failed to start"):
        service_factory(volatile.url, allow_no_persistence=False)

    durable = redis_factory(appendonly=True)
    check(durable.url)
    durable.client().config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(RedisConfigError, match="maxmemory-policy noeviction"):
        check(durable.url)


def test_a_full_redis_answers_resource_exhausted(redis_factory, service_factory):
    server = redis_factory(appendonly=True)
    running = service_factory(server.url, run_worker=False)
    stub = running.stub()
    server.client().config_set("maxmemory", 1)
    try:
        error = rpc_error(lambda: stub.StartTraining(tiny_request()))
    finally:
        server.client().config_set("maxmemory", 0)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "job store is full" in error.details()


def test_soak_deleted_jobs_leave_redis_as_it_was(service, redis_url):
    """Submit, finish and delete many small jobs with the real worker: the key count returns
    exactly to its baseline and the keys' bytes to within SOAK_MEMORY_TOLERANCE."""
    plain = redis.Redis.from_url(redis_url)
    with Client(service.target) as client:

        def batch(n: int) -> list[str]:
            ids = [client.start_training(n_hidden=4, steps=20, eval_every=10).id for _ in range(n)]
            for job_id in ids:
                assert client.wait(job_id, timeout=120).state == "succeeded"
            return ids

        # Warm-up: the tenant's last turn in the queue rotation and its counter stay for good.
        for job_id in batch(1):
            client.delete_job(job_id)
        baseline_keys, baseline_memory = plain.dbsize(), keyspace_bytes(plain)
        grown = 0
        for _ in range(SOAK_JOBS // SOAK_BATCH):
            ids = batch(SOAK_BATCH)
            grown = max(grown, keyspace_bytes(plain) - baseline_memory)
            for job_id in ids:
                client.delete_job(job_id)
    # The jobs did occupy memory, so the check below could fail.
    assert grown > SOAK_MEMORY_TOLERANCE
    assert plain.dbsize() == baseline_keys, key_names(redis_url)
    left = keyspace_bytes(plain) - baseline_memory
    assert left < SOAK_MEMORY_TOLERANCE


def test_a_full_redis_pauses_a_running_job_instead_of_failing_it(redis_factory, service_factory):
    """Writes refused for lack of memory are retried by the worker: once Redis has room again
    the job goes on and succeeds, each metric step once in its stream."""
    server = redis_factory(appendonly=True)
    stub = service_factory(server.url).stub()
    job = stub.StartTraining(tiny_request(steps=3000)).job

    def record() -> rbm_pb2.Job:
        return stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id))

    poll_until(lambda: record().step >= 20)
    admin = server.client()
    admin.config_set("maxmemory", 1)  # every write is refused with OOM from now on
    try:
        time.sleep(0.3)  # a write already running when the limit was set may still land
        before = record()
        stalled = before.step
        for _ in range(10):  # while full: no acknowledged progress, and no failure
            current = record()
            assert current.state == rbm_pb2.JOB_STATE_RUNNING, current.error
            assert current.step == stalled
            time.sleep(0.1)
    finally:
        admin.config_set("maxmemory", 0)
    poll_until(lambda: record().state >= rbm_pb2.JOB_STATE_SUCCEEDED)
    done = record()
    assert done.state == rbm_pb2.JOB_STATE_SUCCEEDED, done.error
    assert done.attempt == before.attempt  # the same worker went on: no takeover was needed
    history = stub.StreamMetrics(rbm_pb2.StreamMetricsRequest(job_id=job.id, history_only=True))
    steps = [event.metrics.step for event in history if event.WhichOneof("event") == "metrics"]
    assert steps == list(range(10, 3001, 10))


def poll_until(condition, timeout_s: float = 120.0) -> None:
    """Poll ``condition`` until it holds (the timeout only stops a hang; it measures nothing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)
