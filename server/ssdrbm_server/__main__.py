"""``python -m ssdrbm_server``: run the gRPC service (and, by default, a worker) from the
SSDRBM_* settings.

Options on the command line override the environment:
  --no-worker     serve the API only (workers run elsewhere: ``python -m ssdrbm_server.worker``)
  --listen ADDR   host:port to listen on (SSDRBM_LISTEN_ADDRESS)
  --wait-for-redis  start once Redis answers, saying so meanwhile (``ssdrbm serve`` passes it)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import textwrap

from ssdrbm_server import logs, tracing
from ssdrbm_server.app import serve
from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.cpus import pin_this_process
from ssdrbm_server.exposure import check_exposure
from ssdrbm_server.redis_wait import wait_for_redis

DESCRIPTION = (
    "Run the ssdrbm gRPC service (and, by default, a training worker) until SIGTERM or Ctrl-C, "
    "configured by SSDRBM_* environment variables; the options below override them."
)
# The settings a first run needs, with what each means; their defaults come from Settings.
MAIN_SETTINGS = (
    ("redis_url", "the Redis that holds jobs; it must keep an append-only file "
     "(redis-server --appendonly yes --dir DIR)"),
    ("listen_address", "the gRPC address"),
    ("http_port", "the HTTP front: REST inference and the dashboard at /dashboard/ (0: off)"),
    ("metrics_port", "Prometheus /metrics (0: off)"),
    ("auth_mode", "none (development) or token, with SSDRBM_AUTH_TOKENS_FILE"),
    ("data_dir", "where the real data sets are (MNIST, Frey Face); empty: the repository's"),
)  # fmt: skip


def epilog() -> str:
    """The main settings with their defaults, the pointer to the rest, the exit codes."""
    defaults = {field.name: field.default for field in dataclasses.fields(Settings)}
    lines = ["the settings a first run needs (all of them, with their reasons: docs/SERVICE.md):"]
    for name, meaning in MAIN_SETTINGS:
        lines.append(f"  SSDRBM_{name.upper()} (default {defaults[name] or 'empty'})")
        indent = " " * 6
        lines += textwrap.wrap(
            meaning, 78, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )
    lines.append("exit codes: 0 stopped, 1 failed while running, 2 configuration error")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse options, configure logging, and serve until SIGTERM/SIGINT; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m ssdrbm_server",
        description=textwrap.fill(DESCRIPTION, width=78),
        epilog=epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--no-worker", action="store_true", help="do not run a worker here")
    parser.add_argument("--listen", help="host:port to listen on")
    parser.add_argument(
        "--wait-for-redis",
        action="store_true",
        help="start once Redis answers, saying so on stderr (without it: start at once, and "
        "answer UNAVAILABLE until Redis is up)",
    )
    args = parser.parse_args(argv)
    overrides: dict[str, object] = {}
    if args.no_worker:
        overrides["run_worker"] = False
    if args.listen:
        overrides["listen_address"] = args.listen
    try:
        settings = Settings.from_env(**overrides)
        check_exposure(settings)  # refused here with exit code 2, before anything starts
    except ConfigError as exc:
        print(f"ssdrbm server: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, settings.log_format)
    try:
        tracing.configure(settings)
    except ConfigError as exc:
        print(f"ssdrbm server: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.wait_for_redis:
        try:
            wait_for_redis(settings, "ssdrbm server")
        except KeyboardInterrupt:
            return 130  # 128 + SIGINT, as shells expect
    pin_this_process(settings.serving_cpu_set, "serving")  # before gRPC starts its threads
    try:
        asyncio.run(serve(settings))
    except ConfigError as exc:  # found at start, e.g. a Redis that would lose jobs
        print(f"ssdrbm server: configuration error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError:
        logging.getLogger("ssdrbm_server").exception("the service stopped with an error")
        return 1
    finally:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
