"""Commands that run the service itself: ``serve`` and ``worker``.

They need the server (``ssdcore`` and ``ssdrbm_server``: torch, Redis; ``pip install .
./client ./server`` in a checkout), imported only here and only when one of these commands
runs, so the client stays light. ``ssdrbm serve ARGS`` is ``python -m ssdrbm_server
--wait-for-redis ARGS``: it waits for Redis, saying so on stderr, where the service alone would
start and answer every call UNAVAILABLE (as deployments, whose probes follow it, want).
``ssdrbm worker ARGS`` is ``python -m ssdrbm_server.worker --wait-for-redis ARGS``.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys

from ssdrbm.cli.funnel import ServerNotInstalled

# The package run as ``python -m`` for each command.
ENTRY_POINTS = {"serve": "ssdrbm_server", "worker": "ssdrbm_server.worker"}
_SERVER_DEPENDENCIES = ("ssdrbm_server", "ssdcore", "torch", "redis")
# Options the CLI adds, to both commands, for a person at a terminal (see the module's docstring).
ADDED_OPTIONS = ["--wait-for-redis"]


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    """Add ``serve`` and ``worker`` to the ``ssdrbm`` parser."""
    helps = {
        "serve": ("run the gRPC service with a worker", "--help for options"),
        "worker": ("run a training worker only", "--slots N: N jobs at once"),
    }
    for command, (what, hint) in helps.items():
        text = f"{what} (needs the server install; {hint})"
        # prefix_chars="+": every option after the command (--listen, --help, ...) is the server's.
        parser = commands.add_parser(command, prefix_chars="+", add_help=False, help=text)
        parser.add_argument("server_args", nargs=argparse.REMAINDER)
        parser.set_defaults(run=run_server, server_command=command)


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
    saved_argv = sys.argv
    sys.argv = [f"ssdrbm {args.server_command}", *ADDED_OPTIONS, *args.server_args]
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
