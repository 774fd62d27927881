"""The Redis store on a real 3-node Redis Cluster: every script and transaction stays in one
slot, each job's keys share a slot, different jobs spread over the nodes, and the whole job
life (submit, claim, fenced writes, checkpoints, events, cancel, listing, datasets, the queue)
works there as on a single Redis.

The cluster client refuses, before sending, a script or MULTI whose keys span slots, and the
servers refuse it too (CROSSSLOT), so each scenario passing is the proof for its requests."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from ssdrbm import Client, MetricsEvent
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.errors import FailedPreconditionError, ResourceExhaustedError
from ssdrbm_server.keys import Keys
from ssdrbm_server.store import (
    CheckpointStore,
    DatasetStore,
    EventStore,
    FencedJob,
    JobQueue,
    JobState,
    JobStore,
    LeaseLostError,
    LeaseStore,
)
from tests.fixtures.redis import RedisClusterNodes
from tests.fixtures.service import RunningService, make_settings
from tests.test_store import dataset_references, metrics, read_all, run, states_of, submit

JOBS = 16  # enough that all of them landing on one of 3 nodes is out of the question (3^-15)


def run_on_cluster(url: str, scenario) -> None:
    run(url, scenario, cluster=True)


def test_a_jobs_keys_share_one_slot_and_jobs_spread_over_the_nodes(
    redis_cluster: RedisClusterNodes, redis_cluster_url: str
) -> None:
    keys = Keys()
    owners: dict[str, int] = {}  # job id -> port of the node owning its slot

    async def scenario(redis: RedisCluster) -> None:
        assert isinstance(redis, RedisCluster)
        jobs = JobStore(redis)
        ids = [(await submit(jobs, tenant=f"t{i % 2}"))[0].id for i in range(JOBS)]
        slots = []
        for job_id in ids:
            job_keys = [
                keys.job(job_id),
                keys.events(job_id),
                keys.checkpoint_index(job_id),
                keys.checkpoint(job_id, 10),
            ]
            assert len({key_slot(key.encode()) for key in job_keys}) == 1
            slots.append(key_slot(keys.job(job_id).encode()))
        assert len(set(slots)) > 1
        owners.update({job_id: redis.get_node_from_key(keys.job(job_id)).port for job_id in ids})
        assert len(set(owners.values())) > 1
        for tenant in ("t0", "t1"):
            tenant_keys = [
                keys.tenant_jobs(tenant),
                keys.tenant_sequence(tenant),
                keys.tenant_active(tenant),
                keys.tenant_datasets(tenant),
                keys.idempotency(tenant, "request"),
            ]
            assert len({key_slot(key.encode()) for key in tenant_keys}) == 1
        shared = [keys.leases(), keys.index_versions(), keys.queue_rotation(), keys.queue_served()]
        shared += [keys.queue_taken(), keys.queue_ready(), keys.tenant_queue("t0")]
        shared += [keys.jobs_in_state(state.value) for state in JobState]
        assert len({key_slot(key.encode()) for key in shared}) == 1

    run_on_cluster(redis_cluster_url, scenario)
    # Each job's keys really are stored on the node owning its slot, and only there.
    for node in redis_cluster.nodes:
        client = node.client()
        try:
            held = {key.decode() for key in client.keys("*")}
        finally:
            client.close()
        for job_id, port in owners.items():
            stored = {keys.job(job_id), keys.events(job_id)} <= held
            assert stored == (port == node.port)


def test_submit_claim_and_fenced_writes_on_a_cluster(redis_cluster_url: str) -> None:
    async def scenario(redis: RedisCluster) -> None:
        jobs, leases, events = JobStore(redis), LeaseStore(redis), EventStore(redis)
        checkpoints = CheckpointStore(redis)
        job, created = await submit(jobs, request_id="req", max_active=2)
        again, created_again = await submit(jobs, request_id="req", max_active=2)
        assert created and not created_again and again.id == job.id
        await submit(jobs, max_active=2)
        with pytest.raises(ResourceExhaustedError):
            await submit(jobs, max_active=2)

        first = await leases.claim(job.id, "slow", lease_ms=300)
        assert first is not None and first.attempt == 1
        slow = FencedJob(redis, first)
        assert await slow.heartbeat() is False
        assert await leases.claim(job.id, "eager", lease_ms=10_000) is None  # still held
        assert [await slow.publish_metrics(s, metrics(s)) for s in (1, 2, 2)] == [True, True, False]
        for step in (1, 2, 3):
            await slow.put_checkpoint(
                step, data=b"model-%d" % step, config_json="{}", trainer_state=b"t", keep=2
            )
        assert await checkpoints.list_steps(job.id) == [2, 3]
        await redis.hset(Keys().checkpoint(job.id, 3), "data", b"damaged")
        assert (await checkpoints.latest(job.id)).step == 2  # falls back past the damaged one
        await slow.backoff(rollback_step=1, event_data=b"diverged")
        assert await slow.publish_metrics(2, metrics(2))  # retrained after the backoff

        await asyncio.sleep(0.4)
        assert await leases.lapsed() == [job.id]
        second = await leases.claim(job.id, "eager", lease_ms=10_000)
        assert second is not None and second.attempt == 2
        with pytest.raises(LeaseLostError):
            await slow.publish_metrics(3, metrics(3))
        eager = FencedJob(redis, second)
        await eager.release(step=2, message="stopping")
        third = await leases.claim(job.id, "last", lease_ms=10_000)
        assert third is not None and third.attempt == 3
        await FencedJob(redis, third).finish(JobState.SUCCEEDED, step=2)
        record = await jobs.get("t1", job.id)
        assert record.state is JobState.SUCCEEDED and record.backoffs == 1
        assert states_of(await read_all(events, job.id)) == [
            "JOB_STATE_QUEUED",
            "JOB_STATE_RUNNING",
            "JOB_STATE_RUNNING",
            "JOB_STATE_QUEUED",
            "JOB_STATE_RUNNING",
            "JOB_STATE_SUCCEEDED",
        ]
        assert await leases.lapsed() == [] and await jobs.count_active("t1") == 1
        await submit(jobs, max_active=2)  # the finished job freed its place

    run_on_cluster(redis_cluster_url, scenario)


def test_cancel_list_and_counts_on_a_cluster(redis_cluster_url: str) -> None:
    async def scenario(redis: RedisCluster) -> None:
        jobs, leases = JobStore(redis), LeaseStore(redis)
        ids = [(await submit(jobs))[0].id for _ in range(5)]
        cancelled = await jobs.cancel("t1", ids[1])
        assert cancelled.state is JobState.CANCELLED
        running = await leases.claim(ids[3], "w1", lease_ms=10_000)
        assert (await jobs.cancel("t1", ids[3])).cancel_requested
        assert await FencedJob(redis, running).heartbeat() is True
        await FencedJob(redis, running).finish(JobState.CANCELLED, step=0)

        pages, token = [], ""
        while True:
            page, token = await jobs.list("t1", page_size=2, page_token=token, state=None)
            pages += [j.id for j in page]
            if not token:
                break
        assert pages == ids[::-1]
        only, _ = await jobs.list("t1", page_size=5, page_token="", state=JobState.CANCELLED)
        assert [j.id for j in only] == [ids[3], ids[1]]
        counts = await jobs.count_by_state()
        assert (counts[JobState.QUEUED], counts[JobState.CANCELLED]) == (3, 2)
        assert await jobs.count_active("t1") == 3

    run_on_cluster(redis_cluster_url, scenario)


def test_events_queue_and_datasets_on_a_cluster(redis_cluster_url: str) -> None:
    async def scenario(redis: RedisCluster) -> None:
        jobs, leases, events, queue = (
            JobStore(redis),
            LeaseStore(redis),
            EventStore(redis),
            JobQueue(redis),
        )
        job, _ = await submit(jobs)
        [(entry, job_id)] = await queue.read("dead", block_ms=200)
        assert job_id == job.id
        await asyncio.sleep(0.05)
        [(entry, taken)] = await queue.autoclaim("w1", min_idle_ms=20)
        assert taken == job.id and await queue.pending("dead") == []
        fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=10_000))
        await queue.ack(entry)
        assert await queue.pending("w1") == [] and await queue.length() == 0

        last = await events.last_token(job.id)
        follower = asyncio.create_task(events.read(job.id, after=last, count=5, block_ms=5000))
        await asyncio.sleep(0.1)
        await fenced.publish_metrics(7, metrics(7))
        [(token, kind, data)] = await asyncio.wait_for(follower, 5)
        assert kind == "metrics" and rbm_pb2.Metrics.FromString(data).step == 7
        replay = await read_all(events, job.id)
        assert [t for t, _, _ in replay][-1] == token and len(replay) == 3

        datasets = DatasetStore(redis)
        array = np.arange(6, dtype="<f4").reshape(2, 3)
        info, created = await datasets.put(
            "t1", shape=(2, 3), dtype="float32", name="a", data=array.tobytes()
        )
        loaded, raw = await datasets.load("t1", info.id)
        assert created and loaded == info and raw == array.tobytes()
        theirs, created_theirs = await datasets.put(
            "t2", shape=(2, 3), dtype="float32", name="b", data=array.tobytes()
        )
        assert created_theirs and theirs.id == info.id and theirs.name == "b"
        with pytest.raises(FailedPreconditionError):
            await CheckpointStore(redis).latest(job.id)

    run_on_cluster(redis_cluster_url, scenario)


def test_dataset_references_on_a_cluster(redis_cluster_url: str) -> None:
    run_on_cluster(redis_cluster_url, dataset_references)


def test_the_whole_service_runs_a_job_on_the_cluster(redis_cluster_url: str) -> None:
    """The gRPC server and its worker on the cluster (SSDRBM_REDIS_CLUSTER=1): a job is
    submitted, trained, followed to its end and served."""
    settings = make_settings(redis_cluster_url, redis_cluster=True)
    with RunningService(settings) as service, Client(service.target) as client:
        job = client.start_training(n_hidden=4, steps=40, eval_every=10, batch_size=20)
        done = client.wait(job.id, timeout=120)
        assert done.state == JobState.SUCCEEDED.value.lower(), done.error
        steps = [
            event.metrics.step
            for event in client.stream_metrics(job.id, follow=False)
            if isinstance(event, MetricsEvent)
        ]
        assert steps == [10, 20, 30, 40]
        features = client.sample_hidden(job.id, np.zeros((3, 100), dtype=np.float32))
        assert features.shape == (3, 4)


def test_chunked_datasets_on_a_cluster(redis_cluster_url: str) -> None:
    keys = Keys()

    async def scenario(redis: RedisCluster) -> None:
        datasets = DatasetStore(redis, chunk_bytes=64)
        array = np.random.default_rng(0).random((40, 10), dtype=np.float32)
        info, created = await datasets.put(
            "t1", shape=(40, 10), dtype="float32", name="x", data=array.tobytes()
        )
        theirs, created_theirs = await datasets.put(
            "t2", shape=(40, 10), dtype="float32", name="y", data=array.tobytes()
        )
        assert created and created_theirs and theirs.id == info.id
        slots = {
            key_slot(k.encode()) for k in (keys.dataset(info.id), keys.dataset_tenants(info.id))
        }
        assert len(slots) == 1
        assert (await datasets.load("t1", info.id))[1] == array.tobytes()
        page, _ = await datasets.list("t2", page_size=5, page_token="")
        assert [d.name for d in page] == ["y"]
        await datasets.delete("t1", info.id)
        await datasets.delete("t2", info.id)
        assert await redis.exists(keys.dataset(info.id)) == 0

    run_on_cluster(redis_cluster_url, scenario)


def test_the_tenant_rotation_of_the_queue_on_a_cluster(redis_cluster_url: str) -> None:
    """The per-tenant lists, the rotation, the taken entries and the wake-up token share the
    `{jobs}` slot, so enqueue (the index step), take, retake and ack each stay in one slot."""
    keys = Keys()
    queue_keys = [keys.tenant_queue(f"t{i}") for i in range(3)]
    queue_keys += [keys.queue_rotation(), keys.queue_served(), keys.queue_taken()]
    queue_keys += [keys.queue_ready(), keys.leases(), keys.index_versions()]
    assert len({key_slot(key.encode()) for key in queue_keys}) == 1

    async def scenario(redis: RedisCluster) -> None:
        jobs, queue = JobStore(redis), JobQueue(redis)
        tenant_of = {}
        for tenant in ("t0", "t0", "t0", "t1"):
            tenant_of[(await submit(jobs, tenant=tenant))[0].id] = tenant
        assert await queue.rotation() == ["t0", "t1"]
        [(dead_entry, _)] = await queue.read("dead", block_ms=0)
        taken = [await queue.read("w1", block_ms=200) for _ in range(3)]
        assert [tenant_of[job_id] for [(_, job_id)] in taken] == ["t1", "t0", "t0"]
        assert await queue.read("w1", block_ms=50) == []  # waited on the wake-up token
        for [(entry, _)] in taken:
            await queue.ack(entry)
        await asyncio.sleep(0.05)
        [(retaken, job_id)] = await queue.autoclaim("w1", min_idle_ms=20)
        assert dead_entry.startswith(job_id) and await queue.pending("dead") == []
        await queue.ack(retaken)
        assert await queue.length() == 0 and await queue.rotation() == []

    run_on_cluster(redis_cluster_url, scenario)
