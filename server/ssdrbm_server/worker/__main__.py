"""`python -m ssdrbm_server.worker`: run one worker alone, configured from SSDRBM_* variables.

Options on the command line override the environment:
  --slots N   jobs (or packs) trained at once, one training process each (SSDRBM_WORKER_SLOTS;
              0, the default, derives it from the machine: worker/slots.py)

SIGTERM (or SIGINT) stops it gracefully: each slot's running job is checkpointed at its current
step and released to the queue for another worker; then the process exits with status 0. A
second signal releases the jobs at once (they resume from their last regular checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from ssdrbm_server import logs, tracing
from ssdrbm_server.config import ConfigError, Settings
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


def run(argv: list[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m ssdrbm_server.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--slots",
        type=int,
        metavar="N",
        help="jobs trained at once (default: SSDRBM_WORKER_SLOTS, else derived from the machine)",
    )
    args = parser.parse_args(argv)
    overrides = {} if args.slots is None else {"worker_slots": args.slots}
    try:
        settings = Settings.from_env(**overrides)
    except ConfigError as exc:
        print(f"ssdrbm-worker: error: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        tracing.configure(settings, service_name="ssdrbm-worker")
    except ConfigError as exc:
        print(f"ssdrbm-worker: error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(main(settings))
    except ConfigError as exc:  # found at start, e.g. a Redis that would lose jobs
        print(f"ssdrbm-worker: error: {exc}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(run())
