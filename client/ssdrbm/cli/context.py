"""Options every command shares (where the service is, how to authenticate) and the client."""

from __future__ import annotations

import argparse
import os

from ssdrbm.client import Client
from ssdrbm.connection import TLS, Connection, tls_from_env
from ssdrbm.retry import RetryPolicy

ENV_WAIT = "SSDRBM_WAIT"
# Commands typed right after `ssdrbm serve &` find the service still starting; a mistyped
# address is reported after this long.
DEFAULT_WAIT_S = 10.0

# dest, flag, argparse keywords; every default comes from the environment (see ssdrbm.connection)
_CONNECTION_OPTIONS: list[tuple[str, str, dict]] = [
    ("target", "--target", {"help": "host:port of the service [$SSDRBM_TARGET, localhost:50051]"}),
    ("token", "--token", {"help": "bearer token [$SSDRBM_TOKEN]"}),
    ("tls", "--tls", {"action": "store_true", "help": "TLS with system roots [$SSDRBM_TLS]"}),
    ("tls_ca", "--tls-ca", {"metavar": "PEM", "help": "server's CA [$SSDRBM_TLS_CA]"}),
    ("tls_cert", "--tls-cert", {"metavar": "PEM", "help": "mTLS client cert [$SSDRBM_TLS_CERT]"}),
    ("tls_key", "--tls-key", {"metavar": "PEM", "help": "mTLS client key [$SSDRBM_TLS_KEY]"}),
    ("timeout", "--timeout", {"type": float, "metavar": "S", "help": "deadline per call [30]"}),
    ("wait", "--wait", {"type": float, "metavar": "S", "help": "retry if unreachable [10]"}),
    ("debug", "--debug", {"action": "store_true", "help": "show tracebacks"}),
]


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """Add the shared options; they may be given before or after the command name."""
    group = parser.add_argument_group("connection")
    for dest, flag, kwargs in _CONNECTION_OPTIONS:
        # SUPPRESS: an option given before the command must not be reset by the subcommand.
        group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, **kwargs)


def option(args: argparse.Namespace, name: str):
    """A shared option's value, None when it was given nowhere."""
    return getattr(args, name, None)


def connection_from_args(args: argparse.Namespace) -> Connection:
    """Connection settings: command-line options first, then environment variables."""
    tls: TLS | None = tls_from_env()
    if option(args, "tls") or option(args, "tls_ca") or option(args, "tls_cert"):
        base = tls or TLS()
        tls = TLS(
            ca=option(args, "tls_ca") or base.ca,
            cert=option(args, "tls_cert") or base.cert,
            key=option(args, "tls_key") or base.key,
        )
    return Connection.resolve(
        option(args, "target"),
        token=option(args, "token"),
        tls=tls if tls is not None else False,
        timeout=option(args, "timeout"),
    )


def client_from_args(args: argparse.Namespace) -> Client:
    """A :class:`~ssdrbm.Client` configured from the command line and the environment."""
    connection = connection_from_args(args)
    wait = option(args, "wait")
    if wait is None:
        wait = float(os.environ.get(ENV_WAIT) or DEFAULT_WAIT_S)
    return Client(
        connection.target,
        token=connection.token,
        tls=connection.tls if connection.tls is not None else False,
        timeout=connection.timeout,
        retry=RetryPolicy.waiting(wait),
    )
