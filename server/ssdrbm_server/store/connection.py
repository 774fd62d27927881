"""The one way the service opens Redis: bytes replies, bounded timeouts, health checks.

A single Redis gets `redis.asyncio.Redis`; a Redis Cluster (`SSDRBM_REDIS_CLUSTER=1`) gets
`redis.asyncio.cluster.RedisCluster`, which routes each command and script by its keys' slot.
The stores work with either: every script and MULTI stays within one slot (ssdrbm_server/keys.py),
and the only multi-slot requests are non-transactional pipelines of reads, which the cluster
client splits by node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

from ssdrbm_server.keys import Keys

# Short enough that an RPC answers UNAVAILABLE promptly when Redis is down, long enough for a
# checkpoint write of a few megabytes on a busy machine.
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0

# The stores accept either client; both speak the same commands.
RedisClient = aioredis.Redis | RedisCluster

T = TypeVar("T")


class Store:
    """A store on one client and key layout; its Lua scripts run with ``run``."""

    def __init__(self, redis: RedisClient, *, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._scripts: dict[str, AsyncScript] = {}

    async def run(self, script: str, keys: list[str], args: Sequence[object] = ()) -> Any:
        """Run a Lua script, given by its source (registered on first use: EVALSHA after)."""
        if script not in self._scripts:
            self._scripts[script] = self.redis.register_script(script)
        return await self._scripts[script](keys=keys, args=args)

    def job_and_events(self, job_id: str) -> list[str]:
        """The KEYS of a script on the job's hash and event stream (its own slot)."""
        return [self.keys.job(job_id), self.keys.events(job_id)]


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def pairs(fields: Mapping[str, object]) -> list:
    """A mapping as the flat field/value list of HSET and of a script's ARGV."""
    return [part for item in fields.items() for part in item]


async def cancellable(call: Awaitable[T]) -> T:
    """Await a Redis call so that cancelling the caller always raises CancelledError here:
    redis-py's asyncio client can lose a cancel that lands inside a command, and a long-lived
    call (a metric stream whose client went away) then never ends. The command runs to its end
    in a task of its own (at most its block time); the caller's cancel lands on the shield."""
    task = asyncio.ensure_future(call)
    task.add_done_callback(_retrieve)  # an error after the caller left is not worth a warning
    return await asyncio.shield(task)


def _retrieve(task: asyncio.Future[object]) -> None:
    if not task.cancelled():
        task.exception()


def connect(url: str, *, cluster: bool = False, **options: object) -> RedisClient:
    """An async client for `url` (redis://, rediss:// for TLS; a password may be in the URL);
    with `cluster`, a Redis Cluster client that discovers the other nodes from that one.
    Replies stay bytes: specs, checkpoints and datasets are binary. Blocking reads (XREAD BLOCK)
    pass their own, longer, wait. With `max_connections`, at most that many connections (per
    node on a cluster); a single Redis then makes further calls wait for a free one."""
    settings: dict[str, object] = {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": 30,
    }
    if cluster:
        # The cluster client keeps its own retry policy: it also covers MOVED replies and a
        # failover while the slot map is refreshed, which one immediate retry would not.
        settings.update(options)
        return RedisCluster.from_url(url, decode_responses=False, **settings)
    settings.update(
        {
            "retry_on_timeout": False,
            # One immediate retry on a fresh connection when a pooled one turns out dead (Redis
            # restarted while it sat idle). Without it, each stale connection fails one request
            # after Redis is back. A Redis that is really down still fails fast: the reconnect
            # is refused. Every write script is fenced or checked, so a rare repeat is harmless.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        }
    )
    settings.update(options)
    if "max_connections" in options:
        # A bounded pool: a call that finds every connection busy waits (up to the socket
        # timeout) for one to come free instead of failing at once with "Too many connections".
        pool = aioredis.BlockingConnectionPool.from_url(
            url, decode_responses=False, timeout=SOCKET_TIMEOUT_S, **settings
        )
        return aioredis.Redis.from_pool(pool)
    return aioredis.Redis.from_url(url, decode_responses=False, **settings)
