"""Logging setup, in one place: text lines (the default) or JSON lines (SSDRBM_LOG_FORMAT=json).

A JSON line holds ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message`` and, when known,
``job_id``, ``tenant`` and ``trace_id``; ``exception`` carries a traceback. The contextual
fields come from, in order: the record's ``extra`` (``logger.info(..., extra={"job_id": j})``),
the fields bound by ``log_context`` for the running task (the worker binds its job's), the
tenant of the gRPC call being handled, and the current trace (ssdrbm_server/tracing.py).

Every process configures logging here: the server, a worker, and each training process.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from ssdrbm_server import tracing
from ssdrbm_server.errors import ServiceError
from ssdrbm_server.tenancy import current_tenant

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONTEXT_FIELDS = ("job_id", "tenant")

_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "ssdrbm_log_context", default=None
)


def configure(log_level: str, log_format: str, *, text_format: str = TEXT_FORMAT) -> None:
    """Send every record at ``log_level`` or above to stderr, as text or JSON lines; Python
    warnings go the same way, so a JSON stream holds nothing else."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(text_format)
    )
    logging.basicConfig(level=log_level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)


@contextlib.contextmanager
def log_context(**fields: str) -> Iterator[None]:
    """Add ``fields`` (e.g. job_id, tenant) to every record logged inside the block, in this
    task or thread and the ones it starts."""
    token = _context.set({**(_context.get() or {}), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_contextual_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def _contextual_fields(record: logging.LogRecord) -> dict[str, str]:
    fields = dict(_context.get() or {})
    for name in CONTEXT_FIELDS:
        value = getattr(record, name, None)
        if value:
            fields[name] = str(value)
    if "tenant" not in fields:
        with contextlib.suppress(ServiceError):  # outside a gRPC call there is no tenant
            fields["tenant"] = current_tenant()
    trace_id = tracing.current_trace_id()
    if trace_id:
        fields["trace_id"] = trace_id
    return fields
