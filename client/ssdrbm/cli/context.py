"""Options every command shares (where the service is, how to authenticate) and the client."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from ssdrbm.client import Client
from ssdrbm.connection import TLS, Connection, tls_from_env
from ssdrbm.retry import RetryPolicy

ENV_WAIT = "SSDRBM_WAIT"
# Without --wait a command tries once, so a service that is down (or a mistyped address) is
# reported at once; commands typed right after `ssdrbm serve &` pass --wait to let it start.
DEFAULT_WAIT_S = 0.0
# A running service accepts the connection well within this; only a longer wait is announced.
QUIET_CONNECT_S = 0.25

# dest, flag, argparse keywords; every default comes from the environment (see ssdrbm.connection)
_CONNECTION_OPTIONS: list[tuple[str, str, dict]] = [
    ("target", "--target", {"help": "host:port of the service [$SSDRBM_TARGET, localhost:50051]"}),
    ("token", "--token", {"help": "bearer token [$SSDRBM_TOKEN]"}),
    ("tls", "--tls", {"action": "store_true", "help": "TLS with system roots [$SSDRBM_TLS]"}),
    ("tls_ca", "--tls-ca", {"metavar": "PEM", "help": "server's CA [$SSDRBM_TLS_CA]"}),
    ("tls_cert", "--tls-cert", {"metavar": "PEM", "help": "mTLS client cert [$SSDRBM_TLS_CERT]"}),
    ("tls_key", "--tls-key", {"metavar": "PEM", "help": "mTLS client key [$SSDRBM_TLS_KEY]"}),
    ("timeout", "--timeout", {"type": float, "metavar": "S", "help": "deadline per call [30]"}),
    ("wait", "--wait", {"type": float, "metavar": "S", "help": "wait S s for the service [0]"}),
    ("debug", "--debug", {"action": "store_true", "help": "show tracebacks"}),
]


Argument = tuple[tuple[str, ...], dict[str, Any]]


def argument(*flags: str, **keywords: Any) -> Argument:
    """One argument of :func:`add_command`, as ``add_argument`` takes it."""
    return flags, keywords


def json_flag(help: str) -> Argument:
    """``--json``: the result printed as JSON (``help`` says how)."""
    return argument("--json", action="store_true", help=help)


def add_command(
    commands: argparse._SubParsersAction,
    parents: list,
    name: str,
    help: str,
    run: Callable[[argparse.Namespace], int],
    *arguments: Argument,
) -> argparse.ArgumentParser:
    """Add command ``name``, which ``run`` runs, with ``arguments`` in their order."""
    parser = commands.add_parser(name, parents=parents, help=help)
    for flags, keywords in arguments:
        parser.add_argument(*flags, **keywords)
    parser.set_defaults(run=run)
    return parser


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


def wait_seconds(args: argparse.Namespace) -> float:
    """How long to wait for an unreachable service: --wait, $SSDRBM_WAIT, else 0."""
    wait = option(args, "wait")
    if wait is None:
        raw = os.environ.get(ENV_WAIT, "").strip()
        try:
            wait = float(raw) if raw else DEFAULT_WAIT_S
        except ValueError:
            raise ValueError(f"{ENV_WAIT} must be a number of seconds, not {raw!r}") from None
    return max(wait, 0.0)


def wait_for_service(connection: Connection, seconds: float) -> None:
    """Wait until the service accepts a connection, for at most ``seconds``.

    Said on stderr once the connection takes longer than a running service would, so a command
    never sits silent; the command's own call then reports a service that did not come up.
    """
    channel = connection.channel()
    ready = grpc.channel_ready_future(channel)
    try:
        try:
            ready.result(timeout=min(QUIET_CONNECT_S, seconds))
            return
        except grpc.FutureTimeoutError:
            pass
        print(
            f"waiting for {connection.target}… (up to {seconds:g} s, --wait)",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(grpc.FutureTimeoutError):
            ready.result(timeout=max(seconds - QUIET_CONNECT_S, 0.0))
    finally:
        ready.cancel()
        channel.close()


def client_from_args(args: argparse.Namespace) -> Client:
    """A :class:`~ssdrbm.Client` configured from the command line and the environment.

    Without a wait, calls are tried once (an unreachable service fails at once); with one, the
    service is waited for first, and calls are retried while UNAVAILABLE for what is left of it.
    """
    connection = connection_from_args(args)
    wait = wait_seconds(args)
    if wait > 0:
        started = time.monotonic()
        wait_for_service(connection, wait)
        wait -= time.monotonic() - started
    return client_for(connection, connection.timeout, RetryPolicy.waiting(wait))


def client_for(connection: Connection, timeout: float, retry: RetryPolicy) -> Client:
    """A :class:`~ssdrbm.Client` on ``connection``'s target, token and TLS."""
    tls = connection.tls if connection.tls is not None else False
    return Client(connection.target, token=connection.token, tls=tls, timeout=timeout, retry=retry)
