"""`python -m bench.service_host`: the service (gRPC server + worker) as a separate process.

The service case measures the server as clients see it, so the server runs in its own process:
its memory is its own, and the benchmark's load generator does not share its interpreter. The
settings come from SSDRBM_* variables like any deployment; the listener is forced onto
127.0.0.1 port 0 (the metrics and HTTP ports off), and the bound port is printed on stdout as
`PORT <n>` once it serves.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from ssdrbm_server.app import Service, serve
from ssdrbm_server.config import Settings
from ssdrbm_server.cpus import pin_this_process

READY_PREFIX = "PORT "


def main() -> int:
    settings = Settings.from_env(listen_address="127.0.0.1:0", metrics_port=0, http_port=0)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr)
    pin_this_process(settings.serving_cpu_set, "serving")  # as `python -m ssdrbm_server` does

    def announce(service: Service) -> None:
        sys.stdout.write(f"{READY_PREFIX}{service.port}\n")
        sys.stdout.flush()

    asyncio.run(serve(settings, on_ready=announce))
    return 0


if __name__ == "__main__":
    sys.exit(main())
