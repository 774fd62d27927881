"""`python -m bench.load`: a bounded load test of the whole service on loopback.

It starts its own redis-server (AOF on), the API server (`python -m ssdrbm_server --no-worker`)
and two workers (`python -m ssdrbm_server.worker`), all bound to 127.0.0.1, then at once:

- submits many small training jobs (queued, shared by the two workers);
- follows them with dozens of concurrent StreamMetrics subscribers;
- sends a steady stream of Reconstruct / SampleHidden calls against a trained model;
- kills one worker with SIGKILL in the middle and starts a replacement (the "chaos" step), and
  measures how long its job took to resume elsewhere;
- at the end, cancels a running job and measures how long the cancel took;
- the fairness phase: tenant A queues many jobs, then tenant B submits one; it counts A's jobs
  that started after B's submit and before B's job started, which the queue's rotation bounds
  by one job slot per worker (server/ssdrbm_server/store/queue.py);
- then the soak (``--soak``, on in the full run): submits, finishes and deletes many more jobs
  and compares the keys' bytes (MEMORY USAGE) and ``DBSIZE`` with their baseline once every
  delete is settled (the purge schedule empty), within a stated tolerance.

It checks that every job SUCCEEDED, that every subscriber saw each metric step exactly once and
the same events a replay returns (no event lost or repeated), and that every serving call
succeeded; it reports latency percentiles. It stops by itself: everything runs under a deadline,
and every process it started is stopped on the way out. Exit status 0 when every check passed.
The API server runs with bearer tokens (two tenants, loopback plaintext): the load and the soak
are tenant A's; tenant B only submits the fairness phase's job.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ssdrbm.connection import with_bearer_token
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.keys import Keys
from ssdrbm_server.redis_process import RedisServer, free_port
from ssdrbm_server.store.records import worker_label

logger = logging.getLogger("bench.load")

REPO = Path(__file__).resolve().parents[1]
N_VISIBLE = 16
START_TIMEOUT_S = 60.0
# The soak compares the keys' own sizes (`keyspace_bytes`), not the allocator's total, which
# moves by tens of KB between two readings of the same data (client buffers, fragmentation).
# They may end this far above the baseline (encodings growing a step, e.g. a listpack)...
SOAK_MEMORY_TOLERANCE_BYTES = 16 * 1024
# ...plus this much per deleted job: each delete leaves a version tombstone in the shared
# indexes (`{jobs}:versions`, `{jobs}:forgotten`) for an hour (ssdrbm_server.store.indexes;
# about 100 bytes measured). One job left behind costs tens of KB.
SOAK_TOMBSTONE_BYTES = 512
SOAK_STEPS = 20  # a soak job's steps; a metric event and a checkpoint every 10
TOKENS = {"alice": "ta", "bob": "tb"}  # tenant -> bearer token (SSDRBM_AUTH_TOKENS)
TENANT_A, TENANT_B = "alice", "bob"


@dataclass
class LoadConfig:
    """Sizes of one run; the defaults are the full run, ``quick()`` a test-sized one."""

    jobs: int = 24
    steps: int = 200
    eval_every: int = 10
    checkpoint_every: int = 50
    subscribers: int = 48
    serving_calls: int = 400
    serving_concurrency: int = 16
    chaos: bool = True  # SIGKILL the worker of a longer job mid-run and start a replacement
    chaos_steps: int = 20_000
    chaos_every: int = 1000  # its metric and checkpoint interval
    lease_seconds: float = 2.0
    soak: bool = True  # submit, finish and delete soak_jobs more jobs; Redis back to baseline
    soak_jobs: int = 200
    soak_batch: int = 20  # jobs in flight at once, under the per-tenant active-job limit
    fairness_jobs: int = 40  # tenant A's backlog before tenant B's one job; 0: no fairness phase
    deadline_s: float = 900.0

    @classmethod
    def quick(cls) -> LoadConfig:
        return cls(
            jobs=4,
            steps=40,
            subscribers=10,
            serving_calls=24,
            serving_concurrency=4,
            chaos_steps=3000,
            chaos_every=250,
            soak_jobs=6,
            soak_batch=3,
            fairness_jobs=6,
            deadline_s=240.0,
        )


@dataclass
class LoadReport:
    """What a run measured and found; ``failures`` is empty when every check passed."""

    config: dict[str, object]
    wall_s: float = 0.0
    jobs_succeeded: int = 0
    jobs_total: int = 0
    events_received: int = 0
    latencies_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    cold_serving_ms: float | None = None  # the first serving call (model and torch load)
    recovery_s: float | None = None  # SIGKILL of a worker -> its job running again elsewhere
    cancel_s: float | None = None  # CancelJob -> state CANCELLED
    soak: dict[str, float] | None = None  # Redis before, at the peak and after the soak
    fairness: dict[str, float] | None = None  # see measure_fairness
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


class DeadlineExceeded(Exception):
    """The run did not finish within its deadline."""


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def check(self, what: str) -> None:
        if time.monotonic() > self.end:
            raise DeadlineExceeded(f"deadline passed while {what}")


def percentiles(samples: list[float]) -> dict[str, float]:
    """count, p50, p95, p99 and max of latencies given in seconds, in milliseconds."""
    if not samples:
        return {"count": 0}
    values = np.asarray(samples) * 1000.0
    return {
        "count": len(samples),
        "p50": round(float(np.percentile(values, 50)), 2),
        "p95": round(float(np.percentile(values, 95)), 2),
        "p99": round(float(np.percentile(values, 99)), 2),
        "max": round(float(values.max()), 2),
    }


# --- the processes under test ---------------------------------------------------------------


class Cluster:
    """redis-server, the API server and the workers, as child processes on loopback."""

    def __init__(self, directory: Path, config: LoadConfig) -> None:
        self.directory = directory
        self.config = config
        self.redis = RedisServer(directory / "redis")
        self.api_port = free_port()
        self.redis_url = self.redis.url
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.directory / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def _env(self, **extra: str) -> dict[str, str]:
        # The caller's own SSDRBM_* settings do not leak in: the run is the same everywhere.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SSDRBM_")}
        return {
            **inherited,
            "SSDRBM_REDIS_URL": self.redis_url,
            "SSDRBM_LEASE_SECONDS": str(self.config.lease_seconds),
            "SSDRBM_TORCH_THREADS": "1",
            # One training slot per worker process: the chaos step kills a job's worker by its
            # process, and fairness is read against two one-job workers.
            "SSDRBM_WORKER_SLOTS": "1",
            "SSDRBM_METRICS_PORT": "0",
            "SSDRBM_LOG_LEVEL": "WARNING",
            "SSDRBM_MAX_JOBS_PER_TENANT": str(
                max(self.config.jobs, self.config.fairness_jobs) + 10
            ),
            **extra,
        }

    def start(self) -> None:
        self.redis.start()
        self._spawn(
            "api",
            [sys.executable, "-m", "ssdrbm_server", "--no-worker", "--listen",
             f"127.0.0.1:{self.api_port}"],
            self._env(
                SSDRBM_AUTH_MODE="token",
                SSDRBM_AUTH_TOKENS=",".join(f"{t}={n}" for n, t in TOKENS.items()),
            ),
        )  # fmt: skip
        for number in (1, 2):
            self.start_worker(f"worker-{number}")
        self._wait_until_serving()

    def start_worker(self, worker_id: str) -> None:
        self._spawn(
            worker_id,
            [sys.executable, "-m", "ssdrbm_server.worker"],
            self._env(SSDRBM_WORKER_ID=worker_id),
        )

    def live_workers(self) -> int:
        return sum(
            name.startswith("worker") and process.poll() is None
            for name, process in self.processes.items()
        )

    def channel(self, tenant: str) -> grpc.Channel:
        """A channel whose every call carries ``tenant``'s bearer token."""
        channel = grpc.insecure_channel(f"127.0.0.1:{self.api_port}")
        return with_bearer_token(channel, TOKENS[tenant])

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait()

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(f"127.0.0.1:{self.api_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                for name, process in self.processes.items():
                    if process.poll() is not None:
                        raise RuntimeError(f"{name} exited at start; see {self.directory}")
                with contextlib.suppress(grpc.RpcError):
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError("the service did not start in time")
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM everything (workers first, Redis last), SIGKILL what lingers."""
        order = [n for n in self.processes if n.startswith("worker")] + ["api"]
        for name in order:
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.redis.stop()


# --- the load ---------------------------------------------------------------------------------


def job_request(
    config: LoadConfig, seed: int, steps: int | None = None, every: int | None = None
) -> rbm_pb2.StartTrainingRequest:
    """A small job on the synthetic dataset (16 visibles, 8 hidden units)."""
    return rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(n_hidden=8),
        optimizer=rbm_pb2.OptimizerSpec(kind=rbm_pb2.OPTIMIZER_KIND_SSD, lr=0.05),
        training=rbm_pb2.TrainingSpec(
            batch_size=20,
            steps=steps or config.steps,
            seed=seed,
            checkpoint_every=every or config.checkpoint_every,
        ),
        eval=rbm_pb2.EvalSpec(every=every or config.eval_every, validation_fraction=0.2),
        dataset=rbm_pb2.DatasetRef(
            builtin=rbm_pb2.BuiltinDataset(
                name="synthetic",
                options={"n_visible": str(N_VISIBLE), "n_hidden": "4", "n_samples": "200"},
            )
        ),
        name=f"load-{seed}",
    )


def timed(samples: list[float], call: Callable[[], object]) -> object:
    started = time.perf_counter()
    result = call()
    samples.append(time.perf_counter() - started)
    return result


class Subscriber(threading.Thread):
    """Follows one job's metric stream to its end, timing the first event and each event's lag
    behind the moment it was written."""

    def __init__(
        self,
        stub: rbm_pb2_grpc.RBMServiceStub,
        job_id: str,
        expected_steps: list[int],
        timeout: float,
    ) -> None:
        super().__init__(daemon=True)
        self.stub, self.job_id, self.timeout = stub, job_id, timeout
        self.expected_steps = expected_steps
        self.events: list[rbm_pb2.MetricEvent] = []
        self.first_event_s: float | None = None
        self.lags_s: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        started = time.perf_counter()
        request = rbm_pb2.StreamMetricsRequest(job_id=self.job_id)
        try:
            for event in self.stub.StreamMetrics(request, timeout=self.timeout):
                if self.first_event_s is None:
                    self.first_event_s = time.perf_counter() - started
                written = event.time.ToNanoseconds() / 1e9
                self.lags_s.append(max(0.0, time.time() - written))
                self.events.append(event)
        except grpc.RpcError as exc:
            self.error = f"{exc.code().name}: {exc.details()}"


def wait_for(
    stub: rbm_pb2_grpc.RBMServiceStub,
    job_id: str,
    done: Callable[[rbm_pb2.Job], bool],
    deadline: Deadline,
    poll_s: float = 0.05,
) -> rbm_pb2.Job:
    while True:
        job = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id))
        if done(job):
            return job
        deadline.check(f"waiting for job {job_id}")
        time.sleep(poll_s)


def serving_tensor() -> rbm_pb2.Tensor:
    rng = np.random.default_rng(0)
    batch = (rng.random((32, N_VISIBLE)) < 0.5).astype("<f4")
    return rbm_pb2.Tensor(shape=list(batch.shape), data=batch.tobytes())


def warm_up(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str, report: LoadReport) -> None:
    """The first serving call loads the model (and torch, in a fresh server); it is timed on
    its own, before the load starts, so that the load's figures are the steady state."""
    cold: list[float] = []
    request = rbm_pb2.ReconstructRequest(job_id=job_id, input=serving_tensor())
    timed(cold, lambda: stub.Reconstruct(request, timeout=120))
    report.cold_serving_ms = round(cold[0] * 1000, 1)


def serving_load(
    stub: rbm_pb2_grpc.RBMServiceStub, job_id: str, config: LoadConfig, report: LoadReport
) -> tuple[list[float], list[float]]:
    """Reconstruct and SampleHidden calls, alternating, from a thread pool."""
    tensor = serving_tensor()
    reconstruct: list[float] = []
    hidden: list[float] = []

    def call(number: int) -> None:
        try:
            if number % 2:
                request = rbm_pb2.ReconstructRequest(job_id=job_id, input=tensor, k=1)
                reply = timed(reconstruct, lambda: stub.Reconstruct(request, timeout=60))
                assert list(reply.output.shape) == [32, N_VISIBLE]
            else:
                request = rbm_pb2.SampleHiddenRequest(job_id=job_id, input=tensor)
                reply = timed(hidden, lambda: stub.SampleHidden(request, timeout=60))
                assert list(reply.output.shape) == [32, 8]
        except (grpc.RpcError, AssertionError) as exc:
            report.failures.append(f"serving call {number} failed: {exc!r}"[:300])

    with ThreadPoolExecutor(config.serving_concurrency) as pool:
        list(pool.map(call, range(config.serving_calls)))
    return reconstruct, hidden


def check_stream(stub: rbm_pb2_grpc.RBMServiceStub, subscriber: Subscriber) -> list[str]:
    """Problems with one subscriber's events (empty when it saw everything exactly once)."""
    problems = []
    if subscriber.error:
        problems.append(f"stream of {subscriber.job_id} ended with {subscriber.error}")
    steps = [e.metrics.step for e in subscriber.events if e.WhichOneof("event") == "metrics"]
    expected = subscriber.expected_steps
    if steps != expected:
        problems.append(f"stream of {subscriber.job_id}: metric steps {steps} != {expected}")
    states = [e.state.state for e in subscriber.events if e.WhichOneof("event") == "state"]
    if not states or states[-1] != rbm_pb2.JOB_STATE_SUCCEEDED:
        problems.append(f"stream of {subscriber.job_id} did not end SUCCEEDED: {states}")
    replay = rbm_pb2.StreamMetricsRequest(job_id=subscriber.job_id, history_only=True)
    stored = [e.resume_token for e in stub.StreamMetrics(replay, timeout=60)]
    if [e.resume_token for e in subscriber.events] != stored:
        problems.append(f"stream of {subscriber.job_id} differs from its replay")
    return problems


def chaos(
    cluster: Cluster, stub: rbm_pb2_grpc.RBMServiceStub, job_id: str, deadline: Deadline
) -> float:
    """SIGKILL the worker of ``job_id`` once it has a checkpoint and is well before its end,
    start a replacement worker; seconds until the job runs again under the next attempt."""
    while True:
        job = stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id))
        if job.state == rbm_pb2.JOB_STATE_RUNNING and job.checkpoint_step > 0:
            break
        if job.state >= rbm_pb2.JOB_STATE_SUCCEEDED:
            raise AssertionError("the chaos job ended before its worker could be killed")
        deadline.check("waiting for the chaos job to checkpoint")
        time.sleep(0.02)
    if job.step > job.total_steps // 2:
        raise AssertionError(f"the chaos job trained too fast to kill mid-run: {job.step}")
    # Tenants see an opaque label of the worker (convert.worker_label), not its id.
    worker = next(name for name in cluster.processes if worker_label(name) == job.worker)
    killed_at = time.perf_counter()
    cluster.kill(worker)
    cluster.start_worker(f"{worker}-replacement")
    wait_for(stub, job_id, lambda j: j.attempt > job.attempt, deadline, 0.02)
    recovery = time.perf_counter() - killed_at
    logger.info("killed %s under job %s; resumed after %.2f s", job.worker, job_id, recovery)
    return recovery


