"""Helpers for server interceptors that wrap an RPC handler's behaviour (error mapping,
authentication, latency metrics). Unary-response behaviours are coroutines; streaming-response
ones are async generators or coroutines that call ``context.write`` (as health's Watch does).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]
Wrapper = Callable[[Behavior], Behavior]

INFERENCE_SERVICE_NAME = "inference.GRPCInferenceService"  # Open Inference Protocol (inference/)
# The services the interceptors (latency, error mapping, authentication) apply to; health and
# reflection stay open. A tuple, as ``str.startswith`` takes it.
SERVICE_PREFIX = ("/ssdrbm.v1.RBMService/", f"/{INFERENCE_SERVICE_NAME}/")


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Wrapper,
    wrap_stream: Wrapper,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` whose behaviour is wrapped: ``wrap_unary`` for unary responses,
    ``wrap_stream`` (which must return an async generator function) for streaming ones;
    ``request_deserializer``, when given, replaces the handler's."""
    serializers = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **serializers)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **serializers)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream), **serializers
        )
    return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **serializers)


async def iterate_responses(
    behavior: Behavior, request: Any, context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    """Yield what a streaming behaviour produces, whether it is an async generator or a
    coroutine that writes with ``context.write`` (then nothing is yielded here)."""
    result = behavior(request, context)
    if inspect.isawaitable(result):
        await result
        return
    async for response in result:
        yield response


def run_first(
    handler: grpc.RpcMethodHandler, first: Callable[[grpc.aio.ServicerContext], None]
) -> grpc.RpcMethodHandler:
    """A copy of ``handler`` that calls ``first(context)`` at the start of every call, before
    the behaviour runs; ``first`` may raise to refuse the call."""

    def wrap_unary(behavior: Behavior) -> Behavior:
        async def after_first(request: Any, context: grpc.aio.ServicerContext) -> Any:
            first(context)
            return await behavior(request, context)

        return after_first

    def wrap_stream(behavior: Behavior) -> Behavior:
        async def after_first(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            first(context)
            async for response in iterate_responses(behavior, request, context):
                yield response

        return after_first

    return wrap_handler(handler, wrap_unary, wrap_stream)


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that wraps the handlers of the service's own methods (`SERVICE_PREFIX`)
    with ``build``; health and reflection pass as they are. Error mapping, authentication and
    latency metrics are its kinds.

    Each method's wrapped handler is built once and reused for every later call: the wrapping
    depends only on the method and the handler it wraps, never on the call (per-call data comes
    from the context), so building closures and a new handler for every call was pure per-request
    overhead. A handler that differs from the one cached (a server rebuilt in tests) is wrapped
    afresh.
    """

    def __init__(
        self, build: Callable[[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]
    ) -> None:
        self._build = build
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler  # an unknown method is answered UNIMPLEMENTED as it is
        entry = self._wrapped.get(method)
        if entry is None or entry[0] is not handler:
            entry = self._wrapped[method] = (handler, self._build(method, handler))
        return entry[1]
