"""Printing results: JSON for scripts (``--json``), plain text for people. Data goes to stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import numpy as np

from ssdrbm.events import to_jsonable

T = TypeVar("T")


def _default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def dumps(value: Any, *, indent: int | None = 2) -> str:
    """JSON text for the SDK's dataclasses, enums, datetimes, paths and numpy values."""
    return json.dumps(to_jsonable(value), indent=indent, default=_default)


def print_json(value: Any, *, lines: bool = False) -> None:
    """Print ``value`` as JSON: indented, or one compact line each (``lines``) for streams."""
    print(dumps(value, indent=None if lines else 2), flush=True)


def print_result(value: T, as_json: bool, render: Callable[[T], str]) -> None:
    """A command's result: ``value`` as JSON under ``--json``, else ``render(value)`` for people."""
    if as_json:
        print_json(value)
    else:
        print(render(value))


def print_listing(
    items: list[T], as_json: bool, table: Callable[[list[T]], str], empty: str
) -> None:
    """A listing command's result: a JSON list, the ``table`` of the items, or ``empty``."""
    if as_json:
        print_json(items)
    else:
        print(table(items) if items else empty)


def format_time(value: datetime | None) -> str:
    """``2024-05-01 12:00:00`` (a listing's CREATED column); "-" when unknown."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def format_number(value: float | None, digits: int = 4) -> str:
    """A compact human-readable number, "-" for a missing one."""
    if value is None:
        return "-"
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.{digits}g}"
    return f"{value:.{max(digits - 1, 1)}e}"


def format_rate(value: float | None) -> str:
    """A throughput such as ``2,500``; "-" when unknown."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 10 else f"{value:.2g}"
