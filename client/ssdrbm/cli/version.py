"""``ssdrbm --version``: the client's version, and the service's when it answers.

The client's version is printed first and always; the service is asked once (no waiting, a short
deadline) so that a service that is down costs a note on stderr, not a failure.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from ssdrbm import __version__
from ssdrbm.cli.context import client_for, connection_from_args, option
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.funnel import Context, describe
from ssdrbm.errors import SSDRBMError
from ssdrbm.retry import NO_RETRY

# A version query should not hang on an address that never answers; --timeout may say longer.
VERSION_TIMEOUT_S = 5.0


def run_version(args: argparse.Namespace) -> ExitCode:
    """Print ``ssdrbm X (client)`` and ``server Y at TARGET (...)``; exit 0 either way."""
    print(f"ssdrbm {__version__} (client)", flush=True)
    connection = connection_from_args(args)
    timeout = option(args, "timeout") or VERSION_TIMEOUT_S
    try:
        with client_for(connection, timeout, NO_RETRY) as client:
            info = client.server_info()
    except SSDRBMError as error:
        reason = describe(error, Context(command="--version", target=connection.target)).what
        if error.code == grpc.StatusCode.UNIMPLEMENTED:
            reason = f"the service at {connection.target} is older than GetServerInfo"
        print(f"server: version unknown ({reason}); only the client's is shown", file=sys.stderr)
        return ExitCode.OK
    print(
        f"server {info.version or '?'} at {connection.target} (api {info.api}, "
        f"python {info.python_version}, torch {info.torch_version or '-'})"
    )
    if info.version != __version__:
        print(
            f"ssdrbm: note: the client ({__version__}) and the service ({info.version}) are "
            "different versions; options new in one may be unknown to the other",
            file=sys.stderr,
        )
    return ExitCode.OK
