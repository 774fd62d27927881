"""Service case: the gRPC service measured end to end over loopback, as its clients see it.

The case starts its own redis-server (free port, temporary directory, AOF fsynced every
second) and the service (gRPC server + worker) as a separate process on port 0
(`bench.service_host`), both through `bench.service_process`, then:

1. trains a 784×500 Bernoulli RBM on MNIST through StartTraining, to have a model to serve;
2. times Reconstruct and SampleHidden one request at a time at batch 1 and 256 (p50 / p99);
3. drives Reconstruct (batch 1) from 16 concurrent clients, each on its own connection: req/s;
4. opens 100 StreamMetrics subscriptions to a running job: lag from an event's write to Redis
   (its `time`) to its arrival at each subscriber;
5. trains the same job spec alone and under the 16-client serving load (idle-loaded-loaded-idle)
   and compares the training throughput the worker reports (samples/s of training time);
6. samples the resident memory of the server process (and its training child) idle and busy;
6b. on a fresh service, uploads large datasets while another client PINGs Redis: Redis's
   longest stall and the API's peak memory (`bench.service_upload`);
7. last, on a service of its own (no worker), has 100 clients follow a queued job live and
   sends the server SIGTERM: how long after the signal each stream ends with its resumable
   UNAVAILABLE (the drain ends shared followers at once, not at their next poll or the grace).

Everything runs on one machine: load generator, server, worker and training share its cores,
which the figures include.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from bench import service_upload
from bench.report import Case, Target
from bench.service_process import (
    START_TIMEOUT_S,
    STREAM_BLOCK_MS,
    MemorySampler,
    ServerProcess,
    redis_server,
    service_process,
)
from bench.timing import percentile, rss_mib

logger = logging.getLogger(__name__)

N_VISIBLE = 784
SERVED_HIDDEN = 500
CLIENTS = 16
SUBSCRIBERS = 100
MAX_STREAM_RECONNECTS = 20  # per subscriber
JOB_TIMEOUT_S = 300.0
TERMINAL = {pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED}


@dataclass(frozen=True)
class Plan:
    """How much to measure; `quick` shrinks every count but keeps the shapes."""

    serve_train_steps: int
    latency_requests: dict[int, int]  # batch size -> sequential requests timed
    load_seconds: float
    stream_steps: int
    stream_eval_every: int
    throughput_steps: int
    throughput_eval_every: int
    throughput_order: tuple[str, ...]  # training phases, "idle" or "loaded"
    mnist_images: int  # the jobs' dataset: the first N MNIST images (10% held out)

    @classmethod
    def full(cls) -> Plan:
        return cls(
            serve_train_steps=100,
            latency_requests={1: 1000, 256: 200},
            load_seconds=8.0,
            stream_steps=600,
            stream_eval_every=20,
            throughput_steps=300,
            throughput_eval_every=100,
            throughput_order=("idle", "loaded", "loaded", "idle"),
            mnist_images=10000,
        )

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            serve_train_steps=20,
            latency_requests={1: 40, 256: 8},
            load_seconds=1.0,
            stream_steps=60,
            stream_eval_every=20,
            throughput_steps=20,
            throughput_eval_every=20,
            throughput_order=("idle", "loaded"),
            mnist_images=1000,
        )


SERVICE_CONFIG = {"model": f"{N_VISIBLE}x{SERVED_HIDDEN}", "transport": "loopback, plaintext"}


# --- requests ---------------------------------------------------------------------------------


def training_request(
    *, n_hidden: int, steps: int, eval_every: int, name: str, images: int
) -> pb.StartTrainingRequest:
    """A Bernoulli RBM on binarized MNIST, CD-1, SGD, batch 100."""
    # An explicit limit: the spec's filled-in default (0, "all") is refused by the worker.
    mnist = pb.BuiltinDataset(name="mnist", options={"limit": str(images)})
    return pb.StartTrainingRequest(
        name=name,
        model=pb.ModelSpec(kind=pb.MODEL_KIND_BERNOULLI, n_hidden=n_hidden),
        optimizer=pb.OptimizerSpec(kind=pb.OPTIMIZER_KIND_SGD, lr=0.01),
        training=pb.TrainingSpec(cd_k=1, batch_size=100, steps=steps, seed=1,
                                 checkpoint_every=steps),
        eval=pb.EvalSpec(every=eval_every),
        dataset=pb.DatasetRef(builtin=mnist, preprocess=pb.PREPROCESS_BINARIZE),
    )  # fmt: skip


def wait_for_job(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> pb.Job:
    """Poll GetJob until the job ends; raise unless it SUCCEEDED."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)
        if job.state in TERMINAL:
            if job.state != pb.JOB_STATE_SUCCEEDED:
                raise RuntimeError(f"job {job_id} ended {pb.JobState.Name(job.state)}: {job.error}")
            return job
        time.sleep(0.1)
    raise RuntimeError(f"job {job_id} did not finish within {JOB_TIMEOUT_S} s")