def measure_cancel(
    stub: rbm_pb2_grpc.RBMServiceStub, config: LoadConfig, deadline: Deadline
) -> float:
    job = stub.StartTraining(job_request(config, seed=10_000, steps=1_000_000)).job
    wait_for(stub, job.id, lambda j: j.state == rbm_pb2.JOB_STATE_RUNNING and j.step > 0, deadline)
    asked = time.perf_counter()
    stub.CancelJob(rbm_pb2.CancelJobRequest(job_id=job.id))
    final = wait_for(stub, job.id, lambda j: j.state >= rbm_pb2.JOB_STATE_SUCCEEDED, deadline, 0.01)
    took = time.perf_counter() - asked
    if final.state != rbm_pb2.JOB_STATE_CANCELLED:
        raise AssertionError(f"cancelled job ended {rbm_pb2.JobState.Name(final.state)}")
    return took


def keyspace_bytes(client: redis.Redis) -> int:
    """The bytes Redis attributes to the keys themselves: MEMORY USAGE of each, every element
    counted (SAMPLES 0), so the same data reads the same."""
    return sum(client.memory_usage(key, samples=0) or 0 for key in client.scan_iter())


def redis_usage(client: redis.Redis) -> tuple[int, int]:
    """(DBSIZE, the keys' bytes) of the service's Redis."""
    return client.dbsize(), keyspace_bytes(client)


