"""The asyncio Python SDK: :class:`AsyncClient`, the same methods as :class:`ssdrbm.Client`.

from ssdrbm.aio import AsyncClient

async with AsyncClient("localhost:50051") as client:
    job = await client.start_training(n_hidden=25, steps=500)
    async for event in client.stream_metrics(job.id):
        ...
    features = await client.sample_hidden(job.id, x)

Each method runs its call's steps (``calls.py``, shared with the blocking client) on a
``grpc.aio`` channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from ssdrbm import calls
from ssdrbm.calls import DEFAULT_PAGE_SIZE
from ssdrbm.client import Client
from ssdrbm.datasets import DEFAULT_CHUNK_BYTES, Dataset, UploadedDataset
from ssdrbm.events import Job, JobState, MetricEvent
from ssdrbm.model_file import ExportedModel
from ssdrbm.server_info import ServerInfo
from ssdrbm.spec import TrainingDefaults
from ssdrbm.sweeps import Sweep

T = TypeVar("T")


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

    def _iterate(self, steps: calls.Steps[None]) -> AsyncIterator[Any]:
        """Run a call's steps, yielding the items they emit."""
        return self._walk(calls.Walk(steps))

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

    # -- jobs ----------------------------------------------------------------------------------

    async def start_training(self, **kwargs: Any) -> Job:
        return await self._run(calls.start_training(self, **kwargs))

    async def server_info(self) -> ServerInfo:
        return await self._run(calls.server_info(self))

    async def training_defaults(self) -> TrainingDefaults:
        return await self._run(calls.training_defaults(self))

    async def get_job(self, job_id: str) -> Job:
        return await self._run(calls.get_job(self, job_id))

    def list_jobs(
        self, state: JobState | str | None = None, *, page_size: int = DEFAULT_PAGE_SIZE
    ) -> AsyncIterator[Job]:
        return self._iterate(calls.list_jobs(self, state, page_size))

    async def cancel(self, job_id: str) -> Job:
        return await self._run(calls.cancel(self, job_id))

    async def delete_job(self, job_id: str, *, force: bool = False) -> None:
        await self._run(calls.delete_job(self, job_id, force))

    # -- sweeps (ssdrbm/sweeps.py) --------------------------------------------------------------

    async def start_sweep(self, **kwargs: Any) -> Sweep:
        return await self._run(calls.start_sweep(self, **kwargs))

    async def get_sweep(self, sweep_id: str) -> Sweep:
        return await self._run(calls.get_sweep(self, sweep_id))

    def list_sweeps(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> AsyncIterator[Sweep]:
        return self._iterate(calls.list_sweeps(self, page_size))

    async def cancel_sweep(self, sweep_id: str) -> Sweep:
        return await self._run(calls.cancel_sweep(self, sweep_id))

    async def delete_sweep(
        self, sweep_id: str, *, force: bool = False, keep_runs: bool = False
    ) -> int:
        return await self._run(calls.delete_sweep(self, sweep_id, force, keep_runs))

    def stream_sweep(self, sweep_id: str, *, timeout: float | None = None) -> AsyncIterator[Sweep]:
        return self._iterate(calls.stream_sweep(self, sweep_id, timeout))

    # -- metrics -------------------------------------------------------------------------------

    def stream_metrics(
        self,
        job_id: str,
        after: str | None = None,
        *,
        follow: bool = True,
        timeout: float | None = None,
    ) -> AsyncIterator[MetricEvent]:
        return self._iterate(calls.stream_metrics(self, job_id, after, follow, timeout))

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[MetricEvent], None] | None = None,
    ) -> Job:
        return await self._run(calls.wait(self, job_id, timeout, on_event))

    # -- serving -------------------------------------------------------------------------------

    async def reconstruct(
        self,
        job_id: str,
        x: np.ndarray,
        k: int = 1,
        *,
        mean_field: bool = False,
        seed: int = 0,
        checkpoint_step: int = 0,
    ) -> np.ndarray:
        steps = calls.reconstruct(self, job_id, x, k, mean_field, seed, checkpoint_step)
        return await self._run(steps)

    async def sample_hidden(
        self,
        job_id: str,
        x: np.ndarray,
        mode: str = "probs",
        *,
        seed: int = 0,
        checkpoint_step: int = 0,
    ) -> np.ndarray:
        steps = calls.sample_hidden(self, job_id, x, mode, seed, checkpoint_step)
        return await self._run(steps)

    # -- datasets and models -------------------------------------------------------------------

    async def upload_dataset(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> str:
        details = await self.upload_dataset_details(data, name=name, chunk_bytes=chunk_bytes)
        return details.id

    async def upload_dataset_details(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> UploadedDataset:
        steps = calls.upload_dataset(self, data, name, chunk_bytes)
        return await self._run(steps)

    def list_datasets(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> AsyncIterator[Dataset]:
        return self._iterate(calls.list_datasets(self, page_size))

    async def delete_dataset(self, dataset_id: str) -> None:
        await self._run(calls.delete_dataset(self, dataset_id))

    async def fetch_model(self, job_id: str, *, checkpoint_step: int = 0) -> ExportedModel:
        return await self._run(calls.fetch_model(self, job_id, checkpoint_step))

    async def export_model(
        self,
        job_id: str,
        path: str | Path,
        *,
        checkpoint_step: int = 0,
        format: str = "safetensors",
        model_name: str | None = None,
    ) -> Path:
        steps = calls.export_model(self, job_id, path, checkpoint_step, format, model_name)
        return await self._run(steps)


# Each method does what the blocking client's does, awaited: its documentation is that method's.
for _name, _method in vars(AsyncClient).items():
    if not _name.startswith("_"):
        _method.__doc__ = getattr(Client, _name).__doc__