def tensor(batch: int, seed: int = 0) -> pb.Tensor:
    """A (batch, 784) binary input as the wire format wants it: float32 little-endian bytes."""
    values = (np.random.default_rng(seed).random((batch, N_VISIBLE)) < 0.2).astype("<f4")
    return pb.Tensor(shape=[batch, N_VISIBLE], data=values.tobytes())


def _request(rpc: str, job_id: str, batch: int):
    if rpc == "Reconstruct":
        return pb.ReconstructRequest(job_id=job_id, input=tensor(batch), k=1, seed=1)
    return pb.SampleHiddenRequest(job_id=job_id, input=tensor(batch), seed=1)


def sequential_latency(
    stub: rbm_pb2_grpc.RBMServiceStub, rpc: str, job_id: str, batch: int, count: int
) -> list[float]:
    """Seconds per call for `count` calls one after the other, after a short warm-up."""
    method = getattr(stub, rpc)
    request = _request(rpc, job_id, batch)
    for _ in range(max(3, count // 20)):
        method(request, timeout=30)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        method(request, timeout=30)
        samples.append(time.perf_counter() - start)
    return samples


async def _concurrent_load(
    target: str, job_id: str, clients: int, done: Callable[[], bool]
) -> list[float]:
    # Each client owns a connection (a local subchannel pool keeps them apart) and sends its
    # next request as soon as the previous answer arrives, until `done()`.
    request = _request("Reconstruct", job_id, 1)
    latencies: list[float] = []
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(clients)
    ]

    async def client(channel: grpc.aio.Channel) -> None:
        stub = rbm_pb2_grpc.RBMServiceStub(channel)
        while not done():
            start = time.perf_counter()
            await stub.Reconstruct(request, timeout=30)
            latencies.append(time.perf_counter() - start)

    try:
        stubs = [rbm_pb2_grpc.RBMServiceStub(channel) for channel in channels]
        await asyncio.gather(*(stub.Reconstruct(request, timeout=30) for stub in stubs))
        await asyncio.gather(*(client(channel) for channel in channels))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    return latencies


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (Linux /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def concurrent_load(
    target: str,
    job_id: str,
    *,
    seconds: float | None = None,
    stop: threading.Event | None = None,
    clients: int = CLIENTS,
    server_pid: int | None = None,
) -> dict[str, float]:
    """Reconstruct at batch 1 from `clients` concurrent clients for `seconds` or until `stop`.

    With `server_pid`, also the CPU time per request of the server process and of this (the
    load-generating) process: which side the machine's cores are spent on.
    """
    server_cpu = cpu_seconds(server_pid) if server_pid else None
    client_cpu = time.process_time()
    start = time.perf_counter()
    if seconds is not None:
        deadline = start + seconds
        done = lambda: time.perf_counter() >= deadline  # noqa: E731
    else:
        assert stop is not None
        done = stop.is_set
    latencies = asyncio.run(_concurrent_load(target, job_id, clients, done))
    elapsed = time.perf_counter() - start
    result = {
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "requests": len(latencies),
    }
    if server_cpu is not None and latencies:
        server_used = (cpu_seconds(server_pid) or server_cpu) - server_cpu
        result["server_cpu_ms_per_request"] = 1000 * server_used / len(latencies)
        client_used = time.process_time() - client_cpu
        result["client_cpu_ms_per_request"] = 1000 * client_used / len(latencies)
    return result


def _event_seconds(event: pb.MetricEvent) -> float:
    return event.time.seconds + event.time.nanos * 1e-9


async def _stream_lag(target: str, job_id: str, subscribers: int) -> tuple[list[float], int, int]:
    lags: list[float] = []
    counts = {"events": 0, "reconnects": 0}
    channel = grpc.aio.insecure_channel(target)
    stub = rbm_pb2_grpc.RBMServiceStub(channel)
    subscribed_at = time.time()

    async def follow() -> None:
        # As any client should: after UNAVAILABLE, reconnect and resume after the last token.
        after = ""
        for _ in range(MAX_STREAM_RECONNECTS + 1):
            call = stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job_id, after=after))
            try:
                async for event in call:
                    arrived = time.time()
                    counts["events"] += 1
                    after = event.resume_token
                    # Events written before the subscriptions opened are history, not live lag.
                    if _event_seconds(event) >= subscribed_at:
                        lags.append(arrived - _event_seconds(event))
                return
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                counts["reconnects"] += 1
                await asyncio.sleep(0.1)
        raise RuntimeError(f"StreamMetrics stayed UNAVAILABLE after {MAX_STREAM_RECONNECTS} tries")

    try:
        followers = [follow() for _ in range(subscribers)]
        await asyncio.wait_for(asyncio.gather(*followers), JOB_TIMEOUT_S)
    finally:
        await channel.close()
    return lags, counts["events"], counts["reconnects"]


