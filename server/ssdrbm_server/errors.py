"""Domain errors of the service and their one mapping to gRPC statuses.

Every layer raises these; only ``ErrorMappingInterceptor`` turns them into statuses: Redis
connection failures become UNAVAILABLE, anything unexpected INTERNAL with a generic message (the
traceback goes to the log, never to the client). Each refusal also carries a ``google.rpc.Status``
(``grpc-status-details-bin``, the gRPC rich error model) built by :func:`rich_status` from what
the error knew where it was raised: an ``ErrorInfo`` (a stable UPPER_SNAKE ``reason``, domain
``ssdrbm``) and, by kind, a BadRequest, QuotaFailure, RetryInfo, PreconditionFailure or
ResourceInfo. The status code and message are the same as without the details.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
import redis.exceptions
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError, Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ssdrbm_server.handlers import ServiceInterceptor, iterate_responses, wrap_handler
from ssdrbm_server.outage import REDIS_OUTAGE

logger = logging.getLogger(__name__)

ERROR_DOMAIN = "ssdrbm"  # ErrorInfo.domain of every refusal
RETRY_SHORTLY_S = 1.0  # RetryInfo of a transient refusal: a race, an outage, a busy cap
RETRY_STORE_FULL_S = 10.0  # a full store frees room as finished jobs are deleted or expire
SERVER_SUBJECT = "server"  # QuotaFailure subject of a limit of the whole server or one request
SHOWN_ID_CHARS = 64  # the longest well-formed id (job, sweep, dataset): more is not an id
# The serialized Status goes out base64-encoded beside grpc-message, which holds the message too;
# gRPC clients refuse trailers over 8 KiB by default (some already past a soft limit there), so
# the details stay well under it.
MAX_STATUS_BYTES = 2048


def tenant_subject(tenant: str) -> str:
    """The QuotaFailure subject of a limit that each tenant has for itself."""
    return f"tenant:{tenant}"


class ServiceError(Exception):
    """Base of every domain error; ``message`` is shown to the client, so it says what to fix.

    ``reason`` (a stable UPPER_SNAKE code, the class's own unless given) and ``metadata`` go into
    the status's ErrorInfo; ``retry_after_s`` (None: retrying the same call will not help) into
    its RetryInfo.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"
    retry_after_s: float | None = None

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.metadata = dict(metadata or {})
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class InvalidArgumentError(ServiceError):
    """A request field is malformed or out of range; the message starts with the field name.

    Its status carries a BadRequest naming ``field`` (a dotted path such as ``optimizer.lr``)
    with the rest of the message as the description."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_FIELD"

    def __init__(self, field: str, message: str, *, reason: str | None = None) -> None:
        super().__init__(f"{field}: {message}", reason=reason, metadata={"field": field})
        self.field = field
        self.description = message


class NotFoundError(ServiceError):
    """The job, dataset or checkpoint does not exist (or belongs to another tenant).

    ``resource_type`` (``job``, ``dataset``, ``checkpoint``) and ``resource_name`` go into a
    ResourceInfo and make the reason, e.g. ``JOB_NOT_FOUND``."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "NOT_FOUND"

    def __init__(self, message: str, *, resource_type: str = "", resource_name: str = "") -> None:
        reason = f"{resource_type.upper()}_NOT_FOUND" if resource_type else None
        super().__init__(message, reason=reason)
        self.resource_type = resource_type
        self.resource_name = resource_name

    @classmethod
    def for_id(cls, resource_type: str, resource_id: str, hint: str) -> NotFoundError:
        """``<type> '<id>' not found; <hint>`` for an id a client sent, shown (and named in the
        ResourceInfo) up to `SHOWN_ID_CHARS`: it may be any text, not only a well-formed id."""
        shown = resource_id[:SHOWN_ID_CHARS]
        return cls(
            f"{resource_type} {shown!r} not found; {hint}",
            resource_type=resource_type,
            resource_name=shown,
        )


class FailedPreconditionError(ServiceError):
    """The request is valid but the system is not in a state to answer it yet.

    ``precondition`` (an UPPER_SNAKE kind such as ``NO_CHECKPOINT``, also the reason) and
    ``subject`` (what must change, e.g. ``job:<id>``) go into a PreconditionFailure."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FAILED_PRECONDITION"

    def __init__(self, message: str, *, precondition: str | None = None, subject: str = "") -> None:
        super().__init__(message, reason=precondition)
        self.subject = subject


class ResourceExhaustedError(ServiceError):
    """A configured limit (size, elements, jobs, streams) would be exceeded.

    ``limit`` names the ``Settings`` field of the limit (its ``SSDRBM_*`` variable goes into the
    ErrorInfo and its name makes the reason, e.g. ``MAX_STREAMS_PER_TENANT_EXCEEDED``);
    ``subject`` is who hit it (``tenant:<t>`` or ``server``), for the QuotaFailure;
    ``retry_after_s`` is set where the limit is on concurrent work, which frees up by itself."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "RESOURCE_EXHAUSTED"

    def __init__(
        self,
        message: str,
        *,
        limit: str | None = None,
        subject: str = SERVER_SUBJECT,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(
            message,
            reason=f"{limit.upper()}_EXCEEDED" if limit else None,
            metadata={"setting": f"SSDRBM_{limit.upper()}"} if limit else None,
            retry_after_s=retry_after_s,
        )
        self.limit = limit
        self.subject = subject


class DeadlineExceededError(ServiceError):
    """The work stopped unfinished because the client's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_EXCEEDED"


class UnavailableError(ServiceError):
    """A dependency (Redis) cannot be reached right now; retrying later may succeed."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "UNAVAILABLE"
    retry_after_s = RETRY_SHORTLY_S


class UnauthenticatedError(ServiceError):
    """No credentials or unknown credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class PermissionDeniedError(ServiceError):
    """The caller is known but not allowed to do this."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "PERMISSION_DENIED"


class AlreadyExistsError(ServiceError):
    """The resource to create exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "ALREADY_EXISTS"


INTERNAL_MESSAGE = "internal error; the server log has the details"
REDIS_UNAVAILABLE_MESSAGE = "the job store (Redis) is unreachable; retry shortly"
REDIS_FULL_MESSAGE = (
    "the job store is full (Redis reached its maxmemory); delete finished jobs you no longer "
    "need (DeleteJob) or ask the operator to raise Redis's maxmemory"
)

# redis-py raises these when the server is down, restarting or too slow to answer.
REDIS_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
)


def _as_service_error(exc: BaseException) -> ServiceError:
    """``exc`` itself, or the domain error that stands for it on the wire."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, REDIS_UNAVAILABLE):
        return UnavailableError(REDIS_UNAVAILABLE_MESSAGE, reason="JOB_STORE_UNAVAILABLE")
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return ResourceExhaustedError(REDIS_FULL_MESSAGE, retry_after_s=RETRY_STORE_FULL_S)
    return ServiceError(INTERNAL_MESSAGE)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and client-facing message for an exception raised by a handler."""
    error = _as_service_error(exc)
    return error.code, error.message


def _specific_details(error: ServiceError) -> list[Message]:
    """The detail that says more about this kind of refusal, beside ErrorInfo and RetryInfo."""
    if isinstance(error, InvalidArgumentError):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=error.description, reason=error.reason
        )
        return [error_details_pb2.BadRequest(field_violations=[violation])]
    if isinstance(error, ResourceExhaustedError):
        quota = error_details_pb2.QuotaFailure.Violation(
            subject=error.subject, description=error.message
        )
        return [error_details_pb2.QuotaFailure(violations=[quota])]
    if isinstance(error, FailedPreconditionError):
        precondition = error_details_pb2.PreconditionFailure.Violation(
            type=error.reason, subject=error.subject, description=error.message
        )
        return [error_details_pb2.PreconditionFailure(violations=[precondition])]
    if isinstance(error, NotFoundError) and error.resource_type:
        resource = error_details_pb2.ResourceInfo(
            resource_type=error.resource_type,
            resource_name=error.resource_name,
            description=error.message,
        )
        return [resource]
    return []


def _without_descriptions(details: list[Message]) -> None:
    """Empty the descriptions, which repeat the status message, to make room."""
    for detail in details:
        items = [*getattr(detail, "field_violations", ()), *getattr(detail, "violations", ())]
        for item in (detail, *items):
            if "description" in item.DESCRIPTOR.fields_by_name:
                item.description = ""


def _packed(code: grpc.StatusCode, message: str, details: list[Message]) -> status_pb2.Status:
    wrapped = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)
        wrapped.append(item)
    return status_pb2.Status(code=code.value[0], message=message, details=wrapped)


def rich_status(exc: BaseException) -> status_pb2.Status:
    """The ``google.rpc.Status`` (code, the same message, details) for a handler's exception;
    the one place where errors become status details. Over ``MAX_STATUS_BYTES`` the details
    lose their descriptions (the message says the same)."""
    error = _as_service_error(exc)
    code, message = error.code, error.message
    metadata = dict(error.metadata)
    if isinstance(error, ResourceExhaustedError | FailedPreconditionError) and error.subject:
        metadata.setdefault("subject", error.subject)
    details: list[Message] = [
        error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=metadata)
    ]
    details += _specific_details(error)
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(round(error.retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    status = _packed(code, message, details)
    if status.ByteSize() > MAX_STATUS_BYTES:
        _without_descriptions(details)
        status = _packed(code, message, details)
    return status


def details_trailer(exc: BaseException) -> tuple[tuple[str, bytes], ...]:
    """The ``grpc-status-details-bin`` trailing metadata for a handler's exception; none for a
    message too long to repeat within the client's metadata limit (it goes out as before)."""
    status = rich_status(exc)
    if status.ByteSize() > MAX_STATUS_BYTES:
        return ()
    return tuple(rpc_status.to_status(status).trailing_metadata)


def _answer_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """Set the call's status for ``exc``; the handler then returns and gRPC sends it."""
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("unhandled error in %s", method, exc_info=exc)
    elif isinstance(exc, REDIS_UNAVAILABLE):
        REDIS_OUTAGE.noticed(exc, by=method)  # logged once an outage, not once a request
    elif code is grpc.StatusCode.UNAVAILABLE:
        logger.warning("%s: %s (%s)", method, message, exc)
    else:
        logger.debug("%s: %s %s", method, code.name, message)
    # Not context.abort(): its AbortError sits in a reference cycle with gRPC's frames, which
    # hold the request, until Python's full collection runs, so every refused request's memory
    # (a whole message of huge lists) stayed that long. Keep the handler's trailing metadata
    # beside the details, as abort() did.
    trailing = (*tuple(context.trailing_metadata() or ()), *details_trailer(exc))
    context.set_code(code)
    context.set_details(message)
    context.set_trailing_metadata(trailing)


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
            reason="UNDECODABLE_REQUEST",
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


class ErrorMappingInterceptor(ServiceInterceptor):
    """Maps domain and Redis errors raised by any handler to their gRPC status (the one place)."""

    def __init__(self) -> None:
        super().__init__(_mapped)


def _mapped(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with its errors mapped to statuses and undecodable requests refused."""

    def wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def mapped(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behavior(_checked(request_or_iterator), context)
            except grpc.aio.AbortError:
                raise  # an explicit context.abort() already carries its status
            except Exception as exc:
                _answer_for(exc, context, method)

        return mapped

    def wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def mapped(
            request_or_iterator: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                request = _checked(request_or_iterator)
                async for response in iterate_responses(behavior, request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                _answer_for(exc, context, method)

        return mapped

    return wrap_handler(handler, wrap_unary, wrap_stream, _tolerant(handler.request_deserializer))
