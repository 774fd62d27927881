"""Authentication and tenancy over real gRPC: bearer tokens from a file or the environment,
UNAUTHENTICATED without a valid one, and another tenant's jobs, datasets and models NOT_FOUND on
every RPC, with the same message as an id that never existed (nothing leaks)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.auth import TokenTable, parse_inline_tokens, parse_token_file
from ssdrbm_server.config import ConfigError, Settings
from tests.fixtures.jobs import finish_with_checkpoint, float_tensor, rpc_error, tiny_request
from tests.fixtures.service import RunningService

ALPHA, BETA = "alpha-secret-1", "beta-secret-2"
UNKNOWN_JOB = "0" * 32


@pytest.fixture
def secured(service_factory: Callable[..., RunningService]) -> RunningService:
    """A token-authenticated service (no worker: jobs are finished by the test itself)."""
    return service_factory(
        run_worker=False, auth_mode="token", auth_tokens=f"{ALPHA}=alpha,{BETA}=beta"
    )


def upload(stub: rbm_pb2_grpc.RBMServiceStub, array: np.ndarray) -> str:
    parts = [
        rbm_pb2.UploadDatasetRequest(
            header=rbm_pb2.DatasetHeader(shape=list(array.shape), dtype=rbm_pb2.DTYPE_FLOAT32)
        ),
        rbm_pb2.UploadDatasetRequest(chunk=array.astype("<f4").tobytes()),
    ]
    return stub.UploadDataset(iter(parts)).dataset_id


def every_rpc(stub: rbm_pb2_grpc.RBMServiceStub, job_id: str) -> dict[str, Callable[[], object]]:
    """One call of each RPC that names ``job_id`` (streams are drained by rpc_error)."""
    return {
        "GetJob": lambda: stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id)),
        "CancelJob": lambda: stub.CancelJob(rbm_pb2.CancelJobRequest(job_id=job_id)),
        "StreamMetrics": lambda: stub.StreamMetrics(
            rbm_pb2.StreamMetricsRequest(job_id=job_id, history_only=True)
        ),
        "Reconstruct": lambda: stub.Reconstruct(
            rbm_pb2.ReconstructRequest(job_id=job_id, input=float_tensor(2, 16))
        ),
        "SampleHidden": lambda: stub.SampleHidden(
            rbm_pb2.SampleHiddenRequest(job_id=job_id, input=float_tensor(2, 16))
        ),
        "ExportModel": lambda: stub.ExportModel(rbm_pb2.ExportModelRequest(job_id=job_id)),
    }


def test_other_tenants_resources_are_not_found_on_every_rpc(
    secured: RunningService, redis_url: str
) -> None:
    alpha, beta = secured.stub(token=ALPHA), secured.stub(token=BETA)
    job = alpha.StartTraining(tiny_request(request_id="shared-id")).job
    finish_with_checkpoint(redis_url, job.id)
    dataset_id = upload(alpha, np.ones((50, 16)))

    # The owner reaches everything.
    assert alpha.GetJob(rbm_pb2.GetJobRequest(job_id=job.id)).state == rbm_pb2.JOB_STATE_SUCCEEDED
    for name, call in every_rpc(alpha, job.id).items():
        result = call()
        if name in ("StreamMetrics", "ExportModel"):
            assert list(result), name

    # The other tenant gets NOT_FOUND, worded exactly as for an id that never existed.
    for name, call in every_rpc(beta, job.id).items():
        error = rpc_error(call)
        assert error.code() is grpc.StatusCode.NOT_FOUND, (name, error.details())
        never = rpc_error(every_rpc(beta, UNKNOWN_JOB)[name])
        assert error.details() == never.details().replace(UNKNOWN_JOB, job.id), name

    assert list(beta.ListJobs(rbm_pb2.ListJobsRequest()).jobs) == []
    for state in (rbm_pb2.JOB_STATE_SUCCEEDED, rbm_pb2.JOB_STATE_QUEUED):
        assert list(beta.ListJobs(rbm_pb2.ListJobsRequest(state=state)).jobs) == []
    [listed] = alpha.ListJobs(rbm_pb2.ListJobsRequest()).jobs
    assert listed.id == job.id

    # A dataset is usable only by the tenant that uploaded it.
    borrowing = tiny_request(dataset=rbm_pb2.DatasetRef(dataset_id=dataset_id))
    error = rpc_error(lambda: beta.StartTraining(borrowing))
    assert error.code() is grpc.StatusCode.NOT_FOUND and dataset_id in error.details()
    assert alpha.StartTraining(borrowing).created

    # Idempotency keys are per tenant: the same request_id is a new job for beta.
    again = beta.StartTraining(tiny_request(request_id="shared-id"))
    assert again.created and again.job.id != job.id
    # Beta's cancel did not touch alpha's job.
    assert alpha.GetJob(rbm_pb2.GetJobRequest(job_id=job.id)).state == rbm_pb2.JOB_STATE_SUCCEEDED


def test_a_queued_job_of_another_tenant_cannot_be_cancelled(secured: RunningService) -> None:
    alpha, beta = secured.stub(token=ALPHA), secured.stub(token=BETA)
    job = alpha.StartTraining(tiny_request()).job
    error = rpc_error(lambda: beta.CancelJob(rbm_pb2.CancelJobRequest(job_id=job.id)))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert alpha.GetJob(rbm_pb2.GetJobRequest(job_id=job.id)).state == rbm_pb2.JOB_STATE_QUEUED


BAD_CREDENTIALS = {
    "no metadata": [],
    "unknown token": [("authorization", "Bearer not-a-token")],
    "prefix of a real token": [("authorization", f"Bearer {ALPHA[:-1]}")],
    "empty bearer": [("authorization", "Bearer ")],
    "wrong scheme": [("authorization", f"Basic {ALPHA}")],
    "token without scheme": [("authorization", ALPHA)],
}


@pytest.mark.parametrize("metadata", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
def test_missing_or_wrong_token_is_unauthenticated(
    secured: RunningService, metadata: list[tuple[str, str]]
) -> None:
    stub = secured.stub()
    calls = {
        "StartTraining": lambda: stub.StartTraining(tiny_request(), metadata=metadata),
        "ListJobs": lambda: stub.ListJobs(rbm_pb2.ListJobsRequest(), metadata=metadata),
        "GetJob": lambda: stub.GetJob(rbm_pb2.GetJobRequest(job_id=UNKNOWN_JOB), metadata=metadata),
        "StreamMetrics": lambda: stub.StreamMetrics(
            rbm_pb2.StreamMetricsRequest(job_id=UNKNOWN_JOB), metadata=metadata
        ),
        "UploadDataset": lambda: stub.UploadDataset(
            iter([rbm_pb2.UploadDatasetRequest(header=rbm_pb2.DatasetHeader(shape=[1, 1]))]),
            metadata=metadata,
        ),
        "ExportModel": lambda: stub.ExportModel(
            rbm_pb2.ExportModelRequest(job_id=UNKNOWN_JOB), metadata=metadata
        ),
    }
    for name, call in calls.items():
        error = rpc_error(call)
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED, (name, error.details())
        assert "token" in error.details() or "authorization" in error.details()
    # Health checks stay open for load balancers and orchestrators.
    health = health_pb2_grpc.HealthStub(secured.channel())
    status = health.Check(health_pb2.HealthCheckRequest(service="ssdrbm.v1.RBMService")).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_tokens_from_a_file_and_from_the_environment(
    tmp_path: Path, service_factory: Callable[..., RunningService], redis_url: str
) -> None:
    lines = tmp_path / "tokens.txt"
    lines.write_text("# token tenant\nfile-token-a   team-a\n\nfile-token-b team-b\n")
    as_json = tmp_path / "tokens.json"
    as_json.write_text(json.dumps({"json-token": "team-j"}))
    environ = {
        "SSDRBM_AUTH_MODE": "token",
        "SSDRBM_AUTH_TOKENS_FILE": str(lines),
        "SSDRBM_AUTH_TOKENS": "env-token=team-e",
    }
    settings = Settings.from_env(environ)
    running = service_factory(
        run_worker=False,
        auth_mode=settings.auth_mode,
        auth_tokens_file=settings.auth_tokens_file,
        auth_tokens=settings.auth_tokens,
    )
    created = {}
    for token in ("file-token-a", "file-token-b", "env-token"):
        created[token] = running.stub(token=token).StartTraining(tiny_request()).job.id
    for token, job_id in created.items():
        [only] = running.stub(token=token).ListJobs(rbm_pb2.ListJobsRequest()).jobs
        assert only.id == job_id  # each token is its own tenant

    assert parse_token_file(as_json) == {"json-token": "team-j"}
    table = TokenTable.from_settings(settings.replace(auth_tokens_file=str(as_json)))
    assert table.tenant_for("json-token") == "team-j" and table.tenant_for("env-token") == "team-e"
    assert table.tenant_for("json-token ") is None and table.tenant_for("") is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"auth_mode": "token"}, "needs tokens"),
        ({"auth_mode": "token", "auth_tokens": "tok=bad tenant!"}, "tenant name"),
        ({"auth_mode": "token", "auth_tokens": "just-a-token"}, "token=tenant"),
    ],
)
def test_unusable_token_configuration_stops_the_start(
    service_factory: Callable[..., RunningService], settings: dict[str, str], message: str
) -> None:
    with pytest.raises(RuntimeError) as failure:
        service_factory(run_worker=False, **settings)
    assert isinstance(failure.value.__cause__, ConfigError)
    assert message in str(failure.value.__cause__)


def test_token_file_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens.txt"
    path.write_text("good tenant\nthree parts here\n")
    with pytest.raises(ConfigError, match=r"tokens.txt:2"):
        parse_token_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        parse_token_file(tmp_path / "missing.txt")
    assert parse_inline_tokens(" a=t1 , b=t2 ,") == {"a": "t1", "b": "t2"}


def test_no_auth_development_mode_is_logged_loudly(
    service_factory: Callable[..., RunningService], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ssdrbm_server.auth")
    running = service_factory(run_worker=False, auth_mode="none")
    warnings = [r for r in caplog.records if r.name == "ssdrbm_server.auth"]
    assert any(
        r.levelno >= logging.WARNING and "AUTHENTICATION IS OFF" in r.getMessage() for r in warnings
    )
    # Every caller is the one development tenant, with or without a token.
    job = running.stub().StartTraining(tiny_request()).job
    seen = running.stub(token="anything").GetJob(rbm_pb2.GetJobRequest(job_id=job.id))
    assert seen.id == job.id
