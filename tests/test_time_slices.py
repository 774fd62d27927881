"""Workers shared in time: a job (or pack) holds its worker for one slice at most while other
work waits, then is checkpointed, put back at the front of its tenant's queue and resumed
later from that checkpoint, each metric step once in its stream.

Real parts: a real redis-server, the real API on loopback, and one real worker process
(`python -m ssdrbm_server.worker`, one job slot) with SSDRBM_SLICE_SECONDS=2.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from ssdrbm_server.keys import Keys
from ssdrbm_server.store import FencedJob, JobQueue, JobStore, LeaseStore
from tests.fixtures.jobs import tiny_request
from tests.fixtures.server_process import start_python_m_worker
from tests.fixtures.service import RunningService
from tests.test_store import run, submit

SLICE_S = 2.0
LEASE_S = 3.0
# Bounds for a loaded 2-core machine, not speed checks: the waiting tenant's job starts within
# one slice (plus a heartbeat and a checkpoint) and then trains 10 steps.
WAIT_BOUND_S = SLICE_S + 10.0
END_BOUND_S = 90.0
# About 2 ms a step here (LONG_SIZE visible and hidden units: steps that cost some compute even
# on a fast CPU): long enough to train on past another tenant's submit, short enough to end in
# the test. The job that also trains through a slice with nothing waiting first is longer.
LONG_SIZE = 128
LONG_STEPS = 3000
LONGEST_STEPS = 5000
EVERY = 100  # the long jobs' evaluation and checkpoint interval
PREEMPTED = "preempted"
CLAIM_MS = 60_000  # a preemption's claim, as long as the test needs (a slice by default)
SHORT_CLAIM_MS = 300  # one that lapses within the test


async def take(queue: JobQueue) -> str:
    """The job a slot takes next, acknowledged (a worker's read)."""
    [(entry, job_id)] = await queue.read("w1", block_ms=0)
    await queue.ack(entry)
    return job_id


def test_the_queue_says_when_a_preemption_serves_other_work(redis_url: str) -> None:
    """The queue's side, step by step: a tenant's plain jobs go before its sweep runs; a
    running job is worth preempting only when the rotation would serve other work (another
    tenant's, or a plain job of its tenant while it is a sweep run); a preempted job goes back
    to the front of its tenant's list, after the waiting tenant's turn."""

    async def scenario(redis) -> None:
        jobs, queue, leases = JobStore(redis), JobQueue(redis), LeaseStore(redis)

        sweep_runs = [(await submit(jobs, tenant="a", sweep_id="s1"))[0].id for _ in range(2)]
        plain = (await submit(jobs, tenant="a"))[0].id
        assert await take(queue) == plain  # before the sweep runs queued ahead of it
        lease = await leases.claim(plain, "w1", lease_ms=10_000)
        assert lease is not None
        assert await queue.would_serve_other({"a": False}) == 0  # only her own work waits
        other = (await submit(jobs, tenant="b"))[0].id
        assert await queue.would_serve_other({"a": False}) == 1  # b was never served
        await FencedJob(redis, lease).release(step=0, message="preempted", front=True)
        assert [await take(queue) for _ in range(4)] == [other, plain, *sweep_runs]
        lease = await leases.claim(sweep_runs[0], "w1", lease_ms=10_000)
        assert await queue.would_serve_other({"a": True}) == 0
        await submit(jobs, tenant="a")
        assert await queue.would_serve_other({"a": True}) == 2  # a plain job of hers waits
        assert await queue.would_serve_other({"a": False}) == 0  # a plain job of hers runs

    run(redis_url, scenario)


def test_concurrent_slices_free_one_slot_per_waiting_job(redis_url: str) -> None:
    """Slots whose slices end together (two slots of alice's, at once): one waiting job of
    bob's preempts one of them, the other's slice starts over; two waiting tenants preempt
    both; two plain jobs of alice's preempt both slots running her sweep runs. The check that
    only asks (a queued job's place) counts the claims and claims nothing."""

    async def scenario(redis) -> None:
        jobs, queue = JobStore(redis), JobQueue(redis)

        async def two_slices_end(running: dict[str, bool]) -> list[int]:
            asks = [queue.would_serve_other(running, claim_ms=CLAIM_MS) for _ in range(2)]
            return sorted(await asyncio.gather(*asks))

        for _ in range(2):  # alice's two jobs run on two slots
            await submit(jobs, tenant="a")
            await take(queue)
        bob = (await submit(jobs, tenant="b"))[0].id
        assert await queue.would_serve_other({"a": False}) == 1  # asking claims nothing
        assert await two_slices_end({"a": False}) == [0, 1]
        assert await queue.would_serve_other({"a": False}) == 0  # a slot is freed for bob's
        await submit(jobs, tenant="c")
        assert await queue.would_serve_other({"a": False}, claim_ms=CLAIM_MS) == 1  # carol's
        assert await take(queue) == bob  # the freed slots take bob's and carol's jobs
        await take(queue)

        await redis.flushdb()  # alice's two slots again, two tenants waiting this time
        for _ in range(2):
            await submit(jobs, tenant="a")
            await take(queue)
        for tenant in ("d", "e"):
            await submit(jobs, tenant=tenant)
        assert await two_slices_end({"a": False}) == [1, 1]  # one slot each for d and e
        assert await queue.would_serve_other({"a": False}, claim_ms=CLAIM_MS) == 0

        await redis.flushdb()  # alice's sweep runs on two slots, two plain jobs of hers waiting
        for _ in range(2):
            await submit(jobs, tenant="a", sweep_id="s1")
            await take(queue)
        for _ in range(2):
            await submit(jobs, tenant="a")
        assert await two_slices_end({"a": True}) == [2, 2]
        assert await queue.would_serve_other({"a": True}, claim_ms=CLAIM_MS) == 0

    run(redis_url, scenario)


def test_a_preemptions_claim_ends_when_its_job_is_taken_or_its_bound_passes(
    redis_url: str,
) -> None:
    """After the claimed turn is taken, the same tenant's next turn frees a slot again at once;
    a claim whose worker died (its job never taken) lapses after its bound."""

    async def scenario(redis) -> None:
        jobs, queue = JobStore(redis), JobQueue(redis)

        await submit(jobs, tenant="a")
        await take(queue)  # alice's job runs
        bobs = [(await submit(jobs, tenant="b"))[0].id for _ in range(2)]
        assert await queue.would_serve_other({"a": False}, claim_ms=CLAIM_MS) == 1
        assert await take(queue) == bobs[0]  # the freed slot takes it: the claim ends
        alices = (await submit(jobs, tenant="a"))[0].id
        assert await take(queue) == alices  # an idle slot serves alice: bob's turn comes again
        assert await queue.would_serve_other({"a": False}, claim_ms=CLAIM_MS) == 1
        await take(queue)

        await submit(jobs, tenant="c")  # carol waits; the slot preempted for her dies
        assert await queue.would_serve_other({"a": False}, claim_ms=SHORT_CLAIM_MS) == 1
        assert await queue.would_serve_other({"a": False}, claim_ms=SHORT_CLAIM_MS) == 0
        await asyncio.sleep(SHORT_CLAIM_MS / 1000 + 0.1)
        assert await queue.would_serve_other({"a": False}, claim_ms=SHORT_CLAIM_MS) == 1
        await asyncio.sleep(SHORT_CLAIM_MS / 1000 + 0.1)
        keys = Keys()  # nothing is left behind once the claims lapse
        assert not await redis.exists(keys.preempted_for_turns(), keys.preempted_for_jobs())

    run(redis_url, scenario)


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    """Worker processes a test starts, killed at its end if still running."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def start_worker(
    redis_url: str, worker_id: str, log: Path, *, pack_size: int = 1, slots: int = 1
) -> subprocess.Popen[str]:
    """`python -m ssdrbm_server.worker` with one job slot (or ``slots``) and short slices; its
    INFO logs go to ``log`` (a test reads them to act at the moment of a preemption)."""
    with log.open("a") as out:
        return start_python_m_worker(
            redis_url,
            output=out,
            worker_id=worker_id,
            lease_seconds=LEASE_S,
            heartbeat_seconds=0.2,
            slice_seconds=SLICE_S,
            max_pack_size=pack_size,
            worker_slots=slots,
            torch_threads=1,
            allow_no_persistence=1,
            log_level="INFO",
        )


def long_request(seed: int, steps: int = LONG_STEPS) -> pb.StartTrainingRequest:
    """A job that outlasts a slice; jobs of one seed pack together (it picks the validation
    split, part of the pack key), jobs of different seeds do not."""
    training = pb.TrainingSpec(batch_size=50, steps=steps, seed=seed, checkpoint_every=EVERY)
    return tiny_request(
        n_visible=LONG_SIZE,
        model=pb.ModelSpec(kind=pb.MODEL_KIND_BERNOULLI, n_hidden=LONG_SIZE),
        training=training,
        eval=pb.EvalSpec(every=EVERY, validation_fraction=0.2),
    )


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until ``condition``; the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"{what} did not happen in {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - started


def state(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> int:
    return stub.GetJob(pb.GetJobRequest(job_id=job_id)).state


def stepped(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> bool:
    """The job has trained a step (GetJob's step, reported with each evaluation)."""
    job = stub.GetJob(pb.GetJobRequest(job_id=job_id))
    return job.step > 0 or job.state == pb.JOB_STATE_SUCCEEDED


def history(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> list[pb.MetricEvent]:
    request = pb.StreamMetricsRequest(job_id=job_id, history_only=True)
    return list(stub.StreamMetrics(request))


def states(events: list[pb.MetricEvent]) -> list[pb.StateChange]:
    return [event.state for event in events if event.WhichOneof("event") == "state"]


def assert_each_step_once(events: list[pb.MetricEvent], total: int, every: int) -> None:
    steps = [event.metrics.step for event in events if event.WhichOneof("event") == "metrics"]
    assert steps == list(range(every, total + 1, every))


def assert_preempted_and_resumed(events: list[pb.MetricEvent]) -> None:
    """A release saying the job was preempted, and a later claim that resumes it."""
    changes = states(events)
    preempted = [i for i, c in enumerate(changes) if c.message.startswith(PREEMPTED)]
    assert preempted, [c.message for c in changes]
    assert changes[preempted[0]].state == pb.JOB_STATE_QUEUED
    later = changes[preempted[0] + 1 :]
    assert any(c.state == pb.JOB_STATE_RUNNING and "resuming" in c.message for c in later)


def preemptions(events: list[pb.MetricEvent]) -> int:
    return sum(c.message.startswith(PREEMPTED) for c in states(events))


def two_tenants(
    service_factory: Callable[..., RunningService],
) -> tuple[rbm_pb2_grpc.RBMServiceStub, rbm_pb2_grpc.RBMServiceStub]:
    """The API alone (workers run as workers), and stubs for the tenants alice and bob."""
    running = service_factory(run_worker=False, auth_mode="token", auth_tokens="ta=alice,tb=bob")
    return running.stub(token="ta"), running.stub(token="tb")


def submit_long_jobs_then_another_tenants(
    service_factory: Callable[..., RunningService],
    redis_url: str,
    workers: list[subprocess.Popen[str]],
    log: Path,
    *,
    pack_size: int,
) -> None:
    """Alice's three long jobs hold the one worker past a slice's end without preemption (only
    her own jobs wait: the rotation would serve her again); then bob's 10-step job starts
    within a slice, each of alice's jobs is preempted at most once and all end SUCCEEDED with
    each step once."""
    alice, bob = two_tenants(service_factory)
    # The first trains through a slice with nothing else waiting and on past bob's submit (a
    # pack of three: all three, each step costing more); when they train one by one, the two
    # behind it are shortened to keep the test short.
    if pack_size > 1:
        totals = [LONG_STEPS] * 3
    else:
        totals = [LONGEST_STEPS, LONG_STEPS // 5, LONG_STEPS // 5]
    long_ids = [alice.StartTraining(long_request(1, steps)).job.id for steps in totals]
    workers.append(start_worker(redis_url, "w1", log, pack_size=pack_size))  # finds all three
    first = long_ids[0]
    wait_for(lambda: stepped(alice, first), END_BOUND_S, "alice's first steps")
    time.sleep(SLICE_S + 0.5)  # a slice's end passed in training, nothing else waiting
    assert state(alice, first) == pb.JOB_STATE_RUNNING, "LONG_STEPS is too short to test slices"
    assert preemptions(history(alice, first)) == 0  # nothing another tenant's waited
    short = bob.StartTraining(tiny_request(steps=10, seed=2)).job.id  # not for alice's pack
    first_step = wait_for(lambda: stepped(bob, short), WAIT_BOUND_S, "bob's first step")
    waited = wait_for(lambda: state(bob, short) == pb.JOB_STATE_SUCCEEDED, WAIT_BOUND_S, "bob's")
    print(f"bob's job: first step {first_step:.1f} s after its submit, end {waited:.1f} s later")
    for job_id, total in zip(long_ids, totals, strict=True):
        wait_for(lambda j=job_id: state(alice, j) == pb.JOB_STATE_SUCCEEDED, END_BOUND_S, "end")
        events = history(alice, job_id)
        assert_each_step_once(events, total, EVERY)
        # Only for bob's job, never for her own: the pack as a unit, else the job that ran.
        assert preemptions(events) == (1 if pack_size > 1 or job_id == first else 0)
    assert_preempted_and_resumed(history(alice, first))


@pytest.mark.parametrize("pack_size", [1, 32], ids=["one-by-one", "packed"])
def test_another_tenants_job_passes_three_long_jobs_within_a_slice(
    service_factory: Callable[..., RunningService],
    redis_url: str,
    workers: list[subprocess.Popen[str]],
    tmp_path: Path,
    pack_size: int,
) -> None:
    submit_long_jobs_then_another_tenants(
        service_factory, redis_url, workers, tmp_path / "w.log", pack_size=pack_size
    )


def test_a_worker_killed_during_a_preemption_loses_nothing(
    service_factory: Callable[..., RunningService],
    redis_url: str,
    workers: list[subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    """SIGKILL of the worker as soon as it logs the preemption (the training process is then
    checkpointing, or the job being released): another worker takes the job over from its last
    checkpoint; both jobs end SUCCEEDED, each step once in the long job's stream."""
    alice, bob = two_tenants(service_factory)
    log = tmp_path / "w1.log"
    workers.append(start_worker(redis_url, "w1", log))
    long_id = alice.StartTraining(long_request(1)).job.id
    wait_for(lambda: stepped(alice, long_id), END_BOUND_S, "a checkpoint")  # step 100
    short = bob.StartTraining(tiny_request(steps=10)).job.id
    wait_for(lambda: "preempted at its slice" in log.read_text(), WAIT_BOUND_S, "a preemption")
    workers[0].send_signal(signal.SIGKILL)
    workers[0].wait()
    workers.append(start_worker(redis_url, "w2", tmp_path / "w2.log"))
    for stub, job_id in ((bob, short), (alice, long_id)):
        wait_for(lambda s=stub, j=job_id: state(s, j) == pb.JOB_STATE_SUCCEEDED, END_BOUND_S, "end")
    events = history(alice, long_id)
    assert_each_step_once(events, LONG_STEPS, EVERY)
    resumed = [c.step for c in states(events) if c.state == pb.JOB_STATE_RUNNING][1:]
    assert resumed and resumed[0] > 0  # from a checkpoint, not from the start


def test_a_plain_job_passes_its_own_tenants_sweep_within_a_slice(
    service_factory: Callable[..., RunningService],
    redis_url: str,
    workers: list[subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    """Sweep runs go after their tenant's other jobs: a plain job alice submits while her
    sweep's runs hold the one worker (and more of them wait) starts within a slice; the run it
    preempts says why, and every run ends SUCCEEDED with each step once."""
    alice, _ = two_tenants(service_factory)
    workers.append(start_worker(redis_url, "w1", tmp_path / "w.log"))
    base = long_request(1)
    base.optimizer.ClearField("lr")
    axis = pb.SweepAxis(field="optimizer.lr", values=[0.05, 0.04])
    runs = [
        run.job_id for run in alice.StartSweep(pb.StartSweepRequest(base=base, axes=[axis])).runs
    ]
    wait_for(lambda: pb.JOB_STATE_RUNNING in [state(alice, r) for r in runs], END_BOUND_S, "a run")
    plain = alice.StartTraining(tiny_request(steps=10)).job.id
    first_step = wait_for(lambda: stepped(alice, plain), WAIT_BOUND_S, "the plain job's step")
    print(f"the plain job's first step came {first_step:.1f} s after its submit")
    assert any(state(alice, r) != pb.JOB_STATE_SUCCEEDED for r in runs)  # a run waits instead
    for job_id in runs:
        wait_for(lambda j=job_id: state(alice, j) == pb.JOB_STATE_SUCCEEDED, END_BOUND_S, "end")
        assert_each_step_once(history(alice, job_id), LONG_STEPS, EVERY)
    preempted = [
        c.message
        for r in runs
        for c in states(history(alice, r))
        if c.message.startswith(PREEMPTED)
    ]
    assert preempted and all("a job of its tenant waits" in m for m in preempted), preempted


def test_two_slots_whose_slices_end_together_free_one_for_one_waiting_job(
    service_factory: Callable[..., RunningService],
    redis_url: str,
    workers: list[subprocess.Popen[str]],
    tmp_path: Path,
) -> None:
    """One worker with two slots starts alice's two long jobs together, so their slices end
    together; bob submits one job: one of alice's jobs is preempted for it, once, the other's
    slice starts over; all end SUCCEEDED, each step once."""
    alice, bob = two_tenants(service_factory)
    long_ids = [alice.StartTraining(long_request(1)).job.id for _ in range(2)]
    workers.append(start_worker(redis_url, "w1", tmp_path / "w.log", slots=2))
    wait_for(lambda: all(stepped(alice, j) for j in long_ids), END_BOUND_S, "alice's steps")
    short = bob.StartTraining(tiny_request(steps=10, seed=2)).job.id
    wait_for(lambda: state(bob, short) == pb.JOB_STATE_SUCCEEDED, 2 * WAIT_BOUND_S, "bob's")
    assert all(state(alice, j) != pb.JOB_STATE_SUCCEEDED for j in long_ids), "too short"
    for job_id in long_ids:
        wait_for(lambda j=job_id: state(alice, j) == pb.JOB_STATE_SUCCEEDED, END_BOUND_S, "end")
        assert_each_step_once(history(alice, job_id), LONG_STEPS, EVERY)
    assert sum(preemptions(history(alice, j)) for j in long_ids) == 1
