"""Serving's budgets: an oversized call is refused before it computes (the server's memory does
not grow), a call whose client left stops between row chunks, and one tenant's calls cannot take
every pool thread. Chunks are observed through the ssdrbm_serving_chunks counter."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import grpc
import numpy as np
from ssdrbm.v1 import rbm_pb2 as pb

from tests.fixtures.jobs import finish_with_checkpoint, float_tensor, rpc_error, tiny_request
from tests.fixtures.service import RunningService

HANG_BOUND_S = 120.0  # only against a hang: each wait ends as soon as its condition holds
LONG_ROWS = 5000  # one row per chunk, 1000 Gibbs sweeps each: far longer than any deadline here


def memory_bytes(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak since the last reset) of this process, which runs
    the service in a thread."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(re.findall(r"\d+", line)[0]) * 1024


def reset_peak_memory() -> None:
    """Start VmHWM afresh at the current VmRSS, so a freed allocation still shows in it."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def chunks(running: RunningService, outcome: str) -> int:
    assert running.service is not None
    registry = running.service.metrics.registry
    value = registry.get_sample_value("ssdrbm_serving_chunks_total", {"outcome": outcome})
    return int(value or 0)


def wait_for(condition: Callable[[], bool]) -> None:
    ends = time.monotonic() + HANG_BOUND_S
    while not condition():
        assert time.monotonic() < ends, "the condition never held"
        time.sleep(0.05)


def trained_job(running: RunningService, redis_url: str, token: str | None = None, **kw) -> str:
    job_id = running.stub(token=token).StartTraining(tiny_request()).job.id
    finish_with_checkpoint(redis_url, job_id, **kw)
    return job_id


def long_reconstruct(job_id: str) -> pb.ReconstructRequest:
    return pb.ReconstructRequest(job_id=job_id, input=float_tensor(LONG_ROWS, 16), k=1000)


def test_an_over_budget_sample_hidden_is_refused_without_the_memory_growing(
    service_factory: Callable[..., RunningService], redis_url: str
) -> None:
    running = service_factory(run_worker=False, max_serving_output_elements=100_000)
    stub = running.stub()
    job_id = trained_job(running, redis_url, n_hidden=65_536)  # the attack's wide model
    one_row = stub.SampleHidden(pb.SampleHiddenRequest(job_id=job_id, input=float_tensor(1, 16)))
    assert list(one_row.output.shape) == [1, 65_536]  # the model is loaded and cached now
    reset_peak_memory()
    before = memory_bytes("VmRSS")
    # 1000 rows of 64 bytes ask for 65.5 M output floats: 262 MB the old server allocated.
    request = pb.SampleHiddenRequest(job_id=job_id, input=float_tensor(1000, 16))
    error = rpc_error(lambda: stub.SampleHidden(request))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SSDRBM_MAX_SERVING_OUTPUT_ELEMENTS" in error.details()
    assert "65536000" in error.details() and "at most 1 rows" in error.details()
    assert memory_bytes("VmHWM") - before < 64 * 1024 * 1024
    assert chunks(running, "computed") == 0  # a single row is tiny: it ran inline


def test_a_reconstruct_whose_deadline_passed_stops_computing(
    service_factory: Callable[..., RunningService], redis_url: str
) -> None:
    running = service_factory(
        run_worker=False, serving_chunk_rows=1, max_serving_output_elements=10**9
    )
    job_id = trained_job(running, redis_url)
    error = rpc_error(lambda: running.stub().Reconstruct(long_reconstruct(job_id), timeout=1.0))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: chunks(running, "abandoned") > 0)
    computed = chunks(running, "computed")
    assert 0 < computed < LONG_ROWS
    assert computed + chunks(running, "abandoned") == LONG_ROWS


def test_a_cancelled_reconstruct_stops_computing(
    service_factory: Callable[..., RunningService], redis_url: str
) -> None:
    running = service_factory(
        run_worker=False, serving_chunk_rows=1, max_serving_output_elements=10**9
    )
    job_id = trained_job(running, redis_url)
    call = running.stub().Reconstruct.future(long_reconstruct(job_id))
    wait_for(lambda: chunks(running, "computed") > 0)
    call.cancel()
    wait_for(lambda: chunks(running, "abandoned") > 0)
    assert chunks(running, "computed") + chunks(running, "abandoned") == LONG_ROWS


def test_one_tenant_cannot_hold_more_pool_calls_than_its_share(
    service_factory: Callable[..., RunningService], redis_url: str
) -> None:
    running = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens="ta=alice,tb=bob",
        serving_chunk_rows=1,
        max_serving_output_elements=10**9,
        max_serving_calls_per_tenant=1,
        serving_wait_seconds=0.2,
    )
    alice_job = trained_job(running, redis_url, token="ta")
    bob_job = trained_job(running, redis_url, token="tb")
    alice, bob = running.stub(token="ta"), running.stub(token="tb")
    held = alice.Reconstruct.future(long_reconstruct(alice_job))
    try:
        wait_for(lambda: chunks(running, "computed") > 0)
        pooled = pb.ReconstructRequest(job_id=alice_job, input=float_tensor(500, 16), k=100)
        error = rpc_error(lambda: alice.Reconstruct(pooled))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "SSDRBM_MAX_SERVING_CALLS_PER_TENANT=1" in error.details()
        pooled.job_id = bob_job
        answer = bob.Reconstruct(pooled, timeout=HANG_BOUND_S)
        assert np.frombuffer(answer.output.data, "<f4").shape == (500 * 16,)
    finally:
        held.cancel()
