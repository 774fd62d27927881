"""Domain errors of the service and their one mapping to gRPC status codes.

Every layer (validation, store, serving, worker) raises these exceptions; only
``ErrorMappingInterceptor`` turns them into gRPC statuses, so the mapping lives in one place.
Redis connection failures become UNAVAILABLE and anything unexpected becomes INTERNAL with a
generic message (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import redis.exceptions
from google.protobuf.message import DecodeError

from ssdrbm_server.handlers import SERVICE_PREFIX, WrappedHandlers, iterate_responses, wrap_handler

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """Base of every domain error; ``message`` is shown to the client, so it says what to fix."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(ServiceError):
    """A request field is malformed or out of range; the message starts with the field name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFoundError(ServiceError):
    """The job, dataset or checkpoint does not exist (or belongs to another tenant)."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(ServiceError):
    """The request is valid but the system is not in a state to answer it yet."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(ServiceError):
    """A configured limit (size, elements, jobs, streams) would be exceeded."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(ServiceError):
    """The work stopped unfinished because the client's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(ServiceError):
    """A dependency (Redis) cannot be reached right now; retrying later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(ServiceError):
    """No credentials or unknown credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ServiceError):
    """The caller is known but not allowed to do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExistsError(ServiceError):
    """The resource to create exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS


INTERNAL_MESSAGE = "internal error; the server log has the details"
REDIS_UNAVAILABLE_MESSAGE = "the job store (Redis) is unreachable; retry shortly"
REDIS_FULL_MESSAGE = (
    "the job store is full (Redis reached its maxmemory); delete finished jobs you no longer "
    "need (DeleteJob) or ask the operator to raise Redis's maxmemory"
)

# redis-py raises these when the server is down, restarting or too slow to answer.
_REDIS_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and client-facing message for an exception raised by a handler."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, _REDIS_UNAVAILABLE):
        return grpc.StatusCode.UNAVAILABLE, REDIS_UNAVAILABLE_MESSAGE
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, REDIS_FULL_MESSAGE
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("unhandled error in %s", method, exc_info=exc)
    elif code is grpc.StatusCode.UNAVAILABLE:
        logger.warning("%s: %s (%s)", method, message, exc)
    else:
        logger.debug("%s: %s %s", method, code.name, message)
    await context.abort(code, message)


class _Undecodable:
    """Stands in for a request whose bytes do not parse as its message type, so that the
    handler wrapper can answer INVALID_ARGUMENT instead of gRPC's generic UNKNOWN."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError(
            "request",
            f"the bytes received are not a valid {self.type_name} message; send it serialized "
            "by a protobuf library from protos/ssdrbm/v1",
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    message_type = getattr(deserializer, "__self__", None)
    type_name = getattr(getattr(message_type, "DESCRIPTOR", None), "full_name", "request")

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return _Undecodable(type_name)

    return deserialize


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.error()
        yield request


def _checked(request_or_iterator: Any) -> Any:
    """The request, or its stream wrapped, refusing parts that did not parse."""
    if isinstance(request_or_iterator, _Undecodable):
        raise request_or_iterator.error()
    if hasattr(request_or_iterator, "__aiter__"):
        return _checked_stream(request_or_iterator)
    return request_or_iterator


def _is_passthrough(exc: BaseException) -> bool:
    # An explicit context.abort() already carries its status; cancellation must propagate.
    return isinstance(exc, grpc.aio.AbortError)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain and Redis errors raised by any handler to their gRPC status (the one place)."""

    def __init__(self) -> None:
        self._handlers = WrappedHandlers(_mapped)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if not method.startswith(SERVICE_PREFIX):
            return handler  # health and reflection raise nothing of ours
        return self._handlers.wrapped(method, handler)


def _mapped(method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` with its errors mapped to statuses and undecodable requests refused."""

    def wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def mapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(_checked(request_or_iterator), context)
            except Exception as exc:
                if _is_passthrough(exc):
                    raise
                await _abort_for(exc, context, method)

        return mapped

    def wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def mapped(
            request_or_iterator: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                request = _checked(request_or_iterator)
                async for response in iterate_responses(behavior, request, context):
                    yield response
            except Exception as exc:
                if _is_passthrough(exc):
                    raise
                await _abort_for(exc, context, method)

        return mapped

    if handler is None:
        return None
    return wrap_handler(handler, wrap_unary, wrap_stream, _tolerant(handler.request_deserializer))
