"""The Redis store against a real redis-server: jobs, paging, events, checkpoints, leases,
fencing, datasets and the queue."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from ssdrbm_server.keys import Keys
from ssdrbm_server.store import (
    CheckpointStore,
    CorruptCheckpointError,
    DatasetStore,
    EventStore,
    FencedJob,
    JobQueue,
    JobState,
    JobStore,
    LeaseLostError,
    LeaseStore,
    connect,
)
from ssdrbm_server.store.datasets import DatasetInUseError
from ssdrbm_server.store.lifecycle import Retention

SPEC = rbm_pb2.StartTrainingRequest(
    model=rbm_pb2.ModelSpec(n_hidden=4), training=rbm_pb2.TrainingSpec(steps=10)
).SerializeToString()


def run(redis_url: str, scenario: Callable[..., Awaitable[None]], *, cluster: bool = False) -> None:
    """Run an async scenario with a fresh client (closed afterwards)."""

    async def main() -> None:
        redis = connect(redis_url, cluster=cluster)
        try:
            await scenario(redis)
        finally:
            await redis.aclose()

    asyncio.run(main())


async def submit(jobs: JobStore, tenant: str = "t1", request_id: str | None = None, **kw):
    return await jobs.submit(tenant, SPEC, name="n", total_steps=10, request_id=request_id, **kw)


async def read_all(events: EventStore, job_id: str) -> list[tuple[str, str, bytes]]:
    return await events.read(job_id, after="", count=10_000, block_ms=None)


def states_of(events: list[tuple[str, str, bytes]]) -> list[str]:
    names = []
    for _token, kind, data in events:
        if kind == "state":
            names.append(rbm_pb2.JobState.Name(rbm_pb2.StateChange.FromString(data).state))
    return names


def test_submit_records_queues_and_is_idempotent(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, events, queue = JobStore(redis), EventStore(redis), JobQueue(redis)
        job, created = await submit(jobs, request_id="req-1")
        assert created
        assert job.state is JobState.QUEUED and job.attempt == 0 and job.checkpoint_step == -1
        assert job.spec == SPEC and job.total_steps == 10 and job.started_at is None
        again, created_again = await submit(jobs, request_id="req-1")
        assert not created_again and again.id == job.id
        other_tenant, created_other = await submit(jobs, tenant="t2", request_id="req-1")
        assert created_other and other_tenant.id != job.id
        assert await queue.length() == 2  # the repeat enqueued nothing
        assert states_of(await read_all(events, job.id)) == ["JOB_STATE_QUEUED"]
        listed, _ = await jobs.list("t1", page_size=10, page_token="", state=None)
        assert [j.id for j in listed] == [job.id]

    run(redis_url, scenario)


def test_get_hides_other_tenants_and_malformed_ids(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs = JobStore(redis)
        job, _ = await submit(jobs)
        assert (await jobs.get("t1", job.id)).id == job.id
        with pytest.raises(NotFoundError):
            await jobs.get("t2", job.id)
        for bad in ["", "nope", job.id + ":metrics", "é" * 32, job.id.upper()]:
            with pytest.raises(NotFoundError):
                await jobs.get("t1", bad)

    run(redis_url, scenario)


def test_list_pages_newest_first_with_state_filter(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs = JobStore(redis)
        ids = [(await submit(jobs))[0].id for _ in range(7)]
        await submit(jobs, tenant="other")
        pages, token = [], ""
        while True:
            page, token = await jobs.list("t1", page_size=3, page_token=token, state=None)
            pages.append([j.id for j in page])
            if not token:
                break
        assert pages == [ids[6:3:-1], ids[3:0:-1], ids[0:1]]
        await jobs.cancel("t1", ids[1])
        await jobs.cancel("t1", ids[5])
        cancelled, token = await jobs.list(
            "t1", page_size=1, page_token="", state=JobState.CANCELLED
        )
        assert [j.id for j in cancelled] == [ids[5]] and token
        rest, token = await jobs.list("t1", page_size=5, page_token=token, state=JobState.CANCELLED)
        assert [j.id for j in rest] == [ids[1]] and token == ""
        for bad in ["abc", "-1", "1" * 30]:
            with pytest.raises(InvalidArgumentError, match="page_token"):
                await jobs.list("t1", page_size=3, page_token=bad, state=None)

    run(redis_url, scenario)


def test_cancel_queued_at_once_and_running_by_flag(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, events, leases = JobStore(redis), EventStore(redis), LeaseStore(redis)
        queued, _ = await submit(jobs)
        running, _ = await submit(jobs)
        assert await jobs.count_active("t1") == 2
        lease = await leases.claim(running.id, "w1", lease_ms=10_000)
        assert lease is not None
        fenced = FencedJob(redis, lease)
        assert await fenced.heartbeat() is False

        cancelled = await jobs.cancel("t1", queued.id)
        assert cancelled.state is JobState.CANCELLED and cancelled.finished_at is not None
        assert states_of(await read_all(events, queued.id)) == [
            "JOB_STATE_QUEUED",
            "JOB_STATE_CANCELLED",
        ]
        flagged = await jobs.cancel("t1", running.id)
        assert flagged.state is JobState.RUNNING and flagged.cancel_requested
        assert await fenced.heartbeat() is True
        await fenced.finish(JobState.CANCELLED, step=0)
        assert await jobs.count_active("t1") == 0
        counts = await jobs.count_by_state()
        assert counts[JobState.CANCELLED] == 2 and counts[JobState.RUNNING] == 0
        assert (await jobs.cancel("t1", queued.id)).state is JobState.CANCELLED  # no-op

    run(redis_url, scenario)


def test_submit_refuses_beyond_active_limit(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs = JobStore(redis)
        first, _ = await submit(jobs, max_active=2)
        await submit(jobs, max_active=2)
        with pytest.raises(ResourceExhaustedError):
            await submit(jobs, max_active=2)
        await submit(jobs, tenant="t2", max_active=2)  # other tenants are not affected
        await jobs.cancel("t1", first.id)
        await submit(jobs, max_active=2)

    run(redis_url, scenario)


def metrics(step: int) -> bytes:
    return rbm_pb2.Metrics(step=step, total_steps=10).SerializeToString()


def test_events_resume_from_any_token_without_gap_or_repeat(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, events, leases = JobStore(redis), EventStore(redis), LeaseStore(redis)
        job, _ = await submit(jobs)
        fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=10_000))
        for step in range(1, 8):
            assert await fenced.publish_metrics(step, metrics(step))
        everything = await read_all(events, job.id)
        assert len(everything) == 2 + 7  # QUEUED, RUNNING, 7 metric events
        for start in range(len(everything)):
            after = "" if start == 0 else everything[start - 1][0]
            chained: list = []
            while batch := await events.read(job.id, after=after, count=2, block_ms=None):
                chained += batch
                after = batch[-1][0]
            assert chained == everything[start:]
        for bad in ["x", "1-", "-1-0", "1-2-3", "99999999999999999999-0"]:
            with pytest.raises(InvalidArgumentError, match="after"):
                await events.read(job.id, after=bad, count=1, block_ms=None)

        # Live follow: a blocked reader wakes for the next event.
        last = everything[-1][0]
        reader = asyncio.create_task(events.read(job.id, after=last, count=10, block_ms=5000))
        await asyncio.sleep(0.1)
        assert await fenced.publish_metrics(8, metrics(8))
        followed = await asyncio.wait_for(reader, 5)
        assert [rbm_pb2.Metrics.FromString(data).step for _, _, data in followed] == [8]

    run(redis_url, scenario)


def test_metric_steps_are_published_once_and_in_order(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, events, leases = JobStore(redis), EventStore(redis), LeaseStore(redis)
        job, _ = await submit(jobs)
        fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=10_000))
        assert [await fenced.publish_metrics(s, metrics(s)) for s in (5, 10, 5, 10, 15)] == [
            True,
            True,
            False,
            False,
            True,
        ]
        record = await jobs.get("t1", job.id)
        assert record.step == 15 and rbm_pb2.Metrics.FromString(record.latest_metrics).step == 15
        published = [
            rbm_pb2.Metrics.FromString(data).step
            for _, kind, data in await read_all(events, job.id)
            if kind == "metrics"
        ]
        assert published == [5, 10, 15]

    run(redis_url, scenario)


def test_checkpoints_retention_and_sha256_fallback(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases, checkpoints = JobStore(redis), LeaseStore(redis), CheckpointStore(redis)
        job, _ = await submit(jobs)
        with pytest.raises(FailedPreconditionError, match="no checkpoint yet"):
            await checkpoints.latest(job.id)
        fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=10_000))
        for step in (10, 20, 30, 40):
            await fenced.put_checkpoint(
                step,
                data=f"model-{step}".encode(),
                config_json='{"kind": "bernoulli"}',
                trainer_state=f"trainer-{step}".encode(),
                keep=3,
            )
        assert await checkpoints.list_steps(job.id) == [20, 30, 40]
        assert (await jobs.get("t1", job.id)).checkpoint_step == 40
        latest = await checkpoints.latest(job.id, with_trainer_state=True)
        assert (latest.step, latest.data, latest.trainer_state) == (40, b"model-40", b"trainer-40")
        assert latest.attempt == 1 and latest.config_json == '{"kind": "bernoulli"}'
        with pytest.raises(NotFoundError, match="step 10"):
            await checkpoints.get(job.id, 10)

        # Flip the newest checkpoint's bytes behind the store's back.
        await redis.hset(Keys().checkpoint(job.id, 40), "data", b"model-4X")
        assert (await checkpoints.latest(job.id)).step == 30
        with pytest.raises(CorruptCheckpointError, match="sha256"):
            await checkpoints.get(job.id, 40)
        await redis.hset(Keys().checkpoint(job.id, 30), "trainer_state", b"garbage")
        assert (await checkpoints.latest(job.id)).step == 30  # model bytes are intact
        assert (await checkpoints.latest(job.id, with_trainer_state=True)).step == 20

    run(redis_url, scenario)


def test_stale_attempt_cannot_write_after_takeover(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, events, leases = JobStore(redis), EventStore(redis), LeaseStore(redis)
        checkpoints = CheckpointStore(redis)
        job, _ = await submit(jobs)
        first = await leases.claim(job.id, "slow", lease_ms=200)
        assert first is not None and first.attempt == 1
        assert await leases.claim(job.id, "eager", lease_ms=10_000) is None  # lease still valid
        slow = FencedJob(redis, first)
        await slow.publish_metrics(1, metrics(1))

        await asyncio.sleep(0.3)  # the slow worker misses its renewal
        assert await leases.lapsed() == [job.id]
        second = await leases.claim(job.id, "eager", lease_ms=10_000)
        assert second is not None and second.attempt == 2
        eager = FencedJob(redis, second)

        with pytest.raises(LeaseLostError):
            await slow.publish_metrics(2, metrics(2))
        with pytest.raises(LeaseLostError):
            await slow.put_checkpoint(2, data=b"x", config_json="{}", trainer_state=b"y")
        with pytest.raises(LeaseLostError):
            await slow.heartbeat()
        with pytest.raises(LeaseLostError):
            await slow.finish(JobState.SUCCEEDED, step=2)
        with pytest.raises(LeaseLostError):
            await slow.release(step=2, message="bye")

        await eager.publish_metrics(2, metrics(2))
        await eager.finish(JobState.SUCCEEDED, step=2)
        record = await jobs.get("t1", job.id)
        assert record.state is JobState.SUCCEEDED and record.attempt == 2
        assert record.worker == "eager"
        assert await checkpoints.list_steps(job.id) == []
        attempts = [
            int(fields[b"attempt"])
            for _, fields in await redis.xrange(Keys().events(job.id))
            if fields[b"kind"] == b"metrics"
        ]
        assert attempts == [1, 2]
        assert states_of(await read_all(events, job.id))[-1] == "JOB_STATE_SUCCEEDED"
        with pytest.raises(LeaseLostError):  # a finished job refuses every attempt
            await eager.publish_metrics(3, metrics(3))

    run(redis_url, scenario)


def test_release_requeues_for_the_next_attempt(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases, queue = JobStore(redis), LeaseStore(redis), JobQueue(redis)
        job, _ = await submit(jobs)
        [(entry, job_id)] = await queue.read("w1", block_ms=100)
        assert job_id == job.id
        lease = await leases.claim(job_id, "w1", lease_ms=10_000)
        await queue.ack(entry)
        await FencedJob(redis, lease).release(step=0, message="worker stopping")
        record = await jobs.get("t1", job.id)
        assert record.state is JobState.QUEUED and record.attempt == 1 and record.worker == "w1"
        assert await leases.lapsed() == [] and await jobs.count_active("t1") == 1
        [(entry, job_id)] = await queue.read("w2", block_ms=100)
        again = await leases.claim(job_id, "w2", lease_ms=10_000)
        assert again is not None and again.attempt == 2 and again.record.worker == "w2"

    run(redis_url, scenario)


def test_queue_entries_of_a_dead_consumer_are_autoclaimed(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, queue = JobStore(redis), JobQueue(redis)
        job, _ = await submit(jobs)
        assert [j for _, j in await queue.read("dead", block_ms=100)] == [job.id]
        assert await queue.read("alive", block_ms=50) == []
        assert await queue.autoclaim("alive", min_idle_ms=60_000) == []
        await asyncio.sleep(0.05)
        [(entry, job_id)] = await queue.autoclaim("alive", min_idle_ms=20)
        assert job_id == job.id
        assert [e for e, _ in await queue.pending("alive")] == [entry]
        await queue.ack(entry)
        assert await queue.pending("alive") == [] and await queue.length() == 0

    run(redis_url, scenario)


def test_datasets_are_content_addressed_and_tenant_scoped(redis_url: str) -> None:
    async def scenario(redis) -> None:
        datasets = DatasetStore(redis)
        array = np.arange(12, dtype="<f4").reshape(3, 4)
        info, created = await datasets.put(
            "t1", shape=(3, 4), dtype="float32", name="a", data=array.tobytes()
        )
        assert created and info.shape == (3, 4) and info.size_bytes == 48 and len(info.id) == 64
        again, created_again = await datasets.put(
            "t1", shape=[3, 4], dtype="float32", name="b", data=array.tobytes()
        )
        assert not created_again and again.id == info.id
        reshaped, _ = await datasets.put(
            "t1", shape=(4, 3), dtype="float32", name="c", data=array.tobytes()
        )
        assert reshaped.id != info.id
        loaded_info, data = await datasets.load("t1", info.id)
        assert loaded_info == info
        assert np.array_equal(np.frombuffer(data, dtype="<f4").reshape(info.shape), array)
        with pytest.raises(NotFoundError):
            await datasets.info("t2", info.id)
        theirs, created_theirs = await datasets.put(
            "t2", shape=(3, 4), dtype="float32", name="mine", data=array.tobytes()
        )
        assert created_theirs and theirs.id == info.id and theirs.name == "mine"
        for bad in ["", "../x", info.id[:-1], info.id + "0"]:
            with pytest.raises(NotFoundError):
                await datasets.load("t1", bad)
        with pytest.raises(InvalidArgumentError, match="data"):
            await datasets.put("t1", shape=(5, 4), dtype="float32", name="", data=b"\0" * 48)
        with pytest.raises(InvalidArgumentError, match="dtype"):
            await datasets.put("t1", shape=(3, 4), dtype="int64", name="", data=b"\0" * 96)
        with pytest.raises(InvalidArgumentError, match="shape"):
            await datasets.put("t1", shape=(0, 4), dtype="uint8", name="", data=b"")

    run(redis_url, scenario)


def test_acknowledged_writes_survive_a_redis_restart(redis_factory) -> None:
    server = redis_factory(appendonly=True)
    ids: dict[str, str] = {}

    async def write(redis) -> None:
        jobs, leases = JobStore(redis), LeaseStore(redis)
        job, _ = await submit(jobs, request_id="r")
        ids["job"] = job.id
        fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=60_000))
        await fenced.publish_metrics(5, metrics(5))
        await fenced.put_checkpoint(5, data=b"model", config_json="{}", trainer_state=b"state")

    async def read(redis) -> None:
        jobs, events = JobStore(redis), EventStore(redis)
        checkpoints = CheckpointStore(redis)
        record = await jobs.get("t1", ids["job"])
        assert record.state is JobState.RUNNING and record.step == 5 and record.attempt == 1
        assert (await checkpoints.latest(ids["job"])).data == b"model"
        assert len(await read_all(events, ids["job"])) == 3
        again, created = await submit(jobs, request_id="r")
        assert not created and again.id == ids["job"]

    run(server.url, write)
    server.kill()  # as a crash: only what AOF fsynced survives
    server.start()
    run(server.url, read)


def test_backoff_rolls_the_published_step_back(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, events, leases = JobStore(redis), EventStore(redis), LeaseStore(redis)
        job, _ = await submit(jobs)
        first = await leases.claim(job.id, "w1", lease_ms=200)
        fenced = FencedJob(redis, first)
        assert [await fenced.publish_metrics(s, metrics(s)) for s in (5, 10)] == [True, True]
        await fenced.backoff(rollback_step=5, event_data=b"lr halved")
        record = await jobs.get("t1", job.id)
        assert (record.step, record.metric_step, record.backoffs) == (5, 5, 1)
        [*_, (_token, kind, data)] = await read_all(events, job.id)
        assert (kind, data) == ("backoff", b"lr halved")
        # The retrained step 10 is published again; only a true repeat is dropped.
        assert [await fenced.publish_metrics(s, metrics(s)) for s in (10, 10)] == [True, False]
        await fenced.backoff(rollback_step=8, event_data=b"again")
        assert (await jobs.get("t1", job.id)).backoffs == 2

        await asyncio.sleep(0.3)  # the lease lapses and another worker takes over
        assert await leases.claim(job.id, "w2", lease_ms=10_000) is not None
        with pytest.raises(LeaseLostError):
            await fenced.backoff(rollback_step=0, event_data=b"stale")
        record = await jobs.get("t1", job.id)
        assert (record.step, record.backoffs) == (8, 2)

    run(redis_url, scenario)


def test_runtime_field_round_trips_and_old_records_decode(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases = JobStore(redis), LeaseStore(redis)
        job, _ = await submit(jobs)
        assert (job.backoffs, job.runtime) == (0, "")
        fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=10_000))
        await fenced.update(runtime='{"device": "cpu"}')
        assert (await jobs.get("t1", job.id)).runtime == '{"device": "cpu"}'
        # A record written before these fields existed.
        await redis.hdel(Keys().job(job.id), "backoffs", "runtime")
        record = await jobs.get("t1", job.id)
        assert (record.backoffs, record.runtime) == (0, "")

    run(redis_url, scenario)


def shared_index_keys() -> list[str]:
    """The `{jobs}` keys that follow a job hash in separate steps (store/indexes.py)."""
    keys = Keys()
    states = [keys.jobs_in_state(state.value) for state in JobState]
    queue = [keys.queue_rotation(), keys.queue_served(), keys.queue_ready()]
    queue.append(keys.tenant_queue("t1"))
    return [keys.index_versions(), keys.leases(), *queue, *states]


def index_keys(tenant: str = "t1") -> list[str]:
    """Every key that follows a job hash in separate steps, the tenant's active set included."""
    return [*shared_index_keys(), Keys().tenant_active(tenant)]