def settle_deletes(client: redis.Redis, deadline: Deadline) -> None:
    """Wait until the purge schedule is empty: DeleteJob removes a job's entry after its last
    step, and the sweeper finishes any delete left half done (ssdrbm_server.store.lifecycle)."""
    schedule = Keys().purge_schedule()
    while client.zcard(schedule):
        deadline.check("waiting for the purge schedule to empty")
        time.sleep(0.2)


def soak_batch(
    stub: rbm_pb2_grpc.RBMServiceStub, config: LoadConfig, seeds: range, deadline: Deadline
) -> list[str]:
    """Submit one job per seed and wait until each SUCCEEDED; their ids."""
    ids = [stub.StartTraining(job_request(config, seed, SOAK_STEPS, 10)).job.id for seed in seeds]
    for job_id in ids:
        job = wait_for(stub, job_id, lambda j: j.state >= rbm_pb2.JOB_STATE_SUCCEEDED, deadline)
        if job.state != rbm_pb2.JOB_STATE_SUCCEEDED:
            raise AssertionError(f"soak job {job_id} ended {job.state}: {job.error}")
    return ids


def soak(
    cluster: Cluster, stub: rbm_pb2_grpc.RBMServiceStub, config: LoadConfig, deadline: Deadline
) -> dict[str, float]:
    """Submit, finish and delete `config.soak_jobs` jobs in batches; Redis's key count and
    memory at the baseline, at the peak and once every delete is settled."""
    client = redis.Redis.from_url(cluster.redis_url)
    try:
        first_seed = 20_000
        # Warm-up: structures that stay for good (a consumer's entries, a counter) exist first.
        for job_id in soak_batch(stub, config, range(first_seed, first_seed + 1), deadline):
            stub.DeleteJob(rbm_pb2.DeleteJobRequest(job_id=job_id))
        settle_deletes(client, deadline)
        baseline_keys, baseline_memory = redis_usage(client)
        peak_keys, peak_memory = baseline_keys, baseline_memory
        started = time.perf_counter()
        for start in range(0, config.soak_jobs, config.soak_batch):
            count = min(config.soak_batch, config.soak_jobs - start)
            seeds = range(first_seed + 1 + start, first_seed + 1 + start + count)
            ids = soak_batch(stub, config, seeds, deadline)
            keys, memory = redis_usage(client)
            peak_keys, peak_memory = max(peak_keys, keys), max(peak_memory, memory)
            for job_id in ids:
                stub.DeleteJob(rbm_pb2.DeleteJobRequest(job_id=job_id))
        settle_deletes(client, deadline)
        after_keys, after_memory = redis_usage(client)
    finally:
        client.close()
    tolerance = SOAK_MEMORY_TOLERANCE_BYTES + SOAK_TOMBSTONE_BYTES * config.soak_jobs
    return {
        "jobs": config.soak_jobs,
        "seconds": round(time.perf_counter() - started, 1),
        "baseline_keys": baseline_keys,
        "peak_keys": peak_keys,
        "after_keys": after_keys,
        "baseline_key_bytes": baseline_memory,
        "peak_key_bytes": peak_memory,
        "after_key_bytes": after_memory,
        "memory_tolerance_bytes": tolerance,
    }


