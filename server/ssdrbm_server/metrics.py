"""Prometheus metrics of the service: jobs by state, the queue by tenant, RPC latency, streams,
serving chunks.

Each server instance owns its registry (tests run several servers in one process). The job
gauges are refreshed from Redis by a periodic task, so a scrape never waits on Redis. Training
metrics (throughput, step time, queue wait, ...) are the worker's (worker/metrics.py): a worker
in the server process counts them in this registry, a worker-only process serves its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ssdrbm_server.errors import status_for
from ssdrbm_server.handlers import ServiceInterceptor, iterate_responses, wrap_handler
from ssdrbm_server.store.records import JobState

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
# The queue's per-tenant series stay few: the tenants with the most queued jobs are labelled by
# name, the rest summed into one OTHER_TENANTS series (a tenant's series goes when it drops out).
QUEUE_TENANTS_LABELLED = 20
OTHER_TENANTS = "_other"

# tenant -> (jobs queued, seconds the longest waiting head of its lists has waited)
QueueBacklog = dict[str, tuple[int, float]]


class ServiceMetrics:
    """The service's Prometheus collectors in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge(
            "ssdrbm_jobs", "Jobs by state (all tenants)", ["state"], registry=self.registry
        )
        self.rpc_latency = Histogram(
            "ssdrbm_rpc_latency_seconds",
            "Time to answer an RPC (streams: until the stream ends)",
            ["method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.streams = Gauge(
            "ssdrbm_metric_streams", "Open StreamMetrics calls", registry=self.registry
        )
        self.serving_chunks = Counter(
            "ssdrbm_serving_chunks",
            "Row chunks of pooled Reconstruct/SampleHidden calls: computed, or abandoned because "
            "the client cancelled or its deadline passed",
            ["outcome"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "ssdrbm_queue_depth",
            f"Jobs queued, by tenant (the {QUEUE_TENANTS_LABELLED} with the most; the others "
            f"summed as {OTHER_TENANTS})",
            ["tenant"],
            registry=self.registry,
        )
        self.queue_wait = Gauge(
            "ssdrbm_queue_head_wait_seconds",
            "How long the tenant's next queued job (or its oldest sweep run, whichever longer) "
            f"has waited since it was queued or put back ({OTHER_TENANTS}: the longest of the "
            "others)",
            ["tenant"],
            registry=self.registry,
        )
        # Set by the servicer (it owns the queue's reads); read by the periodic refresh.
        self.queue_backlog: Callable[[], Awaitable[QueueBacklog]] | None = None
        self._queue_tenants: set[str] = set()
        self.http = MetricsEndpoint(self.registry)  # /metrics, when the server serves it
        self.set_job_counts({})  # every state's series exists from the first scrape on
        self.set_queue_backlog({})

    def set_job_counts(self, counts: dict[JobState, int]) -> None:
        for state in JobState:
            self.jobs.labels(state=state.value).set(counts.get(state, 0))

    def set_queue_backlog(self, backlog: QueueBacklog) -> None:
        """Update the per-tenant queue gauges: the deepest tenants by name, the rest summed."""
        ranked = sorted(backlog.items(), key=lambda item: (-item[1][0], item[0]))
        ranked = [(tenant, value) for tenant, value in ranked if tenant != OTHER_TENANTS]
        named = dict(ranked[:QUEUE_TENANTS_LABELLED])
        rest = [value for tenant, value in backlog.items() if tenant not in named]
        for gone in self._queue_tenants - named.keys():
            self.queue_depth.remove(gone)
            self.queue_wait.remove(gone)
        self._queue_tenants = set(named)
        named[OTHER_TENANTS] = (
            sum(depth for depth, _ in rest),
            max((wait for _, wait in rest), default=0.0),
        )
        for tenant, (depth, wait) in named.items():
            self.queue_depth.labels(tenant=tenant).set(depth)
            self.queue_wait.labels(tenant=tenant).set(wait)

    def exposition(self) -> bytes:
        """The current metrics in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)


class MetricsEndpoint:
    """/metrics of one registry over HTTP, served from a thread."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: Any = None

    def start(self, port: int, address: str) -> int:
        """Start serving; returns the bound port (``port`` 0 picks a free one)."""
        server, _thread = prometheus_client.start_http_server(
            port, addr=address, registry=self.registry
        )
        self._server = server
        return server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


async def refresh_job_gauges(
    metrics: ServiceMetrics,
    count_by_state: Callable[[], Awaitable[dict[JobState, int]]],
    *,
    interval_s: float = 5.0,
) -> None:
    """Periodically copy job counts and the queue's backlog from Redis into the gauges (runs
    forever)."""
    while True:
        try:
            metrics.set_job_counts(await count_by_state())
            if metrics.queue_backlog is not None:
                metrics.set_queue_backlog(await metrics.queue_backlog())
        except Exception as exc:  # Redis down: keep the last values, try again later
            logger.debug("metrics refresh failed: %s", exc)
        await asyncio.sleep(interval_s)


def _code_of(exc: BaseException | None, context: grpc.aio.ServicerContext) -> str:
    if exc is None or isinstance(exc, grpc.aio.AbortError):  # a refusal sets the context's code
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return code.name
        return "OK" if exc is None else "UNKNOWN"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return status_for(exc)[0].name


class LatencyInterceptor(ServiceInterceptor):
    """Records every RPC's latency by method and status code."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.histogram = metrics.rpc_latency
        super().__init__(self._timed)

    def _timed(self, full_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        method = full_method.rsplit("/", 1)[-1]
        histogram = self.histogram
        by_code: dict[str, Any] = {}  # the labelled series, looked up once per status code

        def observe(started: float, exc: BaseException | None, context: Any) -> None:
            elapsed = time.perf_counter() - started
            code = _code_of(exc, context)
            series = by_code.get(code)
            if series is None:
                series = by_code[code] = histogram.labels(method=method, code=code)
            series.observe(elapsed)

        def wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started = time.perf_counter()
                try:
                    response = await behavior(request, context)
                except BaseException as exc:
                    observe(started, exc, context)
                    raise
                observe(started, None, context)
                return response

            return timed

        def wrap_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
            async def timed(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                started = time.perf_counter()
                try:
                    async for response in iterate_responses(behavior, request, context):
                        yield response
                except BaseException as exc:
                    observe(started, exc, context)
                    raise
                observe(started, None, context)

            return timed

        return wrap_handler(handler, wrap_unary, wrap_stream)
