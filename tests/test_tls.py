"""Transport security with throw-away certificates made by openssl: the gRPC listener with a
server certificate, mutual TLS with a client CA, and Redis behind a password and behind TLS."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.redis_process import RedisServer, RedisTls
from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.service import RunningService

OPENSSL = shutil.which("openssl") or "/usr/bin/openssl"
UNKNOWN_JOB = "0" * 32
CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class Pki:
    """A CA and the certificates it signed (paths), plus an outsider not signed by it."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path
    other_ca: Path


def openssl(*args: str | Path, cwd: Path) -> None:
    subprocess.run([OPENSSL, *map(str, args)], cwd=cwd, check=True, capture_output=True)


def new_key_and_request(directory: Path, name: str, subject: str) -> None:
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
            cwd=directory)  # fmt: skip


def self_signed(directory: Path, name: str, subject: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1",
            "-subj", subject, cwd=directory)  # fmt: skip


def sign(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions + "\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "1",
            "-extfile", f"{name}.ext", cwd=directory)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    self_signed(d, "ca", "/CN=ssdrbm test CA")
    self_signed(d, "other-ca", "/CN=someone else's CA")
    new_key_and_request(d, "server", "/CN=localhost")
    sign(d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1")
    new_key_and_request(d, "client", "/CN=trainer-client")
    sign(d, "client", "ca", "extendedKeyUsage=clientAuth")
    self_signed(d, "stranger", "/CN=stranger")
    return Pki(
        ca=d / "ca.crt",
        server_cert=d / "server.crt",
        server_key=d / "server.key",
        client_cert=d / "client.crt",
        client_key=d / "client.key",
        stranger_cert=d / "stranger.crt",
        stranger_key=d / "stranger.key",
        other_ca=d / "other-ca.crt",
    )


@pytest.fixture
def secure_stub() -> Iterator[Callable[..., rbm_pb2_grpc.RBMServiceStub]]:
    """``make(running, ca=..., cert=None, key=None)``: a stub on a TLS channel (closed after)."""
    channels: list[grpc.Channel] = []

    def make(
        running: RunningService, *, ca: Path, cert: Path | None = None, key: Path | None = None
    ) -> rbm_pb2_grpc.RBMServiceStub:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.read_bytes(),
            private_key=key.read_bytes() if key else None,
            certificate_chain=cert.read_bytes() if cert else None,
        )
        channels.append(grpc.secure_channel(running.target, credentials))
        return rbm_pb2_grpc.RBMServiceStub(channels[-1])

    yield make
    for channel in channels:
        channel.close()


def reaches_the_service(stub: rbm_pb2_grpc.RBMServiceStub) -> bool:
    """True when a call got an answer from the servicer (NOT_FOUND for an unknown job)."""
    error = rpc_error(
        lambda: stub.GetJob(rbm_pb2.GetJobRequest(job_id=UNKNOWN_JOB), timeout=CONNECT_TIMEOUT_S)
    )
    if error.code() is grpc.StatusCode.NOT_FOUND:
        return True
    assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return False


def test_server_tls(
    pki: Pki,
    service_factory: Callable[..., RunningService],
    secure_stub: Callable[..., rbm_pb2_grpc.RBMServiceStub],
) -> None:
    running = service_factory(
        run_worker=False, tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key)
    )
    assert reaches_the_service(secure_stub(running, ca=pki.ca))
    assert not reaches_the_service(secure_stub(running, ca=pki.other_ca))  # unverifiable server
    assert not reaches_the_service(running.stub())  # plaintext is refused


def test_mutual_tls_requires_a_client_certificate_from_the_ca(
    pki: Pki,
    service_factory: Callable[..., RunningService],
    secure_stub: Callable[..., rbm_pb2_grpc.RBMServiceStub],
) -> None:
    running = service_factory(
        run_worker=False,
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_client_ca_file=str(pki.ca),
    )
    assert reaches_the_service(
        secure_stub(running, ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    )
    assert not reaches_the_service(secure_stub(running, ca=pki.ca))  # no client certificate
    assert not reaches_the_service(
        secure_stub(running, ca=pki.ca, cert=pki.stranger_cert, key=pki.stranger_key)
    )


def test_half_configured_tls_is_refused_by_the_configuration(
    pki: Pki, service_factory: Callable[..., RunningService]
) -> None:
    with pytest.raises(ConfigError, match="SSDRBM_TLS_KEY_FILE"):
        Settings.from_env({"SSDRBM_TLS_CERT_FILE": str(pki.server_cert)})
    with pytest.raises(RuntimeError) as failure:
        service_factory(run_worker=False, tls_cert_file=str(pki.server_cert))
    assert "SSDRBM_TLS_KEY_FILE" in str(failure.value.__cause__)


def test_redis_password_in_the_url(
    redis_factory: Callable[..., RedisServer], service_factory: Callable[..., RunningService]
) -> None:
    store = redis_factory(appendonly=False)
    admin = redis.Redis(port=store.port)
    admin.config_set("requirepass", "s3cret/with:odd@chars")
    admin.close()
    with_password = f"redis://:{'s3cret%2Fwith%3Aodd%40chars'}@127.0.0.1:{store.port}/0"
    running = service_factory(with_password, run_worker=False)
    assert running.stub().StartTraining(tiny_request()).created

    wrong = service_factory(f"redis://:nope@127.0.0.1:{store.port}/0", run_worker=False)
    error = rpc_error(lambda: wrong.stub().ListJobs(rbm_pb2.ListJobsRequest()))
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    # Tear-down stops the server with a signal; the password does not get in the way.


@pytest.fixture
def tls_redis(pki: Pki, tmp_path: Path) -> Iterator[int]:
    """A redis-server that speaks only TLS (clients need not present a certificate)."""
    tls = RedisTls(cert_file=pki.server_cert, key_file=pki.server_key, ca_file=pki.ca)
    with RedisServer(tmp_path, tls=tls) as server:
        yield server.port


def test_redis_over_tls(
    pki: Pki, tls_redis: int, service_factory: Callable[..., RunningService]
) -> None:
    url = f"rediss://127.0.0.1:{tls_redis}/0?ssl_ca_certs={pki.ca}"
    running = service_factory(url, run_worker=False)
    stub = running.stub()
    job = stub.StartTraining(tiny_request()).job
    assert stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id)).id == job.id
    # The same Redis in plain text does not answer.
    plain = service_factory(f"redis://127.0.0.1:{tls_redis}/0", run_worker=False)
    error = rpc_error(lambda: plain.stub().ListJobs(rbm_pb2.ListJobsRequest(), timeout=30))
    assert error.code() is grpc.StatusCode.UNAVAILABLE
