"""Assembling and running the service: the gRPC server, its worker, metrics and shutdown.

``Service`` wires the stores, serving, interceptors, health and reflection into one
``grpc.aio`` server; ``create_server`` builds and starts one (port 0 in tests); ``serve`` runs
the whole process — gRPC server plus, by default, a worker — until SIGTERM/SIGINT, then shuts
down gracefully: health NOT_SERVING, the worker checkpoints and releases its job, in-flight
RPCs get ``shutdown_grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.allocator import keep_freed_memory
from ssdrbm_server.auth import AuthInterceptor
from ssdrbm_server.config import Settings
from ssdrbm_server.dashboard import dashboard_app
from ssdrbm_server.errors import ErrorMappingInterceptor
from ssdrbm_server.exposure import check_exposure, keep_warning
from ssdrbm_server.http_front import HttpFront, RequestGate
from ssdrbm_server.inference import add_inference_service
from ssdrbm_server.inference.rest import inference_routes
from ssdrbm_server.keys import Keys
from ssdrbm_server.metrics import LatencyInterceptor, ServiceMetrics, refresh_job_gauges
from ssdrbm_server.readiness import LIVENESS, READINESS, follow_redis
from ssdrbm_server.redis_checks import RedisWatch, WriteGate
from ssdrbm_server.servicer import RBMServicer, Stores
from ssdrbm_server.serving import ModelServer
from ssdrbm_server.store import CheckpointStore, DatasetStore, EventStore, JobStore, connect
from ssdrbm_server.store.lifecycle import Retention, repeat_forever
from ssdrbm_server.sweeps.expiry import SweepExpiry

if TYPE_CHECKING:
    from ssdrbm_server.worker import Worker

logger = logging.getLogger(__name__)

SERVICE_NAME = rbm_pb2.DESCRIPTOR.services_by_name["RBMService"].full_name


class Service:
    """One configured gRPC server with its Redis client, stores, model server and health."""

    def __init__(
        self,
        settings: Settings,
        *,
        redis: aioredis.Redis | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        settings.check()  # also when built in code rather than by Settings.from_env
        check_exposure(settings)  # loopback unless auth (or an explicit setting) says otherwise
        self.settings = settings
        self._owns_redis = redis is None
        url, cluster = settings.redis_url, settings.redis_cluster
        if redis is None:
            redis = connect(url, cluster=cluster, max_connections=settings.redis_connections)
        self.redis = redis
        # Live StreamMetrics reads (XREAD BLOCK) wait on their own pool: one connection per
        # allowed stream (+1 for the job's shared follower), never one of the ordinary calls'.
        streams = settings.max_streams + 1
        self.blocking_redis = connect(url, cluster=cluster, max_connections=streams)
        self.keys = Keys(settings.redis_prefix)
        self.stores = Stores(
            jobs=JobStore(self.redis, keys=self.keys, retention=Retention.from_settings(settings)),
            events=EventStore(self.redis, keys=self.keys, blocking=self.blocking_redis),
            checkpoints=CheckpointStore(self.redis, keys=self.keys),
            datasets=DatasetStore(
                self.redis,
                keys=self.keys,
                chunk_bytes=settings.dataset_chunk_bytes,
                idle_seconds=settings.upload_idle_seconds,
                tenant_quota=settings.max_dataset_bytes_per_tenant,
            ),
        )
        self.metrics = metrics or ServiceMetrics()
        self.models = ModelServer(self.stores.checkpoints, settings, self.metrics)
        self.health = health.aio.HealthServicer()
        self.auth = AuthInterceptor(settings)  # also the HTTP front's
        # Checked at start and every SSDRBM_REDIS_CHECK_INTERVAL_S (redis_checks.py); an
        # in-process worker shares it.
        self.redis_watch = RedisWatch(
            self.redis,
            settings,
            consequence=(
                "StartTraining, StartSweep and UploadDataset are refused, readiness is "
                "NOT_SERVING and this process's worker (if any) claims no new job"
            ),
        )
        self.server = grpc.aio.server(
            # The first interceptor is the outermost: latency sees the final status, errors are
            # mapped before it, and authentication runs closest to the handler.
            interceptors=[
                LatencyInterceptor(self.metrics),
                ErrorMappingInterceptor(),
                self.auth,
                WriteGate(self.redis_watch),  # new work only while Redis would keep it
            ],
            options=[
                ("grpc.max_receive_message_length", settings.max_message_bytes),
                ("grpc.max_send_message_length", settings.max_message_bytes),
            ],
        )
        self.servicer = RBMServicer(settings, self.stores, self.models, self.metrics)
        rbm_pb2_grpc.add_RBMServiceServicer_to_server(self.servicer, self.server)
        # The Open Inference Protocol (KServe v2) on the same port, behind the same interceptors.
        self.inference = add_inference_service(
            self.server, settings, self.stores, self.models, self.servicer.recent_jobs, self.redis
        )
        # The HTTP front (health, the protocol's REST form), on the same loop; None when off.
        self.http: HttpFront | None = None
        if settings.http_port:
            gate = RequestGate(settings, self.auth)
            routes = inference_routes(settings, self.inference, gate)
            self.http = HttpFront(settings, routes, ready=self.ready)
            self.http.mount_dashboard(dashboard_app(self.servicer, gate))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = self._bind(settings)
        self._background: list[asyncio.Task[None]] = []  # loops that run while it serves
        self._worker_task: asyncio.Task[None] | None = None  # an in-process worker, if any

    async def ready(self) -> bool:
        """True while the ``readiness`` health entry is SERVING (readiness.py), as a probe sees."""
        check = health_pb2.HealthCheckRequest(service=READINESS)
        answer = await self.health.Check(check, None)
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def watch_worker(self, task: asyncio.Task[None]) -> None:
        """Readiness also requires this in-process worker to be running (readiness.py)."""
        self._worker_task = task

    def _worker_running(self) -> bool:
        return self._worker_task is None or not self._worker_task.done()

    def _bind(self, settings: Settings) -> int:
        address = settings.listen_address
        if settings.tls_cert_file:
            credentials = grpc.ssl_server_credentials(
                [(_read(settings.tls_key_file), _read(settings.tls_cert_file))],
                root_certificates=(
                    _read(settings.tls_client_ca_file) if settings.tls_client_ca_file else None
                ),
                require_client_auth=bool(settings.tls_client_ca_file),
            )
            port = self.server.add_secure_port(address, credentials)
        else:
            port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot listen on {address}")
        return port

    async def start(self) -> int:
        """Start serving; returns the bound port. Refuses (RedisConfigError) a Redis that would
        lose acknowledged work (ssdrbm_server/redis_checks.py), and checks it again while
        serving."""
        await self.redis_watch.check_at_start()
        await self.server.start()
        for name in ("", LIVENESS, SERVICE_NAME, READINESS):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.http is not None:
            await self.http.start()  # after the health entries its /v2/health/ready reads
        # Expired jobs and deletes a dead process left half done (store/lifecycle.py), and
        # sweeps whose jobs expired (sweeps/expiry.py), beside the gauges, checks and probes.
        lifecycle = self.stores.jobs.lifecycle
        expiry = SweepExpiry(self.servicer.sweeps, lifecycle)
        readiness = follow_redis(
            self.redis,
            self.health,
            SERVICE_NAME,
            worker_alive=self._worker_running,
            redis_fit=lambda: self.redis_watch.fit,
        )
        self._background = [
            asyncio.create_task(loop)
            for loop in (
                refresh_job_gauges(self.metrics, self.stores.jobs.count_by_state),
                self.redis_watch.run(),
                readiness,
                repeat_forever(lifecycle.sweep, "expired-job sweep"),
                repeat_forever(expiry.expire_due, "expired-sweep cleanup"),
            )
        ]
        logger.info("gRPC server listening on port %d", self.port)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, let in-flight RPCs finish for ``grace`` seconds, then release all."""
        grace = self.settings.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        self.servicer.begin_shutdown()
        await stop_background_tasks(self._background)
        stopping = [self.server.stop(grace)]
        if self.http is not None:
            stopping.append(self.http.stop())  # its requests in flight get the same grace
        await asyncio.gather(*stopping)
        self.models.close()
        if self._owns_redis:
            await self.redis.aclose()
        await self.blocking_redis.aclose()
        logger.info("gRPC server stopped")


