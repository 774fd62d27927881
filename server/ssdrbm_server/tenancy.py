"""The tenant of the call being handled: one context variable, set by authentication.

The API's authentication (auth.py, and the HTTP front through it) sets it for each call;
handlers read it with ``current_tenant()``, and log records carry it (logs.py). It lives here,
apart from the interceptor, so that the shared modules that read it import nothing of the API.
"""

from __future__ import annotations

import contextvars

from ssdrbm_server.errors import UnauthenticatedError

_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("ssdrbm_tenant")


def set_tenant(tenant: str) -> None:
    """Make ``tenant`` the caller of the call being handled (its context only)."""
    _tenant.set(tenant)


def current_tenant() -> str:
    """The tenant of the call being handled (set by authentication)."""
    try:
        return _tenant.get()
    except LookupError:
        raise UnauthenticatedError("no tenant resolved for this call") from None
