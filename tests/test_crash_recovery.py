"""Crashes seen from a client: a Redis crash and restart (AOF) while a job trains and a client
follows its metrics, a stalled worker whose lease lapsed coming back after another worker
took its job over (fencing by attempt), and a job that ends at the instant its follower turns
from replay to live.

Worker SIGKILL takeover and SIGTERM release are proven in tests/test_worker.py
(``test_sigkilled_worker_job_resumes_on_another_with_each_step_once`` and
``test_sigterm_checkpoints_releases_and_exits_cleanly``); acknowledged store writes surviving a
Redis restart in tests/test_store.py. These tests add the view through the gRPC API.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.keys import Keys
from ssdrbm_server.metrics import ServiceMetrics
from ssdrbm_server.servicer import RBMServicer, Stores
from ssdrbm_server.store import (
    CheckpointStore,
    DatasetStore,
    EventStore,
    FencedJob,
    JobRecord,
    JobState,
    JobStore,
    LeaseStore,
    connect,
)
from ssdrbm_server.store.records import worker_label
from tests.fixtures.jobs import Follower, float_tensor, rpc_error, tiny_request
from tests.fixtures.redis import RedisServer
from tests.fixtures.server_process import start_python_m_worker
from tests.fixtures.service import RunningService, make_settings

WAIT_S = 90.0  # a bound for a loaded 2-core machine, not a speed check
LEASE_S = 1.5
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def training_request(
    steps: int, *, every: int, checkpoint_every: int
) -> rbm_pb2.StartTrainingRequest:
    request = tiny_request(steps=steps)
    request.eval.every = every
    request.training.checkpoint_every = checkpoint_every
    return request


def wait_for_job(
    stub: rbm_pb2_grpc.RBMServiceStub, job_id: str, done: Callable[[rbm_pb2.Job], bool]
) -> rbm_pb2.Job:
    deadline = time.monotonic() + WAIT_S
    while True:
        job = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id))
        if done(job):
            return job
        assert time.monotonic() < deadline, f"job never got there: {job}"
        time.sleep(0.05)


def metric_steps(events: list[rbm_pb2.MetricEvent]) -> list[int]:
    return [e.metrics.step for e in events if e.WhichOneof("event") == "metrics"]


def final_state(events: list[rbm_pb2.MetricEvent]) -> int:
    states = [e.state.state for e in events if e.WhichOneof("event") == "state"]
    return states[-1]


def test_redis_crash_and_restart_loses_nothing_acknowledged(
    redis_factory: Callable[..., RedisServer], service_factory: Callable[..., RunningService]
) -> None:
    """Redis (AOF, fsync always) is killed while a job trains and a client follows it: every
    RPC answers UNAVAILABLE meanwhile and the server keeps running; after the restart every
    acknowledged job is there, the running job's record is at least at the checkpoint
    acknowledged before the kill, it finishes SUCCEEDED and the resumed stream holds every step
    exactly once."""
    store = redis_factory(appendonly=True)
    running = service_factory(store.url, torch_threads=1)
    stub = running.stub()
    total, every = 1500, 20
    job = stub.StartTraining(training_request(total, every=every, checkpoint_every=100)).job
    follower = Follower(stub, job.id)
    wait_for_job(stub, job.id, lambda j: j.checkpoint_step >= 100 or j.state > 2)
    # Acknowledged just before the kill: jobs answered OK (queued behind the running one) and
    # the running job's newest checkpoint.
    queued = [stub.StartTraining(tiny_request(seed=seed)).job.id for seed in range(10)]
    before = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id))
    assert before.state == rbm_pb2.JOB_STATE_RUNNING, "the job ended before Redis went down"

    store.kill()
    follower.join()
    assert follower.error is not None and follower.error.code() is UNAVAILABLE
    seen = list(follower.events)
    calls = {
        "GetJob": lambda: stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id)),
        "ListJobs": lambda: stub.ListJobs(rbm_pb2.ListJobsRequest()),
        "StartTraining": lambda: stub.StartTraining(tiny_request()),
        "StreamMetrics": lambda: stub.StreamMetrics(rbm_pb2.StreamMetricsRequest(job_id=job.id)),
        "CancelJob": lambda: stub.CancelJob(rbm_pb2.CancelJobRequest(job_id=job.id)),
        "Reconstruct": lambda: stub.Reconstruct(
            rbm_pb2.ReconstructRequest(job_id=job.id, input=float_tensor(2, 16))
        ),
        "SampleHidden": lambda: stub.SampleHidden(
            rbm_pb2.SampleHiddenRequest(job_id=job.id, input=float_tensor(2, 16))
        ),
        "ExportModel": lambda: stub.ExportModel(rbm_pb2.ExportModelRequest(job_id=job.id)),
        "UploadDataset": lambda: stub.UploadDataset(
            iter(
                [
                    rbm_pb2.UploadDatasetRequest(
                        header=rbm_pb2.DatasetHeader(shape=[1, 16], dtype=rbm_pb2.DTYPE_FLOAT32)
                    ),
                    rbm_pb2.UploadDatasetRequest(chunk=float_tensor(1, 16).data),
                ]
            )
        ),
    }
    for name, call in calls.items():
        error = rpc_error(call)
        assert error.code() is UNAVAILABLE, (name, error.code(), error.details())
        assert "Redis" in error.details() and "retry" in error.details()
    health = health_pb2_grpc.HealthStub(running.channel())
    assert health.Check(health_pb2.HealthCheckRequest()).status == (
        health_pb2.HealthCheckResponse.SERVING
    )
    time.sleep(1.0)  # the training process keeps going; its worker holds what it produced

    store.start()
    after = wait_for_job(stub, job.id, lambda j: True)  # answers again
    assert after.checkpoint_step >= before.checkpoint_step and after.step >= before.step
    for queued_id in queued:
        assert stub.GetJob(rbm_pb2.GetJobRequest(job_id=queued_id)).id == queued_id
    resumed = Follower(stub, job.id, after=seen[-1].resume_token)
    resumed.join()
    assert resumed.error is None, resumed.error
    events = seen + resumed.events
    assert metric_steps(events) == list(range(every, total + 1, every))
    assert final_state(events) == rbm_pb2.JOB_STATE_SUCCEEDED
    tokens = [e.resume_token for e in events]
    assert len(set(tokens)) == len(tokens)
    finished = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id))
    assert finished.state == rbm_pb2.JOB_STATE_SUCCEEDED and finished.attempt == 1, finished.error
    assert finished.checkpoint_step == total
    # The server goes on taking work.
    assert stub.StartTraining(tiny_request()).created


# --- a stalled worker -----------------------------------------------------------------------


def start_worker(redis_url: str, worker_id: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return start_python_m_worker(
            redis_url,
            output=out,
            worker_id=worker_id,
            lease_seconds=LEASE_S,
            torch_threads=1,
            log_level="INFO",
        )


def children_of(pid: int) -> list[int]:
    """Pids of the live child processes of ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    found.append(int(entry.name))
    return found


