"""`python -m ssdrbm_server.worker`: one worker alone, configured from SSDRBM_* variables and
the options (``--slots N``, ``--wait-for-redis``; entry_point.py). SIGTERM or SIGINT: each slot's
running job is checkpointed and released, then exit 0; a second signal releases them at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from ssdrbm_server import entry_point
from ssdrbm_server.config import Settings
from ssdrbm_server.metrics import MetricsEndpoint
from ssdrbm_server.worker.worker import Worker

logger = logging.getLogger("ssdrbm_server.worker")


async def main(settings: Settings) -> None:
    """Run a worker until SIGTERM or SIGINT."""
    worker = Worker(settings)
    endpoint = MetricsEndpoint(worker.metrics.registry)
    if settings.worker_metrics_port:
        serve_metrics(endpoint, settings)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def request_stop(signum: int) -> None:
        name = signal.Signals(signum).name
        if stopping:  # a second signal: do not wait for the checkpoint any longer
            logger.warning("%s received again: releasing the running jobs at once", name)
            stopping.append(asyncio.ensure_future(worker.stop(graceful=False)))
            return
        logger.info("%s received: checkpointing and releasing the running jobs", name)
        stopping.append(asyncio.ensure_future(worker.stop(graceful=True)))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, request_stop, signum)
    try:
        await worker.run()
        await asyncio.gather(*stopping)
    finally:
        endpoint.stop()


def serve_metrics(endpoint: MetricsEndpoint, settings: Settings) -> None:
    """Serve the worker's /metrics. A port already taken (several workers on one host, one per
    GPU, all with the default) costs this worker its metrics, not its training: logged as an
    error saying what to set."""
    address, port = settings.metrics_address, settings.worker_metrics_port
    try:
        port = endpoint.start(port, address)
    except OSError as exc:
        logger.error(
            "cannot serve metrics on %s:%d (%s); this worker runs without them: give each worker "
            "on a host its own SSDRBM_WORKER_METRICS_PORT (0 turns them off)",
            address,
            port,
            exc,
        )
        return
    logger.info("Prometheus metrics on http://%s:%d/metrics", address, port)


DESCRIPTION = (
    "Run one ssdrbm training worker (its slots train jobs from the queue) until SIGTERM or "
    "Ctrl-C, configured by SSDRBM_* environment variables; the options below override them."
)
MAIN_SETTINGS = (
    ("redis_url", entry_point.REDIS_URL_MEANING),
    ("worker_slots", entry_point.SLOTS_MEANING),
    ("torch_threads", "CPU threads of each training process (0: its slot's share of the CPUs)"),
    ("worker_metrics_port", "the worker's Prometheus /metrics (0: off)"),
    ("data_dir", entry_point.DATA_DIR_MEANING),
)


def run(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = entry_point.parser("python -m ssdrbm_server.worker", DESCRIPTION, MAIN_SETTINGS)
    args = parser.parse_args(argv)
    return entry_point.run("ssdrbm worker", args, main, tracing_name="ssdrbm-worker")


if __name__ == "__main__":
    sys.exit(run())
