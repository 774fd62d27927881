"""Waiting for Redis before the service starts, for a person who started it by hand.

``python -m ssdrbm_server`` starts without Redis (readiness NOT_SERVING, every call UNAVAILABLE
until Redis answers), which suits deployments whose probes follow it. ``--wait-for-redis``
(which ``ssdrbm serve`` passes) instead waits until Redis answers, saying on stderr what it
waits for and how to provide it, so that nobody faces a service that refuses every call.
"""

from __future__ import annotations

import asyncio
import sys
import time
from urllib.parse import urlsplit, urlunsplit

import redis.exceptions

from ssdrbm_server.config import Settings
from ssdrbm_server.store.connection import connect

POLL_S = 0.5  # between two tries while Redis does not answer


def wait_for_redis(settings: Settings, program: str, *, poll_s: float = POLL_S) -> None:
    """Return once the Redis of ``settings`` answers a PING; while it does not, one line on
    stderr says what is awaited and how to provide it, and another when it answers."""
    started = time.monotonic()
    if asyncio.run(redis_answers(settings)):
        return
    print(
        f"{program}: waiting for Redis at {printable_url(settings.redis_url)} "
        "(SSDRBM_REDIS_URL): start it with 'redis-server', or point SSDRBM_REDIS_URL at a "
        "running one; Ctrl-C to give up",
        file=sys.stderr,
        flush=True,
    )
    while not asyncio.run(redis_answers(settings)):
        time.sleep(poll_s)
    waited = time.monotonic() - started
    print(f"{program}: Redis answers after {waited:.0f} s; starting", file=sys.stderr, flush=True)


async def redis_answers(settings: Settings) -> bool:
    """Whether the Redis of ``settings`` answers a PING, through the service's connection."""
    client = None
    try:
        client = connect(settings.redis_url, cluster=settings.redis_cluster)
        return bool(await client.ping())
    except (redis.exceptions.RedisError, OSError):
        return False
    finally:
        if client is not None:
            await client.aclose()


def printable_url(url: str) -> str:
    """``url`` fit to print: a password in it is replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=user + host))
