"""The blocking and the asyncio clients run the same calls (ssdrbm/calls.py): they have the same
methods, and what a call does on the network (retry sleeps, paging) works on both."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable

import pytest
from ssdrbm import Client, RetryPolicy
from ssdrbm.aio import AsyncClient

from tests.fixtures.redis import free_port

QUEUED_JOB = {"n_hidden": 4, "steps": 10, "seed": 1}  # no worker runs it: it stays QUEUED


def _public_methods(cls: type) -> dict[str, Callable]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name != "close"
    }


def test_both_clients_have_the_same_methods_with_the_same_parameters() -> None:
    blocking, asyncio_ = _public_methods(Client), _public_methods(AsyncClient)
    assert blocking.keys() == asyncio_.keys()
    for name, method in blocking.items():
        twin = asyncio_[name]
        assert inspect.signature(method).parameters == inspect.signature(twin).parameters, name
        returns = inspect.signature(method).return_annotation
        if returns.startswith("Iterator["):  # iterators on one side, async iterators on the other
            assert inspect.signature(twin).return_annotation == f"Async{returns}", name
        else:
            assert inspect.iscoroutinefunction(twin), name
            assert inspect.signature(twin).return_annotation == returns, name


def test_the_asyncio_client_waits_out_a_service_that_is_still_starting(service_factory) -> None:
    port = free_port()
    starter = threading.Timer(
        0.5, lambda: service_factory(listen_address=f"127.0.0.1:{port}", run_worker=False)
    )
    patient = RetryPolicy(attempts=30, initial_backoff_s=0.1, max_backoff_s=0.5)

    async def submit() -> tuple[str, list[str]]:
        async with AsyncClient(f"127.0.0.1:{port}", retry=patient) as client:
            job = await client.start_training(**QUEUED_JOB)  # retried until the service is up
            return job.id, [j.id async for j in client.list_jobs()]

    starter.start()
    try:
        job_id, listed = asyncio.run(submit())
    finally:
        starter.join()
    assert listed == [job_id]  # created exactly once


@pytest.mark.parametrize("page_size", [1, 2, 50])
def test_listings_fetch_every_page_on_both_clients(service_factory, page_size: int) -> None:
    service = service_factory(run_worker=False)
    with Client(service.target) as client:
        submitted = [client.start_training(**QUEUED_JOB, name=f"j{i}").id for i in range(3)]
        assert [j.id for j in client.list_jobs(page_size=page_size)] == submitted[::-1]

    async def listed() -> list[str]:
        async with AsyncClient(service.target) as client:
            return [j.id async for j in client.list_jobs(page_size=page_size)]

    assert asyncio.run(listed()) == submitted[::-1]
