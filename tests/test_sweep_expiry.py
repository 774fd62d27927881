"""Sweeps expire with their runs (finished_job_ttl_seconds), over real gRPC and real Redis.

Each run's end moves its sweep's entry in the sweep purge schedule to that run's own expiry time,
only ever later; the expiry (server/ssdrbm_server/sweeps/expiry.py, run by every API process with a
60 s grace) deletes the sweep once none of its jobs is left. The tests call it with no grace
instead of waiting for the background loop; the jobs themselves expire by their Redis TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import redis
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.lifecycle import schedule_member
from ssdrbm_server.sweeps.expiry import SweepExpiry
from tests.fixtures.jobs import rpc_error
from tests.fixtures.service import RunningService
from tests.test_sweep_delete import get, keys_naming, sweep_request, wait_for

TENANT = "default"  # authentication is off in these services


def expire_due(running: RunningService) -> int:
    """One round of the sweep expiry with no grace: how many entries it took."""
    service = running.service
    expiry = SweepExpiry(service.servicer.sweeps, service.stores.jobs.lifecycle)
    return running.run_in_loop(expiry.expire_due(grace_ms=0))


def entry_due_ms(running: RunningService, sweep_id: str) -> float | None:
    client = redis.Redis.from_url(running.settings.redis_url)
    return client.zscore(Keys().sweep_purge_schedule(), schedule_member(sweep_id, TENANT))


def job_gone(running: RunningService, job_id: str) -> Callable[[], bool]:
    client = redis.Redis.from_url(running.settings.redis_url)
    return lambda: not client.exists(Keys().job(job_id))


def cancel(stub, job_id: str) -> None:
    stub.CancelJob(pb.CancelJobRequest(job_id=job_id))


def test_a_sweep_goes_once_its_runs_expired_and_not_before(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False, finished_job_ttl_seconds=1)
    stub = running.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02))
    assert entry_due_ms(running, sweep.id) is None  # no run has ended
    first, second = (run.job_id for run in sweep.runs)

    cancel(stub, first)  # its end schedules the sweep a TTL later
    assert entry_due_ms(running, sweep.id) is not None
    wait_for(job_gone(running, first), "the first run's job to expire")
    assert expire_due(running) == 1  # due, but the second run is still queued
    assert get(stub, sweep.id).state == pb.SWEEP_STATE_RUNNING
    assert entry_due_ms(running, sweep.id) is None  # the second run's end schedules it again

    cancel(stub, second)
    assert entry_due_ms(running, sweep.id) is not None
    wait_for(job_gone(running, second), "the second run's job to expire")
    assert get(stub, sweep.id).state == pb.SWEEP_STATE_EXPIRED  # the board until the expiry
    assert expire_due(running) == 1
    error = rpc_error(lambda: get(stub, sweep.id))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert stub.ListSweeps(pb.ListSweepsRequest()).sweeps == []
    assert keys_naming(running, sweep.id) == []  # entry, record, runs: nothing names it
    assert expire_due(running) == 0


def test_a_run_still_stored_past_its_time_keeps_the_sweep_and_moves_it_on(
    service_factory: Callable[..., RunningService],
) -> None:
    """A job ended but not yet deleted (its Redis expiry lost, its deletion not yet swept):
    the sweep stays and its entry moves on by the grace."""
    running = service_factory(run_worker=False, finished_job_ttl_seconds=1)
    stub = running.stub()
    sweep = stub.StartSweep(sweep_request(0.01))
    [run] = sweep.runs
    cancel(stub, run.job_id)
    redis.Redis.from_url(running.settings.redis_url).persist(Keys().job(run.job_id))
    due = entry_due_ms(running, sweep.id)
    wait_for(lambda: time.time() * 1000 > due, "the entry to be due")
    assert expire_due(running) == 1
    assert get(stub, sweep.id).state == pb.SWEEP_STATE_CANCELLED
    assert entry_due_ms(running, sweep.id) > due + 30_000  # moved on by the 60 s grace


def test_without_a_ttl_sweeps_are_never_scheduled(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False)
    stub = running.stub()
    sweep = stub.StartSweep(sweep_request(0.01))
    cancel(stub, sweep.runs[0].job_id)
    assert entry_due_ms(running, sweep.id) is None
    assert expire_due(running) == 0 and get(stub, sweep.id).state == pb.SWEEP_STATE_CANCELLED


def test_a_run_the_worker_ends_schedules_its_sweep(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(finished_job_ttl_seconds=1)
    stub = running.stub()
    sweep = stub.StartSweep(sweep_request(0.01, steps=10))
    wait_for(lambda: get(stub, sweep.id).state != pb.SWEEP_STATE_RUNNING, "the run to end")
    assert get(stub, sweep.id).state == pb.SWEEP_STATE_SUCCEEDED
    assert entry_due_ms(running, sweep.id) is not None
    wait_for(job_gone(running, sweep.runs[0].job_id), "the run's job to expire")
    assert expire_due(running) == 1
    assert rpc_error(lambda: get(stub, sweep.id)).code() == grpc.StatusCode.NOT_FOUND


def test_a_sweep_whose_creation_died_half_way_still_expires(
    service_factory: Callable[..., RunningService],
) -> None:
    """StartSweep died after recording one of its two runs (and was never repeated): once
    the recorded run's job expired, the sweep goes too."""
    running = service_factory(run_worker=False, finished_job_ttl_seconds=1)
    stub = running.stub()
    sweep = stub.StartSweep(sweep_request(0.01, 0.02))
    client = redis.Redis.from_url(running.settings.redis_url)
    client.rpop(Keys().sweep_runs(TENANT, sweep.id))  # as if the second run was never recorded
    for run in sweep.runs:
        cancel(stub, run.job_id)
    recorded = sweep.runs[0].job_id
    wait_for(job_gone(running, recorded), "the recorded run's job to expire")
    assert expire_due(running) == 1
    assert rpc_error(lambda: get(stub, sweep.id)).code() == grpc.StatusCode.NOT_FOUND
