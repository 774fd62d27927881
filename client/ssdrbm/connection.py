"""Where and how to connect: target, token, TLS, deadlines — from arguments or the environment.

Environment variables (the CLI's options default to them too):

- ``SSDRBM_TARGET``: ``host:port`` of the service (default ``localhost:50051``);
- ``SSDRBM_TOKEN``: bearer token sent as ``authorization: Bearer <token>``;
- ``SSDRBM_TLS``: ``1`` to use TLS with the system's root certificates;
- ``SSDRBM_TLS_CA``: PEM file of the CA that signed the server's certificate (implies TLS);
- ``SSDRBM_TLS_CERT`` / ``SSDRBM_TLS_KEY``: client certificate and key for mutual TLS;
- ``SSDRBM_TIMEOUT``: deadline in seconds for each unary call (default 30).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

DEFAULT_TARGET = "localhost:50051"
DEFAULT_TIMEOUT_S = 30.0

# Large enough for any message the service sends; the SDK splits its own requests well below it.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a dropped connection or a restarted server; gRPC's default first
    # backoff of 1 s would stall every retry and every stream resume.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Retries are the SDK's own (retry.py), so that only idempotent calls are retried.
    ("grpc.enable_retries", 0),
]


@dataclass(frozen=True)
class TLS:
    """TLS settings: ``ca`` verifies the server, ``cert`` + ``key`` identify the client (mTLS).

    ``TLS()`` alone trusts the system's root certificates.
    """

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials reading the PEM files now."""
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls: give both a client certificate and its key, or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca),
            private_key=_read(self.key),
            certificate_chain=_read(self.cert),
        )


def _read(path: str | Path | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def tls_from_env(env: Mapping[str, str] | None = None) -> TLS | None:
    """TLS settings from ``SSDRBM_TLS*`` variables, or ``None`` for a plaintext channel."""
    env = os.environ if env is None else env
    ca, cert, key = env.get("SSDRBM_TLS_CA"), env.get("SSDRBM_TLS_CERT"), env.get("SSDRBM_TLS_KEY")
    if not (_truthy(env.get("SSDRBM_TLS")) or ca or cert or key):
        return None
    return TLS(ca=ca or None, cert=cert or None, key=key or None)


@dataclass(frozen=True)
class Connection:
    """Resolved connection settings shared by :class:`~ssdrbm.Client` and the asyncio client."""

    target: str
    token: str | None
    tls: TLS | None
    timeout: float

    @classmethod
    def resolve(
        cls,
        target: str | None = None,
        *,
        token: str | None = None,
        tls: TLS | bool | None = None,
        timeout: float | None = None,
    ) -> Connection:
        """Fill whatever is not given from the environment, then from the defaults."""
        env = os.environ
        if isinstance(tls, bool):
            tls = TLS() if tls else None
        elif tls is None:
            tls = tls_from_env(env)
        if timeout is None:
            timeout = float(env.get("SSDRBM_TIMEOUT") or DEFAULT_TIMEOUT_S)
        return cls(
            target=target or env.get("SSDRBM_TARGET") or DEFAULT_TARGET,
            token=token if token is not None else (env.get("SSDRBM_TOKEN") or None),
            tls=tls,
            timeout=timeout,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata: the bearer token, when there is one."""
        return (bearer_metadata(self.token),) if self.token else ()

    def channel(self, kind: Any = grpc) -> Any:
        """A channel to the target: blocking, or asyncio with ``kind=grpc.aio``."""
        if self.tls is None:
            return kind.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        return kind.secure_channel(self.target, self.tls.credentials(), options=CHANNEL_OPTIONS)


def bearer_metadata(token: str) -> tuple[str, str]:
    """The metadata entry that authenticates a call with ``token``."""
    return ("authorization", f"Bearer {token}")


def with_bearer_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """``channel`` with ``token`` sent on every call, for code that uses the generated stubs
    directly (the SDK's clients pass it per call)."""
    return grpc.intercept_channel(channel, _BearerToken(token))


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor):  # fmt: skip
    """Adds the bearer metadata to every call of a channel."""

    def __init__(self, token: str) -> None:
        self.metadata = bearer_metadata(token)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self.metadata]
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)