def is_running(pid: int) -> bool:
    with contextlib.suppress(OSError):
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


def trainers_of(pid: int) -> list[int]:
    """The spawned training processes among the children of ``pid`` (not its helpers, such as
    multiprocessing's resource tracker)."""
    trainers = []
    for child in children_of(pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in (Path("/proc") / str(child) / "cmdline").read_bytes():
                trainers.append(child)
    return trainers


@pytest.fixture
def workers() -> list[subprocess.Popen[bytes]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        if process.poll() is None:
            process.kill()
        process.wait()


def test_stalled_worker_cannot_overwrite_the_job_after_a_takeover(
    redis_url: str,
    service_factory: Callable[..., RunningService],
    workers: list[subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    """A worker and its training process are frozen (SIGSTOP) past their lease; another worker
    takes the job over and resumes it; the frozen one wakes up with stale work in hand and has
    every write refused. A client following the job sees each step once and SUCCEEDED."""
    running = service_factory(run_worker=False)
    stub = running.stub()
    total, every = 600, 10
    job = stub.StartTraining(training_request(total, every=every, checkpoint_every=50)).job
    follower = Follower(stub, job.id)
    slow_log = tmp_path / "slow.log"
    slow = start_worker(redis_url, "slow", slow_log)
    workers.append(slow)
    slow_label = worker_label("slow")  # clients see a label, not the worker's id
    wait_for_job(stub, job.id, lambda j: j.checkpoint_step >= 50 and j.worker == slow_label)
    stale_trainers = trainers_of(slow.pid)
    assert len(stale_trainers) == 1, "expected the worker's training process"
    frozen = [slow.pid, *children_of(slow.pid)]  # with its helper processes
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    stalled_at = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id))

    eager = start_worker(redis_url, "eager", tmp_path / "eager.log")
    workers.append(eager)
    wait_for_job(stub, job.id, lambda j: j.attempt == 2 and j.step > stalled_at.step)
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)

    follower.join()
    assert follower.error is None, follower.error
    assert metric_steps(follower.events) == list(range(every, total + 1, every))
    assert final_state(follower.events) == rbm_pb2.JOB_STATE_SUCCEEDED
    finished = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id))
    assert finished.state == rbm_pb2.JOB_STATE_SUCCEEDED
    assert finished.worker == worker_label("eager")
    assert finished.attempt == 2 and finished.checkpoint_step == total

    # Nothing of attempt 1 was written after attempt 2 began.
    client = redis.Redis.from_url(redis_url)
    try:
        attempts = [int(f[b"attempt"]) for _, f in client.xrange(Keys().events(job.id))]
        checkpoint_attempts = {
            int(client.hget(Keys().checkpoint(job.id, int(step)), "attempt"))
            for step in client.zrange(Keys().checkpoint_index(job.id), 0, -1)
        }
    finally:
        client.close()
    takeover = attempts.index(2)
    assert all(a == 2 for a in attempts[takeover:]), attempts
    assert checkpoint_attempts == {2}

    # The woken worker noticed, dropped the job, killed that training process and lives on
    # (it may keep a fresh, idle one ready for its next job).
    deadline = time.monotonic() + WAIT_S
    while is_running(stale_trainers[0]) or "stopping work on it" not in slow_log.read_text():
        assert time.monotonic() < deadline, slow_log.read_text()[-2000:]
        time.sleep(0.1)
    assert "STALE attempt 1" in slow_log.read_text()
    assert slow.poll() is None
    slow.send_signal(signal.SIGTERM)
    assert slow.wait(WAIT_S) == 0


