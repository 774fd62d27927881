"""Serving runs tiny requests inline on the event loop and larger ones on the thread pool;
both paths must give the same answers."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server import serving
from tests.fixtures.jobs import finish_with_checkpoint, tiny_request
from tests.fixtures.service import RunningService

INLINE_ALWAYS = 10**15
INLINE_NEVER = -1


def requests(job_id: str) -> dict[str, Callable]:
    rng = np.random.default_rng(3)
    values = (rng.random((3, 16)) < 0.3).astype("<f4")
    tensor = rbm_pb2.Tensor(shape=[3, 16], data=values.tobytes())
    return {
        "Reconstruct mean field": lambda stub: stub.Reconstruct(
            rbm_pb2.ReconstructRequest(job_id=job_id, input=tensor, k=3, mean_field=True)
        ),
        "Reconstruct sampled, seeded": lambda stub: stub.Reconstruct(
            rbm_pb2.ReconstructRequest(job_id=job_id, input=tensor, k=2, seed=7)
        ),
        "SampleHidden probabilities": lambda stub: stub.SampleHidden(
            rbm_pb2.SampleHiddenRequest(job_id=job_id, input=tensor)
        ),
        "SampleHidden sampled, seeded": lambda stub: stub.SampleHidden(
            rbm_pb2.SampleHiddenRequest(
                job_id=job_id, input=tensor, mode=rbm_pb2.HIDDEN_MODE_SAMPLE, seed=7
            )
        ),
    }


def output(response) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.frombuffer(response.output.data, dtype="<f4").reshape(tuple(response.output.shape))


def test_inline_and_pooled_computations_agree(
    service_factory: Callable[..., RunningService],
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = service_factory(run_worker=False)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    finish_with_checkpoint(redis_url, job.id, step=10)
    answers: dict[int, dict[str, np.ndarray]] = {}
    for limit in (INLINE_ALWAYS, INLINE_NEVER):
        monkeypatch.setattr(serving, "INLINE_MAX_MULTIPLY_ADDS", limit)
        answers[limit] = {name: output(call(stub)) for name, call in requests(job.id).items()}
    for name, inline in answers[INLINE_ALWAYS].items():
        pooled = answers[INLINE_NEVER][name]
        assert inline.shape == pooled.shape, name
        # Same model, same seeded generator, same float32 products: identical to rounding.
        np.testing.assert_allclose(inline, pooled, rtol=1e-6, atol=1e-7, err_msg=name)
