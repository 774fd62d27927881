"""Health entries a prober asks for, and the worker's heartbeat file.

grpc.health.v1 entries this server registers (``python -m ssdrbm_server.healthcheck`` and
Kubernetes gRPC probes name them):

- ``""`` and ``liveness``: SERVING while the process runs; the health service answers from the
  event loop, so an answer at all proves the loop is not stuck ("restart me" when it fails).
- ``readiness``: SERVING while Redis answers a PING and keeps what it acknowledged
  (redis_checks.py) and this process's worker, if any, is alive; a failing readiness probe means
  "route calls elsewhere", not "restart me", which brings neither Redis back nor fixes it.
- ``ssdrbm.v1.RBMService``: follows Redis alone (its calls fail UNAVAILABLE without it).

A worker alone serves no gRPC: it touches its heartbeat file (``SSDRBM_WORKER_HEARTBEAT_FILE``)
every heartbeat from its event loop, which ``healthcheck --worker`` checks is younger than a
lease length, after which the worker's job would be taken over anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from grpc_health.v1 import health, health_pb2
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from ssdrbm_server.outage import REDIS_OUTAGE

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

LIVENESS = "liveness"
READINESS = "readiness"
READINESS_INTERVAL_S = 1.0  # a Redis outage shows in readiness within about this long


async def follow_redis(
    redis: aioredis.Redis,
    servicer: health.aio.HealthServicer,
    service_name: str,
    *,
    worker_alive: Callable[[], bool] | None = None,
    redis_fit: Callable[[], bool] | None = None,
    interval_s: float = READINESS_INTERVAL_S,
) -> None:
    """Ping Redis every ``interval_s`` and set ``service_name``'s health to match, and
    ``readiness`` to Redis, ``worker_alive()`` and ``redis_fit()`` (its persistence settings
    keep acknowledged work, redis_checks.py) together (forever)."""
    state: tuple[bool, bool] | None = None  # (Redis answers, ready); None: not set yet
    blocked_by: str | None = None  # why readiness is NOT_SERVING while Redis answers
    while True:
        reason: Exception | None = None
        try:
            await asyncio.wait_for(redis.ping(), timeout=max(interval_s, 1.0))
            redis_ok = True
        except (TimeoutError, RedisError, OSError) as exc:
            redis_ok, reason = False, exc
        if redis_ok:
            REDIS_OUTAGE.ended()
        else:
            REDIS_OUTAGE.noticed(reason, by=f"the readiness probe ({service_name} NOT_SERVING)")
        blocker = _not_ready_because(worker_alive, redis_fit) if redis_ok else None
        if blocker is not None and blocker != blocked_by:
            logger.warning("%s: %s is NOT_SERVING", blocker, READINESS)
        blocked_by = blocker
        ready = redis_ok and blocker is None
        if state != (redis_ok, ready):
            state = (redis_ok, ready)
            await servicer.set(service_name, SERVING if redis_ok else NOT_SERVING)
            await servicer.set(READINESS, SERVING if ready else NOT_SERVING)
        await asyncio.sleep(interval_s)


def _not_ready_because(
    worker_alive: Callable[[], bool] | None, redis_fit: Callable[[], bool] | None
) -> str | None:
    """Why this process is not ready although Redis answers, or None."""
    if worker_alive is not None and not worker_alive():
        return "the in-process worker is not running"
    if redis_fit is not None and not redis_fit():
        return "Redis would lose acknowledged work (its settings are logged as an ERROR)"
    return None


async def beat_file(path: str, interval_s: float) -> None:
    """Touch ``path`` every ``interval_s`` while the event loop runs; removed when cancelled."""
    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    try:
        while True:
            file.write_text(f"{os.getpid()} {time.time():.3f}\n")
            await asyncio.sleep(interval_s)
    finally:
        with contextlib.suppress(OSError):
            file.unlink()


def heartbeat_age(path: str) -> float | None:
    """Seconds since ``path`` was last touched; None when it does not exist."""
    try:
        return max(0.0, time.time() - os.stat(path).st_mtime)
    except FileNotFoundError:
        return None