def soak_failures(figures: dict[str, float]) -> list[str]:
    """What the soak left behind beyond its tolerance (empty when Redis is back to baseline)."""
    problems = []
    if figures["after_keys"] != figures["baseline_keys"]:
        problems.append(
            f"soak: DBSIZE {figures['after_keys']} after deleting every job, "
            f"baseline {figures['baseline_keys']}"
        )
    grown = figures["after_key_bytes"] - figures["baseline_key_bytes"]
    if grown > figures["memory_tolerance_bytes"]:
        problems.append(
            f"soak: the keys take {grown} bytes more than at the baseline after every delete, "
            f"tolerance {figures['memory_tolerance_bytes']}"
        )
    return problems


def _seconds(timestamp: object) -> float:
    return timestamp.ToNanoseconds() / 1e9  # type: ignore[attr-defined]


def measure_fairness(
    cluster: Cluster, config: LoadConfig, stub_a: rbm_pb2_grpc.RBMServiceStub, deadline: Deadline
) -> dict[str, float]:
    """Tenant A queues ``config.fairness_jobs`` jobs, then tenant B submits one. Counts A's
    jobs started before B's (from each job's started_at): those already running at B's submit,
    and those started after it, which the rotation bounds by one job slot per worker."""
    workers = cluster.live_workers()
    a_ids = [
        stub_a.StartTraining(job_request(config, seed)).job.id
        for seed in range(30_000, 30_000 + config.fairness_jobs)
    ]
    with cluster.channel(TENANT_B) as channel_b:
        stub_b = rbm_pb2_grpc.RBMServiceStub(channel_b)
        b_job = stub_b.StartTraining(job_request(config, 40_000)).job
        b_job = wait_for(stub_b, b_job.id, lambda j: j.HasField("started_at"), deadline)
        with contextlib.suppress(grpc.RpcError):  # not measured beyond its start
            stub_b.CancelJob(rbm_pb2.CancelJobRequest(job_id=b_job.id))
    a_jobs = [stub_a.GetJob(rbm_pb2.GetJobRequest(job_id=j)) for j in a_ids]
    submitted, started = _seconds(b_job.created_at), _seconds(b_job.started_at)
    a_starts = [_seconds(j.started_at) for j in a_jobs if j.HasField("started_at")]
    running = sum(t < submitted for t in a_starts)
    ahead = sum(submitted <= t < started for t in a_starts)
    # What is left is not measured: cancel it instead of training it.
    for job_id in a_ids:
        with contextlib.suppress(grpc.RpcError):
            stub_a.CancelJob(rbm_pb2.CancelJobRequest(job_id=job_id))
    return {
        "tenant_a_jobs": config.fairness_jobs,
        "workers": workers,
        "a_running_at_b_submit": running,
        "a_queued_at_b_submit": config.fairness_jobs - running,
        "a_started_before_b": running + ahead,
        "a_started_after_b_submit_before_b": ahead,
        "b_wait_s": round(started - submitted, 3),
        "within_promise": ahead <= workers,
    }