def stream_lag(
    target: str, stub: rbm_pb2_grpc.RBMServiceStub, plan: Plan, subscribers: int = SUBSCRIBERS
) -> dict[str, float]:
    """`subscribers` clients follow a job from its start to its end; lag of each live event.

    The lag runs from the moment the worker wrote the event to Redis (the event's `time`) to its
    arrival at a subscriber; both clocks are this machine's.
    """
    request = training_request(
        n_hidden=50,
        steps=plan.stream_steps,
        eval_every=plan.stream_eval_every,
        name="stream-lag",
        images=plan.mnist_images,
    )
    job = stub.StartTraining(request, timeout=30).job
    lags, events, reconnects = asyncio.run(_stream_lag(target, job.id, subscribers))
    wait_for_job(stub, job.id)
    if not lags:
        raise RuntimeError("no live StreamMetrics event arrived")
    return {
        "p50_ms": 1000 * percentile(lags, 0.5),
        "p99_ms": 1000 * percentile(lags, 0.99),
        "max_ms": 1000 * max(lags),
        "live_events": len(lags),
        "events": events,
        "reconnects": reconnects,
    }


DRAIN_GRACE_S = 60.0  # far longer than a drain: streams that waited for it would show it
DRAIN_ENV = {"SSDRBM_RUN_WORKER": "false", "SSDRBM_SHUTDOWN_GRACE_S": str(DRAIN_GRACE_S)}
SETTLE_S = 0.5  # after its first event, for each subscriber to reach the live follow


async def _drain_seconds(server: ServerProcess, job_id: str, subscribers: int) -> list[float]:
    channel = grpc.aio.insecure_channel(server.target)
    stub = rbm_pb2_grpc.RBMServiceStub(channel)
    following = [asyncio.Event() for _ in range(subscribers)]
    signalled = asyncio.Event()
    sent: list[float] = []

    async def follow(first: asyncio.Event) -> float:
        try:
            async for _event in stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job_id)):
                first.set()
        except grpc.aio.AioRpcError as error:
            ended = time.perf_counter()
            if error.code() != grpc.StatusCode.UNAVAILABLE or "shutting down" not in (
                error.details() or ""
            ):
                raise
            if not signalled.is_set():
                raise RuntimeError("a stream ended before the server was stopped") from error
            return ended - sent[0]
        raise RuntimeError("a stream of a queued job ended without an error")

    try:
        streams = [asyncio.ensure_future(follow(first)) for first in following]
        waiting = asyncio.gather(*(first.wait() for first in following))
        await asyncio.wait_for(waiting, START_TIMEOUT_S)
        await asyncio.sleep(SETTLE_S)
        sent.append(time.perf_counter())
        server.process.send_signal(signal.SIGTERM)
        signalled.set()
        return await asyncio.wait_for(asyncio.gather(*streams), DRAIN_GRACE_S)
    finally:
        await channel.close()


