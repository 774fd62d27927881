"""Retries with exponential backoff for idempotent calls that failed with UNAVAILABLE.

Only UNAVAILABLE is retried: it means the request did not reach a server that could answer it
(connection refused, dropped, server draining), so sending it again cannot do anything twice for
calls that are idempotent. Every other code is the server's answer and is returned at once.

Calls are retried for a window of time rather than a number of tries: a restarted service is
unreachable for tens of seconds (16-21 s measured for the API process), so the default window,
``SSDRBM_RETRY_S`` or 30 s, outlasts a restart; ``SSDRBM_RETRY_S=0`` turns retries off.

When the refusal carries a RetryInfo (the service's own estimate of when to try again), that
delay replaces the exponential backoff's, still within the same window.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from ssdrbm.errors import retry_delay

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})

ENV_RETRY_S = "SSDRBM_RETRY_S"
DEFAULT_RETRY_S = 30.0  # longer than a service restart


def retry_window_from_env() -> float:
    """Seconds to keep retrying: ``$SSDRBM_RETRY_S``, else 30."""
    raw = os.environ.get(ENV_RETRY_S, "").strip()
    if not raw:
        return DEFAULT_RETRY_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(
            f"{ENV_RETRY_S} must be a number of seconds (0 turns retries off), not {raw!r}"
        )
    return seconds


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry a call that failed with UNAVAILABLE."""

    # total tries, the first included; 1 disables retries. By default the window below is the
    # limit, not the count
    attempts: int = 1_000_000
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2  # each delay is scaled by a random factor in [1 - jitter, 1 + jitter]
    # stop once the sleeps add up to this much (None: attempts alone); $SSDRBM_RETRY_S or 30 s
    max_wait_s: float | None = field(default_factory=retry_window_from_env)

    @classmethod
    def waiting(cls, seconds: float) -> RetryPolicy:
        """Keep retrying for about ``seconds`` (0: a single attempt), e.g. for a starting server."""
        if seconds <= 0:
            return NO_RETRY
        return cls(max_backoff_s=1.0, max_wait_s=seconds)

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts (one fewer than ``attempts``), jitter included."""
        backoff = Backoff(self)
        while (sleep := backoff.next_sleep()) is not None:
            yield sleep


class Backoff:
    """The sleeps of one call's retries under a :class:`RetryPolicy`: exponential with jitter,
    or the service's RetryInfo delay where it gave one; None once tries or window are spent."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._delay = policy.initial_backoff_s
        self._tries_left = max(policy.attempts - 1, 0)
        self._total = 0.0

    def next_sleep(self, requested: float | None = None) -> float | None:
        """The sleep before the next attempt (``requested``, the service's delay, when given)."""
        policy = self.policy
        if self._tries_left <= 0:
            return None
        if policy.max_wait_s is not None and self._total >= policy.max_wait_s:
            return None
        if requested is not None:
            sleep = max(requested, 0.0)
        else:
            factor = 1.0 + random.uniform(-policy.jitter, policy.jitter)
            sleep = min(self._delay, policy.max_backoff_s) * factor
        if policy.max_wait_s is not None:
            sleep = min(sleep, policy.max_wait_s - self._total)
        self._tries_left -= 1
        self._total += sleep
        self._delay *= policy.multiplier
        return sleep

    def after(self, error: grpc.RpcError) -> float | None:
        """The sleep before retrying after ``error``, or None when it is not worth retrying."""
        if not is_retryable(error):
            return None
        sleep = self.next_sleep(retry_delay(error))
        if sleep is not None:
            logger.debug("retrying in %.2fs after %s", sleep, error.code())
        return sleep


NO_RETRY = RetryPolicy(attempts=1)


def is_retryable(error: BaseException) -> bool:
    """True when ``error`` is a gRPC error worth sending again."""
    return isinstance(error, grpc.RpcError) and error.code() in RETRYABLE_CODES


def call_with_retry(
    call: Callable[[], T], policy: RetryPolicy, sleep: Callable[[float], None] = time.sleep
) -> T:
    """Run ``call``; on UNAVAILABLE sleep per ``policy`` (or the service's RetryInfo) and try
    again; re-raise the last error."""
    backoff = Backoff(policy)
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            delay = backoff.after(error)
            if delay is None:
                raise
            sleep(delay)
