"""``python -m ssdrbm_server.healthcheck [host:port]``: exit 0 when the service reports SERVING.

Used by the Docker HEALTHCHECK and docker-compose; it speaks the standard grpc.health.v1
protocol, so any other health prober (grpc_health_probe, Kubernetes gRPC probes) works as well.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


def check(target: str, *, service: str = "", timeout_s: float = 3.0) -> bool:
    """True when ``target`` answers SERVING for ``service`` ("" = the whole server)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    """Exit code 0 when healthy, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m ssdrbm_server.healthcheck")
    parser.add_argument("target", nargs="?", default=DEFAULT_TARGET, help="host:port")
    parser.add_argument("--service", default="", help="service name (default: the server)")
    args = parser.parse_args(argv)
    return 0 if check(args.target, service=args.service) else 1


if __name__ == "__main__":
    sys.exit(main())
