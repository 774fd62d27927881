"""The service under measurement, in processes of its own: a throw-away redis-server and the
service (gRPC server + worker, `bench.service_host`) on loopback ports, and a sampler of the
service process's resident memory. The service cases (`bench.service`, `bench.service_upload`,
`bench.service_pack`, `bench.service_job`) start them from here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.data import REPO_ROOT
from bench.timing import rss_mib
from ssdcore.data import default_data_dir
from ssdrbm_server.redis_process import RedisServer

START_TIMEOUT_S = 60.0
STREAM_BLOCK_MS = 1000  # the server's XREAD BLOCK per poll of a metric stream


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    """A throw-away redis-server on a free loopback port, with the append-only file the service
    requires (fsynced every second, as compose and Kubernetes run it); yields its URL."""
    with RedisServer(directory) as server:
        yield server.url


def stop_process(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `process`; SIGKILL it if it is still running after `grace_s` seconds."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class ServerProcess:
    """The service in its own process; `target` is its loopback address."""

    process: subprocess.Popen
    target: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def children(self) -> list[int]:
        """Direct child processes (the worker's training child), from /proc."""
        pids: list[int] = []
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{self.pid}/task"):
                with open(f"/proc/{self.pid}/task/{task}/children") as children:
                    pids += [int(pid) for pid in children.read().split()]
        return pids


@contextlib.contextmanager
def service_process(
    redis_url: str, directory: Path, extra_env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """Start `python -m bench.service_host` against `redis_url`; stop it with SIGTERM."""
    env = {
        **os.environ,
        "SSDRBM_REDIS_URL": redis_url,
        "SSDRBM_DATA_DIR": str(default_data_dir()),
        "SSDRBM_AUTH_MODE": "none",
        "SSDRBM_LOG_LEVEL": "WARNING",
        "SSDRBM_STREAM_BLOCK_MS": str(STREAM_BLOCK_MS),
        "SSDRBM_MAX_JOBS_PER_TENANT": "64",
        **(extra_env or {}),
    }
    log_path = directory / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.service_host"],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        port = _read_port(process, log_path)
        yield ServerProcess(process, f"127.0.0.1:{port}", log_path)
    finally:
        stop_process(process, 30)


def _read_port(process: subprocess.Popen, log_path: Path) -> int:
    from bench.service_host import READY_PREFIX

    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(process.stdout.readline()))
    reader.daemon = True
    reader.start()
    reader.join(START_TIMEOUT_S)
    line = result[0] if result else ""
    if not line.startswith(READY_PREFIX):
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"the service did not start: {line!r}\n{tail}")
    return int(line[len(READY_PREFIX) :])


class MemorySampler:
    """Samples the RSS of the server process and of its children every 50 ms in a thread."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.server_mib: list[float] = []
        self.child_mib: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            own = rss_mib(self.server.pid)
            if own is not None:
                self.server_mib.append(own)
            children = [rss_mib(pid) for pid in self.server.children()]
            if children and all(value is not None for value in children):
                self.child_mib.append(sum(children))
            self._stop.wait(0.05)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