# How long stop() keeps cancelling the background loops before it leaves them to the loop's end.
BACKGROUND_STOP_TIMEOUT_S = 5.0


async def stop_background_tasks(tasks: list[asyncio.Task[None] | None]) -> None:
    """Cancel the background loops and wait until each has ended.

    One cancel is not always enough: one that lands inside a Redis call can come back out of the
    client as a connection error, which the loop handles as an outage and carries on — and the
    event loop's own shutdown would then wait for it forever. So cancel again until each ends.
    """
    pending = {task for task in tasks if task is not None}
    deadline = asyncio.get_running_loop().time() + BACKGROUND_STOP_TIMEOUT_S
    while pending and asyncio.get_running_loop().time() < deadline:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
    if pending:
        logger.warning("%d background task(s) did not stop: %s", len(pending), pending)


async def create_server(
    settings: Settings, *, redis: aioredis.Redis | None = None
) -> tuple[Service, int]:
    """Build and start a service on ``settings.listen_address`` (port 0 picks a free one)."""
    service = Service(settings, redis=redis)
    return service, await service.start()


async def serve(
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    on_ready: Callable[[Service], None] | None = None,
) -> None:
    """Run the gRPC server (and a worker unless ``settings.run_worker`` is off) until ``stop``
    is set — by default, until SIGTERM or SIGINT."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, _stop_or_exit_now, stop, signum)
    keep_freed_memory()  # large request buffers are reused, not faulted in again each time
    service, _port = await create_server(settings)
    warning = asyncio.create_task(keep_warning(settings))  # exposure, repeated each minute
    if settings.metrics_port:
        metrics_port = service.metrics.http.start(settings.metrics_port, settings.metrics_address)
        logger.info(
            "Prometheus metrics on http://%s:%d/metrics", settings.metrics_address, metrics_port
        )
    worker, worker_task = None, None
    if settings.run_worker:
        worker, worker_task = _start_worker(settings, service)
        service.watch_worker(worker_task)
    if on_ready is not None:
        on_ready(service)
    waiters = [asyncio.ensure_future(stop.wait())]
    if worker_task is not None:
        waiters.append(worker_task)
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    worker_failed = worker_task is not None and worker_task.done() and not stop.is_set()
    if worker_failed:
        logger.error("the worker stopped unexpectedly; shutting the process down")
    logger.info("shutting down (grace %.1f s)", settings.shutdown_grace_s)
    stopping = [service.stop()]
    if worker is not None:
        stopping.append(_stop_worker(worker, worker_task))
    await asyncio.gather(*stopping, return_exceptions=True)
    waiters[0].cancel()
    warning.cancel()
    service.metrics.http.stop()
    if worker_failed:
        # A process without its worker would accept jobs it never runs: fail loudly instead.
        assert worker_task is not None
        error = worker_task.exception() if not worker_task.cancelled() else None
        raise RuntimeError("the in-process worker stopped unexpectedly") from error


def _stop_or_exit_now(stop: asyncio.Event, signum: int) -> None:
    """The first SIGTERM/SIGINT starts the graceful shutdown; a second one ends the process at
    once, for an operator who will not wait (a job being trained resumes from its last
    checkpoint once its lease lapses, as after SIGKILL)."""
    name = signal.Signals(signum).name
    if not stop.is_set():
        logger.info("%s received: shutting down gracefully (send it again to exit at once)", name)
        stop.set()
        return
    logger.warning("%s received again: exiting at once", name)
    os._exit(128 + signum)


def _start_worker(settings: Settings, service: Service) -> tuple[Worker, asyncio.Task[None]]:
    from ssdrbm_server.worker import Worker  # the worker pulls in training; only when it runs here
    from ssdrbm_server.worker.metrics import WorkerMetrics

    # One registry: the worker's metrics appear on the server's /metrics endpoint.
    worker = Worker(
        settings,  # its id, when not set, is the worker's own default (worker/worker.py)
        metrics=WorkerMetrics(service.metrics.registry),
        redis_watch=service.redis_watch,  # checked once per process, gating both
    )
    logger.info("worker %s runs in this process", worker.worker_id)
    return worker, asyncio.create_task(worker.run())


async def _stop_worker(worker: Worker, task: asyncio.Task[None] | None) -> None:
    await worker.stop(graceful=True)
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
