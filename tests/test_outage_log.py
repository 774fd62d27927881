"""A Redis outage is logged once per process, whoever notices it (ssdrbm_server.outage): one
WARNING at its start, a reminder a minute while it lasts, one INFO at its end. Unit cases on a
fake clock, then the real `python -m ssdrbm_server` (API, readiness probe, sweepers and its
worker) with its Redis stopped while clients keep calling."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.outage import Outage
from ssdrbm_server.redis_process import RedisServer
from tests.fixtures.redis import free_port
from tests.fixtures.server_process import python_m_server, stop_gracefully, wait_until

OUTAGE_S = 4.0  # long enough for every part of the process to notice it several times


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_one_warning_a_reminder_a_minute_and_one_info(caplog) -> None:
    clock = Clock()
    outage = Outage("Redis", remind_s=60.0, clock=clock)
    outage.ended()  # no outage on: nothing to say
    with caplog.at_level(logging.INFO, logger="ssdrbm_server.outage"):
        for second in range(150):
            clock.now = 100.0 + second
            outage.noticed(ConnectionError("refused"), by=f"caller {second % 3}")
        clock.now = 260.0
        outage.ended()
        outage.ended()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == ["WARNING", "WARNING", "WARNING", "INFO"]
    assert "Redis unreachable (refused), first noticed by caller 0" in lines[0][1]
    assert "still unreachable after 60 s" in lines[1][1] and "61 failed calls" in lines[1][1]
    assert "still unreachable after 120 s" in lines[2][1]
    assert lines[3][1] == "Redis answers again after 160 s unreachable (150 failed calls meanwhile)"
    assert not outage.on


def test_a_new_outage_after_one_ended_is_logged_again(caplog) -> None:
    clock = Clock()
    outage = Outage("Redis", clock=clock)
    with caplog.at_level(logging.INFO, logger="ssdrbm_server.outage"):
        for _ in range(2):
            outage.noticed(TimeoutError("slow"), by="worker w1")
            outage.noticed(TimeoutError("slow"), by="worker w1")
            clock.now += 5
            outage.ended()
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO", "WARNING", "INFO"]


def test_a_full_redis_is_its_own_outage(caplog) -> None:
    import redis.exceptions

    from ssdrbm_server.outage import REDIS_FULL, REDIS_OUTAGE, redis_answered, redis_outage_for

    full = redis.exceptions.OutOfMemoryError("OOM command not allowed")
    assert redis_outage_for(full) is REDIS_FULL
    assert redis_outage_for(redis.exceptions.ConnectionError("refused")) is REDIS_OUTAGE
    with caplog.at_level(logging.INFO, logger="ssdrbm_server.outage"):
        REDIS_FULL.noticed(full, by="job j1's writes")
        redis_answered()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "Redis full",
        "Redis takes writes again after 0 s full",
    ]


@pytest.mark.slow
def test_the_service_logs_a_redis_outage_once_while_clients_keep_calling(tmp_path) -> None:
    port = free_port()
    with (
        RedisServer(tmp_path / "redis") as redis_server,
        python_m_server(
            redis_server.url, port, metrics_port="0", http_port="0", log_format="text"
        ) as process,
    ):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = rbm_pb2_grpc.RBMServiceStub(channel)

        def answers() -> bool:
            try:
                stub.ListJobs(rbm_pb2.ListJobsRequest(), timeout=2)
                return True
            except grpc.RpcError:
                return False

        wait_until(process, answers, "the service answering")
        redis_server.stop()
        refused = 0
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            try:
                stub.ListJobs(rbm_pb2.ListJobsRequest(), timeout=2)
            except grpc.RpcError as error:
                refused += error.code() is grpc.StatusCode.UNAVAILABLE
            time.sleep(0.1)
        redis_server.start()
        wait_until(process, answers, "the service answering again")
        time.sleep(1.5)  # the readiness probe's next ping says the outage is over
        channel.close()
        output = stop_gracefully(process)
    assert refused >= 10, output
    unreachable = [
        line for line in output.splitlines() if "WARNING" in line and "unreachable" in line
    ]
    assert len(unreachable) == 1, "\n".join(unreachable)
    assert "WARNING ssdrbm_server.outage: Redis unreachable" in unreachable[0]
    recovered = [line for line in output.splitlines() if "answers again" in line]
    assert len(recovered) == 1 and "INFO ssdrbm_server.outage" in recovered[0], output
