"""Stopping a service ends its background loops, even when a cancel is swallowed on the way."""

from __future__ import annotations

import asyncio
import contextlib
import time

from ssdrbm_server.app import stop_background_tasks
from tests.fixtures.jobs import tiny_request
from tests.fixtures.service import RunningService, make_settings


def test_background_tasks_stop_even_when_a_cancel_is_swallowed():
    # Like a loop whose Redis call turned the cancel into a connection error: it carries on.
    async def loop_that_swallows_one_cancel() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        await asyncio.sleep(60)

    async def main() -> float:
        task = asyncio.create_task(loop_that_swallows_one_cancel())
        await asyncio.sleep(0)
        started = time.monotonic()
        await stop_background_tasks([task, None])
        assert task.done()
        return time.monotonic() - started

    assert asyncio.run(main()) < 5.0


def test_services_stop_promptly_one_after_another(redis_url):
    # Before stop_background_tasks, one of the first few of these hung in the event loop's
    # shutdown: the expired-job sweeper had swallowed its cancel mid-Redis call.
    for _ in range(8):
        running = RunningService(make_settings(redis_url, run_worker=False))
        request = tiny_request()
        request.validate_only = True
        running.stub().StartTraining(request, timeout=30)
        running.stop()  # raises when the service does not stop within its timeout
