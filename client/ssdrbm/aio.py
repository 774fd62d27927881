"""The asyncio Python SDK: :class:`AsyncClient`, the same methods as :class:`ssdrbm.Client`.

from ssdrbm.aio import AsyncClient

async with AsyncClient("localhost:50051") as client:
    job = await client.start_training(n_hidden=25, steps=500)
    async for event in client.stream_metrics(job.id):
        ...
    features = await client.sample_hidden(job.id, x)

Each method is the blocking client's, run on a ``grpc.aio`` channel: a method of either client
only runs its call's steps (``calls.py``) through ``self._run`` or ``self._iterate``, which here
await the steps' effects, so the method's result is awaited (or iterated with ``async for``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

from ssdrbm import calls
from ssdrbm.client import Client

T = TypeVar("T")
P = ParamSpec("P")


def _awaited(
    method: Callable[Concatenate[Client, P], T],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """The blocking client's ``method``, awaited on the asyncio client."""

    @functools.wraps(method)
    async def awaited(self: AsyncClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await method(self, *args, **kwargs)  # type: ignore[arg-type, misc]

    return awaited


def _iterated(
    method: Callable[Concatenate[Client, P], Iterator[T]],
) -> Callable[Concatenate[AsyncClient, P], AsyncIterator[T]]:
    """The blocking client's iterating ``method``, an async iterator on the asyncio client."""

    @functools.wraps(method)
    def iterated(self: AsyncClient, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[T]:
        return method(self, *args, **kwargs)  # type: ignore[arg-type, return-value]

    signature = inspect.signature(method)
    returns = f"Async{signature.return_annotation}"
    iterated.__signature__ = signature.replace(return_annotation=returns)  # type: ignore[attr-defined]
    return iterated


class AsyncClient(calls.ClientBase):
    """A ``grpc.aio`` connection to the ssdrbm service; arguments as for :class:`ssdrbm.Client`.

    Create it inside a running event loop (``async with AsyncClient(...) as client``).
    """

    _grpc = grpc.aio

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the transport: await the effects of a call's steps ------------------------------------

    async def _run(self, steps: calls.Steps[T]) -> T:
        """Run a call's steps to their result."""
        walk = calls.Walk(steps)
        async for _ in self._walk(walk):
            pass  # calls that return a result emit nothing
        return walk.result

    async def _walk(self, walk: calls.Walk[Any]) -> AsyncIterator[Any]:
        for effect in walk:
            if isinstance(effect, calls.Emit):
                yield effect.item
            else:
                walk.reply, walk.error = await self._perform(effect)

    async def _perform(self, effect: calls.Effect) -> tuple[Any, grpc.RpcError | None]:
        """The effect's answer, or the RpcError it failed with."""
        try:
            if isinstance(effect, calls.Sleep):
                await asyncio.sleep(effect.seconds)
                return None, None
            if isinstance(effect, calls.Next):
                message = await effect.call.read()
                return (None if message is grpc.aio.EOF else message), None
            method = getattr(self._stub, effect.method)
            call = method(effect.request, timeout=effect.timeout, metadata=effect.metadata)
            return (call if isinstance(effect, calls.Open) else await call), None
        except grpc.RpcError as error:
            return None, error

    # -- the calls: the blocking client's methods, awaited or iterated -------------------------

    start_training = _awaited(Client.start_training)
    training_defaults = _awaited(Client.training_defaults)
    server_info = _awaited(Client.server_info)
    get_job = _awaited(Client.get_job)
    list_jobs = _iterated(Client.list_jobs)
    cancel = _awaited(Client.cancel)
    delete_job = _awaited(Client.delete_job)
    start_sweep = _awaited(Client.start_sweep)
    get_sweep = _awaited(Client.get_sweep)
    list_sweeps = _iterated(Client.list_sweeps)
    cancel_sweep = _awaited(Client.cancel_sweep)
    delete_sweep = _awaited(Client.delete_sweep)
    stream_sweep = _iterated(Client.stream_sweep)
    stream_metrics = _iterated(Client.stream_metrics)
    wait = _awaited(Client.wait)
    reconstruct = _awaited(Client.reconstruct)
    sample_hidden = _awaited(Client.sample_hidden)
    upload_dataset = _awaited(Client.upload_dataset)
    upload_dataset_details = _awaited(Client.upload_dataset_details)
    list_datasets = _iterated(Client.list_datasets)
    delete_dataset = _awaited(Client.delete_dataset)
    fetch_model = _awaited(Client.fetch_model)
    export_model = _awaited(Client.export_model)
