"""Configured limits over real gRPC, each refused with RESOURCE_EXHAUSTED and a message of its
own that names the limit: message size, tensor elements, dataset size, active jobs per tenant,
concurrent metric streams. Under each limit the same call succeeds, so the limit is the cause."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from ssdrbm.v1 import rbm_pb2

from tests.fixtures.jobs import finish_with_checkpoint, float_tensor, rpc_error, tiny_request
from tests.fixtures.service import RunningService

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
TOKENS = "token-a=team-a,token-b=team-b"


def test_message_size_limit(service_factory: Callable[..., RunningService], redis_url: str) -> None:
    running = service_factory(run_worker=False, max_message_bytes=64 * 1024)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    big = float_tensor(2000, 16)  # 128 000 bytes of data
    error = rpc_error(
        lambda: stub.Reconstruct(rbm_pb2.ReconstructRequest(job_id=job.id, input=big))
    )
    assert error.code() is EXHAUSTED
    assert "larger than max" in error.details() and "65536" in error.details()
    # Under the limit the request gets past the transport (here: no checkpoint yet).
    small = float_tensor(2, 16)
    error = rpc_error(
        lambda: stub.Reconstruct(rbm_pb2.ReconstructRequest(job_id=job.id, input=small))
    )
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    # Answers respect the limit too: a model bigger than one message is exported in chunks.
    finish_with_checkpoint(redis_url, job.id, n_visible=2100)  # about 76 kB of safetensors
    header, *chunks = stub.ExportModel(rbm_pb2.ExportModelRequest(job_id=job.id))
    assert len(chunks) > 1 and max(len(c.chunk) for c in chunks) <= 64 * 1024
    assert sum(len(c.chunk) for c in chunks) == header.header.size_bytes > 64 * 1024


def test_tensor_element_limit(service_factory: Callable[..., RunningService]) -> None:
    running = service_factory(run_worker=False, max_tensor_elements=100)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    calls = {
        "Reconstruct": lambda tensor: stub.Reconstruct(
            rbm_pb2.ReconstructRequest(job_id=job.id, input=tensor)
        ),
        "SampleHidden": lambda tensor: stub.SampleHidden(
            rbm_pb2.SampleHiddenRequest(job_id=job.id, input=tensor)
        ),
    }
    for name, call in calls.items():
        error = rpc_error(lambda call=call: call(float_tensor(7, 16)))  # 112 elements
        assert error.code() is EXHAUSTED, name
        assert "112 elements" in error.details() and "limit of 100" in error.details()
        # A shape that claims more elements than it carries is refused before its data is read.
        claimed = rbm_pb2.Tensor(shape=[1 << 30, 1 << 30], data=b"")
        assert rpc_error(lambda call=call, t=claimed: call(t)).code() is EXHAUSTED
        under = rpc_error(lambda call=call: call(float_tensor(6, 16)))  # 96 elements
        assert under.code() is grpc.StatusCode.FAILED_PRECONDITION, name  # no checkpoint yet


def test_dataset_size_limit(service_factory: Callable[..., RunningService]) -> None:
    running = service_factory(run_worker=False, max_dataset_bytes=4096)
    stub = running.stub()

    def upload(rows: int, chunk_rows: int | None = None) -> rbm_pb2.UploadDatasetResponse:
        header = rbm_pb2.DatasetHeader(shape=[rows, 16], dtype=rbm_pb2.DTYPE_FLOAT32)
        data = float_tensor(chunk_rows or rows, 16).data
        return stub.UploadDataset(
            iter(
                [
                    rbm_pb2.UploadDatasetRequest(header=header),
                    rbm_pb2.UploadDatasetRequest(chunk=data),
                ]
            )
        )

    error = rpc_error(lambda: upload(65))  # 4160 bytes
    assert error.code() is EXHAUSTED
    assert "4160 bytes" in error.details() and "limit of 4096" in error.details()
    # A header that understates the size cannot smuggle more bytes in.
    error = rpc_error(lambda: upload(10, chunk_rows=65))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "chunk" in error.details()
    assert upload(64).size_bytes == 4096


def test_active_jobs_per_tenant_limit(service_factory: Callable[..., RunningService]) -> None:
    running = service_factory(
        run_worker=False, max_jobs_per_tenant=2, auth_mode="token", auth_tokens=TOKENS
    )
    a, b = running.stub(token="token-a"), running.stub(token="token-b")
    first = a.StartTraining(tiny_request(request_id="one")).job
    a.StartTraining(tiny_request(request_id="two"))
    error = rpc_error(lambda: a.StartTraining(tiny_request(request_id="three")))
    assert error.code() is EXHAUSTED
    assert "2 queued or running jobs" in error.details() and "cancel" in error.details()
    # A repeat of an accepted request still answers with its job at the limit.
    repeat = a.StartTraining(tiny_request(request_id="one"))
    assert not repeat.created and repeat.job.id == first.id
    # The limit is per tenant.
    assert b.StartTraining(tiny_request()).created
    # Ending a job frees its slot.
    a.CancelJob(rbm_pb2.CancelJobRequest(job_id=first.id))
    assert a.StartTraining(tiny_request(request_id="three")).created


def test_concurrent_stream_limit(service_factory: Callable[..., RunningService]) -> None:
    running = service_factory(run_worker=False, max_streams=2)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    follow = rbm_pb2.StreamMetricsRequest(job_id=job.id)  # a queued job: streams stay open
    open_streams = [stub.StreamMetrics(follow) for _ in range(2)]
    for stream in open_streams:
        assert next(stream).state.state == rbm_pb2.JOB_STATE_QUEUED  # opened on the server
    error = rpc_error(lambda: stub.StreamMetrics(follow))
    assert error.code() is EXHAUSTED
    assert "2 metric streams" in error.details() and "limit 2" in error.details()

    open_streams[0].cancel()  # a client that goes away frees its slot
    deadline = time.monotonic() + 10
    while True:
        replacement = stub.StreamMetrics(follow)
        try:
            assert next(replacement).state.state == rbm_pb2.JOB_STATE_QUEUED
            break
        except grpc.RpcError as exc:
            assert exc.code() is EXHAUSTED
            if time.monotonic() > deadline:
                pytest.fail("a cancelled stream never released its slot")
            time.sleep(0.05)
    replacement.cancel()
    open_streams[1].cancel()


def test_a_cancelled_stream_always_frees_its_slot(
    service_factory: Callable[..., RunningService],
) -> None:
    """A client that reads one event and goes away frees its stream slot, every time: redis-py
    lost a cancel that landed inside a Redis command, so 1 stream in about 10 kept its slot
    for good (store.connection.cancellable)."""
    running = service_factory(run_worker=False, max_streams=1)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    follow = rbm_pb2.StreamMetricsRequest(job_id=job.id)  # a queued job: streams stay open
    for trial in range(40):
        deadline = time.monotonic() + 5
        while True:
            stream = stub.StreamMetrics(follow)
            try:
                next(stream)
                break
            except grpc.RpcError as exc:
                assert exc.code() is EXHAUSTED
                if time.monotonic() > deadline:
                    pytest.fail(f"the stream cancelled before trial {trial} kept its slot")
                time.sleep(0.02)
        stream.cancel()


def test_limits_hold_under_concurrent_requests(
    service_factory: Callable[..., RunningService],
) -> None:
    """Twenty StartTraining and twenty StreamMetrics calls at once: exactly the limit of each
    gets through (the checks are atomic), the rest are RESOURCE_EXHAUSTED."""
    running = service_factory(run_worker=False, max_jobs_per_tenant=5, max_streams=3)
    stub = running.stub()

    def start(_: int) -> grpc.StatusCode:
        try:
            stub.StartTraining(tiny_request())
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(start, range(20)))
    assert codes.count(grpc.StatusCode.OK) == 5 and codes.count(EXHAUSTED) == 15

    [job, *_] = stub.ListJobs(rbm_pb2.ListJobsRequest()).jobs
    follow = rbm_pb2.StreamMetricsRequest(job_id=job.id)
    streams = [stub.StreamMetrics(follow) for _ in range(20)]

    def first(stream) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
        try:
            next(stream)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    with ThreadPoolExecutor(20) as pool:
        codes = list(pool.map(first, streams))
    assert codes.count(grpc.StatusCode.OK) == 3 and codes.count(EXHAUSTED) == 17
    for stream in streams:
        stream.cancel()
