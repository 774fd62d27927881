"""Rich error details (google.rpc.Status in ``grpc-status-details-bin``) on every refusal.

Against the real service (grpc.aio server on port 0, real Redis): a bad field carries a
BadRequest naming its path, a limit a QuotaFailure naming who hit it, a transient refusal a
RetryInfo, on unary and streaming calls; a plain grpc client decodes them with
``grpc_status.rpc_status.from_call``, the SDK (blocking and asyncio) exposes them as attributes
of its typed errors and its retries wait as long as the RetryInfo says; the Open Inference
Protocol service, behind the same interceptor, refuses with details too. The message text is the
one the service sent before details existed. A table checks that every error class of
``ssdrbm_server.errors`` maps to its details.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable

import grpc
import pytest
import redis.exceptions
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from ssdrbm import Client
from ssdrbm.aio import AsyncClient
from ssdrbm.errors import (
    FieldViolation,
    InvalidArgument,
    NotFound,
    QuotaViolation,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from ssdrbm.reconnect import Reconnect
from ssdrbm.retry import NO_RETRY, RetryPolicy, call_with_retry
from ssdrbm.v1 import rbm_pb2
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ssdrbm_server import errors
from tests.fixtures.jobs import float_tensor, rpc_error, tiny_request
from tests.fixtures.service import RunningService

UPPER_SNAKE = re.compile(r"[A-Z][A-Z0-9_]*[A-Z0-9]")
TOKENS = "token-a=team-a,token-b=team-b"


def details_of(status: status_pb2.Status) -> dict[type[Message], Message]:
    """The status's details by type (each type occurs once in this service's statuses)."""
    found: dict[type[Message], Message] = {}
    for packed in status.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.QuotaFailure,
            error_details_pb2.RetryInfo,
            error_details_pb2.PreconditionFailure,
            error_details_pb2.ResourceInfo,
        ):
            if packed.Is(kind.DESCRIPTOR):
                detail = kind()
                packed.Unpack(detail)
                assert kind not in found, f"{kind.__name__} twice"
                found[kind] = detail
    assert len(found) == len(status.details), "a detail of an unexpected type"
    return found


def decoded(error: grpc.RpcError) -> dict[type[Message], Message]:
    """Details decoded the way any grpc client can, checked against the call's code and text."""
    status = rpc_status.from_call(error)  # raises when code or message disagree with the call
    assert status is not None, f"no details on {error.code()}: {error.details()}"
    details = details_of(status)
    info = details[error_details_pb2.ErrorInfo]
    assert info.domain == "ssdrbm" and UPPER_SNAKE.fullmatch(info.reason), info
    return details


# --- every error class maps to details (no server needed for the mapping itself) -------------

TABLE: dict[str, tuple[BaseException, set[type[Message]], str]] = {
    # name: (raised, detail types besides ErrorInfo, reason)
    "invalid": (
        errors.InvalidArgumentError("optimizer.lr", "must be > 0, got -1"),
        {error_details_pb2.BadRequest},
        "INVALID_FIELD",
    ),
    "not_found": (
        errors.NotFoundError("job 'x' not found", resource_type="job", resource_name="x"),
        {error_details_pb2.ResourceInfo},
        "JOB_NOT_FOUND",
    ),
    "not_found_untyped": (errors.NotFoundError("gone"), set(), "NOT_FOUND"),
    "precondition": (
        errors.FailedPreconditionError("no checkpoint", precondition="NO_CHECKPOINT"),
        {error_details_pb2.PreconditionFailure},
        "NO_CHECKPOINT",
    ),
    "exhausted": (
        errors.ResourceExhaustedError("too many", limit="max_streams", retry_after_s=1.0),
        {error_details_pb2.QuotaFailure, error_details_pb2.RetryInfo},
        "MAX_STREAMS_EXCEEDED",
    ),
    "deadline": (errors.DeadlineExceededError("stopped"), set(), "DEADLINE_EXCEEDED"),
    "unavailable": (
        errors.UnavailableError("try later"),
        {error_details_pb2.RetryInfo},
        "UNAVAILABLE",
    ),
    "unauthenticated": (errors.UnauthenticatedError("no token"), set(), "UNAUTHENTICATED"),
    "denied": (errors.PermissionDeniedError("not yours"), set(), "PERMISSION_DENIED"),
    "exists": (errors.AlreadyExistsError("there"), set(), "ALREADY_EXISTS"),
    "service": (errors.ServiceError("base"), set(), "INTERNAL"),
    "redis_down": (
        redis.exceptions.ConnectionError("Error 111"),
        {error_details_pb2.RetryInfo},
        "JOB_STORE_UNAVAILABLE",
    ),
    "redis_full": (
        redis.exceptions.OutOfMemoryError("OOM command not allowed"),
        {error_details_pb2.QuotaFailure, error_details_pb2.RetryInfo},
        "RESOURCE_EXHAUSTED",
    ),
    "bug": (KeyError("secret"), set(), "INTERNAL"),
}


