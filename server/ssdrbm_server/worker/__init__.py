"""Workers: claim jobs from Redis and train them in spawned training processes:
`Worker(settings)` with `async run()` / `async stop(graceful)`; `python -m ssdrbm_server.worker`
runs one alone, configured from SSDRBM_* environment variables.
"""

from __future__ import annotations

from ssdrbm_server.worker.worker import Worker

__all__ = ["Worker"]
