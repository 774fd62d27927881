"""Stopping the demo and the service, from a terminal's point of view.

- One Ctrl-C (SIGINT to the demo's process group, as a terminal sends it) while a job trains:
  the demo stops the service, then Redis, and exits 130 within a bound; nothing it started
  (Redis, the service, its training process) is left running. The next run starts from an
  empty Redis: the interrupted run's job is not there to be trained. A demo killed outright
  (SIGKILL) leaves nothing running either.
- The service with Redis already gone: one SIGINT ends it within its stop timeout rather than
  retrying Redis forever; a second signal ends it at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from tests.fixtures.jobs import tiny_request
from tests.fixtures.redis import RedisServer, free_port
from tests.fixtures.server_process import ROOT, python_m_server, wait_until

pytestmark = pytest.mark.slow  # real processes start, train and stop: about a minute in all

EXIT_BOUND_S = 20.0  # generous on a loaded 2-core machine; a hang is what it catches
START_BOUND_S = 90.0


def terminal_sigint() -> None:
    """As from a terminal: a suite started in the background runs with SIGINT ignored, and an
    ignored signal stays ignored across exec."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Output:
    """A child's output lines, read by a thread; ``wait_for`` a pattern."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, process: subprocess.Popen[str]) -> re.Match[str]:
        deadline = time.monotonic() + START_BOUND_S
        while True:
            for line in self.lines:
                if match := re.search(pattern, line):
                    return match
            assert process.poll() is None or self._thread.is_alive(), self.text
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.text}"
            time.sleep(0.1)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def process_start(pid: int) -> str | None:
    """The kernel's start time of a live (not zombie) process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def descendants(root: int) -> dict[int, str]:
    """Live descendants of ``root``: pid → start time (so a reused pid is not mistaken)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and (start := process_start(pid)) is not None:
                found[pid] = start
                frontier.append(pid)
    return found


def still_running(processes: dict[int, str]) -> list[int]:
    return [pid for pid, start in processes.items() if process_start(pid) == start]


@pytest.fixture
def demo_stack(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[str], Output]]]:
    """``start(*args, **env)``: the demo (python -m ssdrbm_server.demo_stack) in a session of its
    own, as a shell runs a foreground job; its state in ``tmp_path/state``. Synthetic data (an
    empty data directory), so the job is small."""
    started: list[subprocess.Popen[str]] = []
    empty = tmp_path / "no-data"
    empty.mkdir()

    def start(*args: str, **env: str) -> tuple[subprocess.Popen[str], Output]:
        process = subprocess.Popen(
            [sys.executable, "-m", "ssdrbm_server.demo_stack", "--state-dir",
             str(tmp_path / "state"), *args],
            cwd=ROOT,
            env={**os.environ, "SSDRBM_DATA_DIR": str(empty), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=terminal_sigint,
        )  # fmt: skip
        started.append(process)
        return process, Output(process)

    yield start
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_one_ctrl_c_stops_the_demo_and_everything_it_started_and_a_rerun_starts_clean(
    demo_stack: Callable[..., tuple[subprocess.Popen[str], Output]],
) -> None:
    process, output = demo_stack("--steps", "1000000")
    redis_port = int(output.wait_for(r"redis-server on 127\.0\.0\.1:(\d+)", process).group(1))
    job_id = output.wait_for(r"job ([0-9a-f]{32}) queued", process).group(1)
    output.wait_for(r"-- RUNNING", process)  # a worker has the job
    started = descendants(process.pid)
    assert len(started) >= 3, started  # Redis, the service, its training process

    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground group
    process.wait(timeout=EXIT_BOUND_S)
    assert process.returncode == 128 + signal.SIGINT, output.text
    assert "stopping the service, then Redis" in output.text
    assert still_running(started) == []
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=redis_port, socket_connect_timeout=1).ping()

    # The next run: Redis empty, the interrupted job gone (no worker, so its own job stays put).
    process, output = demo_stack("--steps", "10", SSDRBM_RUN_WORKER="0")
    target = output.wait_for(r"the service on (127\.0\.0\.1:\d+)", process).group(1)
    new_id = output.wait_for(r"job ([0-9a-f]{32}) queued", process).group(1)
    with grpc.insecure_channel(target) as channel:
        stub = rbm_pb2_grpc.RBMServiceStub(channel)
        jobs = stub.ListJobs(rbm_pb2.ListJobsRequest(), timeout=10).jobs
        assert [job.id for job in jobs] == [new_id]
        with pytest.raises(grpc.RpcError) as gone:
            stub.GetJob(rbm_pb2.GetJobRequest(job_id=job_id), timeout=10)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    started = descendants(process.pid)
    process.kill()  # the demo killed outright: what it started goes too (SIGTERM on its death)
    process.wait(timeout=EXIT_BOUND_S)
    deadline = time.monotonic() + EXIT_BOUND_S
    while still_running(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert still_running(started) == []


@contextlib.contextmanager
def running_service_with_a_training_job(
    redis_server: RedisServer, **settings: str
) -> Iterator[subprocess.Popen[str]]:
    port = free_port()
    with python_m_server(redis_server.url, port, metrics_port="0", **settings) as process:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rbm_pb2_grpc.RBMServiceStub(channel)
            wait_until(process, lambda: _answers(stub), "the server serving")
            job = stub.StartTraining(tiny_request(steps=1_000_000), timeout=10).job
            # Training under way (a metric event published), not merely claimed: between its
            # claim and its training process's start a job has nothing to release yet.
            wait_until(
                process,
                lambda: stub.GetJob(rbm_pb2.GetJobRequest(job_id=job.id), timeout=10).step > 0,
                "a worker training the job",
            )
        yield process


def _answers(stub: rbm_pb2_grpc.RBMServiceStub) -> bool:
    try:
        stub.ListJobs(rbm_pb2.ListJobsRequest(), timeout=1)
    except grpc.RpcError:
        return False
    return True


def test_sigint_ends_the_service_within_its_stop_timeout_when_redis_is_gone(
    redis_factory: Callable[..., RedisServer],
) -> None:
    store = redis_factory(appendonly=False)
    with running_service_with_a_training_job(store, stop_timeout_seconds="2") as process:
        store.kill()  # Redis dies first, as a terminal's Ctrl-C used to kill it
        began = time.monotonic()
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=EXIT_BOUND_S)
        assert process.returncode == 0, output
        assert time.monotonic() - began < EXIT_BOUND_S
        assert "Redis unreachable while stopping" in output


def test_a_second_signal_ends_the_service_at_once(
    redis_factory: Callable[..., RedisServer],
) -> None:
    store = redis_factory(appendonly=False)
    with running_service_with_a_training_job(store, stop_timeout_seconds="600") as process:
        store.kill()  # the graceful stop would now wait up to its stop timeout for Redis
        process.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=2)  # still waiting for Redis
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=EXIT_BOUND_S)
        assert process.returncode == 128 + signal.SIGTERM, output
        assert "SIGTERM received again: exiting at once" in output
