"""What the two programs, ``python -m ssdrbm_server`` (the service, with a worker by default)
and ``python -m ssdrbm_server.worker`` (a worker alone), share: their common options, the help's
list of the settings a first run needs (defaults read from `Settings`), and the way from the
environment to an exit code — 0 stopped, 1 failed while running, 2 a configuration error, 130
given up while waiting for Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import textwrap
from collections.abc import Callable, Coroutine
from typing import Any

from ssdrbm_server import logs, tracing
from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.redis_wait import wait_for_redis

EXIT_CODES = "exit codes: 0 stopped, 1 failed while running, 2 configuration error"
REDIS_URL_MEANING = (
    "the Redis that holds jobs; it must keep an append-only file "
    "(redis-server --appendonly yes --dir DIR)"
)
SLOTS_MEANING = "jobs (or packs) trained at once, one training process each (0: from the machine)"
DATA_DIR_MEANING = "where the real data sets are (MNIST, Frey Face); empty: the repository's"


def parser(
    prog: str, description: str, settings: tuple[tuple[str, str], ...]
) -> argparse.ArgumentParser:
    """The program's argument parser: its description, ``--slots`` and ``--wait-for-redis``, and
    an epilog naming ``settings`` ((field, meaning) pairs) with their defaults."""
    result = argparse.ArgumentParser(
        prog=prog,
        description=textwrap.fill(description, width=78),
        epilog=epilog(settings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    result.add_argument(
        "--slots", type=int, metavar="N", help=f"{SLOTS_MEANING} (SSDRBM_WORKER_SLOTS)"
    )
    result.add_argument(
        "--wait-for-redis",
        action="store_true",
        help="start once Redis answers, saying so on stderr (without it: start at once, and "
        "retry, unready, until Redis is up)",
    )
    return result


def epilog(settings: tuple[tuple[str, str], ...]) -> str:
    """The settings a first run needs with their defaults, the pointer to the rest, the exit
    codes."""
    defaults = {field.name: field.default for field in dataclasses.fields(Settings)}
    lines = ["the settings a first run needs (all of them, with their reasons: docs/SERVICE.md):"]
    indent = " " * 6
    for name, meaning in settings:
        default = "empty" if defaults[name] == "" else defaults[name]
        lines.append(f"  SSDRBM_{name.upper()} (default {default})")
        lines += textwrap.wrap(
            meaning, 78, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )
    lines.append(EXIT_CODES)
    return "\n".join(lines)


def run(
    program: str,
    args: argparse.Namespace,
    main: Callable[[Settings], Coroutine[Any, Any, None]],
    *,
    tracing_name: str,
    overrides: dict[str, object] | None = None,
    before_start: Callable[[Settings], None] | None = None,
) -> int:
    """Settings from the environment and ``args`` (``overrides`` too), logging and tracing set
    up (spans named ``tracing_name``), ``before_start(settings)``, Redis awaited when asked,
    then ``main(settings)`` until it returns; the exit code. A configuration error, found
    before or at the start, is one line on stderr naming ``program``."""
    overrides = dict(overrides or {})
    if args.slots is not None:
        overrides["worker_slots"] = args.slots
    try:
        settings = Settings.from_env(**overrides)
        logs.configure(settings.log_level, settings.log_format)
        tracing.configure(settings, service_name=tracing_name)
        if before_start is not None:
            before_start(settings)
        if args.wait_for_redis:
            wait_for_redis(settings, program)
        asyncio.run(main(settings))
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT, as shells expect (given up while waiting for Redis)
    except ConfigError as exc:  # in the settings, or found at start (a Redis that would lose jobs)
        print(f"{program}: configuration error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError:
        logging.getLogger("ssdrbm_server").exception("%s stopped with an error", program)
        return 1
    finally:
        tracing.shutdown()
    return 0
