"""A Redis outage in a process's log: one WARNING when it starts, a reminder every
`REMIND_S` while it lasts, one INFO when Redis answers again.

Every part of a process notices an outage on its own (each refused request, the readiness probe,
the worker's poll, a job's fenced writes, the sweepers); each logging what it saw wrote several
lines a second while Redis was down. They all report to the process's one `REDIS_OUTAGE` instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis.exceptions

logger = logging.getLogger(__name__)

REMIND_S = 60.0  # while an outage lasts, how often the log says it still does


class Outage:
    """One dependency's outages in one process: `noticed` on each failure, `ended` on a
    success (a no-op unless an outage was on)."""

    def __init__(
        self,
        what: str,
        *,
        problem: str = "unreachable",
        recovered: str = "answers again",
        remind_s: float = REMIND_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.problem, self.recovered = what, problem, recovered
        self.remind_s = remind_s
        self._clock = clock
        self._since: float | None = None  # when the outage began; None: none is on
        self._reminded = 0.0
        self._failures = 0

    @property
    def on(self) -> bool:
        return self._since is not None

    def noticed(self, error: BaseException, by: str) -> None:
        """``by`` (who noticed, e.g. "worker w1") failed to reach the dependency with ``error``."""
        now = self._clock()
        self._failures += 1
        if self._since is None:
            self._since = self._reminded = now
            logger.warning(
                "%s %s (%s), first noticed by %s; what needs it waits and retries "
                "(said again every %.0f s while the outage lasts)",
                self.what, self.problem, error, by, self.remind_s,
            )  # fmt: skip
        elif now - self._reminded >= self.remind_s:
            self._reminded = now
            logger.warning(
                "%s still %s after %.0f s (%s; %d failed calls so far)",
                self.what, self.problem, now - self._since, error, self._failures,
            )  # fmt: skip

    def ended(self) -> None:
        """The dependency answered: log the outage's end once, if one was on."""
        if self._since is None:
            return
        logger.info(
            "%s %s after %.0f s %s (%d failed calls meanwhile)",
            self.what, self.recovered, self._clock() - self._since, self.problem, self._failures,
        )  # fmt: skip
        self._since, self._failures = None, 0


# The process's one record of Redis outages: the API's request handlers, its readiness probe
# and sweepers, and the worker (in the API process or alone) all report to it.
REDIS_OUTAGE = Outage("Redis")
# Redis at its maxmemory refuses writes: the worker's writes wait until space is freed.
REDIS_FULL = Outage("Redis", problem="full (writes refused)", recovered="takes writes again")


def redis_outage_for(error: BaseException) -> Outage:
    """The outage that ``error`` (one of redis-py's) belongs to."""
    return REDIS_FULL if isinstance(error, redis.exceptions.OutOfMemoryError) else REDIS_OUTAGE


def redis_answered() -> None:
    """A Redis call succeeded: whatever outage was on is over."""
    REDIS_OUTAGE.ended()
    REDIS_FULL.ended()
