"""``python -m ssdrbm_server.demo_stack [--state-dir DIR] [demo options]``: the local demo.

Starts a fresh Redis (append-only file in ``DIR/redis``, emptied first, so an interrupted run
leaves nothing for the next one to train), the service with its worker, then runs the demo
client (``ssdrbm_server.demo``; its options pass through). On the way out it stops the service
(SIGTERM: its worker checkpoints and releases the job), then Redis, which the service needs
until it is gone. Both run in sessions of their own, so a Ctrl-C reaches only this process and
the client, which then stops them once each; a second Ctrl-C kills the service at once. Either
way the service's process group and Redis end before this process does.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from ssdrbm_server import demo
from ssdrbm_server.config import Settings
from ssdrbm_server.healthcheck import check
from ssdrbm_server.http_front import dashboard_url
from ssdrbm_server.readiness import READINESS
from ssdrbm_server.redis_process import RedisServer, free_port

START_TIMEOUT_S = 60.0
# The demo's job is throw-away: a short drain and checkpoint wait keep Ctrl-C prompt.
DEMO_SERVICE_SETTINGS = {"SSDRBM_SHUTDOWN_GRACE_S": "2", "SSDRBM_STOP_TIMEOUT_SECONDS": "5"}
SERVICE_STOP_S = 15.0  # past the settings above: then the service is killed
REDIS_STOP_S = 5.0
PR_SET_PDEATHSIG = 1  # prctl option, <linux/prctl.h>


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class LocalStack:
    """Redis and the service as child processes in sessions of their own."""

    def __init__(self, state_dir: Path, *, port: int, metrics_port: int) -> None:
        self.state_dir = state_dir
        self.logs = state_dir / "logs"
        self.redis = RedisServer(
            state_dir / "redis",
            logfile=self.logs / "redis.log",
            popen_options={
                "start_new_session": True,  # out of the terminal's process group: Ctrl-C is ours
                "preexec_fn": _die_with_parent,
            },
        )
        self.port = port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.service: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.hurry = False  # a second signal while stopping: kill, do not wait

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_redis(self) -> None:
        data = self.redis.directory
        shutil.rmtree(data, ignore_errors=True)  # no jobs of an earlier, interrupted run
        print(f"starting redis-server on 127.0.0.1:{self.redis.port} (data in {data})", flush=True)
        try:
            self.redis.start(START_TIMEOUT_S)
        except RuntimeError as failed:
            raise SystemExit(f"demo: {failed}") from None

    def start_service(self) -> None:
        env = {
            **os.environ,
            **{k: v for k, v in DEMO_SERVICE_SETTINGS.items() if k not in os.environ},
            "SSDRBM_REDIS_URL": self.redis.url,
            "SSDRBM_LISTEN_ADDRESS": self.target,
            "SSDRBM_METRICS_PORT": str(self.metrics_port),
            "SSDRBM_METRICS_ADDRESS": "127.0.0.1",
        }
        log = self.logs / "service.log"
        self.logs.mkdir(parents=True, exist_ok=True)
        print(
            f"starting the service on {self.target} (log: {log}, metrics: "
            f"http://127.0.0.1:{self.metrics_port}/metrics)",
            flush=True,
        )
        with open(log, "wb") as out:
            self.service = subprocess.Popen(
                [sys.executable, "-m", "ssdrbm_server"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, training process included
                preexec_fn=_die_with_parent,
            )
        self._wait(
            lambda: check(self.target, service=READINESS, timeout_s=1.0),
            self.service,
            f"the service ready (see {log})",
        )
        print(f"dashboard: {dashboard_url(Settings.from_env(env)) or 'off'}", flush=True)

    @staticmethod
    def _wait(ready: Callable[[], bool], process: subprocess.Popen[bytes], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if process.poll() is not None:
                raise SystemExit(f"demo: {what} failed: exit status {process.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(f"demo: {what} did not happen within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """The service (gracefully, bounded), then its leftovers, then Redis."""
        if self.service is not None:
            self._stop(self.service, SERVICE_STOP_S, "the service")
            _kill_group(self.service.pid)  # its training process, if it outlived it
        if self.redis.process is not None:
            self._stop(self.redis.process, REDIS_STOP_S, "redis-server")

    def _stop(self, process: subprocess.Popen[bytes], bound_s: float, name: str) -> None:
        if process.poll() is not None:
            return
        process.terminate()
        deadline = time.monotonic() + bound_s
        while process.poll() is None:
            if self.hurry or time.monotonic() > deadline:
                print(f"demo: killing {name}", file=sys.stderr, flush=True)
                process.kill()
                process.wait()
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(0.1)


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the demo process dies, even by SIGKILL,
    so a demo killed outright leaves no service or Redis behind either."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def signal_handling(stack: LocalStack) -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` in the main thread while the demo runs; once
    the stack is stopping, a further one makes it kill instead of wait."""

    def handle(signum: int, _frame: FrameType | None) -> None:
        if not stack.stopping:
            raise Interrupted(signum)
        if not stack.hurry:
            name = signal.Signals(signum).name
            print(f"demo: {name} again: stopping at once", file=sys.stderr, flush=True)
        stack.hurry = True

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Start Redis and the service, run the demo client, stop both; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m ssdrbm_server.demo_stack",
        description=__doc__.splitlines()[0],
        epilog="Other options go to the demo client (python -m ssdrbm_server.demo --help).",
    )
    parser.add_argument("--state-dir", type=Path, default=Path(".ssdrbm"), help="data and logs")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (default: a free one)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port")
    args, client_args = parser.parse_known_args(argv)
    stack = LocalStack(args.state_dir, port=args.port, metrics_port=args.metrics_port)
    code = 1
    with signal_handling(stack):
        try:
            stack.start_redis()
            stack.start_service()
            code = demo.main(["--target", stack.target, *client_args])
        except Interrupted as interrupted:
            stack.stopping = True
            print(f"\ndemo: {interrupted}: stopping the service, then Redis", file=sys.stderr)
            code = 128 + interrupted.signum
        finally:
            stack.stopping = True
            stack.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
