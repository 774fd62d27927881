"""A visible queue: a queued job's position (jobs the rotation serves before it) and an estimate
of when it starts, in GetJob, ListJobs, the CLI and the metrics.

Real parts: a real redis-server, the real API on loopback, one real worker process
(`python -m ssdrbm_server.worker`, one job slot) and the `ssdrbm` CLI as a user runs it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from ssdrbm.events import QueuePlace
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from ssdrbm_server.store import JobQueue, JobStore, LeaseStore
from ssdrbm_server.store.queue import estimate_start
from tests.fixtures.jobs import tiny_request
from tests.fixtures.service import RunningService
from tests.test_store import run, submit
from tests.test_worker import start_worker_process

# The default slice, as the worker process below runs it: no preemption within the test, so
# the positions are exactly the run order.
SLICE_S = 60.0
NO_WORKER_AFTER_S = 1.5  # the API's lease length, after which a job nothing took says so


def test_positions_are_the_order_the_rotation_takes_jobs(redis_url: str) -> None:
    """Three tenants, plain jobs and sweep runs, one tenant served before: each queued job's
    position is its index in the order workers then take them."""

    async def scenario(redis) -> None:
        jobs, queue = JobStore(redis), JobQueue(redis)
        tenant_of: dict[str, str] = {}

        async def submit_as(tenant: str, sweep: bool = False) -> str:
            kw = {"sweep_id": "s1"} if sweep else {}
            job_id = (await submit(jobs, tenant=tenant, **kw))[0].id
            tenant_of[job_id] = tenant
            return job_id

        await submit_as("c")
        [(entry, _)] = await queue.read("w1", block_ms=0)  # c served once: now behind a and b
        await queue.ack(entry)
        for tenant, sweep in [("a", True), ("a", False), ("b", False), ("a", True)]:
            await submit_as(tenant, sweep)
        for tenant, sweep in [("c", False), ("c", False), ("b", False), ("a", False)]:
            await submit_as(tenant, sweep)
        queued = list(tenant_of)[1:]
        positions: dict[str, int] = {}
        for tenant in "abc":
            mine = [job for job in queued if tenant_of[job] == tenant]
            positions |= await queue.positions(tenant, mine)
        assert len(positions) == len(queued)

        taken = []
        for _ in queued:
            [(entry, job_id)] = await queue.read("w1", block_ms=0)
            taken.append(job_id)
            await queue.ack(entry)
        assert [positions[job] for job in taken] == list(range(len(queued)))
        assert await queue.positions("a", queued) == {}  # none queued any more

    run(redis_url, scenario)


def test_places_are_read_on_a_redis_cluster_too(redis_cluster_url: str) -> None:
    """The reads behind a place (the rotation's lists, live leases and their jobs, the Redis
    clock, the streams' newest entries) on a 3-node cluster, where the jobs' keys spread."""

    async def scenario(redis) -> None:
        jobs, queue, leases = JobStore(redis), JobQueue(redis), LeaseStore(redis)
        running = (await submit(jobs, tenant="a"))[0].id
        [(entry, _)] = await queue.read("w1", block_ms=0)
        await queue.ack(entry)
        assert await leases.claim(running, "w1", lease_ms=10_000) is not None
        b1, a1, b2 = [(await submit(jobs, tenant=t))[0].id for t in "bab"]
        places = await queue.places("b", [b1, b2], slice_s=SLICE_S, idle_after_s=1.0)
        places |= await queue.places("a", [a1], slice_s=SLICE_S, idle_after_s=1.0)
        assert [places[job].position for job in (b1, a1, b2)] == [0, 1, 2]
        assert all(place.busy_slots == 1 for place in places.values())
        # the running job has no pace yet, but b waits: it yields at its slice's end
        assert [places[job].starts_in_s for job in (b1, a1, b2)] == [
            SLICE_S,
            2 * SLICE_S,
            3 * SLICE_S,
        ]
        depths = {tenant: depth for tenant, (depth, _) in (await queue.backlog()).items()}
        assert depths == {"a": 1, "b": 2}

    run(redis_url=redis_cluster_url, scenario=scenario, cluster=True)


def test_a_place_reads_as_people_say_it() -> None:
    def place(position: int, starts_in_s: float | None, no_worker: bool = False) -> QueuePlace:
        return QueuePlace(position, starts_in_s, "", 1, SLICE_S, no_worker)

    assert place(3, 40.2).summary() == "3 ahead; about 40 s"
    assert place(0, 170).summary() == "next; about 3 min"
    assert place(12, 2 * 3600 + 300).summary() == "12 ahead; about 2 h 5 min"
    assert place(1, None).summary() == "1 ahead; no estimate yet"
    assert place(0, None, no_worker=True).summary() == "next; no worker is running"


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_the_estimate_counts_slices_when_every_slot_yields(slots: int) -> None:
    """S slots that each yield within a slice start the job with k ahead within
    ceil((k + 1) / S) slices; a slot that frees sooner moves every later start forward."""
    for ahead in range(7):
        starts, basis = estimate_start(ahead, [SLICE_S] * slots, SLICE_S)
        assert starts == math.ceil((ahead + 1) / slots) * SLICE_S
        assert f"{slots} busy slot" in basis
    starts, _ = estimate_start(2, [5.0] + [SLICE_S] * (slots - 1), SLICE_S)
    expected = sorted([5.0, 5.0 + SLICE_S, 5.0 + 2 * SLICE_S] + [SLICE_S] * (slots - 1))
    assert starts == expected[2]
    assert estimate_start(0, [None] * slots, SLICE_S)[0] is None  # no pace known, no yield


def cli(running: RunningService, token: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "SSDRBM_TARGET": running.target, "SSDRBM_TOKEN": token}
    command = [sys.executable, "-m", "ssdrbm.cli", *args]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def cli_output(running: RunningService, token: str, *args: str) -> str:
    out, err = cli(running, token, *args).communicate(timeout=60)
    assert not err, err
    return out


def first_line_with(running: RunningService, text: str, *args: str) -> str:
    """The first line of bob's ``ssdrbm ARGS`` (stderr, or stdout with --json) holding ``text``;
    the command is stopped then (a watch goes on until its job ends)."""
    command = cli(running, "tb", *args)
    output = command.stdout if "--json" in args else command.stderr
    try:
        while text not in (line := output.readline()):
            assert line, f"'ssdrbm {' '.join(args)}' ended without a line holding {text}"
        return line
    finally:
        command.kill()
        command.communicate()


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.1)


def get(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> pb.Job:
    return stub.GetJob(pb.GetJobRequest(job_id=job_id))


def test_queued_jobs_of_two_tenants_start_in_the_order_of_their_positions(
    service_factory: Callable[..., RunningService],
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens="ta=alice,tb=bob",
        slice_seconds=SLICE_S,
        lease_seconds=NO_WORKER_AFTER_S,
    )
    alice, bob = running.stub(token="ta"), running.stub(token="tb")
    long = tiny_request(steps=1_000_000, eval=pb.EvalSpec(every=50, validation_fraction=0.2))
    holder = alice.StartTraining(long).job
    # Nothing runs the queue yet: after a lease length the job says so instead of a number.
    time.sleep(NO_WORKER_AFTER_S + 0.2)
    place = get(alice, holder.id).queue
    assert place.no_worker and not place.HasField("starts_in_seconds") and place.busy_slots == 0
    assert "next; no worker is running" in cli_output(running, "ta", "get", holder.id)

    monkeypatch.setenv("SSDRBM_WORKER_SLOTS", "1")  # one slot: jobs start one at a time
    worker = start_worker_process(redis_url, "queue-w1")  # slices of SLICE_S
    try:
        check_positions_then_the_run_order(running, alice, bob, holder.id)
    finally:
        worker.kill()
        worker.wait()


def check_positions_then_the_run_order(
    running: RunningService,
    alice: rbm_pb2_grpc.RBMServiceStub,
    bob: rbm_pb2_grpc.RBMServiceStub,
    holder: str,
) -> None:
    """While alice's long job holds the one slot: five short jobs of alice and bob queued, their
    places in GetJob, ListJobs, the CLI and the metrics; then, once the long job is cancelled,
    they start in the order of their positions."""
    wait_for(lambda: get(alice, holder).step > 0, 90, "the long job's first metrics")
    submitted = [
        (stub, stub.StartTraining(tiny_request(steps=10, seed=i)).job.id)
        # seeds unlike the long job's and each other's: no two of them can train as a pack
        for i, stub in enumerate([alice, alice, bob, alice, bob], start=10)
    ]
    queued = {job_id: get(stub, job_id).queue for stub, job_id in submitted}
    # bob was never served, alice once (the long job): bob's turn comes first, then hers.
    a1, a2, b1, a3, b2 = (job_id for _, job_id in submitted)
    assert [queued[job].position for job in (b1, a1, b2, a2, a3)] == [0, 1, 2, 3, 4]
    estimates = [queued[job].starts_in_seconds for job in (b1, a1, b2, a2, a3)]
    assert all(queued[job].busy_slots == 1 and not queued[job].no_worker for job in queued)
    assert estimates == sorted(estimates) and estimates[-1] <= 5 * SLICE_S

    listed = bob.ListJobs(pb.ListJobsRequest()).jobs
    assert {job.id: job.queue.position for job in listed if job.HasField("queue")} == {
        b1: 0,
        b2: 2,
    }

    # The CLI: `get` and `jobs` show the place, `watch` says it while the job waits.
    details = cli_output(running, "ta", "get", a3)
    assert "queue:" in details and "4 ahead; about" in details
    assert json.loads(cli_output(running, "ta", "get", a3, "--json"))["queue"]["position"] == 4
    table = cli_output(running, "tb", "jobs").splitlines()
    assert table[0].split()[-1] == "QUEUE" and "2 ahead; about" in table[1]
    assert first_line_with(running, "queued:", "watch", b2).startswith(f"{b2} queued: 2 ahead; ")
    line = json.loads(first_line_with(running, '"queue"', "watch", b2, "--json"))
    assert line["event"] == "queue" and line["queue"]["position"] == 2

    # The API's metrics: queue depth and the waiting heads' wait, per tenant.
    def exposed() -> bool:
        text = running.service.metrics.exposition().decode()
        return (
            'ssdrbm_queue_depth{tenant="alice"} 3.0' in text
            and 'ssdrbm_queue_depth{tenant="bob"} 2.0' in text
            and 'ssdrbm_queue_head_wait_seconds{tenant="bob"}' in text
        )

    wait_for(exposed, 15, "the queue's metrics")

    alice.CancelJob(pb.CancelJobRequest(job_id=holder))
    ended = pb.JOB_STATE_SUCCEEDED

    def all_ended() -> bool:
        return all(get(stub, job_id).state == ended for stub, job_id in submitted)

    wait_for(all_ended, 120, "the queued jobs' end")
    started = {job_id: get(stub, job_id).started_at.ToNanoseconds() for stub, job_id in submitted}
    assert sorted(started, key=started.get) == [b1, a1, b2, a2, a3]
