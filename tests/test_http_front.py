"""The HTTP front (server/ssdrbm_server/http_front.py) attacked with real sockets: `python -m
ssdrbm_server` in a child process (its memory and threads are read from /proc), clients that
trickle their headers or body, hold idle connections, send oversized or malformed bodies, while
valid requests of another tenant are still answered. Then, on the in-process service: HTTPS and
mTLS with the gRPC listener's certificates, health following the service's readiness, and the
dashboard's page."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ssdrbm_server.http_front import DASHBOARD_PATH
from tests.fixtures.redis import RedisServer, free_port
from tests.fixtures.server_process import python_m_server, wait_until
from tests.fixtures.service import RunningService
from tests.test_tls import new_key_and_request, self_signed, sign

ALPHA, BETA = "alpha-secret-1", "beta-secret-2"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
ANSWER_WITHIN_S = 10.0  # generous bound for an answer (or a cut-off) that should be prompt
INFER_PATH = "/v2/models/no-such-model/infer"
MIB = 1024 * 1024


@dataclass
class Api:
    """The child process and its HTTP front's port."""

    pid: int
    port: int

    def status(self, field: str) -> int:
        """A number of /proc/<pid>/status (VmRSS in kB, Threads)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.pid}/status")

    def rss_bytes(self) -> int:
        return self.status("VmRSS") * 1024

    def threads(self) -> int:
        return self.status("Threads")

    def request(
        self, method: str, path: str, body: bytes | None = None, token: str | None = BETA
    ) -> tuple[int, dict]:
        """(status, JSON answer) of one request on a fresh connection."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ANSWER_WITHIN_S)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()


@contextlib.contextmanager
def running_api(redis_url: str, **settings: str) -> Iterator[Api]:
    """The API (no worker, tokens of tenants alpha and beta) with its HTTP front on a free port."""
    port, http_port = free_port(), free_port()
    with python_m_server(
        redis_url,
        port,
        run_worker="0",
        metrics_port="0",
        http_port=str(http_port),
        log_level="WARNING",  # its output goes to a pipe read only at the end
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha,{BETA}=beta",
        **settings,
    ) as process:
        api = Api(process.pid, http_port)
        wait_until(process, lambda: _live(api), "the HTTP front serving")
        yield api


def _live(api: Api) -> bool:
    try:
        return api.request("GET", "/v2/health/live")[0] == 200
    except OSError:
        return False


