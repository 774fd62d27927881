"""``python -m ssdrbm_server``: run the gRPC service (and, by default, a worker) from the
SSDRBM_* settings; the options override them (``--help`` lists them with the main settings).
The way from settings to an exit code is the worker's too (entry_point.py).
"""

from __future__ import annotations

import sys

from ssdrbm_server import entry_point
from ssdrbm_server.app import serve
from ssdrbm_server.config import Settings
from ssdrbm_server.cpus import pin_this_process
from ssdrbm_server.exposure import check_exposure

DESCRIPTION = (
    "Run the ssdrbm gRPC service (and, by default, a training worker) until SIGTERM or Ctrl-C, "
    "configured by SSDRBM_* environment variables; the options below override them."
)
# The settings a first run needs, with what each means; their defaults come from Settings.
MAIN_SETTINGS = (
    ("redis_url", entry_point.REDIS_URL_MEANING),
    ("listen_address", "the gRPC address"),
    ("http_port", "the HTTP front: REST inference and the dashboard at /dashboard/ (0: off)"),
    ("metrics_port", "Prometheus /metrics (0: off)"),
    ("auth_mode", "none (development) or token, with SSDRBM_AUTH_TOKENS_FILE"),
    ("worker_slots", entry_point.SLOTS_MEANING),
    ("data_dir", entry_point.DATA_DIR_MEANING),
)


def before_start(settings: Settings) -> None:
    """Refuse an exposed address nobody guards (exit 2), and keep the API on its CPUs before
    gRPC starts its threads."""
    check_exposure(settings)
    pin_this_process(settings.serving_cpu_set, "serving")


def main(argv: list[str] | None = None) -> int:
    """Parse options and serve until SIGTERM/SIGINT; returns the exit code."""
    parser = entry_point.parser("python -m ssdrbm_server", DESCRIPTION, MAIN_SETTINGS)
    parser.add_argument("--no-worker", action="store_true", help="do not run a worker here")
    parser.add_argument("--listen", help="host:port to listen on (SSDRBM_LISTEN_ADDRESS)")
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {}
    if args.no_worker:
        overrides["run_worker"] = False
    if args.listen:
        overrides["listen_address"] = args.listen
    return entry_point.run(
        "ssdrbm server",
        args,
        serve,
        tracing_name="ssdrbm",
        overrides=overrides,
        before_start=before_start,
    )


if __name__ == "__main__":
    sys.exit(main())
