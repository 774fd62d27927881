"""Loopback unless told otherwise: which listen settings a server accepts, and what it logs.

- The defaults listen on loopback only (gRPC and metrics).
- Without auth, a non-loopback gRPC or metrics address is refused unless
  SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE is set; then a WARNING is logged at start and again and
  again while the server runs.
- Tokens over plaintext on a non-loopback address are refused unless TLS is on or
  SSDRBM_ALLOW_PLAINTEXT_TOKENS is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from ssdrbm_server.app import Service
from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.exposure import (
    check_exposure,
    is_loopback_listen_address,
    keep_warning,
)

TOKENS = {"auth_mode": "token", "auth_tokens": "secret=alice"}


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("127.0.0.2:0", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("unix:/tmp/ssdrbm.sock", True),
        ("0.0.0.0:50051", False),
        ("[::]:50051", False),
        ("10.1.2.3:50051", False),
        ("api.example.com:50051", False),  # a name may resolve to anything: not loopback
    ],
)
def test_loopback_addresses_are_told_apart(address: str, loopback: bool) -> None:
    assert is_loopback_listen_address(address) is loopback


def test_defaults_listen_on_loopback_only() -> None:
    defaults = Settings()
    assert defaults.auth_mode == "none"
    assert defaults.listen_address.startswith("127.0.0.1:")
    assert defaults.metrics_address == "127.0.0.1"
    check_exposure(defaults)  # accepted as it is


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"listen_address": "0.0.0.0:50051"}, "SSDRBM_LISTEN_ADDRESS=0.0.0.0:50051"),
        ({"metrics_address": "0.0.0.0"}, "SSDRBM_METRICS_ADDRESS=0.0.0.0"),
    ],
)
def test_no_auth_beyond_loopback_is_refused_with_what_to_set(
    overrides: dict[str, Any], variable: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        check_exposure(Settings(**overrides))
    message = str(caught.value)
    assert variable in message and "SSDRBM_AUTH_MODE=none" in message
    assert "SSDRBM_AUTH_MODE=token" in message
    assert "SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE=1" in message
    check_exposure(Settings(**overrides, allow_unauthenticated_remote=True))


def test_metrics_address_does_not_matter_when_metrics_are_off() -> None:
    check_exposure(Settings(metrics_address="0.0.0.0", metrics_port=0))


def test_tokens_in_plaintext_beyond_loopback_are_refused() -> None:
    remote = {**TOKENS, "listen_address": "0.0.0.0:50051"}
    with pytest.raises(ConfigError, match="SSDRBM_ALLOW_PLAINTEXT_TOKENS=1") as caught:
        check_exposure(Settings(**remote))
    assert "SSDRBM_TLS_CERT_FILE" in str(caught.value)
    check_exposure(Settings(**remote, allow_plaintext_tokens=True))
    check_exposure(Settings(**remote, tls_cert_file="cert.pem", tls_key_file="key.pem"))
    check_exposure(Settings(**TOKENS))  # loopback: nothing crosses a network


def test_a_service_built_in_code_is_checked_too() -> None:
    with pytest.raises(ConfigError, match="SSDRBM_ALLOW_UNAUTHENTICATED_REMOTE"):
        Service(Settings(listen_address="0.0.0.0:0", metrics_port=0))


def test_unauthenticated_remote_is_warned_of_at_start_and_then_repeatedly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = Settings(listen_address="0.0.0.0:50051", allow_unauthenticated_remote=True)

    async def run_until_three_warnings() -> None:
        task = asyncio.create_task(keep_warning(settings, interval_s=0.01))
        while len(warnings()) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="ssdrbm_server.exposure"):
        asyncio.run(asyncio.wait_for(run_until_three_warnings(), timeout=30))
    assert all(r.levelno == logging.WARNING for r in warnings())
    assert "SSDRBM_LISTEN_ADDRESS=0.0.0.0:50051" in warnings()[0].getMessage()


def test_nothing_is_warned_of_on_loopback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ssdrbm_server.exposure"):
        asyncio.run(asyncio.wait_for(keep_warning(Settings(), interval_s=0.01), timeout=30))
    assert not caplog.records  # and it returned: no loop for a loopback server
