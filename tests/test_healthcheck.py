"""The health probe (``python -m ssdrbm_server.healthcheck``) against real servers and Redis.

- readiness follows Redis (fails while it is down, back when it returns), liveness does not;
- under TLS the probe connects with the server's own SSDRBM_TLS_* settings, also when the
  certificate names a host and not 127.0.0.1; health needs no token when auth is on;
- a worker alone is alive while its heartbeat file is fresh, and not once it stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ssdrbm_server.healthcheck import local_target, main
from tests.fixtures.redis import RedisServer
from tests.fixtures.server_process import ROOT
from tests.fixtures.service import RunningService
from tests.test_tls import Pki, new_key_and_request, pki, sign  # noqa: F401 (pki: a fixture)

WAIT_S = 15.0


def probe(*args: str, **env: str) -> int:
    """The probe's exit code, run in this process with ``env`` as its SSDRBM_* environment."""
    return main(list(args), environ={f"SSDRBM_{k.upper()}": v for k, v in env.items()})


def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT_S:.0f} s"
        time.sleep(0.1)


def test_readiness_follows_redis_and_liveness_does_not(
    redis_factory: Callable[..., RedisServer], service_factory: Callable[..., RunningService]
) -> None:
    store = redis_factory(appendonly=False)
    running = service_factory(store.url, run_worker=False)
    target = running.target
    assert probe(target) == 0  # --ready is the default
    assert probe("--ready", target) == 0 and probe("--live", target) == 0
    store.stop()
    eventually(lambda: probe("--ready", target) == 1, "readiness NOT_SERVING without Redis")
    assert probe("--live", target) == 0
    assert probe("--service", "", target) == 0  # the whole server: alive
    store.start()
    eventually(lambda: probe("--ready", target) == 0, "readiness SERVING once Redis is back")


def test_readiness_requires_the_in_process_worker(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False)
    assert probe(running.target) == 0

    async def stopped_worker() -> None:
        task = asyncio.create_task(asyncio.sleep(0))  # a worker task that has ended
        await task
        running.service.watch_worker(task)

    running.run_in_loop(stopped_worker())
    eventually(lambda: probe("--ready", running.target) == 1, "readiness without the worker")
    assert probe("--live", running.target) == 0


def test_the_probe_command_defaults_to_the_servers_listen_address(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False)
    assert local_target(f"0.0.0.0:{running.port}") == running.target
    env = {**os.environ, "SSDRBM_LISTEN_ADDRESS": f"0.0.0.0:{running.port}"}
    command = [sys.executable, "-m", "ssdrbm_server.healthcheck"]
    for flag in ("--ready", "--live"):
        assert subprocess.run([*command, flag], cwd=ROOT, env=env, timeout=30).returncode == 0
    missing = subprocess.run([*command, "--service", "no.such.Service"], cwd=ROOT, env=env)
    assert missing.returncode == 1


def test_health_needs_no_token(service_factory: Callable[..., RunningService]) -> None:
    running = service_factory(run_worker=False, auth_mode="token", auth_tokens="t0ken=alice")
    assert probe(running.target) == 0 and probe("--live", running.target) == 0


@pytest.fixture(scope="module")
def hostname_cert(pki: Pki) -> Path:  # noqa: F811 (pki: the fixture imported above)
    """A server certificate signed by the test CA for a host name only (no IP address)."""
    directory = pki.ca.parent
    new_key_and_request(directory, "named", "/CN=ssdrbm.internal")
    sign(directory, "named", "ca", "subjectAltName=DNS:ssdrbm.internal")
    return directory / "named.crt"


def test_tls_probe_uses_the_servers_tls_settings(
    pki: Pki,  # noqa: F811
    hostname_cert: Path,
    service_factory: Callable[..., RunningService],
) -> None:
    key = str(pki.ca.parent / "named.key")
    running = service_factory(run_worker=False, tls_cert_file=str(hostname_cert), tls_key_file=key)
    server_env = {
        "listen_address": f"0.0.0.0:{running.port}",
        "tls_cert_file": str(hostname_cert),
        "tls_key_file": key,
        "tls_ca_file": str(pki.ca),
    }
    # The server's own environment is all the probe needs: TLS, the CA, the certificate's name.
    assert probe(**server_env) == 0 and probe("--live", **server_env) == 0
    # The same by options, as from another container.
    assert probe("--ca", str(pki.ca), "--server-name", "ssdrbm.internal", running.target) == 0
    assert probe("--ca", str(pki.ca), running.target) == 1  # 127.0.0.1 is not in the cert
    assert probe("--ca", str(pki.other_ca), "--server-name", "ssdrbm.internal", running.target) == 1
    assert probe(running.target) == 1  # plaintext is refused
    assert probe("--ca", "/nonexistent/ca.pem", running.target) == 2


def test_self_signed_server_certificate_is_its_own_root(
    pki: Pki,  # noqa: F811
    service_factory: Callable[..., RunningService],
) -> None:
    cert, key = pki.stranger_cert, pki.stranger_key  # self-signed, CN=stranger, no SAN
    running = service_factory(run_worker=False, tls_cert_file=str(cert), tls_key_file=key)
    env = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
    assert probe("--server-name", "stranger", running.target, **env) == 0


def test_worker_probe_follows_the_worker_heartbeat_file(redis_url: str, tmp_path: Path) -> None:
    heartbeat = tmp_path / "worker.alive"
    env = {
        "redis_url": redis_url,
        "worker_heartbeat_file": str(heartbeat),
        "heartbeat_seconds": "0.2",
        "lease_seconds": "2",
    }
    assert probe("--worker", **env) == 1  # no worker yet
    assert probe("--worker", redis_url=redis_url) == 2  # no heartbeat file configured
    worker = subprocess.Popen(
        [sys.executable, "-m", "ssdrbm_server.worker"],
        cwd=ROOT,
        env={
            **os.environ,
            "SSDRBM_ALLOW_NO_PERSISTENCE": "1",
            **{f"SSDRBM_{k.upper()}": v for k, v in env.items()},
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        eventually(lambda: probe("--worker", **env) == 0, "the worker's heartbeat")
        time.sleep(0.6)  # several beats later, still fresh
        assert probe("--worker", **env) == 0
        worker.send_signal(signal.SIGTERM)
        output, _ = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0, output
    assert probe("--worker", **env) == 1  # the file went with the worker


def test_a_stale_heartbeat_file_fails_the_worker_probe(tmp_path: Path) -> None:
    heartbeat = tmp_path / "worker.alive"
    heartbeat.write_text("123 0\n")
    env = {"worker_heartbeat_file": str(heartbeat), "lease_seconds": "5"}
    assert probe("--worker", **env) == 0
    old = time.time() - 6
    os.utime(heartbeat, (old, old))  # a hung worker stops touching it
    assert probe("--worker", **env) == 1
