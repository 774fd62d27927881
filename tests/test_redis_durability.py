"""Acknowledged means durable on every process: the API (`python -m ssdrbm_server`) and a worker
alone (`python -m ssdrbm_server.worker`) refuse a Redis that would lose acknowledged work (no
append-only file, even with RDB snapshots; an evicting maxmemory-policy; appendfsync no), at
start and again while running, and resume once it is fixed. On Redis Cluster every node is
asked. Real redis-server, real processes (server/ssdrbm_server/redis_checks.py).

That acknowledged jobs and checkpoints survive a Redis SIGKILL with AOF is proven in
tests/test_crash_recovery.py (``test_redis_crash_and_restart_loses_nothing_acknowledged``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.config import Settings
from ssdrbm_server.readiness import READINESS
from ssdrbm_server.redis_checks import RedisConfigError, RedisWatch, judge
from ssdrbm_server.store import connect
from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.redis import RedisClusterNodes, RedisServer, free_port
from tests.fixtures.server_process import ROOT, python_m_server
from tests.fixtures.service import RunningService

CHECK_INTERVAL_S = "0.3"
EXIT_TIMEOUT_S = 60.0  # a refusal at start: bounds for a loaded 2-core machine
NOTICE_TIMEOUT_S = 20.0  # a change at run time noticed (checked every CHECK_INTERVAL_S)
JOB_TIMEOUT_S = 90.0
# Every setting the processes under test need, without the development override.
STRICT = {
    "allow_no_persistence": "0",
    "redis_check_interval_s": CHECK_INTERVAL_S,
    "metrics_port": "0",
    "worker_metrics_port": "0",
    "torch_threads": "1",
    "log_level": "INFO",
}


def environment(redis_url: str, **settings: str) -> dict[str, str]:
    merged = {"redis_url": redis_url, **STRICT, **settings}
    return {**os.environ, **{f"SSDRBM_{k.upper()}": v for k, v in merged.items()}}


@contextlib.contextmanager
def worker_alone(redis_url: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m ssdrbm_server.worker`, strict, its output in ``log``; killed at the end."""
    with (
        log.open("wb") as out,
        subprocess.Popen(
            [sys.executable, "-m", "ssdrbm_server.worker"],
            cwd=ROOT,
            env=environment(redis_url),
            stdout=out,
            stderr=subprocess.STDOUT,
        ) as process,
    ):
        try:
            yield process
        finally:
            process.kill()  # leaving the Popen waits for it


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.1)


# --- the rules ------------------------------------------------------------------------------


def test_the_rules_name_the_setting_and_the_fix() -> None:
    snapshots_only = {"": {"maxmemory-policy": "noeviction", "appendonly": "no"}}
    refused = judge(snapshots_only, allow_no_persistence=False)
    assert not refused.fit and not refused.waived
    assert "appendonly 'no'" in refused.reason() and "`appendonly yes`" in refused.reason()
    assert "SSDRBM_ALLOW_NO_PERSISTENCE=1" in refused.reason()
    waived = judge(snapshots_only, allow_no_persistence=True)
    assert waived.fit and "SSDRBM_ALLOW_NO_PERSISTENCE=1" in (waived.warning() or "")

    lazy_fsync = {"": {"maxmemory-policy": "noeviction", "appendonly": "yes", "appendfsync": "no"}}
    assert "`appendfsync everysec`" in judge(lazy_fsync, allow_no_persistence=False).reason()
    for fsync in ("everysec", "always"):
        durable = {
            "": {"maxmemory-policy": "noeviction", "appendonly": "yes", "appendfsync": fsync}
        }
        assert judge(durable, allow_no_persistence=False) == judge(
            durable, allow_no_persistence=True
        )
        assert judge(durable, allow_no_persistence=False).fit

    evicting = {"": {"maxmemory-policy": "allkeys-lru", "appendonly": "yes"}}
    for allow in (False, True):  # never waived
        assert (
            "`maxmemory-policy noeviction`" in judge(evicting, allow_no_persistence=allow).reason()
        )


# --- at start -------------------------------------------------------------------------------