def fairness_failures(figures: dict[str, float]) -> list[str]:
    problems = []
    if not figures["within_promise"]:
        problems.append(
            f"fairness: {figures['a_started_after_b_submit_before_b']} of tenant A's jobs "
            f"started after tenant B's submit and before B's job, more than "
            f"{figures['workers']} (one per worker)"
        )
    if figures["a_queued_at_b_submit"] <= figures["workers"]:
        problems.append(
            f"fairness: only {figures['a_queued_at_b_submit']} of tenant A's jobs were still "
            "queued at tenant B's submit, too few to test the rotation"
        )
    return problems


def drive(cluster: Cluster, config: LoadConfig, report: LoadReport, deadline: Deadline) -> None:
    """Run the load against a started cluster, filling ``report``."""
    channel = cluster.channel(TENANT_A)
    stub = rbm_pb2_grpc.RBMServiceStub(channel)
    try:
        # A model to serve while the rest trains.
        model_job = stub.StartTraining(job_request(config, seed=0, steps=config.eval_every)).job
        wait_for(stub, model_job.id, lambda j: j.state >= rbm_pb2.JOB_STATE_SUCCEEDED, deadline)
        warm_up(stub, model_job.id, report)
        logger.info("model to serve is trained; starting the load")

        started = time.perf_counter()
        submit: list[float] = []
        job_ids = [
            timed(submit, lambda s=seed: stub.StartTraining(job_request(config, s))).job.id
            for seed in range(1, config.jobs + 1)
        ]
        every = config.eval_every
        expected = list(range(every, config.steps + 1, every))
        subscribers = [
            Subscriber(stub, job_ids[i % len(job_ids)], expected, deadline.left())
            for i in range(config.subscribers)
        ]
        chaos_result: list[float] = []
        chaos_thread = None
        if config.chaos:
            chaos_request = job_request(config, 9999, config.chaos_steps, config.chaos_every)
            chaos_job = stub.StartTraining(chaos_request).job.id
            job_ids.append(chaos_job)
            chaos_steps = list(
                range(config.chaos_every, config.chaos_steps + 1, config.chaos_every)
            )
            subscribers.append(Subscriber(stub, chaos_job, chaos_steps, deadline.left()))

            def kill_one() -> None:
                try:
                    chaos_result.append(chaos(cluster, stub, chaos_job, deadline))
                except (AssertionError, DeadlineExceeded, grpc.RpcError, StopIteration) as exc:
                    report.failures.append(f"chaos step: {exc!r}"[:300])

            chaos_thread = threading.Thread(target=kill_one, daemon=True)
            chaos_thread.start()
        for subscriber in subscribers:
            subscriber.start()
        reconstruct, hidden = serving_load(stub, model_job.id, config, report)
        for subscriber in subscribers:
            subscriber.join(deadline.left())
            deadline.check("waiting for the metric streams to end")
        if chaos_thread is not None:
            chaos_thread.join(deadline.left())
            report.recovery_s = round(chaos_result[0], 3) if chaos_result else None
        report.wall_s = round(time.perf_counter() - started, 3)
        logger.info("load finished in %.1f s; checking the streams", report.wall_s)

        finals = [stub.GetJob(rbm_pb2.GetJobRequest(job_id=j)) for j in job_ids]
        report.jobs_succeeded = sum(j.state == rbm_pb2.JOB_STATE_SUCCEEDED for j in finals)
        report.jobs_total = len(finals)
        for job in finals:
            if job.state != rbm_pb2.JOB_STATE_SUCCEEDED:
                report.failures.append(f"job {job.id} ended {job.state}: {job.error}")
        for subscriber in subscribers:
            report.failures.extend(check_stream(stub, subscriber))
        report.events_received = sum(len(s.events) for s in subscribers)
        report.cancel_s = round(measure_cancel(stub, config, deadline), 3)
        logger.info("cancel measured")
        if config.soak:
            report.soak = soak(cluster, stub, config, deadline)
            report.failures.extend(soak_failures(report.soak))
            logger.info("soak of %d jobs done", config.soak_jobs)
        if config.fairness_jobs:
            report.fairness = measure_fairness(cluster, config, stub, deadline)
            report.failures.extend(fairness_failures(report.fairness))
            logger.info("fairness phase done")
        report.latencies_ms = {
            "StartTraining": percentiles(submit),
            "Reconstruct (32x16)": percentiles(reconstruct),
            "SampleHidden (32x16)": percentiles(hidden),
            "StreamMetrics first event": percentiles(
                [s.first_event_s for s in subscribers if s.first_event_s is not None]
            ),
            "metric event delivery lag": percentiles([x for s in subscribers for x in s.lags_s]),
        }
    finally:
        channel.close()


