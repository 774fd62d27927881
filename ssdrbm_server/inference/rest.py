"""The REST/JSON form of the Open Inference Protocol, on a port of its own.

Off unless ``SSDRBM_INFERENCE_HTTP_PORT`` is set. A standard-library HTTP server answers from
its own threads (as the /metrics endpoint does) and runs each operation on the service's event
loop, through the same ``InferenceEngine`` as the gRPC form: same model names, serving path,
budgets and tenancy. Every request needs the bearer token the gRPC API takes (``Authorization:
Bearer <token>``), resolved by the same ``AuthInterceptor``. With ``SSDRBM_TLS_CERT_FILE`` set
it speaks HTTPS with the gRPC listener's certificate (and client CA, for mTLS).

Routes: ``GET /v2``, ``GET /v2/health/live``, ``GET /v2/health/ready``,
``GET /v2/models/{name}[/versions/{v}]``, ``GET /v2/models/{name}[/versions/{v}]/ready``,
``POST /v2/models/{name}[/versions/{v}]/infer``. Errors are ``{"error": message}`` with the
HTTP status of their gRPC code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import threading
from collections.abc import Awaitable
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

import grpc
import numpy as np

from ssdrbm_server.auth import AuthInterceptor
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import InvalidArgumentError, ServiceError, status_for
from ssdrbm_server.inference import codec
from ssdrbm_server.inference.engine import SERVER_NAME, InferenceEngine, server_version
from ssdrbm_server.serving import Caller

logger = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 64  # HTTP threads at work at once; more are answered 503 at once
SOCKET_TIMEOUT_S = 30.0  # a client that stops sending its request frees its thread
SHUTDOWN_POLL_S = 0.05  # how often the accept loop looks for stop(), which waits for it
READY_CODE = {True: HTTPStatus.OK, False: HTTPStatus.SERVICE_UNAVAILABLE}
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
# /v2/models/{name}[/versions/{version}][/ready|/infer]
_MODEL_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?(?:/(ready|infer))?")
# The JSON data kinds (numpy's, of the parsed nested lists) each datatype accepts.
_JSON_KINDS = {"FP32": "iuf", "UINT8": "iu", "BOOL": "b"}


class HttpError(Exception):
    """A request the HTTP layer refuses before any operation runs."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class InferenceHttpServer:
    """The REST endpoint: an HTTP server thread calling the engine on the service's loop."""

    def __init__(
        self,
        settings: Settings,
        engine: InferenceEngine,
        auth: AuthInterceptor,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.auth = auth
        self.loop = loop
        self.version = server_version()
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT_REQUESTS)
        self._server = ThreadingHTTPServer(
            (settings.inference_http_address, settings.inference_http_port), _handler_for(self)
        )
        self._server.daemon_threads = True
        if settings.tls_cert_file:
            self._server.socket = _tls_context(settings).wrap_socket(
                self._server.socket, server_side=True
            )
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": SHUTDOWN_POLL_S},
            name="inference-http",
            daemon=True,
        )

    def start(self) -> int:
        """Serve in a background thread; returns the bound port."""
        self._thread.start()
        logger.info(
            "Open Inference Protocol REST on %s://%s:%d/v2",
            "https" if self.settings.tls_cert_file else "http",
            self.settings.inference_http_address,
            self.port,
        )
        return self.port

    def stop(self) -> None:
        """Stop accepting requests and close the socket (requests in flight finish)."""
        self._server.shutdown()
        self._server.server_close()

    def call(self, coroutine: Awaitable[Any]) -> Any:
        """Run an engine operation on the service's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()  # type: ignore[arg-type]

    def answer(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        """(HTTP status, JSON document) for one request."""
        authorization = headers.get("Authorization")
        tenant = self.auth.resolve(
            [] if authorization is None else [("authorization", authorization)]
        )
        if path == "/v2" and method == "GET":
            return HTTPStatus.OK, {"name": SERVER_NAME, "version": self.version, "extensions": []}
        if path == "/v2/health/live" and method == "GET":
            return HTTPStatus.OK, {"live": True}
        if path == "/v2/health/ready" and method == "GET":
            ready = self.call(self.engine.server_ready())
            return READY_CODE[ready], {"ready": ready}
        match = _MODEL_PATH.fullmatch(path)
        if match is None:
            raise HttpError(HTTPStatus.NOT_FOUND, f"no route {path}; see /v2/models/{{name}}")
        name, version, action = unquote(match[1]), unquote(match[2] or ""), match[3]
        if action == "infer":
            _require(method, "POST", path)
            return HTTPStatus.OK, self._infer(tenant, name, version, _json_body(body))
        _require(method, "GET", path)
        if action == "ready":
            ready = self.call(self.engine.model_ready(tenant, name, version))
            return READY_CODE[ready], {"name": name, "ready": ready}
        info = self.call(self.engine.metadata(tenant, name, version))
        return HTTPStatus.OK, asdict(info)

    def _infer(self, tenant: str, name: str, version: str, request: dict[str, Any]) -> Any:
        v = decode_json_input(request, max_elements=self.settings.max_tensor_elements)
        outputs = request.get("outputs") or []
        if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
            raise InvalidArgumentError("outputs", 'must be a list of {"name": ...} objects')
        result = self.call(
            self.engine.infer(
                Caller(tenant=tenant),
                name,
                version,
                v,
                outputs=[str(output.get("name", "")) for output in outputs],
                seed=_json_seed(request.get("parameters") or {}),
            )
        )
        document: dict[str, Any] = {
            "model_name": result.model_name,
            "model_version": result.model_version,
            "outputs": [
                {
                    "name": output,
                    "datatype": codec.OUTPUT_DATATYPE,
                    "shape": list(array.shape),
                    "data": array.ravel().tolist(),
                }
                for output, array in result.outputs
            ],
        }
        if "id" in request:
            document["id"] = request["id"]
        return document


def decode_json_input(request: dict[str, Any], *, max_elements: int) -> np.ndarray:
    """The model input of a JSON inference request (data flat or nested, row-major)."""
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidArgumentError(
            "inputs",
            f'must hold exactly one tensor {{"name": "{codec.INPUT_NAME}", "datatype": ..., '
            '"shape": [batch, n_visible], "data": [...]}',
        )
    tensor = inputs[0]
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(type(dim) is int for dim in shape):
        raise InvalidArgumentError("inputs[0].shape", "must be a list of integers")
    datatype = str(tensor.get("datatype", ""))
    rows_cols = codec.check_input_header(
        str(tensor.get("name", "")),
        datatype,
        shape,
        field="inputs[0]",
        max_elements=max_elements,
    )
    try:
        values = np.asarray(tensor.get("data"))
    except ValueError:
        values = np.asarray(None)  # ragged nesting: refused below with the same message
    if values.dtype.kind not in _JSON_KINDS[datatype]:
        kind = {"FP32": "numbers", "UINT8": "integers 0..255", "BOOL": "true/false"}[datatype]
        raise InvalidArgumentError("inputs[0].data", f"a {datatype} tensor's data must be {kind}")
    return codec.to_model_input(values.ravel(), datatype, rows_cols, field="inputs[0].data")


def _json_seed(parameters: Any) -> int:
    if not isinstance(parameters, dict):
        raise InvalidArgumentError("parameters", "must be a JSON object")
    unknown = set(parameters) - {codec.SEED_PARAMETER} - codec.IGNORED_PARAMETERS
    if unknown:
        raise InvalidArgumentError(
            f"parameters[{sorted(unknown)[0]!r}]",
            f"unknown parameter; the one parameter is {codec.SEED_PARAMETER!r} (hidden_sample)",
        )
    field = f"parameters[{codec.SEED_PARAMETER!r}]"
    return codec.check_seed(parameters.get(codec.SEED_PARAMETER, 0), field=field)


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError("request body", f"is not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise InvalidArgumentError("request body", "must be a JSON object")
    return document


def _require(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise HttpError(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes {allowed}, not {method}")


def _tls_context(settings: Settings) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(settings.tls_client_ca_file)
    return context


def _handler_for(server: InferenceHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = SOCKET_TIMEOUT_S
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def _handle(self, method: str) -> None:
            if not server.slots.acquire(blocking=False):
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "too many requests at once"})
                return
            try:
                body = self._body()
                status, document = server.answer(method, self.path, self.headers, body)
            except HttpError as exc:
                status, document = exc.status, {"error": exc.message}
            except Exception as exc:  # every failure becomes an HTTP answer
                status, document = _error_answer(exc, f"{method} {self.path}")
            finally:
                server.slots.release()
            self._send(status, document)

        def _body(self) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                return b""
            if not length.isdigit():
                raise HttpError(HTTPStatus.BAD_REQUEST, "Content-Length must be a number")
            if int(length) > server.settings.max_message_bytes:
                self.close_connection = True  # the unread body must not be taken for a request
                raise HttpError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request body over {server.settings.max_message_bytes} bytes "
                    "(SSDRBM_MAX_MESSAGE_BYTES); send smaller batches",
                )
            return self.rfile.read(int(length))

        def _send(self, status: int, document: Any) -> None:
            payload = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler


def _error_answer(exc: BaseException, what: str) -> tuple[HTTPStatus, dict[str, str]]:
    """The HTTP status and body of a failed operation (the gRPC mapping, then HTTP's code)."""
    code, message = status_for(exc)
    if not isinstance(exc, ServiceError) and code is grpc.StatusCode.INTERNAL:
        logger.error("unhandled error in %s", what, exc_info=exc)
    status = HTTP_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    return status, {"error": message}


def start_inference_http(
    settings: Settings, engine: InferenceEngine, auth: AuthInterceptor
) -> InferenceHttpServer | None:
    """Start the REST endpoint when ``inference_http_port`` is set (call on the service's
    event loop); None when it is off."""
    if not settings.inference_http_port:
        return None
    server = InferenceHttpServer(settings, engine, auth, asyncio.get_running_loop())
    server.start()
    return server
