"""Commands that run the service itself: ``serve`` and ``worker``.

They need the server package (``ssdrbm-server``: torch, Redis), imported only here and only when
one of these commands runs, so the client stays light.
"""

from __future__ import annotations

import argparse
import importlib

from ssdrbm.cli.funnel import ServerNotInstalled

# The module whose ``main(argv) -> int`` runs each command.
ENTRY_POINTS = {"serve": "server.__main__", "worker": "server.worker.__main__"}


def register(commands: argparse._SubParsersAction, parents: list) -> None:
    """Add ``serve`` and ``worker`` to the ``ssdrbm`` parser."""
    serve = commands.add_parser(
        "serve",
        help="run the gRPC service with a worker (needs ssdrbm-server)",
        description="Run the service; configured by SSDRBM_* variables (see the server's docs).",
    )
    serve.add_argument(
        "server_args", nargs=argparse.REMAINDER, help="passed on, e.g. --listen 0.0.0.0:50051"
    )
    serve.set_defaults(run=run_serve, server_command="serve")

    worker = commands.add_parser("worker", help="run a training worker only (needs ssdrbm-server)")
    worker.add_argument("server_args", nargs=argparse.REMAINDER, help="passed to the worker")
    worker.set_defaults(run=run_serve, server_command="worker")


def load_server_main(command: str):
    """The server's ``main(argv) -> int``, or ServerNotInstalled when it cannot be imported."""
    try:
        module = importlib.import_module(ENTRY_POINTS[command])
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] in ("server", "torch", "redis", "ssdcore"):
            raise ServerNotInstalled(str(error)) from None
        raise
    return module.main


def run_serve(args: argparse.Namespace) -> int:
    """Hand over to the server package's entry point."""
    main = load_server_main(args.server_command)
    return int(main(list(args.server_args)) or 0)
