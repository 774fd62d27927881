"""Fairness between tenants: each tenant gets a share of the server's metric streams, so one
tenant holding many cannot lock the others out; the queue serves tenants in rotation, so one
tenant's backlog does not delay another tenant's first job."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.resolver import resolve
from ssdrbm_server.store import JobQueue, JobState, JobStore
from ssdrbm_server.worker import Worker
from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.service import RunningService
from tests.test_store import run, submit
from tests.test_worker import SETTINGS, TENANT, Harness, run_with_workers, spec


def test_one_tenant_cannot_take_every_metric_stream(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens="ta=alice,tb=bob",
        max_streams=10,
        max_streams_per_tenant=2,
    )
    alice, bob = running.stub(token="ta"), running.stub(token="tb")
    streams = []
    for stub in (alice, bob):
        job = stub.StartTraining(tiny_request()).job  # queued: its streams stay open
        follow = pb.StreamMetricsRequest(job_id=job.id)
        if stub is alice:
            streams += [alice.StreamMetrics(follow) for _ in range(2)]
            for stream in streams:
                assert next(stream).state.state == pb.JOB_STATE_QUEUED  # opened on the server
            error = rpc_error(lambda f=follow: alice.StreamMetrics(f))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SSDRBM_MAX_STREAMS_PER_TENANT=2" in error.details()
            assert "'alice' already has 2" in error.details()
        else:  # the server is far from its global cap: the other tenant still gets a stream
            stream = bob.StreamMetrics(follow)
            assert next(stream).state.state == pb.JOB_STATE_QUEUED
            streams.append(stream)
    for stream in streams:
        stream.cancel()


async def take_tenants(queue: JobQueue, tenant_of: dict[str, str], n: int) -> list[str]:
    """The tenants of the next `n` jobs a worker takes (each acknowledged at once)."""
    tenants = []
    for _ in range(n):
        [(entry, job_id)] = await queue.read("w1", block_ms=0)
        tenants.append(tenant_of[job_id])
        await queue.ack(entry)
    return tenants


def test_the_queue_serves_tenants_in_rotation(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, queue = JobStore(redis), JobQueue(redis)
        tenant_of: dict[str, str] = {}

        async def submit_as(tenant: str) -> str:
            job_id = (await submit(jobs, tenant=tenant))[0].id
            tenant_of[job_id] = tenant
            return job_id

        a_ids = [await submit_as("a") for _ in range(4)]
        for tenant in ("b", "b", "c"):
            await submit_as(tenant)
        assert await queue.rotation() == ["a", "b", "c"] and await queue.length() == 7

        order = []
        for _ in range(7):
            [(entry, job_id)] = await queue.read("w1", block_ms=0)
            order.append(job_id)
            await queue.ack(entry)
        # Least recently served first: each tenant in turn while it has jobs, then the rest.
        assert [tenant_of[job_id] for job_id in order] == ["a", "b", "c", "a", "b", "a", "a"]
        assert [job_id for job_id in order if job_id in a_ids] == a_ids  # a tenant's own: FIFO
        assert await queue.read("w1", block_ms=0) == [] and await queue.length() == 0
        assert await queue.rotation() == []

        # A tenant re-entering the rotation keeps its last turn: "a", served last, waits for
        # "c" even though it queued first, so queueing one job at a time gains no turns.
        for tenant in ("a", "c", "a"):
            await submit_as(tenant)
        assert await queue.rotation() == ["c", "a"]
        assert await take_tenants(queue, tenant_of, 3) == ["c", "a", "a"]

    run(redis_url, scenario)


def test_one_worker_starts_another_tenants_first_job_before_a_backlog(redis_url: str) -> None:
    """Tenant "big" queues 20 jobs, then another tenant one: the one worker starts that job
    before the big tenant's third (FIFO would start it 21st)."""

    async def no_uploads(_dataset_id: str) -> None:
        return None

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        resolved = await resolve(spec(steps=40), SETTINGS, no_uploads)
        body, steps = resolved.spec.SerializeToString(), resolved.total_steps

        async def submit_as(tenant: str) -> str:
            job, _ = await h.jobs.submit(tenant, body, name="n", total_steps=steps, request_id=None)
            return job.id

        big = [await submit_as("big") for _ in range(20)]
        small = await submit_as(TENANT)  # the tenant the harness waits on
        record = await h.wait_for(small, lambda r: r.state.is_terminal)
        assert record.state is JobState.SUCCEEDED, record.error
        started = [(await h.jobs.get("big", job_id)).started_at for job_id in big]
        first = record.started_at
        ahead = [job_id for job_id, at in zip(big, started, strict=True) if at and at < first]
        assert set(ahead) <= set(big[:2]), f"{len(ahead)} of the big tenant's jobs started first"
        assert record.worker == workers[0].worker_id

    run_with_workers(redis_url, ["w1"], scenario)
