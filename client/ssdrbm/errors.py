"""Typed SDK exceptions, mapped from gRPC status codes in one place.

Every failure the SDK raises is an :class:`SSDRBMError`; catch the subclass for the case you can
handle (``NotFound`` for an unknown job, ``Unavailable`` for an unreachable service, ...).
"""

from __future__ import annotations

import grpc


class SSDRBMError(Exception):
    """Base class of every error the SDK raises.

    ``code`` is the gRPC status code (``None`` for errors detected on the client), ``details`` the
    server's message and ``target`` the address the client talked to.
    """

    code: grpc.StatusCode | None = None

    def __init__(self, details: str, *, target: str | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.target = target


class Unavailable(SSDRBMError):
    """The service could not be reached (or is shutting down); retried calls gave up."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(SSDRBMError):
    """The service did not answer within the call's deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(SSDRBMError):
    """The job, dataset or checkpoint does not exist (or belongs to another tenant)."""

    code = grpc.StatusCode.NOT_FOUND


class InvalidArgument(SSDRBMError, ValueError):
    """A request field is invalid; the message names the field and what to change."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(SSDRBMError):
    """The request is valid but the job is not in a state to answer it (e.g. no checkpoint yet)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(SSDRBMError):
    """A limit was hit: message size, tensor elements, dataset size, concurrent jobs or streams."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(SSDRBMError):
    """No bearer token was sent, or the service did not accept it."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SSDRBMError):
    """The token is valid but not allowed to do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(SSDRBMError):
    """The thing to create exists already, e.g. a request_id reused with a different spec."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Cancelled(SSDRBMError):
    """The call was cancelled before it completed."""

    code = grpc.StatusCode.CANCELLED


class ServerError(SSDRBMError):
    """The service failed in a way the caller cannot fix (INTERNAL, UNKNOWN, ...)."""


class IntegrityError(SSDRBMError):
    """Bytes received from the service do not match their announced size or sha256."""


_BY_CODE: dict[grpc.StatusCode, type[SSDRBMError]] = {
    cls.code: cls
    for cls in (
        Unavailable,
        DeadlineExceeded,
        NotFound,
        InvalidArgument,
        FailedPrecondition,
        ResourceExhausted,
        Unauthenticated,
        PermissionDenied,
        AlreadyExists,
        Cancelled,
    )
    if cls.code is not None
}
# OUT_OF_RANGE is an invalid argument by another name for this service's callers.
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgument


def from_rpc_error(error: grpc.RpcError, target: str | None = None) -> SSDRBMError:
    """Convert a ``grpc.RpcError`` (sync or aio) into the matching :class:`SSDRBMError`."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    cls = _BY_CODE.get(code, ServerError)
    converted = cls(details, target=target)
    if cls is ServerError:
        converted.code = code
    return converted
