"""One live follower per job: a single XREAD BLOCK loop whose events all live subscribers share.

A StreamMetrics call replays a job's stream by itself, then, caught up, attaches to the job's
``JobFollower``, which reads each new batch once (one Redis reply, one protobuf decode) and
queues it for every ``Subscription``. A subscriber that falls more than ``buffer_events`` behind
is detached and reads Redis itself from its last token, so one slow client can neither grow the
server's memory nor hold the others back. The follower runs from the first live subscriber of a
job until the last one leaves, the job's stream ends, a Redis error (which every subscriber
raises) or shutdown.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from ssdrbm.v1 import rbm_pb2

from ssdrbm_server import convert
from ssdrbm_server.store.events import token_order
from ssdrbm_server.store.records import JobRecord

logger = logging.getLogger(__name__)

TASK_PREFIX = "event-follower:"


# One blocking read of a job's events after a token (the stream's own poll, which followers
# share): (events, whether the stream has ended), the events flushed when it has.
Poll = Callable[[JobRecord, str], Awaitable[tuple[list[rbm_pb2.MetricEvent], bool]]]


class Ending(enum.Enum):
    """Why a subscription stopped receiving events from its follower."""

    FINISHED = "finished"  # the job's stream has ended: nothing more will come
    BEHIND = "behind"  # the subscriber fell too far behind; it reads Redis itself from its token
    DRAINING = "draining"  # the server is shutting down
    FAILED = "failed"  # the follower's read failed; the subscriber raises that error


class Subscription:
    """One live subscriber's bounded queue of events from its job's follower."""

    def __init__(self, follower: JobFollower, after: str, limit: int) -> None:
        self._follower = follower
        self._last = token_order(after)  # newest event queued or skipped: never queue it twice
        self._limit = limit
        self._pending: deque[rbm_pb2.MetricEvent] = deque()
        self._wake = asyncio.Event()
        self.ending: Ending | None = None
        self._error: BaseException | None = None

    def offer(self, events: list[rbm_pb2.MetricEvent]) -> None:
        """Queue the events newer than this subscriber's position (the follower may have read
        from an older token than the one it attached with); detach it when it falls behind."""
        fresh = [event for event in events if token_order(event.resume_token) > self._last]
        if not fresh or self.ending is not None:
            return
        if len(self._pending) + len(fresh) > self._limit:
            logger.debug(
                "a subscriber of job %s fell behind (%d events queued); it reads Redis itself",
                self._follower.job.id,
                len(self._pending) + len(fresh),
            )
            self.end(Ending.BEHIND)
            self._follower.remove(self)
            return
        self._pending.extend(fresh)
        self._last = token_order(fresh[-1].resume_token)
        self._wake.set()

    def end(self, ending: Ending, error: BaseException | None = None) -> None:
        """Deliver no more events; what is queued is still handed out first."""
        if self.ending is None:
            self.ending = ending
            self._error = error
            self._wake.set()

    async def next_batch(self) -> list[rbm_pb2.MetricEvent]:
        """The events queued since the last call, waiting for some; [] once the subscription
        has ended (see ``ending``). Raises the follower's error after the queued events."""
        while not self._pending and self.ending is None:
            self._wake.clear()
            await self._wake.wait()
        if self._pending:
            batch = list(self._pending)
            self._pending.clear()
            return batch
        if self._error is not None:
            raise self._error
        return []

    def close(self) -> None:
        """Leave the follower (idempotent); the last subscriber to leave stops it."""
        self.end(Ending.FINISHED)
        self._follower.remove(self)


