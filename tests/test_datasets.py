"""Uploaded datasets through the real service: stored in bounded chunks, listed and deleted per
tenant with shared content, a per-tenant byte quota, bounds on concurrent uploads (the server's
and each tenant's share of it), and live metric streams that cannot take the Redis connections
of ordinary calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import redis
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from ssdrbm.datasets import UPLOAD_DTYPES, UPLOAD_DTYPES_BY_NAME, upload_dtype, upload_dtype_code
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from ssdrbm_server.keys import Keys
from ssdrbm_server.store import DatasetStore
from tests.fixtures.jobs import Follower, rpc_error, tiny_request
from tests.fixtures.service import RunningService

ALPHA, BETA = "alpha-secret-1", "beta-secret-2"
CHUNK = 64  # bytes per stored chunk in these tests, so a small array spans many chunks
WAIT_S = 60.0  # a bound for a loaded 2-core machine, not a speed check


def parts(array: np.ndarray, *, piece: int = 50) -> list[pb.UploadDatasetRequest]:
    """Header, then the bytes in pieces that do not line up with elements or stored chunks."""
    data = array.astype("<f4").tobytes()
    header = pb.DatasetHeader(shape=list(array.shape), dtype=pb.DTYPE_FLOAT32, name="bits")
    messages = [pb.UploadDatasetRequest(header=header)]
    messages += [
        pb.UploadDatasetRequest(chunk=data[i : i + piece]) for i in range(0, len(data), piece)
    ]
    return messages


def upload(stub: rbm_pb2_grpc.RBMServiceStub, array: np.ndarray) -> pb.UploadDatasetResponse:
    return stub.UploadDataset(iter(parts(array)), timeout=30)


def listed(stub: rbm_pb2_grpc.RBMServiceStub, page_size: int = 0) -> list[pb.Dataset]:
    found, token = [], ""
    while True:
        reply = stub.ListDatasets(pb.ListDatasetsRequest(page_size=page_size, page_token=token))
        found += list(reply.datasets)
        token = reply.next_page_token
        if not token:
            return found


def delete(stub: rbm_pb2_grpc.RBMServiceStub, dataset_id: str) -> pb.DeleteDatasetResponse:
    return stub.DeleteDataset(pb.DeleteDatasetRequest(dataset_id=dataset_id), timeout=30)


def dataset_keys(client: redis.Redis) -> list[bytes]:
    return [k for k in client.keys("*") if b"dataset:" in k or b"upload:" in k]


def array(seed: int, rows: int = 20) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, 8), dtype=np.float32)


@pytest.fixture
def secured(service_factory: Callable[..., RunningService]) -> RunningService:
    return service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha,{BETA}=beta",
        dataset_chunk_bytes=CHUNK,
    )


def test_an_upload_is_stored_in_bounded_chunks_and_read_back_whole(
    secured: RunningService, redis_server
) -> None:
    stub = secured.stub(token=ALPHA)
    data = array(0)
    reply = upload(stub, data)
    assert reply.created and reply.size_bytes == data.nbytes
    client = redis_server.client()
    values = []
    for key in client.keys("*upload:*"):
        values += list(client.hgetall(key).values())
    assert len(values) == -(-data.nbytes // CHUNK) and max(map(len, values)) <= CHUNK
    store = DatasetStore(secured.service.redis, keys=Keys(secured.settings.redis_prefix))
    info, raw = secured.run_in_loop(store.load("alpha", reply.dataset_id))
    assert np.array_equal(np.frombuffer(raw, dtype="<f4").reshape(info.shape), data)
    assert info.value_range == (float(data.min()), float(data.max()))
    again = stub.UploadDataset(iter(parts(data, piece=7)), timeout=30)
    assert not again.created and again.dataset_id == reply.dataset_id
    assert len(client.keys("*upload:*")) == 1  # the repeat's chunks were dropped


def test_datasets_are_listed_per_tenant_and_shared_bytes_go_with_the_last_reference(
    secured: RunningService, redis_server
) -> None:
    alpha, beta = secured.stub(token=ALPHA), secured.stub(token=BETA)
    ids = sorted(upload(alpha, array(seed)).dataset_id for seed in range(3))
    paged = listed(alpha, page_size=2)
    assert [d.dataset_id for d in paged] == ids
    assert paged[0].name == "bits" and list(paged[0].shape) == [20, 8]
    assert paged[0].dtype == pb.DTYPE_FLOAT32 and paged[0].created_at.seconds > 0
    assert listed(beta) == []
    shared = upload(alpha, array(0)).dataset_id
    for call in (
        lambda: delete(beta, shared),
        lambda: beta.StartTraining(tiny_request(dataset=pb.DatasetRef(dataset_id=shared))),
    ):
        assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND
    same = upload(beta, array(0))
    assert same.created and same.dataset_id == shared  # new for beta, stored once
    delete(alpha, shared)
    assert shared not in [d.dataset_id for d in listed(alpha)]
    assert rpc_error(lambda: delete(alpha, shared)).code() == grpc.StatusCode.NOT_FOUND
    store = DatasetStore(secured.service.redis, keys=Keys(secured.settings.redis_prefix))
    _, raw = secured.run_in_loop(store.load("beta", shared))  # beta's reference keeps it
    assert len(raw) == array(0).nbytes
    delete(beta, shared)
    for other in set(ids) - {shared}:
        delete(alpha, other)
    assert dataset_keys(redis_server.client()) == []


def test_a_dataset_used_by_a_queued_job_cannot_be_deleted(secured: RunningService) -> None:
    stub = secured.stub(token=ALPHA)
    dataset_id = upload(stub, array(1)).dataset_id
    request = tiny_request(dataset=pb.DatasetRef(dataset_id=dataset_id))
    request.training.batch_size = 4
    job = stub.StartTraining(request, timeout=30).job
    error = rpc_error(lambda: delete(stub, dataset_id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert job.id in error.details() and "cancel them" in error.details()
    stub.CancelJob(pb.CancelJobRequest(job_id=job.id), timeout=30)
    # A sweep's runs are jobs submitted the same way: each holds the dataset.
    request.optimizer.ClearField("lr")
    axis = pb.SweepAxis(field="optimizer.lr", values=[0.01, 0.1])
    sweep = stub.StartSweep(pb.StartSweepRequest(base=request, axes=[axis]), timeout=30)
    runs = [run.job_id for run in sweep.runs]
    error = rpc_error(lambda: delete(stub, dataset_id))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert all(run in error.details() for run in runs)
    stub.CancelSweep(pb.CancelSweepRequest(sweep_id=sweep.id), timeout=30)
    assert delete(stub, dataset_id).dataset_id == dataset_id  # ended jobs let go of it
    dataset_ref = pb.DatasetRef(dataset_id=dataset_id)
    gone = rpc_error(lambda: stub.StartTraining(tiny_request(dataset=dataset_ref), timeout=30))
    assert gone.code() == grpc.StatusCode.NOT_FOUND


def test_the_per_tenant_quota_counts_stored_bytes(service_factory) -> None:
    size = array(0).nbytes
    service = service_factory(
        run_worker=False, dataset_chunk_bytes=CHUNK, max_dataset_bytes_per_tenant=2 * size
    )
    stub = service.stub()
    first, second = upload(stub, array(0)), upload(stub, array(1))
    error = rpc_error(lambda: upload(stub, array(2)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_dataset_bytes_per_tenant" in error.details()
    assert not upload(stub, array(0)).created  # a repeat at the quota is still answered
    too_big = rpc_error(lambda: upload(stub, array(3, rows=200)))
    assert too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    delete(stub, first.dataset_id)
    assert upload(stub, array(2)).created
    assert {d.dataset_id for d in listed(stub)} >= {second.dataset_id}


class HeldUpload:
    """An upload whose stream stops after its first piece until `release` (or `cancel`)."""

    def __init__(self, stub: rbm_pb2_grpc.RBMServiceStub, data: np.ndarray) -> None:
        self._release = threading.Event()
        self._messages = parts(data)
        self.sent = threading.Event()
        self.future = stub.UploadDataset.future(self._stream(), timeout=WAIT_S)

    def _stream(self) -> Iterator[pb.UploadDatasetRequest]:
        yield from self._messages[:2]
        self.sent.set()
        self._release.wait(WAIT_S)
        yield from self._messages[2:]

    def release(self) -> pb.UploadDatasetResponse:
        self._release.set()
        return self.future.result()


def test_concurrent_uploads_are_bounded_and_a_half_written_upload_is_never_seen(
    service_factory, redis_server
) -> None:
    service = service_factory(run_worker=False, dataset_chunk_bytes=CHUNK, max_concurrent_uploads=1)
    stub = service.stub()
    held = HeldUpload(stub, array(0))
    assert held.sent.wait(WAIT_S)
    wait_for_uploads(service, 1)
    error = rpc_error(lambda: upload(stub, array(1)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SSDRBM_MAX_CONCURRENT_UPLOADS=1" in error.details()
    assert listed(stub) == []  # the held upload's chunks are not a dataset yet
    assert held.release().created
    cut = HeldUpload(stub, array(2))
    assert cut.sent.wait(WAIT_S)
    cut.future.cancel()
    deadline = time.monotonic() + WAIT_S
    while service.service.servicer.uploads.in_progress and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [d.dataset_id for d in listed(stub)] == [held.future.result().dataset_id]
    assert len(redis_server.client().keys("*upload:*")) == 1  # the cut upload's were dropped


def quota_subject(error: grpc.RpcError) -> str:
    """The QuotaFailure subject of a refusal: whose cap it was."""
    status = rpc_status.from_call(error)
    assert status is not None, error.details()
    for detail in status.details:
        if detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            quota = error_details_pb2.QuotaFailure()
            detail.Unpack(quota)
            return quota.violations[0].subject
    raise AssertionError(f"no QuotaFailure in {error.details()}")


def wait_for_uploads(service: RunningService, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while service.service.servicer.uploads.in_progress < count:
        assert time.monotonic() < deadline, "the held uploads never reached the server"
        time.sleep(0.05)


def test_one_tenants_slow_uploads_leave_the_others_room(service_factory) -> None:
    gamma = "gamma-secret-3"
    service = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha,{BETA}=beta,{gamma}=gamma",
        dataset_chunk_bytes=CHUNK,
        max_concurrent_uploads=3,
        max_uploads_per_tenant=2,
    )
    alpha, beta, third = (service.stub(token=t) for t in (ALPHA, BETA, gamma))
    held = [HeldUpload(alpha, array(seed)) for seed in (0, 1)]  # alpha's share, both stalled
    assert all(h.sent.wait(WAIT_S) for h in held)
    wait_for_uploads(service, 2)
    error = rpc_error(lambda: upload(alpha, array(2)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'alpha' already has 2 uploads" in error.details()
    assert "SSDRBM_MAX_UPLOADS_PER_TENANT=2" in error.details()
    assert quota_subject(error) == "tenant:alpha"
    # Another tenant is not refused for alpha's stalled uploads.
    started = time.monotonic()
    assert upload(beta, array(3)).created
    assert time.monotonic() - started < WAIT_S
    # The server's cap still bounds all tenants together: alpha 2 + beta 1 = 3.
    beta_held = HeldUpload(beta, array(4))
    assert beta_held.sent.wait(WAIT_S)
    wait_for_uploads(service, 3)
    error = rpc_error(lambda: upload(third, array(5)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SSDRBM_MAX_CONCURRENT_UPLOADS=3" in error.details()
    assert quota_subject(error) == "server"
    for upload_in_progress in (*held, beta_held):
        assert upload_in_progress.release().created
    assert upload(third, array(5)).created  # every slot came back
    assert service.service.servicer.uploads.in_progress == 0


def test_live_streams_leave_redis_connections_for_ordinary_calls(service_factory) -> None:
    streams = 6
    service = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha,{BETA}=beta",
        max_streams=streams,
        redis_connections=4,
    )
    alpha, beta = service.stub(token=ALPHA), service.stub(token=BETA)
    jobs = [alpha.StartTraining(tiny_request(), timeout=30).job for _ in range(streams)]
    followers = [Follower(alpha, job.id) for job in jobs]  # queued jobs: they never finish
    deadline = time.monotonic() + WAIT_S
    while service.service.servicer.streams.in_progress < streams and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2 * service.settings.stream_block_ms / 1000)  # every follower is in XREAD BLOCK
    for _ in range(5):
        assert alpha.GetJob(pb.GetJobRequest(job_id=jobs[0].id), timeout=30).id == jobs[0].id
        assert len(alpha.ListJobs(pb.ListJobsRequest(), timeout=30).jobs) == streams
        assert beta.StartTraining(tiny_request(), timeout=30).created
    assert all(f.error is None for f in followers)
    for follower in followers:
        follower.cancel()


def test_every_wire_dtype_has_one_entry_in_the_upload_table() -> None:
    """The one dtype table (ssdrbm.datasets, read by the client, the servicer, the dataset store
    and the worker) covers every DType the protocol names, round trip by name, little-endian."""
    named = {value.number for value in pb.DType.DESCRIPTOR.values} - {pb.DTYPE_UNSPECIFIED}
    assert set(UPLOAD_DTYPES) == named
    assert upload_dtype(pb.DTYPE_UNSPECIFIED) == np.dtype("<f4")
    for code, dtype in UPLOAD_DTYPES.items():
        assert dtype == dtype.newbyteorder("<") and upload_dtype_code(dtype.name) == code
        assert UPLOAD_DTYPES_BY_NAME[dtype.name] is dtype
