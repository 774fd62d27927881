"""Deadlines and reconnection backoff for long-lived metric streams.

Shared by the blocking and the asyncio clients.
"""

from __future__ import annotations

import time

from ssdrbm.retry import RetryPolicy

DEFAULT_RECONNECT_S = 60.0  # how long a metric stream keeps trying to reconnect
STREAM_KEEPS_CLOSING = "the metric stream of job {} kept closing before the job ended"


def deadline_after(timeout: float | None) -> float | None:
    """A ``time.monotonic()`` deadline ``timeout`` seconds from now (None: no deadline)."""
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a ``time.monotonic()`` deadline (None: no deadline)."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.0)


class Reconnect:
    """Backoff between reconnection attempts of a stream, within a time budget.

    The budget restarts whenever an event arrives, so a long stream survives many separate
    outages but gives up on one that lasts longer than ``budget_s``.
    """

    def __init__(self, policy: RetryPolicy, budget_s: float) -> None:
        self.policy = policy
        self.budget_s = budget_s
        self.reset()

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
