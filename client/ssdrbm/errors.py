"""Typed SDK exceptions, mapped from gRPC status codes in one place.

Every failure the SDK raises is an :class:`SSDRBMError`; catch the subclass for the case you can
handle (``NotFound`` for an unknown job, ``Unavailable`` for an unreachable service, ...).

The service attaches a ``google.rpc.Status`` to each refusal (trailing metadata
``grpc-status-details-bin``); its details are the error's attributes (see :class:`SSDRBMError`),
empty (or None) when the status carried none, e.g. for a refusal by the gRPC transport itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2 as details_pb
from google.rpc import status_pb2

DETAILS_METADATA_KEY = "grpc-status-details-bin"


class FieldViolation(NamedTuple):
    """A request field that was refused: its dotted path (``optimizer.lr``) and what is wrong."""

    field: str
    description: str


class QuotaViolation(NamedTuple):
    """A limit that was hit: who hit it (``tenant:<name>`` or ``server``) and the limit."""

    subject: str
    description: str


class PreconditionViolation(NamedTuple):
    """A state that must change first: its kind (``NO_CHECKPOINT``), its subject, the fix."""

    type: str
    subject: str
    description: str


class ResourceInfo(NamedTuple):
    """What was not found: ``resource_type`` (``job``, ``dataset``, ``checkpoint``) and name."""

    resource_type: str
    resource_name: str
    description: str


class SSDRBMError(Exception):
    """Base class of every error the SDK raises.

    ``code`` is the gRPC status code (``None`` for errors detected on the client), ``details`` the
    server's message and ``target`` the address the client talked to. The service's structured
    details: ``reason`` (ErrorInfo's stable UPPER_SNAKE code such as ``INVALID_FIELD`` or
    ``MAX_JOBS_PER_TENANT_EXCEEDED``) and ``error_info`` (its metadata), ``field_violations``,
    ``quota_violations``, ``precondition_violations``, ``resource`` (ResourceInfo or None) and
    ``retry_delay`` (seconds the service asks to wait before retrying, or None).
    """

    code: grpc.StatusCode | None = None

    def __init__(self, details: str, *, target: str | None = None) -> None:
        super().__init__(details)
        self.details = details
        self.target = target
        self.reason: str | None = None
        self.error_info: dict[str, str] = {}
        self.field_violations: list[FieldViolation] = []
        self.quota_violations: list[QuotaViolation] = []
        self.precondition_violations: list[PreconditionViolation] = []
        self.resource: ResourceInfo | None = None
        self.retry_delay: float | None = None


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


# Each error class above that stands for one status code.
_BY_CODE: dict[grpc.StatusCode, type[SSDRBMError]] = {
    cls.code: cls for cls in SSDRBMError.__subclasses__() if cls.code is not None
}
# OUT_OF_RANGE is an invalid argument by another name for this service's callers.
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgument


def rich_status(error: grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` the service attached to ``error`` (sync or aio), or None when
    there is none or it does not agree with the call's own code."""
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key != DETAILS_METADATA_KEY:
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return None
        code = error.code() if hasattr(error, "code") else None
        return status if code is not None and status.code == code.value[0] else None
    return None


def retry_delay(error: grpc.RpcError) -> float | None:
    """Seconds the service asked to wait before retrying (its RetryInfo), or None."""
    return from_rpc_error(error).retry_delay


_DETAIL_TYPES = (
    details_pb.ErrorInfo,
    details_pb.BadRequest,
    details_pb.QuotaFailure,
    details_pb.PreconditionFailure,
    details_pb.ResourceInfo,
    details_pb.RetryInfo,
)


def _tuples(cls: Any, messages: Iterable[Any]) -> list[Any]:
    """Each message as the NamedTuple ``cls`` of its same-named fields."""
    return [cls(*(getattr(message, name) for name in cls._fields)) for message in messages]


def _attach_details(converted: SSDRBMError, details: Iterable[Any]) -> None:
    """Set ``converted``'s attributes from the Status details it came with."""
    for detail in details:
        kind = next((kind for kind in _DETAIL_TYPES if detail.Is(kind.DESCRIPTOR)), None)
        if kind is None:
            continue
        message = kind()
        detail.Unpack(message)
        if kind is details_pb.ErrorInfo:
            converted.reason, converted.error_info = message.reason, dict(message.metadata)
        elif kind is details_pb.BadRequest:
            converted.field_violations += _tuples(FieldViolation, message.field_violations)
        elif kind is details_pb.QuotaFailure:
            converted.quota_violations += _tuples(QuotaViolation, message.violations)
        elif kind is details_pb.PreconditionFailure:
            converted.precondition_violations += _tuples(PreconditionViolation, message.violations)
        elif kind is details_pb.ResourceInfo:
            converted.resource = _tuples(ResourceInfo, [message])[0]
        else:
            converted.retry_delay = message.retry_delay.ToNanoseconds() / 1e9


def from_rpc_error(error: grpc.RpcError, target: str | None = None) -> SSDRBMError:
    """Convert a ``grpc.RpcError`` (sync or aio) into the matching :class:`SSDRBMError`, with
    the service's status details as its attributes."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else None) or str(code)
    cls = _BY_CODE.get(code, ServerError)
    converted = cls(details, target=target)
    if cls is ServerError:
        converted.code = code
    status = rich_status(error)
    if status is not None:
        _attach_details(converted, status.details)
    return converted
