"""Checks at start that Redis is configured to be the system of record.

Two settings make Redis lose jobs silently: an evicting `maxmemory-policy` (e.g. allkeys-lru
drops running jobs' hashes when memory runs short) and no persistence (no AOF and no RDB
snapshots: a restart empties it). The service refuses to start on either, with the fix in the
message; persistence may be waived for development and tests (`allow_no_persistence`). Managed
Redis often forbids CONFIG: then the checks are skipped with a warning.
"""

from __future__ import annotations

import logging

import redis.exceptions

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.store.connection import RedisClient

logger = logging.getLogger(__name__)

SAFE_POLICY = "noeviction"


class RedisConfigError(ConfigError):
    """Redis is configured in a way that would lose jobs."""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _config(redis_client: RedisClient, name: str) -> str | None:
    """CONFIG GET `name` (one node's answer on a cluster); None when not reported."""
    reply = await redis_client.config_get(name)
    for key, value in (reply or {}).items():
        if _text(key) == name:
            return _text(value)
    return None


def problems(policy: str | None, appendonly: str | None, save: str | None, *,
             allow_no_persistence: bool) -> list[str]:  # fmt: skip
    """What is wrong with these settings, each with its fix (empty: all is well)."""
    found = []
    if policy is not None and policy != SAFE_POLICY:
        found.append(
            f"Redis's maxmemory-policy is {policy!r}, which evicts keys (jobs, checkpoints) when "
            f"memory runs short; set `maxmemory-policy {SAFE_POLICY}` (a full Redis then refuses "
            "writes, which the service reports as RESOURCE_EXHAUSTED)"
        )
    no_persistence = appendonly == "no" and (save or "").strip() == ""
    if no_persistence and not allow_no_persistence:
        found.append(
            "Redis keeps no append-only file and no snapshots, so a restart loses every job; "
            "set `appendonly yes` (with appendfsync everysec or always), or "
            "SSDRBM_ALLOW_NO_PERSISTENCE=1 for development"
        )
    return found


async def check_redis_config(redis_client: RedisClient, settings: Settings) -> None:
    """Raise RedisConfigError when Redis would lose jobs; warn when CONFIG is not allowed."""
    try:
        policy = await _config(redis_client, "maxmemory-policy")
        appendonly = await _config(redis_client, "appendonly")
        save = await _config(redis_client, "save")
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        # Unreachable (or a wrong password) at start: the service still starts, reports
        # NOT_SERVING and answers UNAVAILABLE until Redis is back, as it does after a restart.
        logger.warning("cannot reach Redis to check its configuration (%s); not checked", exc)
        return
    except redis.exceptions.ResponseError as exc:  # e.g. CONFIG renamed or not permitted
        logger.warning(
            "cannot read Redis's configuration (%s); make sure maxmemory-policy is %s and AOF "
            "is on, or jobs may be lost",
            exc,
            SAFE_POLICY,
        )
        return
    found = problems(policy, appendonly, save, allow_no_persistence=settings.allow_no_persistence)
    if found:
        raise RedisConfigError("; ".join(found))
    if appendonly == "no" and (save or "").strip() == "":
        logger.warning("Redis keeps no persistence (allowed by SSDRBM_ALLOW_NO_PERSISTENCE)")
    elif appendonly == "no":
        logger.warning("Redis persists by RDB snapshots only: a crash loses the latest writes")
