"""The one error mapping: domain errors, Redis outages and bugs → gRPC statuses.

A real grpc.aio server (port 0, its own event loop in a thread) runs throw-away handlers behind
ErrorMappingInterceptor; a synchronous client checks the status and message of each call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import redis.exceptions

from ssdrbm_server import errors
from ssdrbm_server.errors import ErrorMappingInterceptor, status_for

SERVICE = "ssdrbm.v1.RBMService"  # the interceptor only handles this service's methods

RAISED: dict[str, Exception] = {
    "not_found": errors.NotFoundError("job 'x' not found"),
    "invalid": errors.InvalidArgumentError("optimizer.lr", "must be > 0"),
    "precondition": errors.FailedPreconditionError("no checkpoint yet"),
    "exhausted": errors.ResourceExhaustedError("too many jobs"),
    "unavailable": errors.UnavailableError("try later"),
    "unauthenticated": errors.UnauthenticatedError("missing token"),
    "denied": errors.PermissionDeniedError("not yours"),
    "exists": errors.AlreadyExistsError("already there"),
    "redis_down": redis.exceptions.ConnectionError("Error 111 connecting to 127.0.0.1:1"),
    "redis_slow": redis.exceptions.TimeoutError("Timeout reading from socket"),
    "bug": KeyError("secret internal detail"),
}
EXPECTED = {
    "not_found": (grpc.StatusCode.NOT_FOUND, "job 'x' not found"),
    "invalid": (grpc.StatusCode.INVALID_ARGUMENT, "optimizer.lr: must be > 0"),
    "precondition": (grpc.StatusCode.FAILED_PRECONDITION, "no checkpoint yet"),
    "exhausted": (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many jobs"),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, "try later"),
    "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED, "missing token"),
    "denied": (grpc.StatusCode.PERMISSION_DENIED, "not yours"),
    "exists": (grpc.StatusCode.ALREADY_EXISTS, "already there"),
    "redis_down": (grpc.StatusCode.UNAVAILABLE, errors.REDIS_UNAVAILABLE_MESSAGE),
    "redis_slow": (grpc.StatusCode.UNAVAILABLE, errors.REDIS_UNAVAILABLE_MESSAGE),
    "bug": (grpc.StatusCode.INTERNAL, errors.INTERNAL_MESSAGE),
}


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    name = request.decode()
    if name == "ok":
        return b"fine"
    if name == "abort":
        await context.abort(grpc.StatusCode.OUT_OF_RANGE, "explicit abort")
    raise RAISED[name]


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first"
    raise RAISED[request.decode()]


class LoopServer:
    """A grpc.aio server with the error interceptor, in a background event loop."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server, self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(
            10
        )

    async def _start(self) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Unary": grpc.unary_unary_rpc_method_handler(_unary),
                "Stream": grpc.unary_stream_rpc_method_handler(_stream),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    server = LoopServer()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel
    server.stop()


def call_unary(channel: grpc.Channel, name: str) -> bytes:
    return channel.unary_unary(f"/{SERVICE}/Unary")(name.encode(), timeout=10)


@pytest.mark.parametrize("name", sorted(RAISED))
def test_unary_errors_map_to_their_status(
    channel: grpc.Channel, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="ssdrbm_server.errors"),
        pytest.raises(grpc.RpcError) as caught,
    ):
        call_unary(channel, name)
    assert (caught.value.code(), caught.value.details()) == EXPECTED[name]
    logged_tracebacks = [r for r in caplog.records if r.exc_info]
    if name == "bug":
        # The client gets a generic message; the log gets the traceback with the detail.
        assert "secret" not in caught.value.details()
        assert logged_tracebacks and "secret internal detail" in caplog.text
    else:
        assert not logged_tracebacks


@pytest.mark.parametrize("name", ["not_found", "redis_down", "bug"])
def test_streaming_errors_after_a_response_map_too(channel: grpc.Channel, name: str) -> None:
    stream = channel.unary_stream(f"/{SERVICE}/Stream")(name.encode(), timeout=10)
    received = []
    with pytest.raises(grpc.RpcError) as caught:
        for item in stream:
            received.append(item)
    assert received == [b"first"]
    assert (caught.value.code(), caught.value.details()) == EXPECTED[name]


def test_success_and_explicit_abort_pass_through(channel: grpc.Channel) -> None:
    assert call_unary(channel, "ok") == b"fine"
    with pytest.raises(grpc.RpcError) as caught:
        call_unary(channel, "abort")
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert caught.value.details() == "explicit abort"


def test_status_for_covers_every_service_error() -> None:
    for cls in errors.ServiceError.__subclasses__():
        instance = cls("f", "m") if cls is errors.InvalidArgumentError else cls("m")
        code, message = status_for(instance)
        assert code is cls.code and code is not grpc.StatusCode.INTERNAL
        assert message.endswith("m")
