"""Fairness between tenants: each tenant gets a share of the server's metric streams, so one
tenant holding many cannot lock the others out."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from ssdrbm.v1 import rbm_pb2 as pb

from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.service import RunningService


def test_one_tenant_cannot_take_every_metric_stream(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens="ta=alice,tb=bob",
        max_streams=10,
        max_streams_per_tenant=2,
    )
    alice, bob = running.stub(token="ta"), running.stub(token="tb")
    streams = []
    for stub in (alice, bob):
        job = stub.StartTraining(tiny_request()).job  # queued: its streams stay open
        follow = pb.StreamMetricsRequest(job_id=job.id)
        if stub is alice:
            streams += [alice.StreamMetrics(follow) for _ in range(2)]
            for stream in streams:
                assert next(stream).state.state == pb.JOB_STATE_QUEUED  # opened on the server
            error = rpc_error(lambda f=follow: alice.StreamMetrics(f))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SSDRBM_MAX_STREAMS_PER_TENANT=2" in error.details()
            assert "'alice' already has 2" in error.details()
        else:  # the server is far from its global cap: the other tenant still gets a stream
            stream = bob.StreamMetrics(follow)
            assert next(stream).state.state == pb.JOB_STATE_QUEUED
            streams.append(stream)
    for stream in streams:
        stream.cancel()
