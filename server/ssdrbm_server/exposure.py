"""Who can reach the service: loopback unless told otherwise.

Without authentication (``SSDRBM_AUTH_MODE=none``) a service listening beyond loopback lets
anyone who can reach the host submit and read every job; bearer tokens over plaintext on the
network can be read by anyone on the path. Both are refused when a server is built unless an
explicit setting says the network in front of it is trusted: ``SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE``
(e.g. ports published on the host's loopback only; warned at start and every minute) or
``SSDRBM_ALLOW_PLAINTEXT_TOKENS`` (TLS terminated by a proxy in front; warned at start). Only
processes that listen are checked, so a worker container may share the API's environment.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable

from ssdrbm_server.config import ConfigError, Settings

logger = logging.getLogger(__name__)

WARNING_INTERVAL_S = 60.0
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback_host(host: str) -> bool:
    """True for a loopback IP or the name ``localhost``; anything else (``0.0.0.0``, ``::``,
    a host name) may be reachable from elsewhere."""
    host = host.strip().strip("[]").lower()
    if host in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_listen_address(address: str) -> bool:
    """True when a gRPC listen address (``host:port``, ``[v6]:port``, ``unix:path``) can only be
    reached from this host."""
    if address.startswith(("unix:", "unix-abstract:")):
        return True  # a socket file: local by construction
    host, separator, _port = address.rpartition(":")
    return is_loopback_host(host if separator else address)


def _exposed_addresses(settings: Settings) -> list[str]:
    """The settings naming a non-loopback address, as ``VARIABLE=value``."""
    exposed = _remote_token_listeners(settings)
    if settings.metrics_port and not is_loopback_host(settings.metrics_address):
        exposed.append(f"SSDRBM_METRICS_ADDRESS={settings.metrics_address}")
    return exposed


def _remote_token_listeners(settings: Settings) -> list[str]:
    """The listeners that take bearer tokens, gRPC and the HTTP front (on unless its port is 0,
    with the same TLS settings: http_front.py), beyond loopback, as ``VARIABLE=value``."""
    remote = []
    if not is_loopback_listen_address(settings.listen_address):
        remote.append(f"SSDRBM_LISTEN_ADDRESS={settings.listen_address}")
    if settings.http_port and not is_loopback_host(settings.http_address):
        remote.append(f"SSDRBM_HTTP_ADDRESS={settings.http_address}")
    return remote


def check_exposure(settings: Settings) -> None:
    """Raise ConfigError when the settings would expose the service without auth, or send
    tokens in plaintext, and no explicit setting allows it."""
    if settings.auth_mode == "none":
        exposed = _exposed_addresses(settings)
        if exposed and not settings.allow_unauthenticated_remote:
            raise ConfigError(
                f"{' and '.join(exposed)} is not a loopback address and SSDRBM_AUTH_MODE=none: "
                "anyone who can reach this host could submit and read jobs. Turn on tokens "
                "(SSDRBM_AUTH_MODE=token with SSDRBM_AUTH_TOKENS_FILE, plus "
                "SSDRBM_TLS_CERT_FILE/SSDRBM_TLS_KEY_FILE), listen on 127.0.0.1, or, when only "
                "trusted machines can reach it, set SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE=1"
            )
    elif _plaintext_tokens(settings) and not settings.allow_plaintext_tokens:
        raise ConfigError(
            f"{' and '.join(_remote_token_listeners(settings))} is not a loopback address and TLS "
            "is off: bearer tokens would cross the network in plaintext. Set "
            "SSDRBM_TLS_CERT_FILE and SSDRBM_TLS_KEY_FILE, or, when a proxy in front terminates "
            "TLS, set SSDRBM_ALLOW_PLAINTEXT_TOKENS=1"
        )


def _plaintext_tokens(settings: Settings) -> bool:
    return (
        settings.auth_mode == "token"
        and not settings.tls_cert_file
        and bool(_remote_token_listeners(settings))
    )


async def keep_warning(settings: Settings, interval_s: float = WARNING_INTERVAL_S) -> None:
    """Log what an explicit setting allowed: at once, and the unauthenticated-remote warning
    again every ``interval_s`` while the server runs (the first may have scrolled away)."""
    if _plaintext_tokens(settings):
        logger.warning(
            "bearer tokens are accepted in PLAINTEXT on %s (SSDRBM_ALLOW_PLAINTEXT_TOKENS=1): "
            "only safe behind a proxy that terminates TLS",
            " and ".join(_remote_token_listeners(settings)),
        )
    exposed = _exposed_addresses(settings) if settings.auth_mode == "none" else []
    if exposed:
        message = (
            f"UNAUTHENTICATED and reachable beyond loopback ({', '.join(exposed)}, "
            "SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE=1): anyone who can reach this address can "
            "submit and read jobs; set SSDRBM_AUTH_MODE=token unless only trusted machines can "
            "reach it"
        )
        await repeat_warning(lambda: message, interval_s)


async def repeat_warning(
    message: Callable[[], str | None],
    interval_s: float = WARNING_INTERVAL_S,
    *,
    logger: logging.Logger = logger,
) -> None:
    """Log ``message()`` as a WARNING at once and every ``interval_s`` after, whenever it has
    one (forever): what an explicit setting allows must not be forgotten once the first warning
    has scrolled away. The Redis checks repeat theirs with it (redis_checks.py)."""
    while True:
        text = message()
        if text is not None:
            logger.warning(text)
        await asyncio.sleep(interval_s)
