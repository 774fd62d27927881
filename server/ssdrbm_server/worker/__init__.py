"""Workers: claim jobs from Redis and train them in a spawned child process.

`Worker(redis_url, worker_id=..., data_dir=...)` with `async run()` / `async stop(graceful)`;
`python -m ssdrbm_server.worker` runs one alone, configured from SSDRBM_* environment variables.
"""

from __future__ import annotations

from ssdrbm_server.worker.worker import Worker

__all__ = ["Worker"]