def shutdown_drain(
    server: ServerProcess,
    stub: rbm_pb2_grpc.RBMServiceStub,
    plan: Plan,
    subscribers: int = SUBSCRIBERS,
) -> dict[str, float]:
    """`subscribers` clients follow a queued job live (the server has no worker); then SIGTERM.

    Each stream's drain time runs from the signal to the stream's UNAVAILABLE ("shutting down",
    with the token to resume from), as its client sees it.
    """
    request = training_request(n_hidden=50, steps=plan.stream_steps,
                               eval_every=plan.stream_eval_every, name="shutdown-drain",
                               images=plan.mnist_images)  # fmt: skip
    job = stub.StartTraining(request, timeout=30).job
    seconds = asyncio.run(_drain_seconds(server, job.id, subscribers))
    return {
        "p50_ms": 1000 * percentile(seconds, 0.5),
        "p99_ms": 1000 * percentile(seconds, 0.99),
        "max_ms": 1000 * max(seconds),
        "streams": len(seconds),
    }


def training_throughput(stub: rbm_pb2_grpc.RBMServiceStub, plan: Plan, name: str) -> float:
    """Train the throughput job to the end; the worker's samples/s of training time."""
    request = training_request(
        n_hidden=SERVED_HIDDEN,
        steps=plan.throughput_steps,
        eval_every=plan.throughput_eval_every,
        name=name,
        images=plan.mnist_images,
    )
    job = stub.StartTraining(request, timeout=30).job
    return float(wait_for_job(stub, job.id).latest_metrics.samples_per_second)


# --- the case ---------------------------------------------------------------------------------


def run(*, quick: bool = False) -> tuple[list[Case], list[Target]]:
    """Start Redis and the service, measure, stop both; return the cases and the targets.

    Where the host has two CPUs or more, the training-throughput phases run again against a
    second service whose serving and training are pinned to disjoint CPU halves
    (SSDRBM_SERVING_CPUS, SSDRBM_TRAINING_CPUS), the load generator on the serving half.
    """
    plan = Plan.quick() if quick else Plan.full()
    with tempfile.TemporaryDirectory(prefix="ssdrbm-bench-") as scratch:
        directory = Path(scratch)
        with redis_server(directory) as redis_url:
            with service_process(redis_url, directory) as server:
                cases, targets = _measure_with_log(
                    server, lambda stub: _measure(server, stub, plan)
                )
            halves = cpu_halves()
            if halves is not None:
                pinned_directory = directory / "pinned"
                pinned_directory.mkdir()
                env = {"SSDRBM_SERVING_CPUS": _cpu_list(halves[0]),
                       "SSDRBM_TRAINING_CPUS": _cpu_list(halves[1])}  # fmt: skip
                with service_process(redis_url, pinned_directory, env) as server:
                    case, target = _measure_with_log(
                        server, lambda stub: _measure_pinned(server, stub, plan, halves)
                    )
                cases, targets = [*cases, case], [*targets, target]
            cases += _upload_phase(redis_url, directory, quick=quick)
            # Last: its job stays queued, and no worker may train it during the other phases.
            drain_directory = directory / "drain"
            drain_directory.mkdir()
            with service_process(redis_url, drain_directory, DRAIN_ENV) as server:
                drain = _measure_with_log(server, lambda stub: shutdown_drain(server, stub, plan))
            cases.append(Case("service", "StreamMetrics shutdown drain",
                              {"subscribers": SUBSCRIBERS, "stream_block_ms": STREAM_BLOCK_MS,
                               "shutdown_grace_s": DRAIN_GRACE_S}, drain))  # fmt: skip
            return cases, targets


def _upload_phase(redis_url: str, directory: Path, *, quick: bool) -> list[Case]:
    """Large uploads on a service of their own, so its memory figures start from a fresh
    process: Redis's longest stall for another client and the API's peak RSS."""
    upload_directory = directory / "upload"
    upload_directory.mkdir()
    with service_process(redis_url, upload_directory) as server:
        return _measure_with_log(
            server,
            lambda stub: service_upload.upload_cases(stub, server, redis_url, quick=quick),
        )


