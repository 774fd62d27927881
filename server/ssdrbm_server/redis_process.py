"""A local redis-server child process with the settings the service requires.

The demo, the benchmarks and the tests start Redis through ``RedisServer``: by default an
append-only file fsynced every second, no eviction (redis_checks.py), no RDB snapshots, on
127.0.0.1 only. The port and directory stay the same across ``stop()`` and ``start()``, so a
server with AOF comes back with its data.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ssdrbm_server.redis_checks import SAFE_FSYNC, SAFE_POLICY

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
START_TIMEOUT_S = 60.0  # a large append-only file is loaded before it answers
STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL
CLUSTER_NODE_TIMEOUT_MS = 5000
LOG_TAIL_CHARS = 2000  # of redis.log, in the error when the server exits at start


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class RedisTls:
    """Certificate files of a TLS-only server; clients need not present a certificate."""

    cert_file: Path
    key_file: Path
    ca_file: Path


class RedisServer:
    """A redis-server child process bound to 127.0.0.1:<port> with its files in ``directory``.

    ``appendonly=False`` runs without persistence (the service then needs
    SSDRBM_ALLOW_NO_PERSISTENCE); ``appendfsync="always"`` fsyncs every write; ``save`` holds
    RDB snapshot rules (redis.conf ``save``), none by default. ``cluster=True`` starts a
    cluster-enabled node (joining nodes is the caller's part). With ``tls`` the server speaks
    TLS only, on ``port``. ``popen_options`` go to ``subprocess.Popen`` (e.g.
    ``start_new_session``). Used as a context manager it is started and stopped.
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        appendonly: bool = True,
        appendfsync: str = "everysec",
        save: str = "",
        cluster: bool = False,
        tls: RedisTls | None = None,
        logfile: Path | None = None,
        popen_options: dict[str, Any] | None = None,
    ) -> None:
        if appendfsync not in SAFE_FSYNC:
            raise ValueError(f"appendfsync must be one of {SAFE_FSYNC}, not {appendfsync!r}")
        # Absolute: redis-server changes into --dir before it opens the log file.
        self.directory = directory.resolve()
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.save = save
        self.tls = tls
        self.logfile = (logfile or self.directory / "redis.log").resolve()
        self.popen_options = popen_options or {}
        # A cluster node also listens on a bus port; named here, since port + 10000 (Redis's
        # default) may be taken or beyond 65535 for a free port picked by the kernel.
        self.bus_port = free_port() if cluster else None
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca_file}"
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        args = [
            REDIS_SERVER,
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", self.save,
            "--maxmemory-policy", SAFE_POLICY,
            "--daemonize", "no",
            "--logfile", str(self.logfile),
        ]  # fmt: skip
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.cert_file),
                "--tls-key-file", str(self.tls.key_file),
                "--tls-ca-cert-file", str(self.tls.ca_file),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        if self.bus_port is not None:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.directory / "nodes.conf"),
                "--cluster-port", str(self.bus_port),
                "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
            ]  # fmt: skip
        return args

    def client(self, **options: Any) -> redis.Redis:
        """A synchronous client of this server alone (close it after use)."""
        options = {"socket_connect_timeout": 1, "socket_timeout": 5, **options}
        if self.tls is not None:
            options |= {"ssl": True, "ssl_ca_certs": str(self.tls.ca_file)}
        return redis.Redis(port=self.port, **options)

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server (no-op if running) and wait until it answers; RuntimeError with the
        end of its log if it exits or does not answer within ``timeout_s``."""
        if self.running():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **self.popen_options,
        )
        try:
            self._wait_until_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_until_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = self.client(socket_connect_timeout=0.2, socket_timeout=0.5)
        try:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited at start (status {self.process.returncode}) on "
                        f"port {self.port}:\n{self._log_tail()}"
                    )
                try:
                    # Answered by this process, not by another one that holds the port: then
                    # ours exits at start, which the check above reports.
                    if client.info("server")["process_id"] == self.process.pid:
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer within "
                        f"{timeout_s:.0f} s:\n{self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the server (SIGTERM, then SIGKILL if it lingers); no-op if not running."""
        if self.running():
            assert self.process is not None
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would: only what AOF fsynced survives."""
        if self.running():
            assert self.process is not None
            self.process.kill()
            self.process.wait()
        self.process = None

    def restart(self) -> None:
        """Stop and start again on the same port and directory."""
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
