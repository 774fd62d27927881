"""``python -m ssdrbm_server.healthcheck [--ready | --live | --worker] [host:port]``: the probe.

Exit 0 when healthy, 1 when not, 2 on a usage or configuration error. It asks grpc.health.v1 for
an entry readiness.py registers (``--ready`` the default, ``--live``, ``--service NAME``), or
with ``--worker`` checks a worker's heartbeat file. It reads the server's own ``SSDRBM_*``
settings, so in the server's container it needs no options: the target is the port of
``SSDRBM_LISTEN_ADDRESS`` on 127.0.0.1, and with ``SSDRBM_TLS_CERT_FILE`` set it connects with
TLS, trusting ``SSDRBM_TLS_CA_FILE`` (or the certificate itself, when self-signed) and expecting
the certificate's first DNS name, since a certificate for a host name does not name 127.0.0.1.
Health needs no token: the authentication interceptor lets it through.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.readiness import LIVENESS, READINESS, heartbeat_age

DEFAULT_TARGET = "127.0.0.1:50051"
TIMEOUT_S = 3.0


# How to verify the server: its channel credentials (trusted roots, and a client certificate
# where the server requires one) and the name expected in its certificate ("": the target's).
Tls = tuple[grpc.ChannelCredentials, str]


def check(
    target: str, *, service: str = "", timeout_s: float = TIMEOUT_S, tls: Tls | None = None
) -> bool:
    """True when ``target`` answers SERVING for ``service`` ("" = the whole server)."""
    if tls is None:
        channel = grpc.insecure_channel(target)
    else:
        credentials, server_name = tls
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        channel = grpc.secure_channel(target, credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def local_target(listen_address: str) -> str:
    """Where a probe on the server's own host reaches ``listen_address`` (``0.0.0.0:p`` and
    ``[::]:p`` listen on every address, loopback included)."""
    host, _, port = listen_address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def certificate_dns_name(cert_file: str) -> str:
    """The first DNS name of a PEM certificate ("" if it has none or cannot be read)."""
    try:
        # The standard library's certificate decoder, the one ssl's own tests use.
        decoded = ssl._ssl._test_decode_cert(cert_file)  # type: ignore[attr-defined]
    except (OSError, ssl.SSLError, AttributeError):
        return ""
    names = [value for kind, value in decoded.get("subjectAltName", ()) if kind == "DNS"]
    return names[0] if names else ""


def tls_for(args: argparse.Namespace, settings: Settings) -> Tls | None:
    """TLS as the options say, else as the server's settings say; None for plaintext."""
    server_cert = settings.tls_cert_file
    if not (args.tls or args.ca or server_cert):
        return None
    ca = args.ca or settings.tls_ca_file or server_cert
    server_name = args.server_name
    if server_name is None:
        server_name = certificate_dns_name(server_cert) if server_cert else ""
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(ca),  # None: the system's roots
        private_key=_read(args.key),
        certificate_chain=_read(args.cert),
    )
    return credentials, server_name


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ssdrbm_server.healthcheck", description=__doc__.splitlines()[0]
    )
    parser.add_argument("target", nargs="?", help="host:port (default: SSDRBM_LISTEN_ADDRESS)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--ready", action="store_true", help=f"the '{READINESS}' entry (default)")
    what.add_argument("--live", action="store_true", help=f"the '{LIVENESS}' entry")
    what.add_argument("--service", help="this entry ('' for the whole server)")
    what.add_argument("--worker", action="store_true", help="a worker's heartbeat file")
    parser.add_argument("--tls", action="store_true", help="connect with TLS (system roots)")
    parser.add_argument("--ca", help="CA certificate (PEM) to verify the server with")
    parser.add_argument("--server-name", help="name expected in the server's certificate")
    parser.add_argument("--cert", help="client certificate (PEM), where the server asks for one")
    parser.add_argument("--key", help="client private key (PEM) for --cert")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds to wait")
    return parser


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """Exit code 0 when healthy, 1 otherwise, 2 for a configuration error."""
    args = parser().parse_args(argv)
    try:
        settings = Settings.from_env(os.environ if environ is None else environ)
    except ConfigError as exc:
        print(f"healthcheck: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.worker:
        if not settings.worker_heartbeat_file:
            print("healthcheck: set SSDRBM_WORKER_HEARTBEAT_FILE for --worker", file=sys.stderr)
            return 2
        age = heartbeat_age(settings.worker_heartbeat_file)  # None: no heartbeat file
        return 0 if age is not None and age <= settings.lease_seconds else 1
    service = args.service if args.service is not None else LIVENESS if args.live else READINESS
    target = args.target or local_target(settings.listen_address)
    try:
        tls = tls_for(args, settings)
    except OSError as exc:
        print(f"healthcheck: cannot read a TLS file: {exc}", file=sys.stderr)
        return 2
    return 0 if check(target, service=service, timeout_s=args.timeout, tls=tls) else 1


if __name__ == "__main__":
    sys.exit(main())