def test_the_table_covers_every_error_class() -> None:
    classes = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.ServiceError) and cls.__module__ == errors.__name__
    }
    covered = {type(raised) for raised, _, _ in TABLE.values()}
    assert classes <= covered, f"add to TABLE: {sorted(c.__name__ for c in classes - covered)}"


@pytest.mark.parametrize("name", sorted(TABLE))
def test_every_error_maps_to_its_details(name: str) -> None:
    raised, expected, reason = TABLE[name]
    status = errors.rich_status(raised)
    code, message = errors.status_for(raised)
    assert (status.code, status.message) == (code.value[0], message)  # the text as without
    details = details_of(status)
    assert set(details) == {error_details_pb2.ErrorInfo, *expected}
    info = details[error_details_pb2.ErrorInfo]
    assert (info.reason, info.domain) == (reason, "ssdrbm")
    assert "secret" not in str(status)  # an unexpected error's text stays in the log
    if error_details_pb2.BadRequest in details:
        (violation,) = details[error_details_pb2.BadRequest].field_violations
        assert (violation.field, violation.description) == ("optimizer.lr", "must be > 0, got -1")
    if error_details_pb2.RetryInfo in details:
        assert details[error_details_pb2.RetryInfo].retry_delay.ToNanoseconds() > 0


def test_long_messages_keep_the_trailers_under_the_metadata_limit() -> None:
    # Descriptions repeat the message: past the budget they go, the structure stays ...
    long = errors.ResourceExhaustedError("x" * 1500, limit="max_streams", subject="tenant:t")
    status = errors.rich_status(long)
    assert status.message == long.message and status.ByteSize() <= errors.MAX_STATUS_BYTES
    (violation,) = details_of(status)[error_details_pb2.QuotaFailure].violations
    assert (violation.subject, violation.description) == ("tenant:t", "")
    assert errors.details_trailer(long)
    # ... and a message too long to repeat goes out alone, as it did before details existed.
    assert errors.details_trailer(errors.NotFoundError("x" * 3000)) == ()


# --- against the real service ----------------------------------------------------------------


def test_bad_fields_are_bad_requests_naming_the_field(service: RunningService) -> None:
    stub = service.stub()
    bad_lr = tiny_request(optimizer=rbm_pb2.OptimizerSpec(kind=rbm_pb2.OPTIMIZER_KIND_SSD, lr=-0.5))
    error = rpc_error(lambda: stub.StartTraining(bad_lr, timeout=30))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "optimizer.lr: must be > 0, got -0.5"  # as before the details
    (violation,) = decoded(error)[error_details_pb2.BadRequest].field_violations
    assert (violation.field, violation.description) == ("optimizer.lr", "must be > 0, got -0.5")

    unknown = tiny_request(dataset=rbm_pb2.DatasetRef(builtin=rbm_pb2.BuiltinDataset(name="nope")))
    error = rpc_error(lambda: stub.StartTraining(unknown, timeout=30))
    details = decoded(error)
    (violation,) = details[error_details_pb2.BadRequest].field_violations
    assert violation.field == "dataset.builtin.name" and "unknown dataset 'nope'" in (
        violation.description
    )
    assert error.details() == f"dataset.builtin.name: {violation.description}"
    assert details[error_details_pb2.ErrorInfo].metadata["field"] == "dataset.builtin.name"

    # The SDK: the same text, the field as an attribute.
    with Client(service.target, retry=NO_RETRY) as client, pytest.raises(InvalidArgument) as caught:
        client.start_training(n_hidden=4, lr=-1.0)
    assert str(caught.value) == "optimizer.lr: must be > 0, got -1.0"
    assert caught.value.field_violations == [
        FieldViolation("optimizer.lr", "must be > 0, got -1.0")
    ]
    assert caught.value.reason == "INVALID_FIELD" and caught.value.retry_delay is None