async def undone(redis, keys: list[str], operation: Awaitable):
    """Run `operation`, then put `keys` back as they were: as if its process had died before
    the steps that write them. Returns the operation's result."""
    saved = {key: await redis.dump(key) for key in keys}
    result = await operation
    for key, value in saved.items():
        await redis.delete(key)
        if value is not None:
            await redis.restore(key, 0, value)
    return result


async def states_indexed(jobs: JobStore) -> dict[str, int]:
    return {state.value: n for state, n in (await jobs.count_by_state()).items() if n}


def test_a_submit_that_died_before_queueing_is_finished_by_its_repeat(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, queue, keys = JobStore(redis), JobQueue(redis), Keys()
        job, _ = await undone(redis, shared_index_keys(), submit(jobs, request_id="r"))
        await redis.hdel(keys.job(job.id), "seq")
        for key in (keys.job(job.id), keys.events(job.id)):
            await redis.expire(key, 3600)  # not admitted either
        assert await queue.length() == 0 and await states_indexed(jobs) == {}

        for _ in range(2):  # finished once, however often the request is repeated
            again, created = await submit(jobs, request_id="r")
            assert again.id == job.id and not created
        assert await queue.length() == 1 and await states_indexed(jobs) == {"QUEUED": 1}
        for key in (keys.job(job.id), keys.events(job.id)):
            assert await redis.pttl(key) == -1
        assert (await jobs.get("t1", job.id)).seq == job.seq

    run(redis_url, scenario)


def test_the_limit_check_repairs_the_tenants_active_jobs(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases, keys = JobStore(redis), LeaseStore(redis), Keys()
        ended, _ = await submit(jobs, max_active=2)
        running, _ = await submit(jobs, max_active=2)
        fenced = FencedJob(redis, await leases.claim(ended.id, "w1", lease_ms=10_000))
        # The active set lost the finished job's removal: the tenant looks full.
        await undone(redis, [keys.tenant_active("t1")], fenced.finish(JobState.SUCCEEDED, step=1))
        assert await jobs.count_active("t1") == 2
        vanished, created = await submit(jobs, max_active=2)
        assert created and await jobs.count_active("t1") == 2
        # A job whose hash is gone (its unadmitted submit died and it expired).
        await redis.delete(keys.job(vanished.id), keys.events(vanished.id))
        newest, created = await submit(jobs, max_active=2)
        assert created and await jobs.count_active("t1") == 2
        listed, _ = await jobs.list("t1", page_size=10, page_token="", state=None)
        assert [j.id for j in listed] == [newest.id, running.id, ended.id]
        with pytest.raises(ResourceExhaustedError):  # these two really are active
            await submit(jobs, max_active=2)

    run(redis_url, scenario)


async def lapsed_after_dying(redis, last_write: Callable[[FencedJob], Awaitable]):
    """A job whose worker (100 ms lease) made `last_write` and died before its index steps;
    returns (jobs, leases, job) once the lease has lapsed."""
    jobs, leases = JobStore(redis), LeaseStore(redis)
    job, _ = await submit(jobs)
    fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=100))
    await undone(redis, index_keys(), last_write(fenced))
    await asyncio.sleep(0.15)
    assert await leases.lapsed() == [job.id]  # the lease entry leads a worker to the job
    return jobs, leases, job


