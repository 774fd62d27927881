"""DeleteSweep over real gRPC and real Redis: a sweep and every run's job go (their keys too),
unfinished runs need force (a running one included, whose worker then stops), keep_runs keeps the
jobs as ordinary jobs, tenancy, a second delete, the freed job quota, runs whose jobs were
deleted or expired (finished_job_ttl_seconds) on the board, the SDK and ``ssdrbm sweep-delete``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis
from ssdrbm import Client, JobState
from ssdrbm.aio import AsyncClient
from ssdrbm.errors import FailedPrecondition
from ssdrbm.sweeps import SweepState
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.connection import connect
from ssdrbm_server.store.records import record_from_hash
from ssdrbm_server.store.rungs import RungGate
from ssdrbm_server.sweeps.store import SweepStore
from tests.fixtures.console import cli
from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.service import RunningService

WAIT_S = 120.0  # a bound for a loaded 2-core machine, not a speed check
ALPHA, BETA = "alpha-secret-1", "beta-secret-2"


def sweep_request(*lrs: float, steps: int = 20) -> pb.StartSweepRequest:
    base = tiny_request(steps=steps)
    base.optimizer.ClearField("lr")
    return pb.StartSweepRequest(
        base=base, axes=[pb.SweepAxis(field="optimizer.lr", values=list(lrs))]
    )


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def delete(stub, sweep_id: str, **flags: bool) -> pb.DeleteSweepResponse:
    return stub.DeleteSweep(pb.DeleteSweepRequest(sweep_id=sweep_id, **flags))


def get(stub, sweep_id: str) -> pb.Sweep:
    return stub.GetSweep(pb.GetSweepRequest(sweep_id=sweep_id))


def keys_naming(running: RunningService, *ids: str) -> list[bytes]:
    """Every Redis key whose name holds one of the ids."""
    client = redis.Redis.from_url(running.settings.redis_url)
    return [key for some_id in ids for key in client.scan_iter(match=f"*{some_id}*")]


def assert_gone(running: RunningService, stub, sweep: pb.Sweep, job_ids: list[str]) -> None:
    """The sweep and its jobs are NOT_FOUND, unlisted, and no key names them."""
    error = rpc_error(lambda: get(stub, sweep.id))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert sweep.id not in [s.id for s in stub.ListSweeps(pb.ListSweepsRequest()).sweeps]
    for job_id in job_ids:
        error = rpc_error(lambda job_id=job_id: stub.GetJob(pb.GetJobRequest(job_id=job_id)))
        assert error.code() == grpc.StatusCode.NOT_FOUND
    assert not [job.id for job in stub.ListJobs(pb.ListJobsRequest()).jobs if job.id in job_ids]
    assert keys_naming(running, sweep.id, *job_ids) == []
    client = redis.Redis.from_url(running.settings.redis_url)
    keys = Keys(running.settings.redis_prefix)
    assert client.zscore(keys.tenant_sweeps("default"), sweep.id) is None
    active = {member.decode() for member in client.smembers(keys.tenant_active("default"))}
    assert not active & set(job_ids)


@pytest.fixture
def idle(service_factory: Callable[..., RunningService]) -> RunningService:
    """A service without a worker: sweeps are created and stay queued."""
    return service_factory(run_worker=False)


# --- with a worker ------------------------------------------------------------------------------


def test_deleting_a_finished_sweep_removes_it_its_jobs_and_their_keys(
    service: RunningService,
) -> None:
    stub = service.stub()
    request = sweep_request(0.01, 0.05)
    request.early_stopping.rungs[:] = [10]  # rung and decision keys to remove as well
    request.request_id = "finished-1"
    sweep = stub.StartSweep(request)
    wait_for(lambda: get(stub, sweep.id).state == pb.SWEEP_STATE_SUCCEEDED, "the sweep to end")
    job_ids = [run.job_id for run in sweep.runs]
    assert keys_naming(service, sweep.id)  # record, runs, rung, decisions, request id key
    assert delete(stub, sweep.id).deleted_jobs == 2
    assert_gone(service, stub, sweep, job_ids)
    client = redis.Redis.from_url(service.settings.redis_url)
    idempotency = Keys(service.settings.redis_prefix).sweep_idempotency("default", "finished-1")
    assert not client.exists(idempotency)
    # Deleting twice: the sweep is gone.
    error = rpc_error(lambda: delete(stub, sweep.id))
    assert error.code() == grpc.StatusCode.NOT_FOUND and sweep.id in error.details()


def test_force_deletes_a_sweep_while_a_worker_trains_its_run(service: RunningService) -> None:
    stub = service.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02, steps=5000))
    job_ids = [run.job_id for run in sweep.runs]
    states = lambda: {run.state for run in get(stub, sweep.id).runs}  # noqa: E731
    wait_for(lambda: pb.JOB_STATE_RUNNING in states(), "a running run")
    error = rpc_error(lambda: delete(stub, sweep.id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "force" in error.details() and "2 runs queued or running" in error.details()
    assert get(stub, sweep.id).state == pb.SWEEP_STATE_RUNNING  # refused: nothing changed
    assert delete(stub, sweep.id, force=True).deleted_jobs == 2
    assert_gone(service, stub, sweep, job_ids)
    # The worker stops at its next fenced write (heartbeats every 0.5 s) and writes nothing back.
    time.sleep(1.5)
    assert keys_naming(service, sweep.id, *job_ids) == []
    follow_up = stub.StartTraining(tiny_request(steps=10)).job  # and it takes the next job
    job_state = lambda: stub.GetJob(pb.GetJobRequest(job_id=follow_up.id)).state  # noqa: E731
    wait_for(lambda: job_state() == pb.JOB_STATE_SUCCEEDED, "the next job")


# --- without a worker ---------------------------------------------------------------------------


def test_keep_runs_deletes_only_the_sweep(idle: RunningService) -> None:
    stub = idle.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02))
    assert delete(stub, sweep.id, keep_runs=True).deleted_jobs == 0  # queued runs: no force
    assert rpc_error(lambda: get(stub, sweep.id)).code() == grpc.StatusCode.NOT_FOUND
    assert keys_naming(idle, sweep.id) == []
    for run in sweep.runs:  # ordinary jobs now, still queued
        job = stub.GetJob(pb.GetJobRequest(job_id=run.job_id))
        assert job.state == pb.JOB_STATE_QUEUED and job.sweep_id == ""


def test_a_sweep_still_being_created_needs_force(idle: RunningService) -> None:
    stub = idle.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02))
    for run in sweep.runs:
        stub.CancelJob(pb.CancelJobRequest(job_id=run.job_id))  # every run ended...
    client = redis.Redis.from_url(idle.settings.redis_url)
    client.rpop(Keys(idle.settings.redis_prefix).sweep_runs("default", sweep.id))
    # ...but its StartSweep has not recorded every run yet (or died before: its repeat would).
    error = rpc_error(lambda: delete(stub, sweep.id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "1 of 2 created" in error.details() and "force" in error.details()
    assert delete(stub, sweep.id, force=True).deleted_jobs == 1


def test_a_delete_racing_the_sweeps_creation_leaves_no_job_behind(idle: RunningService) -> None:
    """DeleteSweep --force while StartSweep is still creating the runs, at whatever point the
    delete lands: the StartSweep either completed first or answers NOT_FOUND, and no job of the
    sweep is left (runs recorded after the delete read the sweep are deleted by it; a run
    created after the delete removed the sweep is removed by the StartSweep)."""
    stub = idle.stub()
    redis_client = redis.Redis.from_url(idle.settings.redis_url)
    for attempt in range(6):
        request = sweep_request(*(0.001 * (i + 1) for i in range(12)))
        request.name = f"race-{attempt}"

        def start(request: pb.StartSweepRequest = request) -> pb.Sweep | grpc.RpcError:
            try:
                return stub.StartSweep(request)
            except grpc.RpcError as error:
                return error

        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(start)
            listed: list[pb.Sweep] = []
            deadline = time.monotonic() + WAIT_S
            while not listed:  # the record exists before its first run
                assert time.monotonic() < deadline, "the sweep never showed in ListSweeps"
                sweeps = stub.ListSweeps(pb.ListSweepsRequest()).sweeps
                listed = [s for s in sweeps if s.name == request.name]
            time.sleep(0.005 * attempt)  # land at different points of the creation
            delete(stub, listed[0].id, force=True)
            outcome = started.result(timeout=WAIT_S)
        if isinstance(outcome, grpc.RpcError):
            assert outcome.code() == grpc.StatusCode.NOT_FOUND, outcome.details()
            assert "deleted while StartSweep created its runs" in outcome.details()
        assert list(stub.ListJobs(pb.ListJobsRequest(page_size=100)).jobs) == []
        assert keys_naming(idle, listed[0].id) == []
        assert not redis_client.smembers(Keys().tenant_active("default"))


def test_another_tenant_gets_not_found(service_factory: Callable[..., RunningService]) -> None:
    tenants = service_factory(
        run_worker=False, auth_mode="token", auth_tokens=f"{ALPHA}=alpha,{BETA}=beta"
    )
    alpha, beta = tenants.stub(token=ALPHA), tenants.stub(token=BETA)
    sweep = alpha.StartSweep(sweep_request(0.01))
    for flags in ({}, {"force": True}, {"keep_runs": True}):
        error = rpc_error(lambda flags=flags: delete(beta, sweep.id, **flags))
        assert error.code() == grpc.StatusCode.NOT_FOUND, flags
    assert get(alpha, sweep.id).runs[0].state == pb.JOB_STATE_QUEUED  # untouched
    assert rpc_error(lambda: delete(alpha, "")).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rpc_error(lambda: delete(alpha, "x:y")).code() == grpc.StatusCode.NOT_FOUND
    assert delete(alpha, sweep.id, force=True).deleted_jobs == 1


def test_deleting_a_sweep_frees_the_job_quota(
    service_factory: Callable[..., RunningService],
) -> None:
    stub = service_factory(run_worker=False, max_jobs_per_tenant=3).stub()
    first = stub.StartSweep(sweep_request(0.01, 0.02, 0.03))
    error = rpc_error(lambda: stub.StartSweep(sweep_request(0.04, 0.05)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert delete(stub, first.id, force=True).deleted_jobs == 3
    second = stub.StartSweep(sweep_request(0.04, 0.05))
    assert len(second.runs) == 2 and second.state == pb.SWEEP_STATE_RUNNING


def test_a_run_deleted_by_its_owner_shows_as_expired_and_is_skipped(idle: RunningService) -> None:
    stub = idle.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02))
    stub.CancelSweep(pb.CancelSweepRequest(sweep_id=sweep.id))
    gone = sweep.runs[0].job_id
    stub.DeleteJob(pb.DeleteJobRequest(job_id=gone))
    board = get(stub, sweep.id)
    assert board.state == pb.SWEEP_STATE_CANCELLED and len(board.runs) == 2
    [expired] = [run for run in board.runs if run.job_id == gone]
    assert expired.expired and expired.state == pb.JOB_STATE_UNSPECIFIED
    assert dict(expired.point) == dict(sweep.runs[0].point)
    shown = cli(idle, "sweep-show", sweep.id)
    assert shown.returncode == 0, shown.stderr
    [row] = [line.split() for line in shown.stdout.splitlines() if gone in line]
    assert row[:4] == ["-", gone, "expired", "-"]  # no rank, no step: its job is gone
    assert delete(stub, sweep.id).deleted_jobs == 1  # the other one; no force: all ended
    assert_gone(idle, stub, sweep, [run.job_id for run in sweep.runs])


def test_runs_whose_jobs_expired_leave_an_expired_sweep(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False, finished_job_ttl_seconds=1)
    stub = running.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02))
    for run in sweep.runs:  # each job ends (not the sweep), then expires after 1 s
        stub.CancelJob(pb.CancelJobRequest(job_id=run.job_id))
    wait_for(lambda: all(run.expired for run in get(stub, sweep.id).runs), "the jobs to expire")
    board = get(stub, sweep.id)
    assert board.state == pb.SWEEP_STATE_EXPIRED and not board.best_job_id
    assert [s.state for s in stub.ListSweeps(pb.ListSweepsRequest()).sweeps] == [
        pb.SWEEP_STATE_EXPIRED
    ]
    updates = list(stub.StreamSweep(pb.StreamSweepRequest(sweep_id=sweep.id), timeout=WAIT_S))
    assert [update.sweep.state for update in updates] == [pb.SWEEP_STATE_EXPIRED]  # it ended
    with Client(running.target) as client:
        seen = client.get_sweep(sweep.id)
        assert seen.state is SweepState.EXPIRED and seen.done
        assert all(run.expired and run.state is JobState.UNSPECIFIED for run in seen.runs)
        assert client.delete_sweep(sweep.id) == 0
    assert keys_naming(running, sweep.id) == []


def test_a_deleted_sweep_takes_no_rung_decisions(redis_url: str) -> None:
    sweep_id = "ef" * 16
    raw = {b"tenant": b"t", b"state": b"RUNNING", b"sweep_id": sweep_id.encode()}
    metrics = pb.Metrics(step=10, reconstruction_error=1.0).SerializeToString()

    async def scenario() -> list[bytes]:
        client = connect(redis_url)
        try:
            store = SweepStore(client, Keys())
            await store.create(
                "t", sweep_id, name="", request=b"", points=[], rungs=[10], eta=3,
                rank_metric="reconstruction_error",
            )  # fmt: skip
            gate = RungGate(client, Keys(), record_from_hash("a" * 32, raw))
            assert not await gate.check(10, metrics)  # the first at the rung: decided
            late = RungGate(client, Keys(), record_from_hash("b" * 32, raw))
            assert not await late.check(20, metrics)  # not a rung step; the rungs are loaded
            await store.delete("t", sweep_id, "")
            # A worker that loaded the rungs before the delete: no decision, no keys written.
            assert not await late.check(10, metrics) and not late.stop_reason
            return [key async for key in client.scan_iter(match=f"*{sweep_id}*")]
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == []


# --- SDK and CLI --------------------------------------------------------------------------------


def test_sdk_deletes_sweeps(idle: RunningService) -> None:
    with Client(idle.target) as client:
        sweep = client.start_sweep(n_hidden=8, steps=20, axes={"lr": [0.01, 0.02]})
        with pytest.raises(FailedPrecondition, match="force"):
            client.delete_sweep(sweep.id)
        assert client.delete_sweep(sweep.id, force=True) == 2
        kept = client.start_sweep(n_hidden=8, steps=20, axes={"lr": [0.01, 0.02]})
        assert client.delete_sweep(kept.id, keep_runs=True) == 0
        assert client.get_job(kept.runs[0].job_id).state is JobState.QUEUED
        other = client.start_sweep(n_hidden=8, steps=20, axes={"lr": [0.03]})

    async def asynchronous() -> int:
        async with AsyncClient(idle.target) as client:
            return await client.delete_sweep(other.id, force=True)

    assert asyncio.run(asynchronous()) == 1
    with Client(idle.target) as client:
        assert list(client.list_sweeps()) == []


def test_cli_sweep_delete(idle: RunningService) -> None:
    stub = idle.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02))
    refused = cli(idle, "sweep-delete", sweep.id)
    assert refused.returncode != 0 and "--force" in refused.stderr, refused.stderr
    result = cli(idle, "sweep-delete", sweep.id, "--force")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{sweep.id} deleted with 2 jobs"
    missing = cli(idle, "sweep-delete", sweep.id)
    assert missing.returncode != 0 and "not found" in missing.stderr, missing.stderr
