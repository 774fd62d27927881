"""Worker metrics scraped over HTTP, as Prometheus would: a worker-only process on its own
/metrics port (SSDRBM_WORKER_METRICS_PORT), and a worker inside the server process on the
server's endpoint (one registry).

The counts are exact: samples = steps × batch size, one step-time observation per step, one
checkpoint-write observation per checkpoint, one queue wait per first claim, one takeover per
lapsed lease taken over.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.store import LeaseStore, connect
from tests.fixtures.jobs import tiny_request
from tests.fixtures.redis import free_port
from tests.fixtures.service import RunningService

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 90.0  # a bound for a loaded 2-core machine, not a speed check
STEPS, CHECKPOINT_EVERY, BATCH = 30, 20, 20
CHECKPOINTS_PER_JOB = 2  # steps 20 and 30 (the last step is always saved)


def request(optimizer: int) -> rbm_pb2.StartTrainingRequest:
    spec = tiny_request(steps=STEPS)
    spec.optimizer.kind = optimizer
    spec.training.batch_size = BATCH
    spec.training.checkpoint_every = CHECKPOINT_EVERY
    return spec


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:port/metrics, by (sample name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_succeeded(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        job = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id), timeout=10)
        if job.state == rbm_pb2.JOB_STATE_SUCCEEDED:
            return
        assert job.state in (rbm_pb2.JOB_STATE_QUEUED, rbm_pb2.JOB_STATE_RUNNING), job
        assert time.monotonic() < deadline, f"job did not finish: {job}"
        time.sleep(0.1)


def labels(optimizer: str) -> tuple[tuple[str, str], ...]:
    return (("model", "bernoulli"), ("optimizer", optimizer))


def claim_and_abandon(redis_url: str, job_id: str, lease_ms: int) -> None:
    """A worker that claims the job and dies at once: its lease lapses after ``lease_ms``."""

    async def claim() -> None:
        redis = connect(redis_url)
        try:
            assert await LeaseStore(redis).claim(job_id, "gone-worker", lease_ms=lease_ms)
        finally:
            await redis.aclose()

    asyncio.run(claim())


def start_worker(redis_url: str, metrics_port: int) -> subprocess.Popen[str]:
    """`python -m ssdrbm_server.worker` with its metrics on ``metrics_port``; output (stderr
    too) on its stdout pipe."""
    env = {
        **os.environ,
        "SSDRBM_REDIS_URL": redis_url,
        "SSDRBM_WORKER_METRICS_PORT": str(metrics_port),
        "SSDRBM_TORCH_THREADS": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "ssdrbm_server.worker"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_worker_process_serves_exact_training_metrics(
    redis_url: str, service_factory: Callable[..., RunningService]
) -> None:
    api = service_factory(run_worker=False)
    stub = api.stub()
    # Job A is claimed by a worker that "dies": the real worker takes it over once its lease
    # lapses. Job B goes through the queue.
    taken_over = stub.StartTraining(request(rbm_pb2.OPTIMIZER_KIND_SGD), timeout=30).job
    claim_and_abandon(redis_url, taken_over.id, lease_ms=200)
    queued = stub.StartTraining(request(rbm_pb2.OPTIMIZER_KIND_SSD), timeout=30).job
    metrics_port = free_port()
    worker = start_worker(redis_url, metrics_port)
    try:
        wait_succeeded(stub, taken_over.id)
        wait_succeeded(stub, queued.id)
        samples = scrape(metrics_port)
    finally:
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, output

    for optimizer in ("sgd", "ssd"):
        assert samples["ssdrbm_training_samples_total", labels(optimizer)] == STEPS * BATCH
        assert samples["ssdrbm_training_step_seconds_count", labels(optimizer)] == STEPS
        step_time = samples["ssdrbm_training_step_seconds_sum", labels(optimizer)]
        assert 0 < step_time < WAIT_S
    assert samples["ssdrbm_checkpoint_write_seconds_count", ()] == 2 * CHECKPOINTS_PER_JOB
    # Only job B waited in the queue for its first claim; job A was taken over.
    assert samples["ssdrbm_queue_wait_seconds_count", ()] == 1
    assert samples["ssdrbm_queue_wait_seconds_sum", ()] > 0
    assert samples["ssdrbm_lease_takeovers_total", ()] == 1
    assert samples["ssdrbm_worker_jobs_finished_total", (("state", "SUCCEEDED"),)] == 2
    assert samples["ssdrbm_worker_jobs_finished_total", (("state", "FAILED"),)] == 0
    assert samples["ssdrbm_training_process_failures_total", ()] == 0
    assert samples["ssdrbm_training_backoffs_total", ()] == 0


def diverging_request() -> rbm_pb2.StartTrainingRequest:
    """A Gaussian RBM with plain SGD at lr 2: it blows up at its first evaluation (seeded)."""
    spec = tiny_request(steps=STEPS)
    spec.model.kind = rbm_pb2.MODEL_KIND_GAUSSIAN
    spec.model.variance = rbm_pb2.VARIANCE_KIND_IDENTITY
    spec.optimizer.kind = rbm_pb2.OPTIMIZER_KIND_SGD
    spec.optimizer.lr = 2.0
    spec.training.batch_size = BATCH
    spec.training.checkpoint_every = 5
    spec.eval.every = 5
    return spec


def test_in_process_worker_reports_on_the_server_endpoint(
    service_factory: Callable[..., RunningService],
) -> None:
    """The worker in the server process counts in the server's registry. A job that blows up
    counts each backoff, and the steps trained again after a rollback count as samples too."""
    metrics_port = free_port()
    service = service_factory(metrics_port=metrics_port, torch_threads=1)
    stub = service.stub()
    job = stub.StartTraining(request(rbm_pb2.OPTIMIZER_KIND_SSD), timeout=30).job
    wait_succeeded(stub, job.id)
    samples = scrape(metrics_port)
    # One registry: the server's RPC latency beside the worker's training counters.
    assert samples["ssdrbm_training_samples_total", labels("ssd")] == STEPS * BATCH
    assert samples["ssdrbm_training_step_seconds_count", labels("ssd")] == STEPS
    assert samples["ssdrbm_checkpoint_write_seconds_count", ()] == CHECKPOINTS_PER_JOB
    assert samples["ssdrbm_queue_wait_seconds_count", ()] == 1
    started = (("code", "OK"), ("method", "StartTraining"))
    assert samples["ssdrbm_rpc_latency_seconds_count", started] == 1
    # Throughput is the counter's rate(); the gauge copied from the last event is gone.
    assert not any(name == "ssdrbm_training_samples_per_second" for name, _ in samples)

    diverging = stub.StartTraining(diverging_request(), timeout=30).job
    wait_succeeded(stub, diverging.id)
    events = stub.StreamMetrics(rbm_pb2.StreamMetricsRequest(job_id=diverging.id), timeout=WAIT_S)
    backoffs = [event.backoff for event in events if event.WhichOneof("event") == "backoff"]
    samples = scrape(metrics_port)
    assert backoffs, "the job did not blow up"
    assert samples["ssdrbm_training_backoffs_total", ()] == len(backoffs)
    # Trained: every step once, plus those between each rollback and the blow-up seen after.
    trained = STEPS + sum(backoff.step - backoff.rollback_step for backoff in backoffs)
    gaussian_sgd = (("model", "gaussian"), ("optimizer", "sgd"))
    assert samples["ssdrbm_training_step_seconds_count", gaussian_sgd] == trained
    assert samples["ssdrbm_training_samples_total", gaussian_sgd] == trained * BATCH
    assert samples["ssdrbm_worker_jobs_finished_total", (("state", "SUCCEEDED"),)] == 2


def test_a_taken_metrics_port_costs_the_worker_its_metrics_not_its_work(redis_url: str) -> None:
    """Several workers on one host with the default port: the second one logs what to set
    and goes on taking jobs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = start_worker(redis_url, port)
        seen = []
        try:
            assert worker.stdout is not None
            for line in worker.stdout:  # until the worker runs (or its output ends)
                seen.append(line)
                if " started" in line:
                    break
        finally:
            worker.send_signal(signal.SIGTERM)
            rest, _ = worker.communicate(timeout=30)
    output = "".join(seen) + rest
    assert worker.returncode == 0, output
    assert f"cannot serve metrics on 127.0.0.1:{port}" in output
    assert "SSDRBM_WORKER_METRICS_PORT" in output
    assert any(" started" in line for line in seen), output