def request_head(path: str, token: str | None, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Trickler:
    """A client that sends ``opening`` and then one byte at a time; notes what the server
    answered and when it closed the connection."""

    def __init__(self, port: int, opening: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(opening)
        self.sock.setblocking(False)
        self.answer = b""
        self.closed_after: float | None = None
        self.started = time.monotonic()

    @property
    def status(self) -> int | None:
        return int(self.answer.split()[1]) if self.answer.startswith(b"HTTP/1.1 ") else None

    def step(self) -> None:
        """Read what came back, then send one more byte; note the close."""
        if self.closed_after is not None:
            return
        try:
            while chunk := self.sock.recv(65536):
                self.answer += chunk
            self._closed()  # b"": the server closed it
            return
        except BlockingIOError:
            pass
        except OSError:
            self._closed()
            return
        try:
            self.sock.send(b"x")
        except BlockingIOError:
            pass  # the server stopped reading: its buffers are full
        except OSError:
            self._closed()

    def _closed(self) -> None:
        self.closed_after = time.monotonic() - self.started
        self.sock.close()


@contextlib.contextmanager
def trickling(tricklers: list[Trickler], every_s: float = 0.2) -> Iterator[None]:
    """Step every trickler every ``every_s`` seconds in a background thread."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(every_s):
            for trickler in tricklers:
                trickler.step()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        for trickler in tricklers:
            trickler.sock.close()


def wait_for(condition: object, what: str, within_s: float = ANSWER_WITHIN_S) -> None:
    deadline = time.monotonic() + within_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_tricklers_are_cut_off_while_another_tenant_is_answered(redis_url: str) -> None:
    """70 clients trickle: 30 without a token (refused 401 as their headers end, taking no
    request slot), 30 of tenant alpha (8 hold alpha's request slots until the body deadline cuts
    them off, the others get 429 at once), 10 that never finish their headers (cut off by the
    header deadline). Tenant beta's requests are answered all the while."""
    with running_api(
        redis_url,
        http_header_timeout_s=str(HEADER_TIMEOUT_S),
        http_body_timeout_s=str(BODY_TIMEOUT_S),
        http_max_requests_per_tenant="8",
    ) as api:
        endless = {"content_length": str(MIB)}
        unauthenticated = [
            Trickler(api.port, request_head(INFER_PATH, None, **endless)) for _ in range(30)
        ]
        alpha = [Trickler(api.port, request_head(INFER_PATH, ALPHA, **endless)) for _ in range(30)]
        slow_headers = [
            Trickler(api.port, f"POST {INFER_PATH} HTTP/1.1\r\nX-Slow: ".encode())
            for _ in range(10)
        ]
        everyone = unauthenticated + alpha + slow_headers
        with trickling(everyone):
            valid = json.dumps({"inputs": [{"name": "input", "datatype": "FP32"}]}).encode()
            for _ in range(4):
                started = time.monotonic()
                assert api.request("GET", "/v2")[0] == 200
                status, answer = api.request("POST", INFER_PATH, valid)
                assert status in (400, 404), answer  # read and parsed: a bad model/input answer
                assert time.monotonic() - started < ANSWER_WITHIN_S
                time.sleep(0.5)
            wait_for(
                lambda: all(t.closed_after is not None for t in everyone),
                "every trickler cut off",
                within_s=BODY_TIMEOUT_S + ANSWER_WITHIN_S,
            )
    assert {t.status for t in unauthenticated} == {401}
    held = [t for t in alpha if t.status is None]  # no answer: cut off mid-body
    assert len(held) == 8, [t.status for t in alpha]
    assert {t.status for t in alpha if t not in held} == {429}
    assert all(cut_off_near(t, BODY_TIMEOUT_S) for t in held), [t.closed_after for t in held]
    assert all(t.status is None for t in slow_headers)
    assert all(cut_off_near(t, HEADER_TIMEOUT_S) for t in slow_headers)


def cut_off_near(trickler: Trickler, deadline_s: float) -> bool:
    """Closed by the server at its deadline: not before it, and not long after."""
    assert trickler.closed_after is not None
    return deadline_s - 0.5 <= trickler.closed_after <= deadline_s + 5


def read_answer(sock: socket.socket, within_s: float = ANSWER_WITHIN_S) -> bytes:
    """The bytes the server sends until it closes, or what came within ``within_s``."""
    sock.settimeout(within_s)
    answer = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_an_oversized_body_is_refused_before_it_is_read(redis_url: str) -> None:
    """24 MiB over the 16 MiB default: refused 413 from Content-Length before a byte of the
    body is sent; sent chunked, refused once past the limit; the API's memory barely moves."""
    size = 24 * MIB
    with running_api(redis_url) as api:
        before = api.rss_bytes()
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", api.port)) as sock:
            sock.sendall(request_head(INFER_PATH, ALPHA, content_length=str(size)))
            answer = read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert b"SSDRBM_HTTP_MAX_BODY_BYTES" in answer
        assert time.monotonic() - started < ANSWER_WITHIN_S
        assert api.rss_bytes() - before < 4 * MIB

        with socket.create_connection(("127.0.0.1", api.port)) as sock:
            sock.sendall(request_head(INFER_PATH, ALPHA, transfer_encoding="chunked"))
            chunk = b"%x\r\n%s\r\n" % (MIB, b"[" * MIB)
            answer, sent = b"", 0
            while sent < size and not answer:
                with contextlib.suppress(OSError):  # the server may close as it answers
                    sock.sendall(chunk)
                    sent += MIB
                if select.select([sock], [], [], 0.05)[0]:
                    answer = read_answer(sock)
            answer = answer or read_answer(sock)
        assert answer.startswith(b"HTTP/1.1 413"), answer
        assert sent < size
        # What the API held: up to the limit in chunks, never the whole body or its parse.
        assert api.rss_bytes() - before < 64 * MIB
        assert api.request("GET", "/v2")[0] == 200


def test_malformed_or_deep_json_is_400_never_500(redis_url: str) -> None:
    deep = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    just_too_deep = b'{"inputs": ' + b"[" * 8 + b"]" * 8 + b"}"
    bodies = {
        "depth 100,000": (deep, "not JSON"),
        "depth 9": (just_too_deep, "nests deeper than 8"),
        "truncated": (b'{"inputs": [{"data": [1, 2', "not JSON"),
        "not UTF-8": (b"\xff\xfe\x00{", "not JSON"),
        "a list": (b"[1, 2, 3]", "JSON object"),
        "empty": (b"", "not JSON"),
        "5000 digits": (b'{"inputs": [{"data": [' + b"7" * 5000 + b"]}]}", "not JSON"),
        "NaN shape": (b'{"inputs": [{"shape": [NaN], "datatype": "FP32"}]}', "shape"),
    }
    with running_api(redis_url) as api:
        for case, (body, hint) in bodies.items():
            status, answer = api.request("POST", INFER_PATH, body, token=ALPHA)
            assert status == 400 and hint in answer["error"], (case, status, answer)
        assert api.request("GET", "/v2")[0] == 200


def test_idle_connections_cost_no_threads_are_capped_and_time_out(redis_url: str) -> None:
    """300 idle sockets against a cap of 250: the 50 over it are answered 503 and closed as they
    open, the others closed by the header deadline; the API gains no thread for any of them."""
    with running_api(
        redis_url, http_header_timeout_s=str(HEADER_TIMEOUT_S), http_max_connections="250"
    ) as api:
        threads = api.threads()
        started = time.monotonic()
        sockets = [socket.create_connection(("127.0.0.1", api.port)) for _ in range(300)]
        try:
            time.sleep(0.5)
            assert api.threads() - threads < 5, (threads, api.threads())
            answers = [read_answer(sock) for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        # Every socket closed by the server (read_answer would have waited ANSWER_WITHIN_S).
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 5
        refused = [answer for answer in answers if answer.startswith(b"HTTP/1.1 503")]
        assert len(refused) == 50
        assert all(answer == b"" for answer in answers if answer not in refused)
        assert api.request("GET", "/v2")[0] == 200


def test_the_front_speaks_https_with_the_grpc_certificates_and_client_ca(
    tmp_path: Path, service_factory: Callable[..., RunningService]
) -> None:
    self_signed(tmp_path, "ca", "/CN=ssdrbm test CA")
    for name, extensions in [
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ("client", "extendedKeyUsage=clientAuth"),
    ]:
        new_key_and_request(tmp_path, name, f"/CN={name}")
        sign(tmp_path, name, "ca", extensions)
    port = free_port()
    service_factory(
        run_worker=False,
        http_port=port,
        tls_cert_file=str(tmp_path / "server.crt"),
        tls_key_file=str(tmp_path / "server.key"),
        tls_client_ca_file=str(tmp_path / "ca.crt"),
    )
    url = f"https://127.0.0.1:{port}/v2/health/live"
    context = ssl.create_default_context(cafile=tmp_path / "ca.crt")
    refused = (urllib.error.URLError, ssl.SSLError, ConnectionError)
    with pytest.raises(refused):  # no client certificate
        urllib.request.urlopen(url, context=context, timeout=ANSWER_WITHIN_S)
    with pytest.raises(refused):  # plaintext
        urllib.request.urlopen(url.replace("https", "http"), timeout=ANSWER_WITHIN_S)
    context.load_cert_chain(tmp_path / "client.crt", tmp_path / "client.key")
    with urllib.request.urlopen(url, context=context, timeout=ANSWER_WITHIN_S) as response:
        assert (response.status, json.load(response)) == (200, {"live": True})


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read()


def test_health_follows_the_service_readiness_and_the_dashboard_mount_point(
    redis_factory: Callable[..., RedisServer], service_factory: Callable[..., RunningService]
) -> None:
    store = redis_factory(appendonly=False)
    port = free_port()
    service_factory(store.url, run_worker=False, http_port=port)
    assert http_get(port, "/v2/health/ready") == (200, b'{"ready":true}')
    store.stop()
    wait_for(lambda: http_get(port, "/v2/health/ready")[0] == 503, "not ready without Redis")
    assert http_get(port, "/v2/health/live") == (200, b'{"live":true}')
    store.start()
    wait_for(lambda: http_get(port, "/v2/health/ready")[0] == 200, "ready once Redis is back")

    status, page = http_get(port, f"{DASHBOARD_PATH}/")  # the dashboard (test_dashboard.py)
    assert status == 200 and b"dashboard.js" in page


def test_a_taken_http_port_stops_the_service_with_the_fix(redis_url: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        http_port = taken.getsockname()[1]
        with python_m_server(redis_url, free_port(), http_port=str(http_port)) as process:
            output, _ = process.communicate(timeout=60)
    assert process.returncode == 2, output
    assert f"cannot listen on 127.0.0.1:{http_port}" in output and "SSDRBM_HTTP_PORT" in output