def test_a_finish_that_died_before_its_index_steps_is_repaired_by_the_next_claim(
    redis_url: str,
) -> None:
    async def scenario(redis) -> None:
        jobs, leases, job = await lapsed_after_dying(
            redis, lambda fenced: fenced.finish(JobState.SUCCEEDED, step=1)
        )
        assert await states_indexed(jobs) == {"RUNNING": 1} and await jobs.count_active("t1") == 1
        assert await leases.claim(job.id, "w2", lease_ms=10_000) is None
        assert await states_indexed(jobs) == {"SUCCEEDED": 1} and await jobs.count_active("t1") == 0
        assert await leases.lapsed() == []
        record = await jobs.get("t1", job.id)
        assert record.state is JobState.SUCCEEDED and record.attempt == 1

    run(redis_url, scenario)


def test_a_release_that_died_before_its_index_steps_is_claimed_once_the_lease_lapses(
    redis_url: str,
) -> None:
    async def scenario(redis) -> None:
        jobs, leases, job = await lapsed_after_dying(
            redis, lambda fenced: fenced.release(step=0, message="stopping")
        )
        assert (await jobs.get("t1", job.id)).state is JobState.QUEUED
        lease = await leases.claim(job.id, "w2", lease_ms=10_000)
        assert lease is not None and lease.attempt == 2
        assert await states_indexed(jobs) == {"RUNNING": 1}
        assert await leases.deadline_ms(job.id) == await redis.zscore(Keys().leases(), job.id)

    run(redis_url, scenario)


