"""Checks shared by every RPC's request fields: enums, free text, finite numbers.

Each failure is an ``InvalidArgumentError`` naming the field and the fix.
"""

from __future__ import annotations

import math

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from ssdrbm_server.errors import InvalidArgumentError


def enum_value(enum: EnumTypeWrapper, value: int, field: str) -> int:
    """``value`` if it is a member of ``enum``; an open proto3 enum may carry unknown numbers."""
    if value not in enum.DESCRIPTOR.values_by_number:
        names = [v.name for v in enum.DESCRIPTOR.values if not v.name.endswith("_UNSPECIFIED")]
        raise InvalidArgumentError(field, f"unknown value {value}; use one of {names}")
    return value


def check_text(value: str, field: str, max_length: int) -> None:
    """Printable text of at most ``max_length`` characters."""
    if len(value) > max_length:
        raise InvalidArgumentError(
            field, f"is {len(value)} characters long; at most {max_length} allowed"
        )
    if any(not char.isprintable() for char in value):
        raise InvalidArgumentError(field, "contains control characters; use printable text")


def finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgumentError(field, f"must be a finite number, got {value}")
    return value