def run(config: LoadConfig, *, keep_dir: Path | None = None) -> LoadReport:
    """One bounded run; never raises for a failed check (see ``report.failures``)."""
    report = LoadReport(config=asdict(config))
    deadline = Deadline(config.deadline_s)
    with _work_dir(keep_dir) as directory:
        cluster = Cluster(directory, config)
        try:
            cluster.start()
            logger.info("redis, the API server and two workers are up")
            drive(cluster, config, report, deadline)
        except (DeadlineExceeded, AssertionError, RuntimeError, grpc.RpcError) as exc:
            report.failures.append(f"{type(exc).__name__}: {exc}"[:500])
        finally:
            cluster.stop()
    return report


@contextlib.contextmanager
def _work_dir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="ssdrbm-load-") as directory:
        yield Path(directory)


def print_report(report: LoadReport) -> None:
    config = report.config
    print(
        f"load: {config['jobs']} jobs x {config['steps']} steps on 2 workers, "
        f"{config['subscribers']} metric subscribers, {config['serving_calls']} serving calls "
        f"({config['serving_concurrency']} at a time), chaos={'on' if config['chaos'] else 'off'}"
    )
    print(
        f"wall {report.wall_s:.1f} s, {report.jobs_succeeded}/{report.jobs_total} jobs SUCCEEDED, "
        f"{report.events_received} events received"
    )
    print(f"{'latency (ms)':32} {'count':>6} {'p50':>9} {'p95':>9} {'p99':>9} {'max':>9}")
    for name, values in report.latencies_ms.items():
        cells = " ".join(f"{values.get(k, float('nan')):>9}" for k in ("p50", "p95", "p99", "max"))
        print(f"{name:32} {values.get('count', 0):>6} {cells}")
    if report.cold_serving_ms is not None:
        print(f"first serving call (loads the model): {report.cold_serving_ms:.0f} ms")
    if report.recovery_s is not None:
        print(
            f"worker SIGKILL -> job running again on another worker: {report.recovery_s:.2f} s "
            f"(lease {config['lease_seconds']} s)"
        )
    if report.cancel_s is not None:
        print(f"CancelJob -> CANCELLED: {report.cancel_s:.2f} s")
    if report.soak is not None:
        print_soak(report.soak)
    if report.fairness is not None:
        f = report.fairness
        print(
            f"fairness: tenant A queued {f['tenant_a_jobs']} jobs, then tenant B one; "
            f"{f['a_started_before_b']} of A's started before B's ({f['a_running_at_b_submit']} "
            f"already running at B's submit, {f['a_started_after_b_submit_before_b']} after it); "
            f"{f['workers']} workers; B waited {f['b_wait_s']:.2f} s; promise (at most one job "
            f"slot per worker): {'kept' if f['within_promise'] else 'BROKEN'}"
        )
    print("checks: all passed" if report.ok else "FAILED:\n  " + "\n  ".join(report.failures))


