"""ListJobs page tokens: opaque, and valid only for the tenant that received them.

A token holds the listing position to continue below — a position in the tenant's own sequence
(`tenant:{<t>}:seq`, keys.py), so it says nothing about other tenants' jobs — and a short tag
derived from the tenant's name. Another tenant's token (or a forged one) fails the tag check
and is INVALID_ARGUMENT; even a forged tag would only page the caller's own listing, which is
the only one a caller's listing ever reads. The text is base64url, so clients treat it as
opaque instead of doing arithmetic on it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib

from ssdrbm_server.errors import InvalidArgumentError

_VERSION = b"j1:"
_TAG_BYTES = 6
_MAX_POSITION_DIGITS = 18  # below 2^63: what Redis's INCR can count to
_NOT_A_TOKEN = "not a token from ListJobs; pass next_page_token unchanged or leave empty"


def _tenant_tag(tenant: str) -> bytes:
    return hashlib.sha256(b"ssdrbm list page\0" + tenant.encode()).digest()[:_TAG_BYTES]


def encode_page_token(tenant: str, position: int) -> str:
    """The token that continues ``tenant``'s listing below ``position``."""
    raw = _VERSION + _tenant_tag(tenant) + str(int(position)).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_page_token(tenant: str, token: str) -> int | None:
    """The position to continue below, None for the first page (empty token); raises
    InvalidArgumentError naming page_token for anything ListJobs did not give this tenant."""
    if token == "":
        return None
    try:
        padded = token + "=" * (-len(token) % 4)
        raw = base64.b64decode(padded, altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError("page_token", _NOT_A_TOKEN) from None
    head = _VERSION + _tenant_tag(tenant)
    digits = raw[len(head) :]
    if not raw.startswith(_VERSION) or not 0 < len(digits) <= _MAX_POSITION_DIGITS:
        raise InvalidArgumentError("page_token", _NOT_A_TOKEN)
    if not raw.startswith(head):
        raise InvalidArgumentError(
            "page_token", "belongs to another caller's listing; start again with an empty token"
        )
    if not digits.isdigit():
        raise InvalidArgumentError("page_token", _NOT_A_TOKEN)
    return int(digits)
