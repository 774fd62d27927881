"""Deadlines and reconnection backoff for long-lived metric streams.

Shared by the blocking and the asyncio clients.
"""

from __future__ import annotations

import time

from ssdrbm.retry import RetryPolicy

DEFAULT_RECONNECT_S = 60.0  # how long a metric stream keeps trying to reconnect
STREAM_KEEPS_CLOSING = "the metric stream of job {} kept closing before the job ended"


class Reconnect:
    """Backoff between reconnection attempts of a stream, within a time budget, and the whole
    stream's deadline ``timeout`` seconds from now (None: no deadline).

    The budget restarts whenever an event arrives, so a long stream survives many separate
    outages but gives up on one that lasts longer than ``budget_s``.
    """

    def __init__(self, policy: RetryPolicy, budget_s: float, timeout: float | None = None) -> None:
        self.policy = policy
        self.budget_s = budget_s
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.reset()

    def remaining(self) -> float | None:
        """Seconds left until the stream's deadline (None: no deadline)."""
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def reset(self) -> None:
        """Start a fresh budget: the stream made progress."""
        self.failures = 0
        self.since: float | None = None

    def next_delay(self, requested: float | None = None) -> float | None:
        """The sleep before the next attempt, or None when the budget is spent; ``requested``
        (the service's RetryInfo delay, when it gave one) replaces the backoff's own."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since >= self.budget_s:
            return None
        backoff = self.policy.initial_backoff_s * self.policy.multiplier**self.failures
        delay = min(backoff, self.policy.max_backoff_s) if requested is None else max(requested, 0)
        self.failures += 1
        return min(delay, self.budget_s - (now - self.since))