def cpu_halves() -> tuple[frozenset[int], frozenset[int]] | None:
    """This process's CPUs split into a serving and a training half; None with fewer than 2."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return frozenset(cpus[:half]), frozenset(cpus[half:])


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def _measure_with_log(server: ServerProcess, measure: Callable[[object], object]):
    channel = grpc.insecure_channel(server.target)
    try:
        return measure(rbm_pb2_grpc.RBMServiceStub(channel))
    except Exception:
        # The server's own log says why; it goes away with the temporary directory.
        tail = server.log_path.read_text(errors="replace")[-4000:]
        logger.error("service case failed; the server's log ends with:\n%s", tail)
        raise
    finally:
        channel.close()


def _train_served(stub, plan: Plan) -> pb.Job:
    """The 784x500 model every serving call uses, trained for `plan.serve_train_steps`."""
    served = stub.StartTraining(
        training_request(n_hidden=SERVED_HIDDEN, steps=plan.serve_train_steps,
                         eval_every=plan.serve_train_steps, name="served",
                         images=plan.mnist_images),
        timeout=30,
    ).job  # fmt: skip
    wait_for_job(stub, served.id)
    return served


def _measure_pinned(
    server: ServerProcess, stub, plan: Plan, halves: tuple[frozenset[int], frozenset[int]]
) -> tuple[Case, Target]:
    serving, training = halves
    logger.info("service: training throughput with serving on CPUs %s, training on %s",
                sorted(serving), sorted(training))  # fmt: skip
    served = _train_served(stub, plan)
    case, slowdown, _ = _throughput_case(
        server, stub, served.id, plan, name="training throughput, pinned", load_cpus=serving,
        config={"serving_cpus": _cpu_list(serving), "training_cpus": _cpu_list(training),
                "load_generator_cpus": _cpu_list(serving)},
    )  # fmt: skip
    target = Target(
        "service",
        "training throughput lost under serving load, serving and training on separate CPUs",
        slowdown, 0.20, "<=",
    )  # fmt: skip
    return case, target


def _measure(server: ServerProcess, stub, plan: Plan) -> tuple[list[Case], list[Target]]:
    config = SERVICE_CONFIG
    logger.info("service: training the served model")
    served = _train_served(stub, plan)
    cases: list[Case] = []
    latencies: dict[tuple[str, int], dict[str, float]] = {}
    for rpc in ("Reconstruct", "SampleHidden"):
        for batch, count in plan.latency_requests.items():
            logger.info("service: %s batch %d", rpc, batch)
            samples = sequential_latency(stub, rpc, served.id, batch, count)
            metrics = {
                "p50_ms": 1000 * percentile(samples, 0.5),
                "p99_ms": 1000 * percentile(samples, 0.99),
                "requests": len(samples),
            }
            latencies[(rpc, batch)] = metrics
            cases.append(Case("service", f"{rpc} batch {batch}",
                              {**config, "batch": batch, "clients": 1}, metrics))  # fmt: skip
    idle_rss = rss_mib(server.pid)

    logger.info("service: %d concurrent clients", CLIENTS)
    with MemorySampler(server) as serving_memory:
        load = concurrent_load(
            server.target, served.id, seconds=plan.load_seconds, server_pid=server.pid
        )
    cases.append(Case("service", f"Reconstruct {CLIENTS} clients",
                      {**config, "batch": 1, "clients": CLIENTS,
                       "seconds": plan.load_seconds}, load))  # fmt: skip

    logger.info("service: StreamMetrics with %d subscribers", SUBSCRIBERS)
    lag = stream_lag(server.target, stub, plan)
    cases.append(Case("service", "StreamMetrics lag",
                      {"model": f"{N_VISIBLE}x50", "subscribers": SUBSCRIBERS,
                       "eval_every": plan.stream_eval_every}, lag))  # fmt: skip

    logger.info("service: training throughput, idle then under serving load")
    throughput, slowdown, busy = _throughput_case(
        server, stub, served.id, plan, name="training throughput"
    )
    cases.append(throughput)
    busy_rss = max(serving_memory.server_mib + busy["server_mib"], default=None)
    cases.append(Case("service", "server memory", {"process": "gRPC server + worker"},
                      {"idle_rss_mib": idle_rss, "busy_rss_mib": busy_rss,
                       "training_child_rss_mib": busy["child_mib"]}))  # fmt: skip
    return cases, _targets(latencies, load, lag, slowdown)


def _throughput_case(
    server: ServerProcess,
    stub,
    served_id: str,
    plan: Plan,
    *,
    name: str,
    load_cpus: frozenset[int] = frozenset(),
    config: dict[str, object] | None = None,
) -> tuple[Case, float, dict]:
    """Training samples/s idle and under load as one Case, the fraction lost to the load, and
    the phases' memory and load figures (for the memory case)."""
    rates, phases_busy = _throughput_phases(server, stub, served_id, plan, load_cpus)
    phases = ", ".join(
        f"{phase} {value:.0f}"
        for phase, value in zip(plan.throughput_order, phases_busy["rates"], strict=True)
    )
    idle_rate = statistics.mean(rates["idle"])
    loaded_rate = statistics.mean(rates["loaded"])
    slowdown = 1.0 - loaded_rate / idle_rate
    case = Case("service", name,
                {**SERVICE_CONFIG, "cd_k": 1, "batch": 100, "steps": plan.throughput_steps,
                 "load": f"{CLIENTS} clients Reconstruct batch 1",
                 "order": "-".join(plan.throughput_order), **(config or {})},
                {"idle_samples_per_s": idle_rate, "loaded_samples_per_s": loaded_rate,
                 "loaded_requests_per_s": phases_busy["requests_per_s"]},
                {"throughput_lost": slowdown},
                [f"{name}: samples/s per phase, in order: {phases}"])  # fmt: skip
    return case, slowdown, phases_busy


