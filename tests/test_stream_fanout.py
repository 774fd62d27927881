"""Live StreamMetrics subscribers of one job share one follower (ssdrbm_server.event_fanout).

Real redis-server, real gRPC server on port 0, synchronous loopback clients in threads. Events
are appended by a stand-in writer in MULTI bursts (one XREAD reply then holds the whole burst),
so each test decides exactly what the stream holds while subscribers join and leave. Every
subscriber's events are compared with the job's full history read afterwards. Nothing here is
timed: the event lag and the shutdown drain time are measured by `python -m bench service`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from ssdrbm_server.errors import REDIS_UNAVAILABLE_MESSAGE
from ssdrbm_server.event_fanout import TASK_PREFIX
from ssdrbm_server.keys import Keys
from ssdrbm_server.store.events import MAX_BLOCK_MS, metrics_event_fields
from tests.fixtures.jobs import Follower, tiny_request
from tests.fixtures.service import RunningService

CALL_TIMEOUT_S = 60.0
WAIT_S = 15.0


# --- helpers ----------------------------------------------------------------------------------


class Subscriber(Follower):
    """A StreamMetrics call on a channel of its own, which the test may close."""

    def __init__(self, running: RunningService, job_id: str, after: str = "") -> None:
        self.channel = grpc.insecure_channel(running.target)
        super().__init__(rbm_pb2_grpc.RBMServiceStub(self.channel), job_id, after)

    def join(self, timeout: float = CALL_TIMEOUT_S) -> None:
        super().join(timeout)
        self.channel.close()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def follower_tasks(running: RunningService) -> list[str]:
    """Names of the follower tasks alive on the service's event loop."""

    async def names() -> list[str]:
        return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith(TASK_PREFIX)]

    return running.run_in_loop(names())


def attached(running: RunningService, job_id: str) -> int:
    """Subscribers attached to the job's follower (0 when it has none)."""

    async def count() -> int:
        assert running.service is not None
        follower = running.service.servicer.fanout.follower(job_id)
        return 0 if follower is None else follower.subscribers

    return running.run_in_loop(count())


def assert_no_followers(running: RunningService) -> None:
    wait_for(lambda: not follower_tasks(running), "the follower tasks to end")
    assert running.service is not None
    assert len(running.service.servicer.fanout) == 0