class JobFollower:
    """The single XREAD BLOCK loop of one job, feeding its attached subscriptions."""

    def __init__(
        self, job: JobRecord, after: str, poll: Poll, on_stop: Callable[[JobFollower], None]
    ) -> None:
        self.job = job
        self.position = after  # token of the newest event handed out; the next read starts here
        self._poll = poll
        self._on_stop = on_stop
        self._subscriptions: set[Subscription] = set()
        self._stopped = False
        self.task = asyncio.create_task(self._run(), name=f"{TASK_PREFIX}{job.id}")

    def add(self, after: str, limit: int) -> Subscription:
        subscription = Subscription(self, after, limit)
        self._subscriptions.add(subscription)
        return subscription

    def remove(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)
        if not self._subscriptions:
            self.stop(Ending.FINISHED)

    @property
    def subscribers(self) -> int:
        return len(self._subscriptions)

    def stop(self, ending: Ending, error: BaseException | None = None) -> None:
        """End every subscription and the loop; safe to call from the loop itself."""
        if self._stopped:
            return
        self._stopped = True
        for subscription in list(self._subscriptions):
            subscription.end(ending, error)
        self._subscriptions.clear()
        self._on_stop(self)
        if self.task is not asyncio.current_task():
            self.task.cancel()

    async def _run(self) -> None:
        try:
            while not self._stopped:
                await self._step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The subscribers raise it, so each call gets the status the error mapping gives.
            logger.warning("following the events of job %s failed: %r", self.job.id, exc)
            self.stop(Ending.FAILED, exc)

    async def _step(self) -> None:
        batch, ended = await self._poll(self.job, self.position)
        if batch:
            self.position = batch[-1].resume_token
            for subscription in list(self._subscriptions):
                subscription.offer(batch)
        if ended or any(convert.is_terminal_event(event) for event in batch):
            self.stop(Ending.FINISHED)


class EventFanout:
    """The live followers of one server process, one per job with live subscribers."""

    def __init__(self, poll: Poll, *, buffer_events: int) -> None:
        self.poll = poll
        self._buffer_events = buffer_events
        self._followers: dict[str, JobFollower] = {}
        self._closed = False

    def attach(self, job: JobRecord, after: str) -> Subscription | None:
        """Subscribe to the live events of ``job`` after the token ``after``, starting its
        follower if there is none. None when the follower has already handed out events
        after ``after`` (the caller reads those itself first) or after ``close``."""
        if self._closed:
            return None
        follower = self._followers.get(job.id)
        if follower is None:
            follower = JobFollower(job, after, self.poll, self._forget)
            self._followers[job.id] = follower
        elif token_order(after) < token_order(follower.position):
            return None
        return follower.add(after, self._buffer_events)

    def close(self) -> None:
        """Shutdown: end every follower now; its subscribers see ``Ending.DRAINING``."""
        self._closed = True
        for follower in list(self._followers.values()):
            follower.stop(Ending.DRAINING)

    def follower(self, job_id: str) -> JobFollower | None:
        return self._followers.get(job_id)

    def __len__(self) -> int:
        return len(self._followers)

    def _forget(self, follower: JobFollower) -> None:
        if self._followers.get(follower.job.id) is follower:
            del self._followers[follower.job.id]


class LiveReader:
    """One stream's live events: from its job's follower while caught up with it, from reads
    of its own (the fanout's ``poll``) while behind it; closed when the stream ends."""

    def __init__(self, fanout: EventFanout, job: JobRecord) -> None:
        self._fanout = fanout
        self._job = job
        self._subscription: Subscription | None = None
        self._behind = False

    async def next_batch(self, after: str) -> tuple[list[rbm_pb2.MetricEvent], bool]:
        """The next events after the token ``after`` (the newest one the stream has sent) and
        whether the stream has ended; may be ([], False) after a timeout or at shutdown."""
        if self._subscription is None and not self._behind:
            self._subscription = self._fanout.attach(self._job, after)
        if self._subscription is None:
            # Read once by ourselves before attaching again: a follower started at a token far
            # behind would only overflow this stream's queue again at its first read.
            self._behind = False
            return await self._fanout.poll(self._job, after)
        batch = await self._subscription.next_batch()
        if batch:
            return batch, False
        ending = self._subscription.ending
        self.close()
        self._behind = ending is Ending.BEHIND
        return [], ending is Ending.FINISHED

    def close(self) -> None:
        """Leave the follower, if attached (idempotent)."""
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