# --- a job that ends at the worst moment ----------------------------------------------------


def test_a_job_ending_between_replay_and_live_follow_loses_no_event(redis_url: str) -> None:
    """The follower has replayed the stream and is about to follow it live when the job
    publishes its last metrics and ends: those events and the terminal state still reach it.
    (Found by the load test: the stream used to close without them.)"""

    async def main() -> list[rbm_pb2.MetricEvent]:
        redis_client = connect(redis_url)
        stores = Stores(
            jobs=JobStore(redis_client),
            events=EventStore(redis_client),
            checkpoints=CheckpointStore(redis_client),
            datasets=DatasetStore(redis_client),
        )
        spec = tiny_request(steps=20).SerializeToString()
        job, _ = await stores.jobs.submit("t", spec, name="", total_steps=20, request_id=None)
        lease = await LeaseStore(redis_client).claim(job.id, "w", lease_ms=60_000)
        assert lease is not None
        worker = FencedJob(redis_client, lease)
        await worker.publish_metrics(10, rbm_pb2.Metrics(step=10).SerializeToString())

        class EndsRightAfterTheReplay(RBMServicer):
            async def _has_ended(self, record: JobRecord) -> bool:
                if (await stores.jobs.get("t", record.id)).state is JobState.RUNNING:
                    await worker.publish_metrics(20, rbm_pb2.Metrics(step=20).SerializeToString())
                    await worker.finish(JobState.SUCCEEDED, step=20)
                return await super()._has_ended(record)

        settings = make_settings(redis_url, run_worker=False)
        servicer = EndsRightAfterTheReplay(
            settings,
            stores,
            models=None,
            metrics=ServiceMetrics(),  # type: ignore[arg-type]
        )
        try:
            current = await stores.jobs.get("t", job.id)
            return [e async for e in servicer._events(current, "", history_only=False)]
        finally:
            await redis_client.aclose()

    events = asyncio.run(main())
    assert metric_steps(events) == [10, 20]
    assert final_state(events) == rbm_pb2.JOB_STATE_SUCCEEDED