def blocked_commands(client: redis.Redis) -> list[str]:
    """The commands of the Redis clients blocked now, once there is one (between two polls of
    a follower there may be none for an instant); [] if none blocks within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        blocked = [c["cmd"] for c in client.client_list() if "b" in c["flags"]]
        if blocked or time.monotonic() > deadline:
            return blocked
        time.sleep(0.02)


def xread_calls(client: redis.Redis) -> int:
    """XREAD commands Redis has run so far (counted as each is issued)."""
    return client.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)


class Writer:
    """Appends metric events to a job's stream in bursts, as the worker's writes would."""

    def __init__(self, running: RunningService, job_id: str) -> None:
        self.client = redis.Redis.from_url(running.settings.redis_url)
        self.key = Keys(running.settings.redis_prefix).events(job_id)
        self.step = 0

    def burst(self, size: int) -> None:
        # One MULTI: a blocked XREAD is answered after it, with the whole burst in one reply.
        with self.client.pipeline(transaction=True) as pipe:
            for _ in range(size):
                self.step += 1
                data = pb.Metrics(step=self.step).SerializeToString()
                pipe.xadd(self.key, metrics_event_fields(data, attempt=1))
            pipe.execute()

    def tokens(self) -> list[str]:
        return [entry_id.decode() for entry_id, _ in self.client.xrange(self.key)]

    def close(self) -> None:
        self.client.close()


def history(running: RunningService, job_id: str) -> list[pb.MetricEvent]:
    request = pb.StreamMetricsRequest(job_id=job_id, history_only=True)
    return list(running.stub().StreamMetrics(request, timeout=CALL_TIMEOUT_S))


def assert_exact_suffix(subscriber: Subscriber, full: list[pb.MetricEvent]) -> None:
    """The subscriber got every event after its token, once each, in order."""
    tokens = [event.resume_token for event in full]
    start = tokens.index(subscriber.after) + 1 if subscriber.after else 0
    assert subscriber.error is None, subscriber.error
    assert [e.resume_token for e in subscriber.events] == tokens[start:]
    assert subscriber.events == full[start:]


@pytest.fixture
def queued(service_factory: Callable[..., RunningService]) -> Iterator[Callable[..., tuple]]:
    """``make(**settings) -> (running, job_id, writer)``: a service without a worker and a
    QUEUED job whose stream the test writes."""
    writers: list[Writer] = []

    def make(**settings: object) -> tuple[RunningService, str, Writer]:
        running = service_factory(run_worker=False, **settings)
        job = running.stub().StartTraining(tiny_request(), timeout=30).job
        writer = Writer(running, job.id)
        writers.append(writer)
        return running, job.id, writer

    yield make
    for writer in writers:
        writer.close()


def cancel(running: RunningService, job_id: str) -> None:
    running.stub().CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=30)


# --- tests ------------------------------------------------------------------------------------


def test_many_subscribers_cause_one_blocking_read(queued) -> None:
    # The longest poll (MAX_BLOCK_MS): reads that end without news stay rare during the test.
    running, job_id, writer = queued(stream_block_ms=MAX_BLOCK_MS)
    subscribers = [Subscriber(running, job_id) for _ in range(20)]
    wait_for(lambda: attached(running, job_id) == 20, "20 attached subscribers")
    client = redis.Redis.from_url(running.settings.redis_url)
    bursts = 3
    try:
        # Attached subscribers read nothing from Redis themselves: the follower's XREAD is the
        # only blocked client (subscribers reading alone would be 20 of them).
        assert blocked_commands(client) == ["xread"]
        before = xread_calls(client)
        for burst in range(1, bursts + 1):
            writer.burst(2)
            # The next burst only once every subscriber has this one: each burst is the answer
            # to one read, after which the follower reads again.
            wait_for(
                lambda n=burst: all(len(s.events) == 1 + 2 * n for s in subscribers),
                f"burst {burst} at every subscriber",
            )
        assert blocked_commands(client) == ["xread"]
        reads = xread_calls(client) - before
    finally:
        client.close()
    # One read per burst for all 20 subscribers, where subscribers reading alone would make 20
    # per burst. A poll that ends empty after MAX_BLOCK_MS reads again too, which a slow machine
    # may add once or twice; the bound leaves room for 16 of those.
    assert bursts <= reads < len(subscribers), reads
    cancel(running, job_id)
    for subscriber in subscribers:
        subscriber.join()
    full = history(running, job_id)
    assert [e.WhichOneof("event") for e in full] == ["state", *["metrics"] * 2 * bursts, "state"]
    for subscriber in subscribers:
        assert_exact_suffix(subscriber, full)
    assert_no_followers(running)


def test_joins_mid_stream_and_bursts_leave_no_gap_or_repeat(queued, caplog) -> None:
    # A buffer smaller than most bursts: subscribers keep falling behind and catching up.
    running, job_id, writer = queued(stream_buffer_events=4)
    writer.burst(300)  # more than one replay batch before anyone subscribes
    rng = random.Random(7)
    subscribers: list[Subscriber] = []
    with caplog.at_level(logging.DEBUG, logger="ssdrbm_server.event_fanout"):
        for round_ in range(40):
            writer.burst(rng.randint(1, 10))
            if round_ % 3 == 0:
                tokens = writer.tokens()
                # From the start, from a random token, and from the live end.
                after = rng.choice(["", rng.choice(tokens), tokens[-1]])
                subscribers.append(Subscriber(running, job_id, after))
            time.sleep(rng.uniform(0.0, 0.03))
        wait_for(lambda: attached(running, job_id) > 0, "an attached subscriber")
        writer.burst(10)  # more than the buffer holds, for everyone attached now
        cancel(running, job_id)
        for subscriber in subscribers:
            subscriber.join()
    full = history(running, job_id)
    assert full[-1].state.state == pb.JOB_STATE_CANCELLED
    for subscriber in subscribers:
        assert_exact_suffix(subscriber, full)
    assert any("fell behind" in record.getMessage() for record in caplog.records)
    assert_no_followers(running)


def test_follower_starts_with_the_first_live_subscriber_and_stops_with_the_last(queued) -> None:
    running, job_id, writer = queued()
    replay = history(running, job_id)  # a replay alone starts nothing
    assert len(replay) == 1 and not follower_tasks(running)
    first, second = Subscriber(running, job_id), Subscriber(running, job_id)
    wait_for(lambda: attached(running, job_id) == 2, "two attached subscribers")
    assert follower_tasks(running) == [TASK_PREFIX + job_id]
    first.cancel()  # the client cancels
    wait_for(lambda: attached(running, job_id) == 1, "one attached subscriber")
    assert follower_tasks(running) == [TASK_PREFIX + job_id]
    second.channel.close()  # the client goes away
    assert_no_followers(running)
    first.join()
    second.join()
    # A new live subscriber starts a new follower, which stops once the job has ended.
    third = Subscriber(running, job_id, after=replay[-1].resume_token)
    wait_for(lambda: attached(running, job_id) == 1, "the third subscriber")
    writer.burst(2)
    cancel(running, job_id)
    third.join()
    assert_exact_suffix(third, history(running, job_id))
    assert_no_followers(running)


def test_redis_error_in_the_follower_is_unavailable_for_every_subscriber(
    redis_factory, service_factory
) -> None:
    redis_server = redis_factory(appendonly=True)
    running = service_factory(redis_server.url, run_worker=False)
    job_id = running.stub().StartTraining(tiny_request(), timeout=30).job.id
    subscribers = [Subscriber(running, job_id) for _ in range(5)]
    wait_for(lambda: attached(running, job_id) == 5, "5 attached subscribers")
    redis_server.stop()
    for subscriber in subscribers:
        subscriber.join()
        assert subscriber.error is not None
        assert subscriber.error.code() == grpc.StatusCode.UNAVAILABLE
        assert subscriber.error.details() == REDIS_UNAVAILABLE_MESSAGE  # as for any RPC
    assert_no_followers(running)
    # The server kept running: with Redis back, a stream follows live and ends as before.
    redis_server.start()
    after = subscribers[0].events[-1].resume_token
    again = Subscriber(running, job_id, after=after)
    wait_for(lambda: attached(running, job_id) == 1, "a subscriber after the restart")
    cancel(running, job_id)
    again.join()
    assert again.error is None
    assert [e.state.state for e in again.events] == [pb.JOB_STATE_CANCELLED]
    assert_no_followers(running)


def test_shutdown_ends_shared_followers_at_once(redis_factory, service_factory) -> None:
    # The drain must not wait for the followers' reads: with Redis frozen (SIGSTOP) a read is
    # never answered, not even by its block timing out. A drain that waited for it would end
    # the streams only when the read fails (after the Redis socket timeout, with the Redis
    # error, not "shutting down") or when the 10-minute grace runs out.
    redis_server = redis_factory(appendonly=False)
    running = service_factory(redis_server.url, run_worker=False, shutdown_grace_s=600.0)
    job_id = running.stub().StartTraining(tiny_request(), timeout=30).job.id
    subscribers = [Subscriber(running, job_id) for _ in range(3)]
    wait_for(lambda: attached(running, job_id) == 3, "3 attached subscribers")
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        stopper = threading.Thread(target=running.stop)
        stopper.start()
        for subscriber in subscribers:
            subscriber.join()
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    stopper.join(CALL_TIMEOUT_S)
    assert not stopper.is_alive()
    for subscriber in subscribers:
        assert subscriber.error is not None
        assert subscriber.error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in subscriber.error.details()
        assert subscriber.events[-1].resume_token in subscriber.error.details()


def test_trained_job_reaches_every_subscriber_whole(service_factory) -> None:
    running = service_factory()
    stub = running.stub()
    job = stub.StartTraining(tiny_request(steps=200, eval=pb.EvalSpec(every=2)), timeout=30).job
    subscribers = [Subscriber(running, job.id)]
    for _ in range(4):
        wait_for(lambda: len(subscribers[-1].events) > 2, "events for the newest subscriber")
        # Join mid-run, resuming after an event a running subscriber has already received.
        subscribers.append(Subscriber(running, job.id, subscribers[-1].events[-1].resume_token))
    for subscriber in subscribers:
        subscriber.join()
    full = history(running, job.id)
    assert full[-1].state.state == pb.JOB_STATE_SUCCEEDED
    for subscriber in subscribers:
        assert_exact_suffix(subscriber, full)
    assert_no_followers(running)
