"""Commands that run the service itself: ``serve`` and ``worker``.

They need the server (``ssdcore`` and ``ssdrbm_server``: torch, Redis; ``pip install .`` in a
checkout), imported only here and only when one of these commands runs, so the client stays
light. ``ssdrbm serve ARGS`` runs ``python -m ssdrbm_server ARGS``, and ``ssdrbm worker ARGS``
runs ``python -m ssdrbm_server.worker ARGS``, once Redis answers: until then they wait, saying
so on stderr. A service started without its job store would answer every call UNAVAILABLE (as
``python -m ssdrbm_server`` does, for deployments whose probes follow it), where a person who
typed ``ssdrbm serve`` should see at once what is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import runpy
import sys
import time
from urllib.parse import urlsplit, urlunsplit

from ssdrbm.cli.funnel import ServerNotInstalled

# The package run as ``python -m`` for each command.
ENTRY_POINTS = {"serve": "ssdrbm_server", "worker": "ssdrbm_server.worker"}
_SERVER_DEPENDENCIES = ("ssdrbm_server", "ssdcore", "torch", "redis")
REDIS_POLL_S = 0.5  # between two tries while Redis does not answer
_HELP = ("-h", "--help")


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    """Add ``serve`` and ``worker`` to the ``ssdrbm`` parser."""
    # prefix_chars="+": every option after the command (--listen, --help, ...) is the server's.
    serve = commands.add_parser(
        "serve",
        prefix_chars="+",
        add_help=False,
        help="run the gRPC service with a worker (needs the server install; --help for options)",
    )
    serve.add_argument("server_args", nargs=argparse.REMAINDER)
    serve.set_defaults(run=run_server, server_command="serve")

    worker = commands.add_parser(
        "worker",
        prefix_chars="+",
        add_help=False,
        help="run a training worker only (needs the server install)",
    )
    worker.add_argument("server_args", nargs=argparse.REMAINDER)
    worker.set_defaults(run=run_server, server_command="worker")


def import_server(package: str) -> None:
    """Import ``package``; ServerNotInstalled when it (or torch, Redis) is missing."""
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] in _SERVER_DEPENDENCIES:
            raise ServerNotInstalled(str(error)) from None
        raise


def run_server(args: argparse.Namespace) -> int:
    """Run the server package's ``__main__`` with the remaining arguments; its exit status."""
    package = ENTRY_POINTS[args.server_command]
    import_server(package)
    if not any(arg in _HELP for arg in args.server_args):
        wait_for_redis(f"ssdrbm {args.server_command}")
    saved_argv = sys.argv
    sys.argv = [f"ssdrbm {args.server_command}", *args.server_args]
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=False)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved_argv
    return 0


def wait_for_redis(program: str, *, poll_s: float = REDIS_POLL_S) -> None:
    """Return once the Redis of the server's settings (SSDRBM_REDIS_URL) answers a PING.

    While it does not, one line on stderr says what is awaited and how to provide it; another
    says when it answers. Settings that do not load are left for the server to report.
    """
    from ssdrbm_server.config import ConfigError, Settings

    try:
        settings = Settings.from_env()
    except ConfigError:
        return
    started = time.monotonic()
    if asyncio.run(_redis_answers(settings.redis_url, settings.redis_cluster)):
        return
    print(
        f"{program}: waiting for Redis at {printable_url(settings.redis_url)} "
        "(SSDRBM_REDIS_URL): start it with 'redis-server', or point SSDRBM_REDIS_URL at a "
        "running one; Ctrl-C to give up",
        file=sys.stderr,
        flush=True,
    )
    while not asyncio.run(_redis_answers(settings.redis_url, settings.redis_cluster)):
        time.sleep(poll_s)
    waited = time.monotonic() - started
    print(f"{program}: Redis answers after {waited:.0f} s; starting", file=sys.stderr, flush=True)


async def _redis_answers(url: str, cluster: bool) -> bool:
    """Whether Redis at ``url`` answers a PING, through the server's own connection rules."""
    import redis.exceptions

    from ssdrbm_server.store.connection import connect

    client = None
    try:
        client = connect(url, cluster=cluster)
        return bool(await client.ping())
    except (redis.exceptions.RedisError, OSError):
        return False
    finally:
        if client is not None:
            await client.aclose()


def printable_url(url: str) -> str:
    """``url`` fit to print: a password in it is replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=user + host))
