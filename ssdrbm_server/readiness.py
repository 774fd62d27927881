"""Readiness: the service's health follows whether Redis, its system of record, answers.

The overall health entry ("") says the process is alive and stays SERVING while it runs; the
entry for ``ssdrbm.v1.RBMService`` says whether calls can succeed now, so a load balancer or
orchestrator can route around a server whose Redis is unreachable while its RPCs answer
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2
from redis import asyncio as aioredis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def follow_redis(
    redis: aioredis.Redis,
    servicer: health.aio.HealthServicer,
    service_name: str,
    *,
    interval_s: float = 1.0,
) -> None:
    """Ping Redis every ``interval_s`` and set ``service_name``'s health to match (forever)."""
    ready = True
    while True:
        try:
            await asyncio.wait_for(redis.ping(), timeout=max(interval_s, 1.0))
            now_ready = True
        except (TimeoutError, RedisError, OSError) as exc:
            now_ready = False
            reason = exc
        if now_ready != ready:
            ready = now_ready
            if ready:
                logger.info("Redis answers again: %s is SERVING", service_name)
            else:
                logger.warning("Redis unreachable (%s): %s is NOT_SERVING", reason, service_name)
            await servicer.set(service_name, SERVING if ready else NOT_SERVING)
        await asyncio.sleep(interval_s)
