"""The one way the service opens Redis: bytes replies, bounded timeouts, health checks."""

from __future__ import annotations

import redis.asyncio as aioredis

# Short enough that an RPC answers UNAVAILABLE promptly when Redis is down, long enough for a
# checkpoint write of a few megabytes on a busy machine.
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0


def connect(url: str, **options: object) -> aioredis.Redis:
    """An async client for `url` (redis://, rediss:// for TLS; a password may be in the URL).

    Replies stay bytes (`decode_responses=False`): specs, checkpoints and datasets are binary.
    Blocking reads (XREAD BLOCK) pass their own, longer, wait.
    """
    settings: dict[str, object] = {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": 30,
        "retry_on_timeout": False,
    }
    settings.update(options)
    return aioredis.Redis.from_url(url, decode_responses=False, **settings)