def _throughput_phases(
    server: ServerProcess, stub, served_id: str, plan: Plan, load_cpus: frozenset[int]
):
    """Train the throughput job once per phase of `plan.throughput_order` (idle or loaded).

    The order idle-loaded-loaded-idle cancels a load from elsewhere that drifts linearly in
    time. Under load, 16 clients keep Reconstruct busy for the whole job.
    """
    rates: dict[str, list[float]] = {"idle": [], "loaded": []}
    busy: dict = {"server_mib": [], "child_mib": [], "requests_per_s": [], "rates": []}
    for index, phase in enumerate(plan.throughput_order):
        name = f"throughput-{phase}-{index}"
        if phase == "idle":
            with MemorySampler(server) as memory:
                rates["idle"].append(training_throughput(stub, plan, name))
            busy["child_mib"] += memory.child_mib
            busy["rates"].append(rates["idle"][-1])
            continue
        stop = threading.Event()
        load: dict = {}

        def drive(stop: threading.Event = stop, load: dict = load) -> None:
            if load_cpus:  # Linux pins the calling thread: the load generator's event loop
                os.sched_setaffinity(0, load_cpus)
            load.update(concurrent_load(server.target, served_id, stop=stop))

        with MemorySampler(server) as memory:
            loader = threading.Thread(target=drive, daemon=True)
            loader.start()
            time.sleep(0.5)  # the load is running before the job starts
            rates["loaded"].append(training_throughput(stub, plan, name))
            stop.set()
            loader.join()
        busy["server_mib"] += memory.server_mib
        busy["child_mib"] += memory.child_mib
        busy["requests_per_s"].append(load["requests_per_s"])
        busy["rates"].append(rates["loaded"][-1])
    return rates, {
        "server_mib": busy["server_mib"],
        "child_mib": max(busy["child_mib"], default=None),
        "requests_per_s": statistics.mean(busy["requests_per_s"]),
        "rates": busy["rates"],
    }


def _targets(latencies, load, lag, slowdown) -> list[Target]:
    batch1 = latencies[("Reconstruct", 1)]
    return [
        Target("service", "Reconstruct batch 1 p50", batch1["p50_ms"], 2.0, "<=", " ms"),
        Target("service", "Reconstruct batch 1 p99", batch1["p99_ms"], 10.0, "<=", " ms"),
        Target("service", f"Reconstruct req/s, {CLIENTS} clients", load["requests_per_s"],
               1000.0, ">=", "/s"),
        Target("service", f"StreamMetrics lag p99, {SUBSCRIBERS} subscribers", lag["p99_ms"],
               100.0, "<=", " ms"),
        Target("service", "training throughput lost under serving load", slowdown, 0.20, "<="),
    ]  # fmt: skip
