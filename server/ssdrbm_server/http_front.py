"""The service's one HTTP front: health, the Open Inference Protocol's REST form
(inference/rest.py) and the dashboard's mount point, served by uvicorn on the gRPC server's own
asyncio loop (a connection costs a coroutine, not a thread).

``app.Service`` starts and stops it with the gRPC server (``SSDRBM_HTTP_ADDRESS``:
``SSDRBM_HTTP_PORT``, port 0 turns it off; beyond loopback it follows the gRPC address's rules,
exposure.py), with the gRPC listener's TLS settings. The framework is Starlette, the ASGI toolkit
of uvicorn's maintainers, for only what the front uses (routing, mounts, requests, JSON
responses); the protocol's free-form JSON tensors gain nothing from FastAPI's pydantic layer.
``/v2/health/live`` and ``/v2/health/ready`` are open, as probes need: ready follows the
``readiness`` health entry (readiness.py), 503 while it is not SERVING and during shutdown.

Limits against slow and hostile clients (``SSDRBM_HTTP_*``, each one's reason in config.py),
which uvicorn alone lacks or counts before authentication: header and body deadlines
(``DeadlineProtocol``), a connection cap, a body size checked before any parsing (413), request
slots per server and per tenant taken after authentication (``RequestGate``: 429), and JSON
malformed or nested deeper than ``MAX_JSON_DEPTH`` answered 400, never 500. Errors are
``{"error": message}`` with the HTTP status of their gRPC code; an answer given before the
request's body was read closes the connection, so the unread rest is never taken for a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator
from http import HTTPStatus
from typing import Any

import grpc
import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from ssdrbm_server.auth import AuthInterceptor
from ssdrbm_server.call_slots import CallSlots, SlotCap
from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.errors import InvalidArgumentError, ServiceError, status_for

logger = logging.getLogger(__name__)

HEALTH_LIVE = "/v2/health/live"
HEALTH_READY = "/v2/health/ready"
DASHBOARD_PATH = "/dashboard"
BACKLOG = 128  # connections the kernel queues before they are accepted
# The protocol's documents nest 5 deep ({"inputs": [{"data": [[...]]}]}); more is not a request.
MAX_JSON_DEPTH = 8
READY_STATUS = {True: HTTPStatus.OK, False: HTTPStatus.SERVICE_UNAVAILABLE}
# gRPC code → HTTP status, as Google's APIs map them.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: HTTPStatus.CONFLICT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
}
_OVER_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)

Handler = Callable[[Request, str], Awaitable[Response]]


class HttpError(Exception):
    """A request the HTTP layer refuses before any operation runs."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the deadlines it lacks (it only times out a connection
    left idle after an answer), and its connection cap applied as connections open.

    The request's progress is h11's view of the client: IDLE until its headers are in, SEND_BODY
    until its body is; each phase gets its own deadline from the moment it begins. Once the
    request is whole, the route's own limits apply (serving deadlines, the request slots).
    """

    def __init__(
        self, *args: Any, deadlines: dict[object, float], max_connections: int, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.deadlines = deadlines  # seconds for each h11 client state that has one
        self.max_connections = max_connections
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: object = None  # the h11 state the deadline is for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_OVER_CONNECTIONS)
            transport.close()  # not held open until its header deadline
            return
        self._follow_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a kept-alive connection starts waiting for headers again

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if self.transport.is_closing():
            state = None
        if state is not self._phase:
            self._set_deadline(state)

    def _set_deadline(self, state: object) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = state
        seconds = self.deadlines.get(state)
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        what = "headers" if self._phase is h11.IDLE else "body"
        logger.debug("closing an HTTP connection from %s: its %s took too long", self.client, what)
        self._deadline = None
        self.transport.close()


class RequestGate:
    """What an authenticated route passes before it works: the caller's token, a request slot
    of the tenant's, and a body within the size limit."""

    def __init__(self, settings: Settings, auth: AuthInterceptor) -> None:
        self.auth = auth
        self.max_body_bytes = settings.http_max_body_bytes
        self.slots = CallSlots(
            SlotCap(
                settings.http_max_requests,
                "http_max_requests",
                "this server already handles {count} HTTP requests "
                "(SSDRBM_HTTP_MAX_REQUESTS={limit}); retry in a moment",
            ),
            SlotCap(
                settings.http_max_requests_per_tenant,
                "http_max_requests_per_tenant",
                "tenant {tenant!r} already has {count} HTTP requests in progress "
                "(SSDRBM_HTTP_MAX_REQUESTS_PER_TENANT={limit}); wait for one to finish",
            ),
        )

    async def body(self, request: Request) -> bytes:
        """The request's body, refused (413) once it would pass ``http_max_body_bytes``: from
        Content-Length before reading, and while reading a chunked one."""
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > self.max_body_bytes:  # h11 checked digits
            raise self._too_large()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
        request.state.body_read = True
        return b"".join(chunks)

    def _too_large(self) -> HttpError:
        return HttpError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"request body over {self.max_body_bytes} bytes (SSDRBM_HTTP_MAX_BODY_BYTES); send "
            "smaller batches, or large ones over gRPC with raw contents",
        )

    def route(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        """``handler(request, tenant)`` run authenticated, in a request slot, with every failure
        answered as a JSON error."""

        async def endpoint(request: Request) -> Response:
            try:  # the tenant of ``Authorization: Bearer <token>``, as auth.py resolves it
                authorization = request.headers.get("authorization")
                metadata = [] if authorization is None else [("authorization", authorization)]
                tenant = self.auth.resolve(metadata)
                with self.slots.hold(tenant):
                    return await handler(request, tenant)
            except Exception as exc:  # every failure becomes an HTTP answer
                return error_response(request, exc)

        return endpoint


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object; InvalidArgument (400) when it is not JSON, not an object,
    or nested deeper than ``MAX_JSON_DEPTH``. Parses a whole body: call it off the event loop."""
    try:
        document = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        reason = "nested too deep" if isinstance(exc, RecursionError) else exc
        raise InvalidArgumentError("request body", f"is not JSON ({reason})") from None
    if not isinstance(document, dict):
        raise InvalidArgumentError("request body", "must be a JSON object")
    if not _nesting_within(document, MAX_JSON_DEPTH):
        raise InvalidArgumentError(
            "request body", f"nests deeper than {MAX_JSON_DEPTH} levels; no request needs that"
        )
    return document


def _nesting_within(document: Any, limit: int) -> bool:
    """True when no object or array in ``document`` lies more than ``limit`` levels deep
    (iterative: the check itself cannot run out of stack)."""
    level = [document]
    for _depth in range(limit):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return True
    return False


def error_response(request: Request, exc: BaseException) -> JSONResponse:
    """The HTTP answer of a failed request: its gRPC status mapped to HTTP, ``{"error": ...}``."""
    if isinstance(exc, HttpError):
        status, message = exc.status, exc.message
    elif isinstance(exc, ClientDisconnect):
        status, message = HTTPStatus.BAD_REQUEST, "the client went away"  # nobody reads it
    else:
        code, message = status_for(exc)
        if not isinstance(exc, ServiceError) and code is grpc.StatusCode.INTERNAL:
            logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        status = HTTP_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    headers = {}
    if _body_unread(request):
        headers["connection"] = "close"  # the unread rest must not be taken for a request
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(retry_after_s)))
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _body_unread(request: Request) -> bool:
    if getattr(request.state, "body_read", False):
        return False
    declared = request.headers.get("content-length")
    return "transfer-encoding" in request.headers or declared not in (None, "0")


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no route, wrong method) as JSON errors too."""
    assert isinstance(exc, HTTPException)
    message = {
        HTTPStatus.NOT_FOUND: f"no route {request.url.path}; see /v2/models/{{name}}",
        HTTPStatus.METHOD_NOT_ALLOWED: f"{request.url.path} does not take {request.method}",
    }.get(HTTPStatus(exc.status_code), exc.detail)
    return error_response(request, HttpError(HTTPStatus(exc.status_code), message))


def dashboard_url(settings: Settings) -> str | None:
    """The dashboard's address as a browser on this host opens it; None with the front off."""
    if not settings.http_port:
        return None
    host = settings.http_address
    if host in ("0.0.0.0", "::"):  # every interface: this host reaches it on loopback
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if settings.tls_cert_file else "http"
    return f"{scheme}://{host}:{settings.http_port}{DASHBOARD_PATH}/"


def _listen(address: str, port: int) -> socket.socket:
    """The front's listening socket, bound now, as the gRPC port is: a taken address stops the
    service before it starts (ConfigError: ``python -m ssdrbm_server`` exits 2 with the fix)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        listener = socket.create_server((address, port), family=family, backlog=BACKLOG)
    except OSError as exc:
        raise ConfigError(
            f"the HTTP front cannot listen on {address}:{port} ({exc.strerror or exc}): set "
            "SSDRBM_HTTP_PORT to a free port, or 0 to turn the HTTP front off"
        ) from exc
    listener.setblocking(False)
    return listener


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the service: signals belong to the service (app.serve), which stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpFront:
    """The HTTP server on the running event loop; ``routes`` are served beside health."""

    def __init__(
        self, settings: Settings, routes: list[BaseRoute], *, ready: Callable[[], Awaitable[bool]]
    ) -> None:
        self.settings = settings
        self._ready = ready
        self.app = Starlette(
            routes=[
                Route(HEALTH_LIVE, self._live, methods=["GET"]),
                Route(HEALTH_READY, self._readiness, methods=["GET"]),
                *routes,
            ],
            exception_handlers={HTTPException: _http_exception},
        )
        self._listener = _listen(settings.http_address, settings.http_port)
        self.port: int = self._listener.getsockname()[1]
        self._server: _EmbeddedServer | None = None
        self._serving: asyncio.Task[None] | None = None

    def mount_dashboard(self, app: ASGIApp) -> None:
        """Serve ``app`` under ``DASHBOARD_PATH``, with the front's limits (and, for its own
        routes, its own authentication: ``RequestGate.route``)."""
        self.app.router.routes.append(Mount(DASHBOARD_PATH, app=app))

    async def _live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def _readiness(self, request: Request) -> Response:
        ready = await self._ready()
        return JSONResponse({"ready": ready}, status_code=READY_STATUS[ready])

    async def start(self) -> int:
        """Serve on the running loop; returns the bound port."""
        settings = self.settings
        protocol = functools.partial(
            DeadlineProtocol,
            deadlines={
                h11.IDLE: settings.http_header_timeout_s,
                h11.SEND_BODY: settings.http_body_timeout_s,
            },
            max_connections=settings.http_max_connections,
        )
        config = uvicorn.Config(
            self.app,
            http=protocol,  # type: ignore[arg-type]
            lifespan="off",
            log_config=None,  # the service's logging, untouched
            access_log=False,
            server_header=False,
            # One above the connections DeadlineProtocol keeps open, so uvicorn's own 503 (for
            # connections or requests at the limit) never refuses a connection it kept.
            limit_concurrency=settings.http_max_connections + 1,
            backlog=BACKLOG,
            timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_s)),
            ssl_certfile=settings.tls_cert_file or None,
            ssl_keyfile=settings.tls_key_file or None,
            ssl_ca_certs=settings.tls_client_ca_file or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if settings.tls_client_ca_file else ssl.CERT_NONE,
        )
        self._server = _EmbeddedServer(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[self._listener]))
        while not self._server.started and not self._serving.done():
            await asyncio.sleep(0.01)
        if self._serving.done():
            self._serving.result()  # raises what stopped it
        logger.info(
            "HTTP front on %s://%s:%d (health /v2/health/*, inference /v2, dashboard %s/)",
            "https" if settings.tls_cert_file else "http",
            settings.http_address,
            self.port,
            DASHBOARD_PATH,
        )
        return self.port

    async def stop(self) -> None:
        """Stop accepting; requests in flight get the shutdown grace, then are cancelled."""
        if self._server is None or self._serving is None:
            self._listener.close()  # never served
            return
        self._server.should_exit = True
        await asyncio.gather(self._serving, return_exceptions=True)
