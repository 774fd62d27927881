"""The asyncio Python SDK: :class:`AsyncClient`, the same methods as :class:`ssdrbm.Client`.

from ssdrbm.aio import AsyncClient

async with AsyncClient("localhost:50051") as client:
    job = await client.start_training(n_hidden=25, steps=500)
    async for event in client.stream_metrics(job.id):
        ...
    features = await client.sample_hidden(job.id, x)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ssdrbm import export, reconnect, serving
from ssdrbm.client import DEFAULT_PAGE_SIZE
from ssdrbm.connection import TLS, Connection
from ssdrbm.datasets import (
    DEFAULT_CHUNK_BYTES,
    Dataset,
    UploadedDataset,
    load_array,
    upload_messages,
)
from ssdrbm.errors import ResourceExhausted, Unavailable, from_rpc_error, retry_delay
from ssdrbm.events import Job, JobState, MetricEvent, StateEvent, event_from_proto
from ssdrbm.model_file import ExportedModel
from ssdrbm.retry import RetryPolicy, acall_with_retry, is_retryable
from ssdrbm.server_info import ServerInfo
from ssdrbm.spec import TrainingDefaults, training_request
from ssdrbm.sweeps import Sweep, sweep_request
from ssdrbm.tensors import DEFAULT_MAX_BATCH_BYTES
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

logger = logging.getLogger(__name__)


class AsyncClient:
    """A ``grpc.aio`` connection to the ssdrbm service; arguments as for :class:`ssdrbm.Client`.

    Create it inside a running event loop (``async with AsyncClient(...) as client``).
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        token: str | None = None,
        tls: TLS | bool | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        reconnect_s: float = reconnect.DEFAULT_RECONNECT_S,
    ) -> None:
        self.connection = Connection.resolve(target, token=token, tls=tls, timeout=timeout)
        self.retry = retry or RetryPolicy()
        self.max_batch_bytes = max_batch_bytes
        self.reconnect_s = reconnect_s
        self._channel = self.connection.aio_channel()
        self._stub = rbm_pb2_grpc.RBMServiceStub(self._channel)

    @property
    def target(self) -> str:
        """The address this client talks to."""
        return self.connection.target

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _pages(self, method: str, request: Any, field: str) -> AsyncIterator[Any]:
        """Every item (``field`` of each response) of a paged List call; see the blocking
        client's ``_pages``."""
        while True:
            response = await self._call(method, request)
            for message in getattr(response, field):
                yield message
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token

    async def _call(self, method: str, request: Any) -> Any:
        """A unary call with the deadline, the token and retries on UNAVAILABLE."""
        stub_method = getattr(self._stub, method)
        try:
            return await acall_with_retry(
                lambda: stub_method(
                    request, timeout=self.connection.timeout, metadata=self.connection.metadata()
                ),
                self.retry,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.target) from None

    async def start_training(self, **kwargs: Any) -> Job:
        """Submit a training job; see :meth:`ssdrbm.Client.start_training` for the arguments."""
        request = training_request(**kwargs)
        return Job.from_proto((await self._call("StartTraining", request)).job)

    async def server_info(self) -> ServerInfo:
        """The service's version, API and optional features (``GetServerInfo``)."""
        return ServerInfo.from_proto(
            await self._call("GetServerInfo", rbm_pb2.GetServerInfoRequest())
        )

    async def training_defaults(self) -> TrainingDefaults:
        """The defaults the service fills into unset fields: step sizes per model and
        optimizer, and a minimal request resolved (every other default)."""
        return TrainingDefaults.from_proto(
            await self._call("GetTrainingDefaults", rbm_pb2.GetTrainingDefaultsRequest())
        )

    async def get_job(self, job_id: str) -> Job:
        """The job's current record."""
        return Job.from_proto(await self._call("GetJob", rbm_pb2.GetJobRequest(job_id=job_id)))

    async def list_jobs(
        self, state: JobState | str | None = None, *, page_size: int = DEFAULT_PAGE_SIZE
    ) -> AsyncIterator[Job]:
        """Every job of the caller, newest first, page by page."""
        state_number = JobState(state).to_proto() if state else 0
        request = rbm_pb2.ListJobsRequest(page_size=page_size, state=state_number)
        async for message in self._pages("ListJobs", request, "jobs"):
            yield Job.from_proto(message)

    async def cancel(self, job_id: str) -> Job:
        """Ask the job to stop; returns its record."""
        request = rbm_pb2.CancelJobRequest(job_id=job_id)
        return Job.from_proto(await self._call("CancelJob", request))

    async def delete_job(self, job_id: str, *, force: bool = False) -> None:
        """Delete a finished job and all it stored; ``force`` cancels an unfinished one first."""
        request = rbm_pb2.DeleteJobRequest(job_id=job_id, force=force)
        await self._call("DeleteJob", request)

    # -- sweeps (ssdrbm/sweeps.py) --------------------------------------------------------------

    async def start_sweep(self, **kwargs: Any) -> Sweep:
        """Start a sweep; see :meth:`ssdrbm.Client.start_sweep` for the arguments."""
        return Sweep.from_proto(await self._call("StartSweep", sweep_request(**kwargs)))

    async def get_sweep(self, sweep_id: str) -> Sweep:
        """The sweep with its leaderboard (runs best first)."""
        request = rbm_pb2.GetSweepRequest(sweep_id=sweep_id)
        return Sweep.from_proto(await self._call("GetSweep", request))

    async def list_sweeps(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> AsyncIterator[Sweep]:
        """Every sweep of the caller, newest first (without their runs)."""
        request = rbm_pb2.ListSweepsRequest(page_size=page_size)
        async for message in self._pages("ListSweeps", request, "sweeps"):
            yield Sweep.from_proto(message)

    async def cancel_sweep(self, sweep_id: str) -> Sweep:
        """Cancel every queued or running run of the sweep."""
        request = rbm_pb2.CancelSweepRequest(sweep_id=sweep_id)
        return Sweep.from_proto(await self._call("CancelSweep", request))

    async def delete_sweep(
        self, sweep_id: str, *, force: bool = False, keep_runs: bool = False
    ) -> int:
        """Delete the sweep and its runs' jobs; returns how many jobs were deleted. ``force``
        cancels unfinished runs first; ``keep_runs`` keeps the jobs."""
        request = rbm_pb2.DeleteSweepRequest(sweep_id=sweep_id, force=force, keep_runs=keep_runs)
        return (await self._call("DeleteSweep", request)).deleted_jobs

    async def stream_sweep(
        self, sweep_id: str, *, timeout: float | None = None
    ) -> AsyncIterator[Sweep]:
        """The live leaderboard until the sweep ends; see the blocking client."""
        deadline = reconnect.deadline_after(timeout)
        backoff = reconnect.Reconnect(self.retry, self.reconnect_s)
        while True:
            call = self._stub.StreamSweep(
                rbm_pb2.StreamSweepRequest(sweep_id=sweep_id),
                timeout=reconnect.remaining(deadline),
                metadata=self.connection.metadata(),
            )
            try:
                async for message in call:
                    backoff.reset()
                    sweep = Sweep.from_proto(message.sweep)
                    yield sweep
                    if sweep.done:
                        return
                return
            except grpc.RpcError as error:
                delay = backoff.next_delay(retry_delay(error)) if is_retryable(error) else None
                if delay is None:
                    raise from_rpc_error(error, self.target) from None
                await asyncio.sleep(delay)
            finally:
                call.cancel()

    async def stream_metrics(
        self,
        job_id: str,
        after: str | None = None,
        *,
        follow: bool = True,
        timeout: float | None = None,
    ) -> AsyncIterator[MetricEvent]:
        """The job's events, resuming after dropped connections; see the blocking client."""
        token = after or ""
        deadline = reconnect.deadline_after(timeout)
        backoff = reconnect.Reconnect(self.retry, self.reconnect_s)
        while True:
            request = rbm_pb2.StreamMetricsRequest(
                job_id=job_id, after=token, history_only=not follow
            )
            call = self._stub.StreamMetrics(
                request, timeout=reconnect.remaining(deadline), metadata=self.connection.metadata()
            )
            received = 0
            try:
                async for message in call:
                    token = message.resume_token or token
                    received += 1
                    backoff.reset()
                    event = event_from_proto(message)
                    if event is None:
                        continue
                    yield event
                    if isinstance(event, StateEvent) and event.state.terminal:
                        return
            except grpc.RpcError as error:
                delay = backoff.next_delay(retry_delay(error)) if is_retryable(error) else None
                if delay is None:
                    raise from_rpc_error(error, self.target) from None
                logger.info("metric stream of %s dropped (%s); resuming", job_id, error.code())
                await asyncio.sleep(delay)
                continue
            finally:
                call.cancel()
            if not follow or (received == 0 and (await self.get_job(job_id)).done):
                return
            delay = backoff.next_delay()
            if delay is None:
                raise Unavailable(reconnect.STREAM_KEEPS_CLOSING.format(job_id), target=self.target)
            await asyncio.sleep(delay)

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[MetricEvent], None] | None = None,
    ) -> Job:
        """Follow the job until it ends and return its final record."""
        async for event in self.stream_metrics(job_id, timeout=timeout):
            if on_event is not None:
                on_event(event)
        return await self.get_job(job_id)

    async def _batched(
        self,
        x: np.ndarray,
        method: str,
        build: Callable[[np.ndarray, int], Any],
        same: bool,
    ) -> np.ndarray:
        plan = serving.BatchPlan.for_input(x, self.max_batch_bytes)
        outputs: list[np.ndarray] = []
        start = 0
        while start < plan.batch.shape[0]:
            rows = plan.next_slice(start)
            try:
                response = await self._call(method, build(plan.batch[rows], start))
            except ResourceExhausted:
                if plan.shrink():
                    continue
                raise
            outputs.append(serving.output_array(response))
            start = rows.stop
        return plan.assemble(outputs, same_shape=same)

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
        """Visible vectors after ``k`` Gibbs steps (or mean field); same shape as ``x``."""

        def build(rows: np.ndarray, start: int) -> rbm_pb2.ReconstructRequest:
            return serving.reconstruct_request(
                job_id,
                rows,
                k=k,
                mean_field=mean_field,
                seed=serving.chunk_seed(seed, start),
                checkpoint_step=checkpoint_step,
            )

        return await self._batched(x, "Reconstruct", build, same=True)

    async def sample_hidden(
        self,
        job_id: str,
        x: np.ndarray,
        mode: str = "probs",
        *,
        seed: int = 0,
        checkpoint_step: int = 0,
    ) -> np.ndarray:
        """Hidden probabilities (``"probs"``) or samples (``"sample"``) of ``x``."""
        mode_number = serving.hidden_mode(mode)

        def build(rows: np.ndarray, start: int) -> rbm_pb2.SampleHiddenRequest:
            return serving.sample_hidden_request(
                job_id,
                rows,
                mode=mode_number,
                seed=serving.chunk_seed(seed, start),
                checkpoint_step=checkpoint_step,
            )

        return await self._batched(x, "SampleHidden", build, same=False)

    async def upload_dataset(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> str:
        """Upload an array (or a ``.npy`` file) and return its dataset id."""
        details = await self.upload_dataset_details(data, name=name, chunk_bytes=chunk_bytes)
        return details.id

    async def upload_dataset_details(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> UploadedDataset:
        """Upload and return the id with shape, size and whether the content was new."""
        array = load_array(data)
        timeout = self.connection.timeout + array.nbytes / 5e6

        def send() -> Awaitable[Any]:
            return self._stub.UploadDataset(
                _aiter(upload_messages(array, name=name, chunk_bytes=chunk_bytes)),
                timeout=timeout,
                metadata=self.connection.metadata(),
            )

        try:
            response = await acall_with_retry(send, self.retry)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.target) from None
        return UploadedDataset(
            id=response.dataset_id,
            shape=tuple(response.shape),
            size_bytes=response.size_bytes,
            created=response.created,
        )

    async def list_datasets(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> AsyncIterator[Dataset]:
        """The caller's uploaded datasets, ordered by id, page by page."""
        request = rbm_pb2.ListDatasetsRequest(page_size=page_size)
        async for message in self._pages("ListDatasets", request, "datasets"):
            yield Dataset.from_proto(message)

    async def delete_dataset(self, dataset_id: str) -> None:
        """Remove a dataset from the caller's datasets (FailedPrecondition while a queued or
        running job of the caller trains on it)."""
        await self._call("DeleteDataset", rbm_pb2.DeleteDatasetRequest(dataset_id=dataset_id))

    async def _download(
        self,
        job_id: str,
        checkpoint_step: int,
        export_format: int = rbm_pb2.EXPORT_FORMAT_SAFETENSORS,
    ) -> export.ModelDownload:
        request = rbm_pb2.ExportModelRequest(
            job_id=job_id, checkpoint_step=checkpoint_step, format=export_format
        )

        async def receive() -> export.ModelDownload:
            call = self._stub.ExportModel(
                request, timeout=self.connection.timeout, metadata=self.connection.metadata()
            )
            return export.collect_export([message async for message in call], export_format)

        try:
            return await acall_with_retry(receive, self.retry)
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.target) from None

    async def fetch_model(self, job_id: str, *, checkpoint_step: int = 0) -> ExportedModel:
        """The job's model as numpy tensors plus its config."""
        return (await self._download(job_id, checkpoint_step)).model()

    async def export_model(
        self,
        job_id: str,
        path: str | Path,
        *,
        checkpoint_step: int = 0,
        format: str = "safetensors",
        model_name: str | None = None,
    ) -> Path:
        """Write the job's model to ``path`` as ``"safetensors"`` (directory), ``"onnx"`` (file)
        or ``"triton"`` (model repository directory); see :meth:`ssdrbm.Client.export_model`."""
        export_format = export.wire_format(format)
        if format == "triton":
            export.check_model_name(model_name or job_id)
        download = await self._download(job_id, checkpoint_step, export_format)
        return download.save(path, format, model_name=model_name or job_id)


async def _aiter(items: Any) -> AsyncIterator[Any]:
    for item in items:
        yield item
