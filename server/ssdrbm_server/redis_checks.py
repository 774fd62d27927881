"""Redis must keep what the service acknowledged: checked at start and again while running.

A job acknowledged or a checkpoint recorded must survive a Redis crash. Three settings break
that silently: an evicting `maxmemory-policy` drops jobs' hashes when memory runs short; without
an append-only file (`appendonly no`) a killed Redis loses every write since its last RDB
snapshot; with `appendfsync no` the AOF reaches the disk when the OS decides (about 30 s on
Linux), so a host crash loses that much (`everysec` loses at most about a second, and nothing
when only Redis dies; `always` loses nothing).

Every process that writes (the API and each worker) refuses to start on any of them, with the
fix in the message, and checks again every SSDRBM_REDIS_CHECK_INTERVAL_S, since `CONFIG SET`
changes them at run time. While Redis is unfit the API reports readiness NOT_SERVING and refuses
`WRITE_METHODS` (FAILED_PRECONDITION naming the setting and the fix), and a worker claims no new
job, each logging an ERROR every check; both resume once a check finds the setting fixed. No AOF
and `appendfsync no` may be waived for development and tests (SSDRBM_ALLOW_NO_PERSISTENCE=1,
then warned at start and every minute); eviction never is. On Redis Cluster every node the
client knows is asked; where CONFIG is forbidden (managed Redis) the checks are skipped with a
warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.errors import FailedPreconditionError
from ssdrbm_server.exposure import WARNING_INTERVAL_S, repeat_warning
from ssdrbm_server.handlers import ServiceInterceptor, run_first
from ssdrbm_server.store.connection import RedisClient

logger = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"
SAFE_FSYNC = ("everysec", "always")
CHECKED = ("maxmemory-policy", "appendonly", "appendfsync")
UNANSWERED_S = 1.0  # how often Redis is asked while it has never answered a check
ALLOW_NO_PERSISTENCE = "SSDRBM_ALLOW_NO_PERSISTENCE=1"
# The calls that create work Redis would then have to keep: refused while it would not.
WRITE_METHODS = frozenset(
    f"/ssdrbm.v1.RBMService/{name}" for name in ("StartTraining", "StartSweep", "UploadDataset")
)
# Redis (or a cluster node) cannot be asked now: an outage, which readiness reports, not a verdict.
_UNREACHABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    TimeoutError,
    OSError,
)


class RedisConfigError(ConfigError):
    """Redis is configured in a way that would lose acknowledged work."""


@dataclass(frozen=True)
class Verdict:
    """What a check found: ``refused`` settings stop writes, ``waived`` ones are only warned
    about (SSDRBM_ALLOW_NO_PERSISTENCE). Each entry names the node, the setting and the fix."""

    refused: tuple[str, ...] = ()
    waived: tuple[str, ...] = ()

    @property
    def fit(self) -> bool:
        return not self.refused

    def reason(self) -> str:
        return "; ".join(self.refused)

    def warning(self) -> str | None:
        if not self.waived:
            return None
        return f"Redis may lose acknowledged work ({ALLOW_NO_PERSISTENCE}): " + "; ".join(
            self.waived
        )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_config(client: RedisClient) -> dict[str, dict[str, str]]:
    """The `CHECKED` settings of every node: ``{node address: {name: value}}`` (the address is
    "" for a single Redis). One CONFIG GET per setting, which every Redis version accepts."""
    nodes: dict[str, dict[str, str]] = {}
    if isinstance(client, RedisCluster):
        await client.initialize()  # the node list is empty until the first command otherwise
    for name in CHECKED:
        if isinstance(client, RedisCluster):
            cluster_nodes = client.get_nodes()  # primaries and replicas the client knows
            replies = await asyncio.gather(
                *(client.config_get(name, target_nodes=node) for node in cluster_nodes)
            )
            named = zip((node.name for node in cluster_nodes), replies, strict=True)
        else:
            named = [("", await client.config_get(name))]
        for node, reply in named:
            values = {_text(key): _text(value) for key, value in dict(reply or {}).items()}
            nodes.setdefault(node, {}).update(values)
    return nodes


def judge(nodes: dict[str, dict[str, str]], *, allow_no_persistence: bool) -> Verdict:
    """Each node's settings against the rules above, fixes included."""
    refused: list[str] = []
    waived: list[str] = []
    for node, values in sorted(nodes.items()):
        where = f"Redis node {node}" if node else "Redis"
        policy = values.get("maxmemory-policy")
        if policy is not None and policy != SAFE_POLICY:
            refused.append(
                f"{where} has maxmemory-policy {policy!r}, which evicts keys (jobs, checkpoints) "
                f"when memory runs short; set `maxmemory-policy {SAFE_POLICY}` (a full Redis then "
                "refuses writes, which the service reports as RESOURCE_EXHAUSTED)"
            )
        losses = []
        if values.get("appendonly", "yes") != "yes":
            losses.append(
                f"{where} has appendonly {values['appendonly']!r}: without the append-only file "
                "a crash loses every write since the last RDB snapshot, acknowledged jobs "
                "included; set `appendonly yes` with `appendfsync everysec` (or `always`): "
                "`redis-server --appendonly yes`, or CONFIG SET appendonly yes and the same in "
                "redis.conf"
            )
        elif values.get("appendfsync", "everysec") not in SAFE_FSYNC:
            losses.append(
                f"{where} has appendfsync {values['appendfsync']!r}: the append-only file "
                "reaches the disk when the OS decides, so a host crash loses about the last 30 s "
                "of acknowledged writes; set `appendfsync everysec` (at most about a second) or "
                "`always`"
            )
        if allow_no_persistence:
            waived += losses
        else:
            refused += [f"{loss} (or {ALLOW_NO_PERSISTENCE} for development)" for loss in losses]
    return Verdict(tuple(refused), tuple(waived))


