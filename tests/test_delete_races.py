"""Deletes racing the calls they could contradict, through the real gRPC server, many trials:

- DeleteJob(force) against a repeat of the StartTraining that created the job (same request_id):
  the repeat answers either that job (it was read before the delete began) or a new job (the
  delete released the request_id first), never an error and never a job that was already gone;
- DeleteDataset against StartTraining on that dataset: either the delete wins (the submit is
  refused NOT_FOUND) or the submit wins (the delete is refused FAILED_PRECONDITION naming the
  job), so no accepted job ever fails for want of its dataset.

Each trial starts both calls at a barrier, one of them after a seeded random delay of a few
milliseconds, so the trials cover the orders in which their Redis steps can interleave.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc
from ssdrbm.v1 import rbm_pb2 as pb

from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.service import RunningService
from tests.test_datasets import CHUNK, array, delete, listed, upload

TRIALS = 60
MAX_DELAY_S = 0.012  # spread of the second call's start: about the length of a delete
WAIT_S = 60.0  # a bound for a loaded machine, not a speed check


def race(first: Callable[[], Any], second: Callable[[], Any], delay_s: float) -> list[Any]:
    """Run both calls at once, the second ``delay_s`` later (negative: the first later); each
    result is the call's answer or the grpc.RpcError it raised."""
    barrier = threading.Barrier(2)

    def run(call: Callable[[], Any], wait_s: float) -> Any:
        barrier.wait(WAIT_S)
        time.sleep(wait_s)
        try:
            return call()
        except grpc.RpcError as error:
            return error

    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(run, first, max(0.0, -delay_s)),
            pool.submit(run, second, max(0.0, delay_s)),
        ]
        return [future.result(WAIT_S) for future in futures]


def describe(answer: Any) -> str:
    if isinstance(answer, grpc.RpcError):
        return f"{answer.code().name}: {answer.details()}"
    return type(answer).__name__


def test_a_repeated_request_id_racing_a_forced_delete_answers_an_existing_job(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False)  # jobs stay QUEUED: the forced delete cancels
    stub = running.stub()
    rng = random.Random(0)
    outcomes: Counter[str] = Counter()
    for trial in range(TRIALS):
        request = tiny_request(request_id=f"nightly-{trial}")
        job_id = stub.StartTraining(request, timeout=WAIT_S).job.id
        deleted, repeat = race(
            partial(stub.DeleteJob, pb.DeleteJobRequest(job_id=job_id, force=True), timeout=WAIT_S),
            partial(stub.StartTraining, request, timeout=WAIT_S),
            rng.uniform(-MAX_DELAY_S / 3, MAX_DELAY_S),
        )
        assert isinstance(deleted, pb.DeleteJobResponse), describe(deleted)
        assert isinstance(repeat, pb.StartTrainingResponse), f"trial {trial}: {describe(repeat)}"
        gone = rpc_error(partial(stub.GetJob, pb.GetJobRequest(job_id=job_id), timeout=WAIT_S))
        assert gone.code() == grpc.StatusCode.NOT_FOUND
        if repeat.job.id == job_id:
            # Read before the delete began: the job as it then was, and the request_id is free.
            assert not repeat.created and repeat.job.state == pb.JOB_STATE_QUEUED
            outcomes["the job, read before the delete"] += 1
            new_id = stub.StartTraining(request, timeout=WAIT_S).job.id
        else:
            # After the delete began: a new job, which exists and which the request_id names.
            assert repeat.created, f"trial {trial}: an earlier job {repeat.job.id} answered"
            outcomes["a new job"] += 1
            new_id = repeat.job.id
        assert stub.GetJob(pb.GetJobRequest(job_id=new_id), timeout=WAIT_S).id == new_id
        again = stub.StartTraining(request, timeout=WAIT_S)
        assert not again.created and again.job.id == new_id
        stub.DeleteJob(pb.DeleteJobRequest(job_id=new_id, force=True), timeout=WAIT_S)
    print(f"{TRIALS} trials: {dict(outcomes)}")
    assert stub.ListJobs(pb.ListJobsRequest(), timeout=WAIT_S).jobs == []


def test_a_repeat_of_a_finished_jobs_request_id_answers_that_job(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False)
    stub = running.stub()
    request = tiny_request(request_id="once")
    job_id = stub.StartTraining(request, timeout=WAIT_S).job.id
    stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=WAIT_S)
    again = stub.StartTraining(request, timeout=WAIT_S)
    assert not again.created and again.job.id == job_id
    assert again.job.state == pb.JOB_STATE_CANCELLED
    stub.DeleteJob(pb.DeleteJobRequest(job_id=job_id), timeout=WAIT_S)
    fresh = stub.StartTraining(request, timeout=WAIT_S)  # deleted: the request_id is free
    assert fresh.created and fresh.job.id != job_id


def test_a_dataset_deleted_while_a_job_on_it_is_submitted_never_fails_the_accepted_job(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(dataset_chunk_bytes=CHUNK)  # with a worker: accepted jobs train
    stub = running.stub()
    rng = random.Random(1)
    outcomes: Counter[str] = Counter()
    accepted: list[str] = []
    for trial in range(TRIALS):
        dataset_id = upload(stub, array(trial)).dataset_id
        request = tiny_request(steps=10, dataset=pb.DatasetRef(dataset_id=dataset_id))
        request.training.batch_size = 4
        deleted, submitted = race(
            partial(delete, stub, dataset_id),
            partial(stub.StartTraining, request, timeout=WAIT_S),
            rng.uniform(-MAX_DELAY_S / 2, MAX_DELAY_S / 2),
        )
        if isinstance(deleted, pb.DeleteDatasetResponse):
            # The delete came first: the submit found no dataset, and nothing was queued.
            assert isinstance(submitted, grpc.RpcError), f"trial {trial}: a job was accepted"
            assert submitted.code() == grpc.StatusCode.NOT_FOUND, describe(submitted)
            assert dataset_id in submitted.details()
            outcomes["the delete first"] += 1
        else:
            # The submit came first: the delete is refused, naming the job and what to do.
            assert isinstance(submitted, pb.StartTrainingResponse), describe(submitted)
            assert deleted.code() == grpc.StatusCode.FAILED_PRECONDITION, describe(deleted)
            assert submitted.job.id in deleted.details() and "cancel" in deleted.details()
            accepted.append(submitted.job.id)
            outcomes["the submit first"] += 1
    print(f"{TRIALS} trials: {dict(outcomes)}")
    ended = [wait_until_ended(stub, job_id) for job_id in accepted]
    failed = [job.error for job in ended if job.state != pb.JOB_STATE_SUCCEEDED]
    assert failed == []
    # Ended jobs hold their datasets no more: every one left can be deleted now.
    for dataset in listed(stub):
        delete(stub, dataset.dataset_id)
    assert listed(stub) == []


def wait_until_ended(stub: Any, job_id: str) -> pb.Job:
    deadline = time.monotonic() + WAIT_S * 3
    while True:
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=WAIT_S)
        if job.state not in (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {pb.JobState.Name(job.state)}"
        time.sleep(0.1)
