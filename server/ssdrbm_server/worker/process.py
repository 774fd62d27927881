"""The training child process as the worker sees it: spawn, message inbox, kill.

The worker process itself never imports torch (nor initialises CUDA): `run_child` is the spawn
target, and only inside the child does it import the training code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from ssdrbm_server.config import Settings
from ssdrbm_server.cpus import pin_this_process
from ssdrbm_server.worker import protocol

logger = logging.getLogger(__name__)

CHILD_JOIN_TIMEOUT_S = 10.0
# How long a training process may take to start (spawn, import torch, warm up, create a CUDA
# context) before its silence counts as a hang: a cold GPU host takes tens of seconds.
STARTUP_ALLOWANCE_S = 120.0


def run_child(
    conn: Connection,
    parent_pid: int,
    log_level: str,
    cpus: frozenset[int] = frozenset(),
    log_format: str = "text",
) -> None:
    """Spawn target, in the child: pinned to ``cpus`` (SSDRBM_TRAINING_CPUS) before torch is
    imported, so that the thread pools torch starts inherit the mask."""
    pin_this_process(cpus, "training")
    from ssdrbm_server.worker.child import child_main

    child_main(conn, parent_pid, log_level, log_format)


class ChildProcess:
    """The spawned training process and a thread that feeds its messages to an asyncio queue.
    Started before there is a job for it (importing torch takes seconds), kept ready, and reused
    for the next job when the last one ended normally."""

    def __init__(
        self, log_level: str, cpus: frozenset[int] = frozenset(), log_format: str = "text"
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=run_child,
            args=(child_conn, os.getpid(), log_level, cpus, log_format),
            name="ssdrbm-train",
            daemon=True,
        )
        self.process.start()
        self.jobs_started = 0
        # Liveness, written by the reader thread: when anything last came from the process,
        # and whether it has finished warming up (its first heartbeat).
        self.last_heard = time.monotonic()
        self.ready = False
        child_conn.close()  # so that the child's exit reads as EOF here
        self.inbox: asyncio.Queue[protocol.Message | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._pump, args=(loop,), daemon=True)
        self._reader.start()

    @classmethod
    def for_settings(cls, settings: Settings) -> ChildProcess:
        return cls(settings.log_level, settings.training_cpu_set, settings.log_format)

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                message = protocol.receive(self.conn)
                self.last_heard = time.monotonic()
                if message.kind == protocol.ALIVE:
                    self.ready = True  # heartbeats only feed the silence check, not the inbox
                    continue
                loop.call_soon_threadsafe(self.inbox.put_nowait, message)
        except (EOFError, OSError):
            pass
        # None: the child is gone. The loop may be closed already when the worker has ended.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self.inbox.put_nowait, None)

    def send(self, message: protocol.Message) -> None:
        """Send a message (dropped with a warning when the process is gone)."""
        if message.kind == protocol.START:
            self.jobs_started += 1
        try:
            protocol.send(self.conn, message)
        except OSError:
            logger.warning(
                "training process %s is gone; message %s dropped", self.process.pid, message.kind
            )

    def silent_for(self, since: float) -> float:
        """Seconds without a message from the process, counted from ``since`` at the earliest
        (a monotonic time: when it was given its job)."""
        return time.monotonic() - max(self.last_heard, since)

    def allowed_silence(self, timeout_s: float) -> float:
        """The silence after which the process counts as hung: ``timeout_s`` once it is warm,
        at least STARTUP_ALLOWANCE_S while it is still starting."""
        return timeout_s if self.ready else max(timeout_s, STARTUP_ALLOWANCE_S)

    async def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        await self.join()

    async def join(self) -> int | None:
        """The exit code once the process exited (None if it did not in time)."""
        await asyncio.to_thread(self.process.join, CHILD_JOIN_TIMEOUT_S)
        return self.process.exitcode

    def close(self) -> None:
        self.conn.close()


def describe_exit(code: int | None) -> str:
    """How a process ended, in words: "killed by SIGKILL", "exited with code 1"."""
    if code is None:
        return "closed its pipe but did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