def test_a_cancel_that_died_before_its_index_steps_is_repaired_by_the_worker(
    redis_url: str,
) -> None:
    async def scenario(redis) -> None:
        jobs, leases, queue = JobStore(redis), LeaseStore(redis), JobQueue(redis)
        job, _ = await submit(jobs)
        await undone(redis, index_keys(), jobs.cancel("t1", job.id))
        assert await states_indexed(jobs) == {"QUEUED": 1} and await jobs.count_active("t1") == 1
        [(_entry, job_id)] = await queue.read("w1", block_ms=100)
        assert await leases.claim(job_id, "w1", lease_ms=10_000) is None
        assert await states_indexed(jobs) == {"CANCELLED": 1} and await jobs.count_active("t1") == 0

    run(redis_url, scenario)


def test_a_claim_that_died_after_reserving_its_lease_entry(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases = JobStore(redis), LeaseStore(redis)
        job, _ = await submit(jobs)
        await leases.index.reserve_lease(job.id, 100)  # a claim's first step, then it died
        await asyncio.sleep(0.15)
        assert await leases.lapsed() == [job.id]
        lease = await leases.claim(job.id, "w2", lease_ms=10_000)
        assert lease is not None and lease.attempt == 1

    run(redis_url, scenario)


def test_a_late_index_step_cannot_undo_a_newer_state(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases, queue = JobStore(redis), LeaseStore(redis), JobQueue(redis)
        job, _ = await submit(jobs)
        assert await leases.claim(job.id, "slow", lease_ms=100) is not None
        await asyncio.sleep(0.15)
        eager = FencedJob(redis, await leases.claim(job.id, "eager", lease_ms=10_000))
        await eager.finish(JobState.SUCCEEDED, step=1)
        # The slow worker's heartbeat and release index steps, arriving after all that.
        await leases.index.follow(job.id, "t1", JobState.RUNNING, 1, lease_deadline=2**41)
        await leases.index.follow(job.id, "t1", JobState.QUEUED, 1, enqueue=True)
        assert await states_indexed(jobs) == {"SUCCEEDED": 1}
        assert await leases.lapsed() == [] and await redis.zscore(Keys().leases(), job.id) is None
        assert await queue.length() == 1  # the submit's entry only

    run(redis_url, scenario)


async def keys_of_job(redis, job_id: str) -> list[bytes]:
    """Every key whose name holds the job id (its own keys, idempotency keys do not)."""
    return [key async for key in redis.scan_iter(match=f"*{job_id}*")]


async def members_naming(redis, job_id: str) -> list[str]:
    """The shared and tenant index keys that still list the job."""
    keys, found = Keys(), []
    for state in JobState:
        if await redis.sismember(keys.jobs_in_state(state.value), job_id):
            found.append(state.value)
    if await redis.hexists(keys.index_versions(), job_id):
        found.append("versions")
    if await redis.zscore(keys.leases(), job_id) is not None:
        found.append("leases")
    if await redis.zscore(keys.tenant_jobs("t1"), job_id) is not None:
        found.append("listing")
    if await redis.sismember(keys.tenant_active("t1"), job_id):
        found.append("active")
    if await redis.zcard(keys.purge_schedule()):
        found.append("purge")
    return found


async def finished_job(redis, jobs: JobStore, *, request_id: str | None = None, **fenced_kw):
    """A job claimed, given checkpoints at steps 10-40 and ended SUCCEEDED."""
    job, _ = await submit(jobs, request_id=request_id, idempotency_ttl_s=3600)
    lease = await LeaseStore(redis).claim(job.id, "w1", lease_ms=10_000)
    fenced = FencedJob(redis, lease, **fenced_kw)
    for step in (10, 20, 30, 40):
        await fenced.put_checkpoint(step, data=b"m", config_json="{}", trainer_state=b"t", keep=3)
    await fenced.finish(JobState.SUCCEEDED, step=40)
    return job


def test_delete_removes_every_key_and_index_entry_of_a_job(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs = JobStore(redis)
        job = await finished_job(redis, jobs, request_id="rid-1")
        idempotency = Keys().idempotency("t1", "rid-1")
        assert 0 < await redis.ttl(idempotency) <= 3600  # request ids are remembered a while
        with pytest.raises(NotFoundError):
            await jobs.delete("t2", job.id)  # another tenant's job
        await jobs.delete("t1", job.id)
        assert await keys_of_job(redis, job.id) == []
        assert await redis.exists(idempotency) == 0
        # The versions hash keeps a tombstone (an hour) so late index steps cannot re-add it.
        assert await members_naming(redis, job.id) == ["versions"]
        with pytest.raises(NotFoundError):
            await jobs.get("t1", job.id)
        with pytest.raises(NotFoundError):
            await jobs.delete("t1", job.id)
        # The request id is free again: a repeat creates a new job.
        again, created = await submit(jobs, request_id="rid-1")
        assert created and again.id != job.id

    run(redis_url, scenario)


def on_dataset(dataset_id: str) -> bytes:
    """SPEC training on an uploaded dataset."""
    spec = rbm_pb2.StartTrainingRequest.FromString(SPEC)
    spec.dataset.dataset_id = dataset_id
    return spec.SerializeToString()


async def dataset_references(redis) -> None:
    """An accepted job holds its uploaded dataset until it ends; a submit finds it gone once
    deleted; a reference an end left behind (its index step lost) is repaired."""
    jobs, datasets = JobStore(redis), DatasetStore(redis)
    info, _ = await datasets.put("t1", shape=(2, 4), dtype="uint8", name="d", data=bytes(8))
    with pytest.raises(NotFoundError, match=info.id):  # another tenant's: not theirs to train on
        await jobs.submit("t2", on_dataset(info.id), name="n", total_steps=10, request_id=None)
    job, _ = await jobs.submit("t1", on_dataset(info.id), name="n", total_steps=10, request_id=None)
    with pytest.raises(DatasetInUseError, match=job.id) as refused:
        await datasets.delete("t1", info.id)
    assert refused.value.job_ids == [job.id]
    # An end whose index step never ran still holds the dataset, until someone looks at the job.
    await redis.hset(Keys().job(job.id), "state", JobState.CANCELLED.value)
    with pytest.raises(DatasetInUseError):
        await datasets.delete("t1", info.id)
    assert await jobs.still_active("t1", [job.id]) == []
    await datasets.delete("t1", info.id)
    with pytest.raises(NotFoundError, match=info.id):
        await jobs.submit("t1", on_dataset(info.id), name="n", total_steps=10, request_id=None)
    assert await redis.hlen(Keys().tenant_job_datasets("t1")) == 0


def test_an_accepted_job_holds_its_dataset_until_it_ends(redis_url: str) -> None:
    run(redis_url, dataset_references)


def test_a_finished_job_keeps_its_last_checkpoint(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, checkpoints = JobStore(redis), CheckpointStore(redis)
        job = await finished_job(redis, jobs)
        assert await checkpoints.list_steps(job.id) == [40]
        assert (await checkpoints.latest(job.id)).step == 40
        assert await redis.ttl(Keys().job(job.id)) == -1  # no finished-job TTL by default

    run(redis_url, scenario)


def test_delete_of_an_active_job_needs_force(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases = JobStore(redis), LeaseStore(redis)
        queued, _ = await submit(jobs)
        with pytest.raises(FailedPreconditionError, match="force"):
            await jobs.delete("t1", queued.id)
        await jobs.delete("t1", queued.id, force=True)
        assert await keys_of_job(redis, queued.id) == []

        running, _ = await submit(jobs)
        fenced = FencedJob(redis, await leases.claim(running.id, "w1", lease_ms=10_000))
        await fenced.put_checkpoint(10, data=b"m", config_json="{}", trainer_state=b"t")
        await jobs.delete("t1", running.id, force=True)
        assert await keys_of_job(redis, running.id) == []
        assert await members_naming(redis, running.id) == ["versions"]
        # The worker still training it is refused at its next write and stops.
        with pytest.raises(LeaseLostError):
            await fenced.heartbeat()
        with pytest.raises(LeaseLostError):
            await fenced.put_checkpoint(20, data=b"m", config_json="{}", trainer_state=b"t")
        assert await keys_of_job(redis, running.id) == []
        assert await jobs.count_active("t1") == 0

    run(redis_url, scenario)


def test_a_delete_that_died_after_the_job_keys_is_finished_by_the_sweeper(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs = JobStore(redis)
        job = await finished_job(redis, jobs)
        lifecycle = jobs.lifecycle
        # Steps 1 and 2 only: the process died before the tenant and shared index steps.
        await lifecycle.schedule(job.id, "t1", delay_ms=0)
        assert await lifecycle._delete_job_keys(job.id, "t1", False) == "deleted"
        assert "listing" in await members_naming(redis, job.id)
        assert await lifecycle.sweep(grace_ms=60_000) == 0  # not overdue yet: may be in flight
        assert await lifecycle.sweep(grace_ms=0) == 1
        assert await members_naming(redis, job.id) == ["versions"]

    run(redis_url, scenario)


def test_finished_jobs_expire_with_every_key(redis_url: str) -> None:
    async def scenario(redis) -> None:
        retention = Retention(checkpoints_kept=2, job_ttl_s=1)
        jobs = JobStore(redis, retention=retention)
        job = await finished_job(redis, jobs, retention=retention)
        keys = Keys()
        assert await CheckpointStore(redis).list_steps(job.id) == [30, 40]
        own = [keys.job(job.id), keys.events(job.id), keys.checkpoint_index(job.id)]
        own += [keys.checkpoint(job.id, 30), keys.checkpoint(job.id, 40)]
        ttls = [await redis.pttl(key) for key in own]
        assert all(0 < ttl <= 1000 for ttl in ttls), ttls
        # Redis removes the data at its time; the sweeper then clears the index entries.
        while await redis.exists(keys.job(job.id)):
            await asyncio.sleep(0.1)
        assert (await jobs.list("t1", page_size=10, page_token="", state=None))[0] == []
        assert await jobs.lifecycle.sweep(grace_ms=0) == 1
        assert await keys_of_job(redis, job.id) == []
        assert await members_naming(redis, job.id) == ["versions"]

    run(redis_url, scenario)


def test_the_sweeper_leaves_an_active_job_alone(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs = JobStore(redis)
        job, _ = await submit(jobs)
        await jobs.lifecycle.schedule(job.id, "t1", delay_ms=0)  # e.g. a delete that died
        assert await jobs.lifecycle.sweep(grace_ms=0) == 1
        assert (await jobs.get("t1", job.id)).state == JobState.QUEUED
        assert await redis.zcard(Keys().purge_schedule()) == 0

    run(redis_url, scenario)


def test_submit_refuses_beyond_the_job_record_quota(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs = JobStore(redis)
        first = await finished_job(redis, jobs)
        await submit(jobs, max_records=2)
        with pytest.raises(ResourceExhaustedError, match=r"max_job_records_per_tenant.*delete"):
            await submit(jobs, max_records=2)
        await jobs.delete("t1", first.id)
        await submit(jobs, max_records=2)

    run(redis_url, scenario)


def test_chunked_uploads_commit_once_and_a_dead_upload_stays_invisible(redis_url: str) -> None:
    async def scenario(redis) -> None:
        keys = Keys()
        datasets = DatasetStore(redis, chunk_bytes=16, idle_seconds=60)
        array = np.arange(30, dtype="<f4").reshape(5, 6)
        # Two uploads of the same bytes at once: one stores them, both tenants reference them.
        first = datasets.begin("t1", shape=(5, 6), dtype="float32", name="a")
        second = datasets.begin("t2", shape=(5, 6), dtype="float32", name="b")
        for upload in (first, second):
            await upload.write(array.tobytes())
        (info, created), (theirs, created_theirs) = await asyncio.gather(
            first.commit((0.0, 29.0)), second.commit((0.0, 29.0))
        )
        assert created and created_theirs and info.id == theirs.id
        assert len(await redis.keys("*upload:*")) == 1
        assert (
            max(len(v) for v in (await redis.hgetall((await redis.keys("*upload:*"))[0])).values())
            <= 16
        )
        # An upload that dies midway is never visible and its chunks expire.
        dead = datasets.begin("t1", shape=(5, 6), dtype="float32", name="dead")
        await dead.write(array.tobytes()[:50])
        assert 0 < await redis.pttl(keys.upload(dead.upload_id)) <= 60_000
        page, token = await datasets.list("t1", page_size=10, page_token="")
        assert [d.id for d in page] == [info.id] and token == ""
        # A record whose upload never completed is not a dataset.
        await redis.hset(keys.dataset("f" * 64), mapping={"blob": dead.upload_id, "shape": "[1,1]"})
        with pytest.raises(NotFoundError):
            await datasets.info("t1", "f" * 64)
        await datasets.delete("t1", info.id)
        assert (await datasets.load("t2", info.id))[1] == array.tobytes()
        await datasets.delete("t2", info.id)
        assert await redis.exists(keys.dataset(info.id), keys.dataset_tenants(info.id)) == 0
        assert await datasets.used_bytes("t1") == 0 == await datasets.used_bytes("t2")
        quota = DatasetStore(redis, chunk_bytes=16, tenant_quota=100)
        with pytest.raises(ResourceExhaustedError, match="max_dataset_bytes_per_tenant"):
            await quota.put("t3", shape=(5, 6), dtype="float32", name="", data=array.tobytes())

    run(redis_url, scenario)