def test_api_and_worker_alone_refuse_a_redis_that_would_lose_jobs_at_start(
    redis_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """A snapshots-only Redis (the README's old quick start) and an evicting one: both the API
    and a worker alone exit with status 2 and the setting and its fix, before serving or
    claiming anything."""
    snapshots_only = redis_factory(appendonly=False, save="900 1")
    evicting = redis_factory()
    evicting.client().config_set("maxmemory-policy", "allkeys-lru")
    cases = {"appendonly": snapshots_only, "maxmemory-policy": evicting}
    started: list[tuple[str, str, subprocess.Popen]] = []
    for setting, store in cases.items():  # all four at once: each start costs seconds
        api = subprocess.Popen(
            [sys.executable, "-m", "ssdrbm_server", "--no-worker"],
            cwd=ROOT,
            env=environment(store.url, listen_address=f"127.0.0.1:{free_port()}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        worker = subprocess.Popen(
            [sys.executable, "-m", "ssdrbm_server.worker"],
            cwd=ROOT,
            env=environment(store.url),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started += [(setting, "API", api), (setting, "worker", worker)]
    try:
        for setting, who, process in started:
            output, _ = process.communicate(timeout=EXIT_TIMEOUT_S)
            assert process.returncode == 2, (who, setting, output)
            fix = "`appendonly yes`" if setting == "appendonly" else "`maxmemory-policy noeviction`"
            assert setting in output and fix in output, (who, output)
            assert "claims no new job" not in output and "listening" not in output, (who, output)
    finally:
        for _, _, process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert len(snapshots_only.client().keys("*")) == 0  # nothing was written to either
    assert len(evicting.client().keys("*")) == 0


# --- at run time ----------------------------------------------------------------------------


def readiness(channel: grpc.Channel) -> int | None:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=READINESS), timeout=5
        )
    except grpc.RpcError:
        return None
    return reply.status


def test_appendonly_turned_off_at_run_time_stops_new_work_until_it_is_back(
    redis_factory: Callable[..., RedisServer],
    service_factory: Callable[..., RunningService],
    tmp_path: Path,
) -> None:
    """CONFIG SET appendonly no while the API and a worker alone run (checks every 0.3 s): the
    API turns readiness NOT_SERVING and refuses StartTraining with FAILED_PRECONDITION naming
    the setting, the worker leaves a queued job alone and logs an ERROR each check; after
    CONFIG SET appendonly yes both resume: the job trains, readiness is SERVING, new work is
    accepted."""
    store = redis_factory()
    port = free_port()
    log = tmp_path / "worker.log"
    # A service with the development override submits the job the strict API would refuse.
    lenient = service_factory(store.url, run_worker=False).stub()
    with (
        worker_alone(store.url, log),
        python_m_server(store.url, port, run_worker="0", **STRICT) as api,
    ):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = rbm_pb2_grpc.RBMServiceStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_for(lambda: readiness(channel) == serving, "the API ready", EXIT_TIMEOUT_S)
        wait_for(lambda: "started" in log.read_text(), "the worker started", EXIT_TIMEOUT_S)

        store.client().config_set("appendonly", "no")
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_for(lambda: readiness(channel) == not_serving, "readiness off", NOTICE_TIMEOUT_S)
        error = rpc_error(lambda: stub.StartTraining(tiny_request()))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "appendonly 'no'" in error.details() and "`appendonly yes`" in error.details()
        assert stub.ListJobs(rbm_pb2.ListJobsRequest()) is not None  # reads still work

        def refusals() -> int:
            return sum(
                "ERROR" in line and "appendonly 'no'" in line and "claims no new job" in line
                for line in log.read_text().splitlines()
            )

        wait_for(lambda: refusals() >= 1, "the worker's ERROR", NOTICE_TIMEOUT_S)
        job = lenient.StartTraining(tiny_request()).job
        wait_for(lambda: refusals() >= 4, "an ERROR at each check", NOTICE_TIMEOUT_S)
        get = rbm_pb2.GetJobRequest(job_id=job.id)
        assert lenient.GetJob(get).state == rbm_pb2.JOB_STATE_QUEUED  # not claimed

        store.client().config_set("appendonly", "yes")
        succeeded = rbm_pb2.JOB_STATE_SUCCEEDED
        wait_for(lambda: lenient.GetJob(get).state == succeeded, "the job trained", JOB_TIMEOUT_S)
        wait_for(lambda: readiness(channel) == serving, "readiness back", NOTICE_TIMEOUT_S)
        assert stub.StartTraining(tiny_request()).created
        channel.close()
        assert api.poll() is None
    assert "Redis keeps acknowledged work again" in log.read_text()


# --- on a cluster ---------------------------------------------------------------------------


def test_one_cluster_node_without_aof_is_found(redis_cluster: RedisClusterNodes) -> None:
    """Every node is asked, not the one the URL names: appendonly no on another node refuses,
    naming that node."""
    other = redis_cluster.nodes[-1]
    settings = Settings(redis_url=redis_cluster.url, redis_cluster=True)

    async def check() -> None:
        client = connect(redis_cluster.url, cluster=True)
        try:
            await RedisWatch(client, settings, consequence="").check_at_start()
        finally:
            await client.aclose()

    asyncio.run(check())  # every node keeps an AOF
    other.client().config_set("appendonly", "no")
    try:
        with pytest.raises(RedisConfigError) as refused:
            asyncio.run(check())
    finally:
        other.client().config_set("appendonly", "yes")
    message = str(refused.value)
    assert f"Redis node 127.0.0.1:{other.port} has appendonly 'no'" in message
    assert message.count("appendonly 'no'") == 1  # that node only


def test_a_redis_unreachable_at_start_is_judged_as_soon_as_it_answers(
    redis_factory: Callable[..., RedisServer],
) -> None:
    """A process may start before Redis (readiness NOT_SERVING meanwhile); a Redis that then
    comes up without AOF is held back within about a second, not a whole check period."""
    store = redis_factory(appendonly=False, save="900 1")
    store.stop()
    settings = Settings(redis_url=store.url, redis_check_interval_s=30.0)

    async def scenario() -> None:
        client = connect(store.url)
        watch = RedisWatch(client, settings, consequence="nothing is claimed")
        checks = None
        try:
            await watch.check_at_start()  # not reachable: no verdict, no refusal
            assert watch.fit
            checks = asyncio.create_task(watch.run())
            await asyncio.to_thread(store.start)
            deadline = time.monotonic() + NOTICE_TIMEOUT_S
            while watch.fit:
                assert time.monotonic() < deadline, "never judged"
                await asyncio.sleep(0.1)
            assert "appendonly 'no'" in (watch.refusal() or "")
        finally:
            if checks is not None:
                checks.cancel()
                await asyncio.gather(checks, return_exceptions=True)
            await client.aclose()

    asyncio.run(scenario())


def test_the_development_override_is_warned_of_at_start_and_then_repeatedly(
    redis_factory: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """SSDRBM_ALLOW_NO_PERSISTENCE=1 lets a process run on a Redis without AOF, and says so as a
    WARNING at start and again every minute (here every 0.01 s), like the other overrides."""
    store = redis_factory(appendonly=False)
    settings = Settings(redis_url=store.url, allow_no_persistence=True)

    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "SSDRBM_ALLOW_NO_PERSISTENCE=1" in r.getMessage()]

    async def scenario() -> None:
        client = connect(store.url)
        watch = RedisWatch(client, settings, consequence="")
        try:
            await watch.check_at_start()
            assert watch.fit
            checks = asyncio.create_task(watch.run(warning_interval_s=0.01))
            while len(warnings()) < 3:
                await asyncio.sleep(0.01)
            checks.cancel()
            await asyncio.gather(checks, return_exceptions=True)
        finally:
            await client.aclose()

    with caplog.at_level(logging.WARNING, logger="ssdrbm_server.redis_checks"):
        asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    assert all(r.levelno == logging.WARNING for r in warnings())
    assert "appendonly 'no'" in warnings()[0].getMessage()