async def check_redis_config(redis_client: RedisClient, settings: Settings) -> Verdict:
    """Raise RedisConfigError when Redis would lose acknowledged work; what was found (nothing
    when it could not be asked)."""
    watch = RedisWatch(redis_client, settings, consequence="")
    await watch.check_at_start()
    return watch.verdict


class RedisWatch:
    """Redis's fitness as the last check found it, for the gates that act on it: readiness and
    `WriteGate` in the API, the claim loop in a worker.

    ``consequence`` says in the ERROR logged each check while unfit what this process holds
    back meanwhile."""

    def __init__(self, client: RedisClient, settings: Settings, *, consequence: str) -> None:
        self.client = client
        self.settings = settings
        self.consequence = consequence
        self.verdict = Verdict()  # unchecked counts as fit: the start check refuses, not this
        self._answered = False  # Redis has answered a check (or refused CONFIG) at least once
        self._config_readable = True

    @property
    def fit(self) -> bool:
        return self.verdict.fit

    def refusal(self) -> str | None:
        """Why writes are held back now, or None."""
        return None if self.fit else self.verdict.reason()

    async def check_at_start(self) -> None:
        """Raise RedisConfigError on an unfit Redis (the process must not start). Unreachable,
        the process still starts (readiness NOT_SERVING, UNAVAILABLE until Redis is back) and
        the first check once Redis answers judges it."""
        if await self._judged(at_start=True) and not self.fit:
            raise RedisConfigError(self.verdict.reason())

    async def check(self) -> None:
        """Ask Redis again; log what changed, and an ERROR every check while unfit."""
        was_fit = self.fit
        if not await self._judged(at_start=False):
            return  # the verdict stands until Redis tells
        if not self.fit:
            logger.error(
                "Redis would lose acknowledged work: %s. Until it is fixed %s",
                self.verdict.reason(),
                self.consequence,
            )
        elif not was_fit:
            logger.info("Redis keeps acknowledged work again: resuming")

    async def _judged(self, *, at_start: bool) -> bool:
        """Judge each node's settings; False when Redis cannot tell now: unreachable (an outage,
        which readiness reports) or CONFIG refused (managed Redis: warned once)."""
        try:
            nodes = await read_config(self.client)
        except _UNREACHABLE as exc:
            if at_start:
                logger.warning("cannot reach Redis to check its configuration (%s) yet", exc)
            return False
        except redis.exceptions.ResponseError as exc:  # e.g. CONFIG renamed or not permitted
            self._answered = True
            if self._config_readable:
                logger.warning(
                    "cannot read Redis's configuration (%s); make sure maxmemory-policy is %s "
                    "and appendonly is yes (appendfsync everysec or always) on every node, or "
                    "acknowledged work may be lost",
                    exc,
                    SAFE_POLICY,
                )
            self._config_readable = False
            return False
        self._answered = self._config_readable = True
        self.verdict = judge(nodes, allow_no_persistence=self.settings.allow_no_persistence)
        return True

    async def run(
        self, interval_s: float | None = None, warning_interval_s: float = WARNING_INTERVAL_S
    ) -> None:
        """Check every ``interval_s`` (SSDRBM_REDIS_CHECK_INTERVAL_S) and repeat the warning for
        what SSDRBM_ALLOW_NO_PERSISTENCE waives (at once, then every ``warning_interval_s``, a
        minute), forever."""
        interval = self.settings.redis_check_interval_s if interval_s is None else interval_s
        await asyncio.gather(
            self._check_every(interval),
            repeat_warning(lambda: self.verdict.warning(), warning_interval_s, logger=logger),
        )

    async def _check_every(self, interval_s: float) -> None:
        while True:
            # Until Redis first answers (unreachable at start), ask about as often as readiness
            # does, so that a Redis that comes up unfit is held back at once.
            await asyncio.sleep(interval_s if self._answered else min(interval_s, UNANSWERED_S))
            await self.check()


class WriteGate(ServiceInterceptor):
    """Refuses `WRITE_METHODS` while ``watch`` finds Redis unfit. FAILED_PRECONDITION, not
    UNAVAILABLE: it lasts until an operator acts, so clients should not retry it shortly."""

    def __init__(self, watch: RedisWatch, methods: Iterable[str] = WRITE_METHODS) -> None:
        self.watch = watch
        self.methods = frozenset(methods)
        super().__init__(self._gated)

    def _gated(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` of a write method, refused at each call while Redis is unfit."""
        if method not in self.methods:
            return handler
        name = method.rsplit("/", 1)[-1]
        watch = self.watch

        def refuse_while_unfit(_context: grpc.aio.ServicerContext) -> None:
            reason = watch.refusal()
            if reason is not None:
                raise FailedPreconditionError(
                    f"{name} is refused while Redis would lose acknowledged work: {reason}. "
                    "Reads still work; retry once the operator has fixed Redis",
                    precondition="REDIS_NOT_DURABLE",
                    subject="redis",
                )

        return run_first(handler, refuse_while_unfit)
