"""Authentication: bearer token → tenant, resolved once per call by an interceptor.

The interceptor stores the caller's tenant in a context variable for the duration of the call;
handlers read it with ``current_tenant()``. The tenant is the isolation boundary: stores look
jobs and datasets up per tenant, so another tenant's resource is simply NOT_FOUND.

Tokens come from a file (lines ``<token> <tenant>``, ``#`` comments, or a JSON object
``{"token": "tenant"}``) and/or an inline ``token=tenant,...`` setting. In mode ``none`` every
caller is tenant ``default`` — for development only, and logged loudly at start.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.errors import UnauthenticatedError
from ssdrbm_server.handlers import ServiceInterceptor, run_first
from ssdrbm_server.tenancy import set_tenant

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class TokenTable:
    """Maps bearer tokens to tenants; compares tokens in constant time."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        for token, tenant in tokens.items():
            if not token:
                raise ConfigError("an auth token is empty")
            if not _TENANT_NAME.fullmatch(tenant):
                raise ConfigError(
                    f"tenant name {tenant!r} must be 1-64 letters, digits, '_', '.' or '-'"
                )
        self._tokens = dict(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def tenant_for(self, token: str) -> str | None:
        """The tenant owning ``token``, or None."""
        found = None
        for known, tenant in self._tokens.items():
            # Check every entry so the time taken does not reveal which prefix matched.
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found

    @classmethod
    def from_settings(cls, settings: Settings) -> TokenTable:
        """Tokens from SSDRBM_AUTH_TOKENS_FILE and SSDRBM_AUTH_TOKENS together."""
        tokens: dict[str, str] = {}
        if settings.auth_tokens_file:
            tokens.update(parse_token_file(Path(settings.auth_tokens_file)))
        if settings.auth_tokens:
            tokens.update(parse_inline_tokens(settings.auth_tokens))
        return cls(tokens)


def parse_token_file(path: Path) -> dict[str, str]:
    """Tokens from a JSON object file or a ``<token> <tenant>`` lines file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the auth tokens file {path}: {exc}") from exc
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        return {str(token): str(tenant) for token, tenant in data.items()}
    tokens: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{number}: expected '<token> <tenant>'")
        tokens[parts[0]] = parts[1]
    return tokens


def parse_inline_tokens(text: str) -> dict[str, str]:
    """Tokens from ``token1=tenant1,token2=tenant2``."""
    tokens: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        token, sep, tenant = item.partition("=")
        if not sep:
            raise ConfigError("SSDRBM_AUTH_TOKENS entries must look like token=tenant")
        tokens[token.strip()] = tenant.strip()
    return tokens


def _bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return ""
    return None


class AuthInterceptor(ServiceInterceptor):
    """Resolves the caller's tenant for every RBMService call (health and reflection are open)."""

    def __init__(self, settings: Settings) -> None:
        self.mode = settings.auth_mode
        self.table = TokenTable.from_settings(settings) if self.mode == "token" else None
        if self.mode == "none":
            logger.warning(
                "AUTHENTICATION IS OFF (SSDRBM_AUTH_MODE=none): every caller is tenant %r. "
                "Use SSDRBM_AUTH_MODE=token outside development.",
                DEFAULT_TENANT,
            )
        elif not self.table:
            raise ConfigError(
                "SSDRBM_AUTH_MODE=token needs tokens: set SSDRBM_AUTH_TOKENS_FILE or "
                "SSDRBM_AUTH_TOKENS"
            )
        else:
            logger.info("bearer-token authentication on, %d token(s)", len(self.table))
        super().__init__(self._authenticated)

    def resolve(self, metadata: Any) -> str:
        """The tenant for a call's metadata, or UnauthenticatedError."""
        if self.table is None:
            return DEFAULT_TENANT
        token = _bearer_token(metadata)
        if token is None:
            raise UnauthenticatedError(
                "missing credentials: send 'authorization: Bearer <token>' (gRPC metadata, "
                "or the HTTP header on the REST port)",
                reason="MISSING_CREDENTIALS",
            )
        tenant = self.table.tenant_for(token) if token else None
        if tenant is None:
            raise UnauthenticatedError(
                "invalid bearer token; check the token you were given", reason="INVALID_TOKEN"
            )
        return tenant

    def _authenticated(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` run with the caller's tenant resolved from the call's own metadata."""
        resolve = self.resolve
        return run_first(
            handler, lambda context: set_tenant(resolve(context.invocation_metadata()))
        )