def print_soak(soak: dict[str, float]) -> None:
    kib = 1024
    grown = soak["after_key_bytes"] - soak["baseline_key_bytes"]
    print(
        f"soak: {soak['jobs']} jobs submitted, finished and deleted in {soak['seconds']} s; "
        f"DBSIZE {soak['baseline_keys']} -> peak {soak['peak_keys']} -> "
        f"{soak['after_keys']}; keys' bytes {soak['baseline_key_bytes'] / kib:.0f} KiB -> "
        f"peak {soak['peak_key_bytes'] / kib:.0f} KiB -> "
        f"{soak['after_key_bytes'] / kib:.0f} KiB ({grown / kib:+.1f} KiB, tolerance "
        f"{soak['memory_tolerance_bytes'] / kib:.0f} KiB; keys must match exactly)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="test-sized run")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--subscribers", type=int)
    parser.add_argument("--serving-calls", type=int)
    parser.add_argument("--no-chaos", action="store_true", help="do not kill a worker")
    soak_help = "submit, finish and delete many jobs; Redis back to its baseline (full: on)"
    parser.add_argument("--soak", action=argparse.BooleanOptionalAction, help=soak_help)
    parser.add_argument("--soak-jobs", type=int)
    fairness_help = "tenant A's backlog before tenant B's one job (0: no fairness phase)"
    parser.add_argument("--fairness-jobs", type=int, help=fairness_help)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--keep", type=Path, help="keep logs and Redis files in this directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = LoadConfig.quick() if args.quick else LoadConfig()
    names = ("jobs", "steps", "subscribers", "serving_calls", "soak_jobs", "soak", "fairness_jobs")
    for name in names:
        if getattr(args, name) is not None:
            setattr(config, name, getattr(args, name))
    config.chaos = config.chaos and not args.no_chaos
    report = run(config, keep_dir=args.keep)
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        print_report(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
