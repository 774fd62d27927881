"""OpenTelemetry tracing, optional: the one module that imports opentelemetry.

Without the ``tracing`` extra or with ``SSDRBM_TRACING=off`` (the default) every function here is
a cheap no-op. Traced: StartTraining, Reconstruct and SampleHidden (children of an incoming W3C
``traceparent``), the job's time in the queue, the worker's claim, its training attempt and each
checkpoint write. StartTraining stores its span's ``traceparent`` in the job record and the
worker starts its spans from it, so one trace runs from the submit to the last checkpoint.

The tracer is this module's, not OpenTelemetry's global one: tests install an in-memory
exporter per test (``install``), which the global provider (settable once) would not allow.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

from ssdrbm_server.config import ConfigError, Settings

try:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    AVAILABLE = True
except ImportError:  # the service runs without the tracing extra
    AVAILABLE = False

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # the W3C header, as gRPC metadata and in the job record
# Neither distribution is on a package index: the extra is installed from a checkout.
INSTALL_HINT = "pip install './server[tracing]' in a checkout of the ssdrbm repository"
OTLP_HINT = "pip install opentelemetry-exporter-otlp-proto-grpc (part of the tracing extra)"

RpcMethod = TypeVar("RpcMethod", bound=Callable[..., Awaitable[Any]])

_tracer: Any = None  # None: tracing off, every span is a no-op
_provider: Any = None


def configure(settings: Settings, *, service_name: str = "ssdrbm") -> None:
    """Start tracing as ``settings.tracing`` says: ``off``, ``console`` (spans printed to
    stdout, for development) or ``otlp`` (the OTLP/gRPC exporter, configured by the standard
    OTEL_EXPORTER_OTLP_* variables). ConfigError when the packages for it are missing."""
    mode = settings.tracing
    if mode == "off":
        return
    if not AVAILABLE:
        raise ConfigError(f"SSDRBM_TRACING={mode} needs OpenTelemetry: {INSTALL_HINT}")
    if mode == "console":
        exporter: Any = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(f"SSDRBM_TRACING=otlp needs the OTLP exporter: {OTLP_HINT}") from None
        exporter = OTLPSpanExporter()
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name  # the standard variable wins
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    logger.info("tracing on: spans go to %s", mode)


def install(provider: Any) -> None:
    """Trace with ``provider`` (an SDK TracerProvider); None turns tracing off again."""
    global _tracer, _provider
    if _provider is not None and _provider is not provider:
        _provider.shutdown()  # flushes the spans still batched
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer("ssdrbm_server")


def shutdown() -> None:
    """Flush and stop the exporter (at process exit)."""
    install(None)


def enabled() -> bool:
    return _tracer is not None


@contextlib.contextmanager
def span(
    name: str,
    *,
    parent: Any = None,
    attributes: Mapping[str, Any] | None = None,
    server: bool = False,
) -> Iterator[Any]:
    """A span around the block, current inside it (children nest under it); ``parent`` is a
    context from ``context_from_traceparent`` (default: the current span). Yields the span, or
    None when tracing is off."""
    if _tracer is None:
        yield None
        return
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    with _tracer.start_as_current_span(
        name, context=parent, kind=kind, attributes=dict(attributes or {})
    ) as current:
        yield current


def traced_rpc(name: str) -> Callable[[RpcMethod], RpcMethod]:
    """Decorate a unary servicer method with its server span, which names the request's job when
    it has one: a child of the caller's ``traceparent`` metadata when sent, else a new trace."""

    def decorate(method: RpcMethod) -> RpcMethod:
        @functools.wraps(method)
        async def traced(servicer: Any, request: Any, context: Any) -> Any:
            if _tracer is None:
                return await method(servicer, request, context)
            metadata = context.invocation_metadata() or ()
            carrier = {k: v for k, v in metadata if k == TRACEPARENT and isinstance(v, str)}
            parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
            job_id = getattr(request, "job_id", "")
            attributes = {"ssdrbm.job_id": job_id} if job_id else {}
            rpc = f"ssdrbm.v1.RBMService/{name}"
            with span(rpc, parent=parent, attributes=attributes, server=True):
                return await method(servicer, request, context)

        return traced  # type: ignore[return-value]

    return decorate


def set_attribute(key: str, value: Any) -> None:
    """Set an attribute on the current span (e.g. the id of the job just created)."""
    if _tracer is not None:
        trace.get_current_span().set_attribute(key, value)


def record_span(
    name: str,
    *,
    parent: Any,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A span for something already over, from its Unix start and end times (seconds): the
    job's time in the queue, known only once a worker claims it."""
    if _tracer is None:
        return
    started = _tracer.start_span(
        name, context=parent, attributes=dict(attributes or {}), start_time=int(start_s * 1e9)
    )
    started.end(end_time=int(max(end_s, start_s) * 1e9))


def current_traceparent() -> str:
    """The current span as a W3C ``traceparent`` value, "" when there is none."""
    if _tracer is None:
        return ""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get(TRACEPARENT, "")


def context_from_traceparent(traceparent: str) -> Any:
    """The context to start a child span of ``traceparent`` in (None: a new trace)."""
    if _tracer is None or not traceparent:
        return None
    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})


def current_trace_id() -> str:
    """The current trace id in hex (for logs), "" when no span is recording."""
    if not AVAILABLE:
        return ""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""
