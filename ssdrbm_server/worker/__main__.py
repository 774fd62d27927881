"""`python -m ssdrbm_server.worker`: run one worker alone, configured from SSDRBM_* variables.

SIGTERM (or SIGINT) stops it gracefully: the running job is checkpointed at its current step
and released to the queue for another worker; then the process exits with status 0. A second
signal releases the job at once (it resumes from its last regular checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.worker.worker import Worker

logger = logging.getLogger("ssdrbm_server.worker")


async def main(settings: Settings) -> None:
    """Run a worker until SIGTERM or SIGINT."""
    worker = Worker(settings)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    def request_stop(signum: int) -> None:
        name = signal.Signals(signum).name
        if stopping:  # a second signal: do not wait for the checkpoint any longer
            logger.warning("%s received again: releasing the running job at once", name)
            stopping.append(asyncio.ensure_future(worker.stop(graceful=False)))
            return
        logger.info("%s received: checkpointing and releasing the running job", name)
        stopping.append(asyncio.ensure_future(worker.stop(graceful=True)))

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, request_stop, signum)
    await worker.run()
    await asyncio.gather(*stopping)


def run() -> int:
    """Console entry point; returns the exit status."""
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"ssdrbm-worker: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(main(settings))
    return 0


if __name__ == "__main__":
    sys.exit(run())
