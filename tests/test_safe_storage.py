"""Stored data is never trusted: a checkpoint whose bytes no longer match their sha256 is
skipped for the previous good one, and a checkpoint that is a pickle (even with a matching
sha256, as a forged write to Redis would have) is refused without being unpickled."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import grpc
import redis
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.checkpoints import sha256_hex
from tests.fixtures.jobs import finish_with_checkpoint, float_tensor, rpc_error, tiny_request
from tests.fixtures.service import RunningService


class _Trap:
    """Unpickling this creates a file: proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def reconstruct(stub, job_id: str, step: int = 0) -> rbm_pb2.ReconstructResponse:
    request = rbm_pb2.ReconstructRequest(job_id=job_id, input=float_tensor(2, 16), mean_field=True)
    request.checkpoint_step = step
    return stub.Reconstruct(request)


def test_corrupted_checkpoint_falls_back_to_the_previous_good_one(
    service_factory: Callable[..., RunningService], redis_url: str
) -> None:
    running = service_factory(run_worker=False)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    finish_with_checkpoint(redis_url, job.id, step=10)
    client = redis.Redis.from_url(redis_url)
    try:
        # A second, newer checkpoint whose bytes were damaged after they were written.
        good = client.hgetall(Keys().checkpoint(job.id, 10))
        data = bytearray(good[b"data"])
        data[len(data) // 2] ^= 0xFF  # one flipped byte
        damaged = {**good, b"step": b"20", b"data": bytes(data)}
        client.hset(Keys().checkpoint(job.id, 20), mapping=damaged)
        client.zadd(Keys().checkpoint_index(job.id), {"20": 20})
        client.hset(Keys().job(job.id), "checkpoint_step", 20)
    finally:
        client.close()
    assert reconstruct(stub, job.id).checkpoint_step == 10  # the latest good one
    error = rpc_error(lambda: reconstruct(stub, job.id, step=20))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "sha256" in error.details() and "earlier checkpoint_step" in error.details()
    header, *_ = stub.ExportModel(rbm_pb2.ExportModelRequest(job_id=job.id))
    assert header.header.step == 10


def test_a_pickled_checkpoint_is_refused_not_unpickled(
    service_factory: Callable[..., RunningService], redis_url: str, tmp_path: Path
) -> None:
    running = service_factory(run_worker=False)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    finish_with_checkpoint(redis_url, job.id, step=10)
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Trap(marker))
    client = redis.Redis.from_url(redis_url)
    try:
        key = Keys().checkpoint(job.id, 10)
        client.hset(key, mapping={"data": payload, "sha256": sha256_hex(payload)})
    finally:
        client.close()
    error = rpc_error(lambda: reconstruct(stub, job.id))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot be read as a model" in error.details()
    assert not marker.exists()
    pickle.loads(payload)  # the trap works: unpickling would have created the file
    assert marker.exists()
