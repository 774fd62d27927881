"""Tracing: one trace from StartTraining through the queue to the worker's attempt and its
checkpoint writes (the traceparent crosses Redis in the job record), a caller's traceparent
honoured, and a span for each serving call. Spans are collected with the SDK's in-memory
exporter, installed in-process for the test.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server import tracing
from ssdrbm_server.config import ConfigError, Settings
from tests.fixtures.jobs import N_VISIBLE, float_tensor, tiny_request
from tests.fixtures.service import RunningService

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 90.0  # a bound for a loaded 2-core machine, not a speed check
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_PARENT = f"00-{CALLER_TRACE}-b7ad6b7169203331-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def wait_succeeded(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id)).state != rbm_pb2.JOB_STATE_SUCCEEDED:
        assert time.monotonic() < deadline, "the job did not succeed in time"
        time.sleep(0.1)


def named(finished: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in finished if span.name == name]


def test_one_trace_from_submit_to_checkpoints_and_a_serving_span(
    spans: InMemorySpanExporter, service_factory: Callable[..., RunningService]
) -> None:
    service = service_factory(torch_threads=1)
    stub = service.stub()
    request = tiny_request(steps=30)
    request.training.checkpoint_every = 20
    job = stub.StartTraining(request, timeout=30, metadata=[("traceparent", CALLER_PARENT)]).job
    wait_succeeded(stub, job.id)
    stub.SampleHidden(
        rbm_pb2.SampleHiddenRequest(job_id=job.id, input=float_tensor(2, N_VISIBLE)), timeout=30
    )
    service.stop()  # every span has ended
    finished = list(spans.get_finished_spans())

    (submit,) = named(finished, "ssdrbm.v1.RBMService/StartTraining")
    # The caller's traceparent is honoured: StartTraining joins its trace, under its span.
    assert format(submit.context.trace_id, "032x") == CALLER_TRACE
    assert format(submit.parent.span_id, "016x") == CALLER_PARENT.split("-")[2]
    assert submit.attributes["ssdrbm.job_id"] == job.id
    (queue,) = named(finished, "ssdrbm.queue")
    (claim,) = named(finished, "ssdrbm.worker.claim")
    (attempt,) = named(finished, "ssdrbm.worker.attempt")
    checkpoints = named(finished, "ssdrbm.worker.checkpoint")
    assert sorted(span.attributes["ssdrbm.step"] for span in checkpoints) == [20, 30]
    for child in (queue, claim, attempt):
        assert child.context.trace_id == submit.context.trace_id
        assert child.parent.span_id == submit.context.span_id
        assert child.attributes["ssdrbm.job_id"] == job.id
    for checkpoint in checkpoints:
        assert checkpoint.context.trace_id == submit.context.trace_id
        assert checkpoint.parent.span_id == attempt.context.span_id
    # In order: queued from the submit until the claim, then the attempt with its checkpoints.
    assert submit.start_time <= queue.start_time <= queue.end_time <= claim.end_time
    assert claim.end_time <= attempt.start_time
    assert (
        attempt.attributes["ssdrbm.attempt"] == 1 and claim.attributes["ssdrbm.takeover"] is False
    )

    (serving,) = named(finished, "ssdrbm.v1.RBMService/SampleHidden")
    assert serving.attributes["ssdrbm.job_id"] == job.id
    assert serving.parent is None  # a call of its own, a new trace
    assert serving.context.trace_id != submit.context.trace_id


def test_tracing_off_stores_no_traceparent(service_factory: Callable[..., RunningService]) -> None:
    tracing.shutdown()
    service = service_factory(run_worker=False)
    job = service.stub().StartTraining(tiny_request(), timeout=30).job
    assert service.service is not None
    record = service.run_in_loop(service.service.stores.jobs.get("default", job.id))
    assert record.traceparent == ""


def test_unknown_tracing_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="SSDRBM_TRACING must be"):
        Settings(tracing="jaeger").check()


def test_otlp_without_its_exporter_is_refused_with_the_install_hint() -> None:
    try:
        found = importlib.util.find_spec("opentelemetry.exporter.otlp") is not None
    except ModuleNotFoundError:
        found = False
    if found:
        pytest.skip("the OTLP exporter is installed here")
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp"):
        tracing.configure(Settings(tracing="otlp"))
    assert not tracing.enabled()


def test_without_opentelemetry_the_service_imports_and_tracing_is_a_no_op() -> None:
    """The tracing extra is optional: with opentelemetry unimportable the server modules load,
    spans are no-ops, and asking for tracing is refused with the install hint."""
    code = """
import sys
sys.modules["opentelemetry"] = None  # every opentelemetry import now fails
import ssdrbm_server.logs, ssdrbm_server.worker.worker  # (the servicer would pull in torch)
from ssdrbm_server import tracing
from ssdrbm_server.config import ConfigError, Settings
assert not tracing.AVAILABLE
tracing.configure(Settings())  # off: nothing to do
with tracing.span("ssdrbm.x") as current:
    assert current is None
assert tracing.current_traceparent() == "" and tracing.current_trace_id() == ""
try:
    tracing.configure(Settings(tracing="console"))
except ConfigError as exc:
    print(exc)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "SSDRBM_TRACING=console needs OpenTelemetry" in result.stdout
    assert "pip install './server[tracing]' in a checkout" in result.stdout