def test_limits_are_quota_failures_naming_who_hit_them(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens=TOKENS,
        max_jobs_per_tenant=1,
        max_tensor_elements=100,
    )
    stub = running.stub(token="token-a")
    job = stub.StartTraining(tiny_request(seed=1), timeout=30).job
    error = rpc_error(lambda: stub.StartTraining(tiny_request(seed=2), timeout=30))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == (
        "tenant already has 1 queued or running jobs; wait for one to finish or cancel one"
    )
    details = decoded(error)
    (violation,) = details[error_details_pb2.QuotaFailure].violations
    assert (violation.subject, violation.description) == ("tenant:team-a", error.details())
    info = details[error_details_pb2.ErrorInfo]
    assert info.reason == "MAX_JOBS_PER_TENANT_EXCEEDED"
    assert dict(info.metadata) == {
        "setting": "SSDRBM_MAX_JOBS_PER_TENANT",
        "subject": "tenant:team-a",
    }
    assert error_details_pb2.RetryInfo not in details  # a job ending is no matter of seconds

    # A request over a limit of the server: its subject is the server.
    big = rbm_pb2.ReconstructRequest(job_id=job.id, input=float_tensor(7, 16))  # 112 elements
    error = rpc_error(lambda: stub.Reconstruct(big, timeout=30))
    assert "112 elements, more than this server's limit of 100" in error.details()
    details = decoded(error)
    (violation,) = details[error_details_pb2.QuotaFailure].violations
    assert violation.subject == "server"
    assert details[error_details_pb2.ErrorInfo].reason == "MAX_TENSOR_ELEMENTS_EXCEEDED"

    # Under the limit, the job's state is what stops it: a precondition naming the job.
    small = rbm_pb2.ReconstructRequest(job_id=job.id, input=float_tensor(2, 16))
    error = rpc_error(lambda: stub.Reconstruct(small, timeout=30))
    (failure,) = decoded(error)[error_details_pb2.PreconditionFailure].violations
    assert (failure.type, failure.subject) == ("NO_CHECKPOINT", f"job:{job.id}")
    assert failure.description == error.details()

    # Authentication refusals carry their reason too (raised by the auth interceptor).
    error = rpc_error(lambda: running.stub().GetJob(rbm_pb2.GetJobRequest(job_id=job.id)))
    assert error.code() is grpc.StatusCode.UNAUTHENTICATED
    assert decoded(error)[error_details_pb2.ErrorInfo].reason == "MISSING_CREDENTIALS"

    client = Client(running.target, token="token-a", retry=NO_RETRY)
    with client, pytest.raises(ResourceExhausted) as caught:
        client.start_training(n_hidden=4, steps=10, seed=5)
    assert caught.value.quota_violations == [QuotaViolation("tenant:team-a", str(caught.value))]
    assert caught.value.error_info == {
        "setting": "SSDRBM_MAX_JOBS_PER_TENANT",
        "subject": "tenant:team-a",
    }


