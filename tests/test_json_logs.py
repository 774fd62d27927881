"""SSDRBM_LOG_FORMAT=json: `python -m ssdrbm_server` (server, worker and training process) writes
one JSON object per stderr line, with the job, tenant and trace when known. With
SSDRBM_TRACING=console the spans go to stdout, so stderr stays pure JSON.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server import logs
from tests.fixtures.jobs import tiny_request
from tests.fixtures.redis import free_port

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 90.0  # a bound for a loaded 2-core machine, not a speed check


def run_job(port: int, server: subprocess.Popen[str]) -> str:
    """Submit a tiny job once the server answers; wait for it to succeed; its id."""
    deadline = time.monotonic() + WAIT_S
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rbm_pb2_grpc.RBMServiceStub(channel)
        while True:
            assert server.poll() is None, "the server exited"
            try:
                job = stub.StartTraining(tiny_request(steps=20), timeout=5).job
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        while stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id)).state != (
            rbm_pb2.JOB_STATE_SUCCEEDED
        ):
            assert time.monotonic() < deadline, "the job did not succeed in time"
            time.sleep(0.1)
    return job.id


def test_server_and_worker_log_json_lines_with_job_tenant_and_trace(redis_url: str) -> None:
    port = free_port()
    env = {
        **os.environ,
        "SSDRBM_REDIS_URL": redis_url,
        "SSDRBM_LISTEN_ADDRESS": f"127.0.0.1:{port}",
        "SSDRBM_METRICS_PORT": "0",
        "SSDRBM_ALLOW_NO_PERSISTENCE": "1",
        "SSDRBM_SHUTDOWN_GRACE_S": "1",
        "SSDRBM_TORCH_THREADS": "1",
        "SSDRBM_LOG_FORMAT": "json",
        "SSDRBM_TRACING": "console",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "ssdrbm_server"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        job_id = run_job(port, server)
    finally:
        server.send_signal(signal.SIGTERM)
        stdout, stderr = server.communicate(timeout=60)
    assert server.returncode == 0, stderr

    lines = stderr.splitlines()
    assert len(lines) > 5
    records = []
    for line in lines:
        record = json.loads(line)  # every line, from every process, is one JSON object
        assert {"time", "level", "logger", "message"} <= record.keys(), line
        records.append(record)
    about_job = [r for r in records if r.get("job_id") == job_id]
    assert about_job, "no record names the job"
    assert all(r["tenant"] == "default" for r in about_job)
    # The worker's records about the job carry its trace, the trace of the StartTraining call.
    traced = {r["trace_id"] for r in about_job if "trace_id" in r}
    assert len(traced) == 1
    (trace_id,) = traced
    assert len(trace_id) == 32
    # The console exporter printed the spans of that trace on stdout.
    assert f"0x{trace_id}" in stdout and "ssdrbm.worker.attempt" in stdout
    assert any(r["message"].startswith("shutting down") for r in records)


def test_json_formatter_takes_fields_from_extra_and_context() -> None:
    formatter = logs.JsonFormatter()
    record = logging.LogRecord(
        "ssdrbm_server.x", logging.WARNING, __file__, 1, "a %s", ("b",), None
    )
    record.job_id = "j1"
    with logs.log_context(tenant="t1"):
        entry = json.loads(formatter.format(record))
    assert entry["message"] == "a b" and entry["level"] == "WARNING"
    assert entry["logger"] == "ssdrbm_server.x"
    assert entry["job_id"] == "j1" and entry["tenant"] == "t1"
    assert entry["time"].endswith("+00:00")
    outside = json.loads(formatter.format(record))
    assert "tenant" not in outside and "trace_id" not in outside
