"""Deployment files and the process entry points.

- docker-compose.yml: Redis with AOF and a health check, the gRPC port published on the host's
  loopback only (auth is off there), workers; the image alone refuses to serve without auth.
- Dockerfile: installs the same packages as scripts/install, torch at the pinned version.
- ``python -m ssdrbm_server``: starts, reports SERVING to
  ``python -m ssdrbm_server.healthcheck``, serves Prometheus metrics, and on SIGTERM shuts down
  gracefully with exit code 0.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
import urllib.request
from importlib.util import find_spec

import grpc
import pytest
import yaml
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.exposure import check_exposure
from ssdrbm_server.healthcheck import check
from tests.fixtures.redis import free_port
from tests.fixtures.server_process import ROOT, python_m_server, stop_gracefully, wait_until


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def dockerfile() -> str:
    # Join continuation lines so each instruction is one line.
    return (ROOT / "Dockerfile").read_text().replace("\\\n", " ")


def pip_targets(text: str) -> set[str]:
    """Local packages that `pip install` lines install, without -e and [extras]."""
    targets: set[str] = set()
    for line in text.splitlines():
        if "pip install" not in line or line.lstrip().startswith("#"):
            continue
        words = shlex.split(line.split("pip install", 1)[1].split("&&")[0], comments=True)
        for word in words:
            word = word.strip("'\"")
            if word.startswith(".") and not word.startswith("--"):
                targets.add(re.sub(r"\[.*\]$", "", word).rstrip("/") or ".")
    return targets


def test_compose_runs_redis_with_aof_and_health_checks() -> None:
    services = compose()["services"]
    redis = services["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert any(volume.endswith(":/data") for volume in redis["volumes"])


def test_compose_publishes_grpc_and_checks_its_health() -> None:
    services = compose()["services"]
    api = services["ssdrbm"]
    assert "127.0.0.1:50051:50051" in api["ports"]
    assert api["command"] == ["python", "-m", "ssdrbm_server"]
    assert "ssdrbm_server.healthcheck" in api["healthcheck"]["test"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    worker = services["worker"]
    assert worker["command"] == ["python", "-m", "ssdrbm_server.worker"]
    assert worker["deploy"]["replicas"] >= 1
    for service in (api, worker):
        assert service["environment"]["SSDRBM_REDIS_URL"] == "redis://redis:6379/0"


def image_environment() -> dict[str, str]:
    """The SSDRBM_* variables the Dockerfile's ENV sets."""
    env_lines = re.findall(r"^ENV (.*)$", dockerfile(), re.MULTILINE)
    return dict(re.findall(r"(SSDRBM_\w+)=(\S+)", " ".join(env_lines)))


def test_compose_publishes_without_auth_on_the_host_loopback_only() -> None:
    """Auth is off in the development stack: every published port is bound to 127.0.0.1, and
    the server is told explicitly that it may listen on 0.0.0.0 inside its container."""
    api = compose()["services"]["ssdrbm"]
    environment = api["environment"]
    assert environment.get("SSDRBM_AUTH_MODE", "none") == "none"
    assert environment["SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE"] == "1"
    for port in api["ports"]:
        assert port.startswith("127.0.0.1:"), f"{port} is published on every host address"
    settings = Settings.from_env({**image_environment(), **environment})
    check_exposure(settings)  # starts as composed


def test_image_alone_refuses_to_serve_unauthenticated_on_every_address() -> None:
    image = image_environment()
    assert image["SSDRBM_LISTEN_ADDRESS"].startswith("0.0.0.0:")  # reachable in a container
    with pytest.raises(ConfigError, match="SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE"):
        check_exposure(Settings.from_env(image))
    tokens = {**image, "SSDRBM_AUTH_MODE": "token", "SSDRBM_AUTH_TOKENS": "t=alice"}
    with pytest.raises(ConfigError, match="SSDRBM_TLS_CERT_FILE"):
        check_exposure(Settings.from_env(tokens))  # tokens, but in plaintext
    check_exposure(Settings.from_env({**tokens, "SSDRBM_ALLOW_PLAINTEXT_TOKENS": "1"}))


def test_python_m_server_refuses_a_remote_address_without_auth(redis_url: str) -> None:
    with python_m_server(redis_url, free_port(), listen_address="0.0.0.0:0") as process:
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert "SSDRBM_LISTEN_ADDRESS=0.0.0.0:0 is not a loopback address" in output
    assert "SSDRBM_AUTH_MODE=token" in output and "SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE=1" in output


def test_compose_commands_name_modules_that_exist() -> None:
    for module in ("ssdrbm_server", "ssdrbm_server.healthcheck", "ssdrbm_server.worker"):
        assert find_spec(module) is not None, module


def test_dockerfile_installs_what_scripts_install_installs() -> None:
    install = (ROOT / "scripts" / "install").read_text()
    docker = dockerfile()
    assert pip_targets(docker) == pip_targets(install) == {"."}
    # Every folder the installed packages need is copied into the image.
    for folder in ("client/", "ssdcore/", "ssdrbm_server/"):
        assert re.search(rf"^COPY {folder} ", docker, re.MULTILINE), folder


def test_dockerfile_pins_the_same_torch_and_runs_the_server() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    docker = dockerfile()
    version = re.search(r"^ARG TORCH_VERSION=(\S+)", docker, re.MULTILINE).group(1)
    assert pinned == f"torch=={version}"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11", docker, re.MULTILINE)
    assert re.search(r'^CMD \["python", "-m", "ssdrbm_server"\]', docker, re.MULTILINE)
    assert "ssdrbm_server.healthcheck" in re.search(r"^HEALTHCHECK .*", docker, re.MULTILINE).group(
        0
    )


def test_python_m_server_serves_and_stops_gracefully_on_sigterm(redis_url: str) -> None:
    port, metrics_port = free_port(), free_port()
    with python_m_server(
        redis_url,
        port,
        metrics_port=str(metrics_port),
        metrics_address="127.0.0.1",
        run_worker="0",
    ) as process:
        wait_until(process, lambda: check(f"127.0.0.1:{port}", timeout_s=1.0), "the server serving")
        healthcheck = subprocess.run(
            [sys.executable, "-m", "ssdrbm_server.healthcheck", f"127.0.0.1:{port}"],
            cwd=ROOT,
            timeout=30,
        )
        assert healthcheck.returncode == 0
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rbm_pb2_grpc.RBMServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetJob(rbm_pb2.GetJobRequest(job_id="0" * 32), timeout=10)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            exposition = response.read().decode()
        assert 'ssdrbm_rpc_latency_seconds_count{code="NOT_FOUND",method="GetJob"} 1.0' in (
            exposition
        )
        assert 'ssdrbm_jobs{state="QUEUED"}' in exposition
        output = stop_gracefully(process)
    assert process.returncode == 0, output
    assert "AUTHENTICATION IS OFF" in output  # the no-auth mode is announced loudly
    assert "shutting down" in output and "gRPC server stopped" in output
    assert not check(f"127.0.0.1:{port}", timeout_s=1.0)


@pytest.mark.parametrize("target", ["127.0.0.1:1"])
def test_healthcheck_fails_when_nothing_listens(target: str) -> None:
    assert not check(target, timeout_s=1.0)