def test_a_busy_stream_cap_asks_to_retry_later(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False, max_streams=1)
    stub = running.stub()
    job = stub.StartTraining(tiny_request(), timeout=30).job
    open_stream = stub.StreamMetrics(rbm_pb2.StreamMetricsRequest(job_id=job.id), timeout=30)
    try:
        next(open_stream)  # the first stream is served and follows live
        error = rpc_error(
            lambda: stub.StreamMetrics(rbm_pb2.StreamMetricsRequest(job_id=job.id), timeout=10)
        )
    finally:
        open_stream.cancel()
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == (
        "this server already serves 1 metric streams (limit 1); retry later or poll GetJob"
    )
    details = decoded(error)  # a server-streaming call carries them as a unary one does
    assert details[error_details_pb2.RetryInfo].retry_delay.ToNanoseconds() == int(
        errors.RETRY_SHORTLY_S * 1e9
    )
    assert details[error_details_pb2.QuotaFailure].violations[0].subject == "server"
    converted = from_rpc_error(error)
    assert converted.retry_delay == errors.RETRY_SHORTLY_S
    assert converted.reason == "MAX_STREAMS_EXCEEDED"


def test_an_unreachable_store_asks_to_retry_and_the_sdk_waits_that_long(
    redis_factory, service_factory: Callable[..., RunningService]
) -> None:
    store = redis_factory(appendonly=False)
    running = service_factory(store.url, run_worker=False)
    stub = running.stub()
    job = stub.StartTraining(tiny_request(), timeout=30).job
    store.stop()
    get = lambda: stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id), timeout=30)  # noqa: E731
    error = rpc_error(get)
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert error.details() == errors.REDIS_UNAVAILABLE_MESSAGE
    details = decoded(error)
    assert details[error_details_pb2.ErrorInfo].reason == "JOB_STORE_UNAVAILABLE"
    delay = details[error_details_pb2.RetryInfo].retry_delay.ToNanoseconds() / 1e9
    assert delay == errors.RETRY_SHORTLY_S

    # The SDK's retries sleep what the service asked, not their own 0.01 s, within the window.
    sleeps: list[float] = []
    policy = RetryPolicy(initial_backoff_s=0.01, jitter=0.0, max_wait_s=2.5 * delay)
    with pytest.raises(grpc.RpcError):
        call_with_retry(get, policy, sleep=sleeps.append)
    assert sleeps == pytest.approx([delay, delay, 0.5 * delay])

    with Client(running.target, retry=NO_RETRY) as client, pytest.raises(Unavailable) as caught:
        client.get_job(job.id)
    assert caught.value.retry_delay == delay
    assert caught.value.reason == "JOB_STORE_UNAVAILABLE"


def test_the_async_client_exposes_the_details_too(service: RunningService) -> None:
    async def check() -> None:
        async with AsyncClient(service.target, retry=NO_RETRY) as client:
            with pytest.raises(NotFound) as missing:
                await client.get_job("no-such-job")
            with pytest.raises(InvalidArgument) as invalid:
                await client.start_training(n_hidden=0)
        assert missing.value.reason == "JOB_NOT_FOUND"
        assert missing.value.resource is not None
        assert missing.value.resource[:2] == ("job", "no-such-job")
        assert str(missing.value) == missing.value.resource.description
        (violation,) = invalid.value.field_violations
        assert violation.field == "model.n_hidden"
        assert str(invalid.value) == f"model.n_hidden: {violation.description}"

    asyncio.run(check())


def test_the_inference_service_refuses_with_details_too(service: RunningService) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(service.channel())
    request = service_pb2.ModelInferRequest(model_name="0" * 32)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(float_tensor(1, 16).data)
    error = rpc_error(lambda: stub.ModelInfer(request, timeout=30))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    details = decoded(error)
    assert details[error_details_pb2.ErrorInfo].reason == "MODEL_NOT_FOUND"
    resource = details[error_details_pb2.ResourceInfo]
    assert (resource.resource_type, resource.resource_name) == ("model", "0" * 32)
    assert from_rpc_error(error).resource == ("model", "0" * 32, error.details())


def test_stream_reconnection_waits_the_requested_delay_within_its_budget() -> None:
    backoff = Reconnect(RetryPolicy(initial_backoff_s=0.01), budget_s=60.0)
    assert backoff.next_delay() == pytest.approx(0.01)  # its own backoff without a RetryInfo
    assert backoff.next_delay(2.5) == 2.5  # the service's delay replaces it
    assert 0 < Reconnect(RetryPolicy(), budget_s=0.5).next_delay(2.5) <= 0.5  # within the budget
