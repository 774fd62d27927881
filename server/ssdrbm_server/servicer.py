"""The RBMService servicer: each RPC as a typed async method over the Redis stores.

Handlers raise domain errors (ssdrbm_server/errors.py); the error interceptor maps them to statuses.
The caller's tenant comes from the auth interceptor (``current_tenant()``), and every store
lookup is scoped by it, so another tenant's job or dataset is NOT_FOUND.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import re
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from ssdrbm.datasets import upload_dtype, upload_dtype_code
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server import convert, model_export, resolver, tracing
from ssdrbm_server.call_slots import CallSlots, SlotCap
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import InvalidArgumentError, UnavailableError
from ssdrbm_server.event_fanout import EventFanout, LiveReader
from ssdrbm_server.metrics import ServiceMetrics
from ssdrbm_server.recent_jobs import RecentJobs
from ssdrbm_server.request_bounds import check_dataset_shape
from ssdrbm_server.request_checks import enum_value
from ssdrbm_server.server_info import server_info
from ssdrbm_server.serving import Caller, ModelServer
from ssdrbm_server.store.checkpoints import CheckpointStore
from ssdrbm_server.store.connection import cancellable
from ssdrbm_server.store.datasets import DatasetInfo, DatasetInUseError, DatasetStore, Upload
from ssdrbm_server.store.events import EventStore
from ssdrbm_server.store.jobs import JobStore
from ssdrbm_server.store.queue import JobQueue, QueuePlace
from ssdrbm_server.store.records import JobRecord, JobState
from ssdrbm_server.sweeps.service import SweepService
from ssdrbm_server.sweeps.store import SweepStore
from ssdrbm_server.tenancy import current_tenant
from ssdrbm_server.tensors import array_to_tensor, tensor_to_array

logger = logging.getLogger(__name__)

pb = rbm_pb2
Context = grpc.aio.ServicerContext

REPLAY_BATCH = 256
EXPORT_CHUNK_BYTES = 1 << 20
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_ID_LENGTH = 128
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass
class Stores:
    jobs: JobStore
    events: EventStore
    checkpoints: CheckpointStore
    datasets: DatasetStore


class RBMServicer(rbm_pb2_grpc.RBMServiceServicer):
    def __init__(
        self, settings: Settings, stores: Stores, models: ModelServer, metrics: ServiceMetrics
    ) -> None:
        self.settings = settings
        self.stores = stores
        self.models = models
        self.recent_jobs = RecentJobs()
        self.streams = CallSlots(  # StreamMetrics and StreamSweep calls
            SlotCap(
                settings.max_streams,
                "max_streams",
                "this server already serves {count} metric streams (limit {limit}); retry later "
                "or poll {poll}",
            ),
            SlotCap(
                settings.max_streams_per_tenant,
                "max_streams_per_tenant",
                "tenant {tenant!r} already has {count} metric streams open on this server "
                "(SSDRBM_MAX_STREAMS_PER_TENANT={limit}); close one you no longer follow, or poll "
                "{poll}",
            ),
            on_change=metrics.streams.set,
        )
        # Each upload buffers a chunk and keeps Redis writing: bounded per API process.
        self.uploads = CallSlots(
            SlotCap(
                settings.max_concurrent_uploads,
                "max_concurrent_uploads",
                "this server already receives {count} uploads, of all tenants "
                "(SSDRBM_MAX_CONCURRENT_UPLOADS={limit}); retry in a moment",
            ),
            SlotCap(
                settings.max_uploads_per_tenant,
                "max_uploads_per_tenant",
                "tenant {tenant!r} already has {count} uploads in progress on this server "
                "(SSDRBM_MAX_UPLOADS_PER_TENANT={limit}); let one finish (or cancel it), then "
                "retry",
            ),
        )
        self._draining = False
        self.fanout = EventFanout(self._poll, buffer_events=settings.stream_buffer_events)
        self.sweeps = SweepService(
            settings, stores.jobs, SweepStore(stores.jobs.redis, stores.jobs.keys)
        )
        self.queue = JobQueue(stores.jobs.redis, keys=stores.jobs.keys)  # read-only here
        metrics.queue_backlog = self.queue.backlog

    # --- jobs -------------------------------------------------------------------------------

    @tracing.traced_rpc("StartTraining")
    async def StartTraining(
        self, request: pb.StartTrainingRequest, context: Context
    ) -> pb.StartTrainingResponse:
        tenant = current_tenant()
        job = await resolver.resolve(
            request, self.settings, functools.partial(self.stores.datasets.info, tenant)
        )
        if request.validate_only:
            return pb.StartTrainingResponse(job=_unsubmitted(job), created=False)
        record, created = await self.stores.jobs.submit(
            tenant,
            job.spec.SerializeToString(),
            name=job.spec.name,
            total_steps=job.total_steps,
            n_visible=job.n_visible,
            request_id=job.spec.request_id or None,
            # Checked in the same atomic step as the insert; a repeated request_id still
            # returns its job even at the limit.
            max_active=self.settings.max_jobs_per_tenant,
            max_records=self.settings.max_job_records_per_tenant,
            idempotency_ttl_s=self.settings.idempotency_ttl_seconds,
            traceparent=tracing.current_traceparent(),  # the worker's spans join this trace
            pack_key=job.pack_key,
        )
        tracing.set_attribute("ssdrbm.job_id", record.id)
        if created:
            logger.info(
                "job %s queued for tenant %s (%d steps)",
                record.id,
                tenant,
                job.total_steps,
                extra={"job_id": record.id},  # a field of its own in JSON logs
            )
        else:  # a reused request_id must come with the spec it was first used with
            first = pb.StartTrainingRequest.FromString(record.spec)
            resolver.check_same_request(first, job.spec, f"job {record.id}")
        return pb.StartTrainingResponse(job=convert.job_to_proto(record), created=created)

    async def GetTrainingDefaults(
        self, request: pb.GetTrainingDefaultsRequest, context: Context
    ) -> pb.TrainingDefaults:
        return await resolver.training_defaults(self.settings)

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.ServerInfo:
        return server_info()

    async def GetJob(self, request: pb.GetJobRequest, context: Context) -> pb.Job:
        record = await self._job(request.job_id)
        places = await self.queue_places(record.tenant, [record])
        return convert.job_to_proto(record, places.get(record.id))

    async def ListJobs(self, request: pb.ListJobsRequest, context: Context) -> pb.ListJobsResponse:
        paging = _paging(request)
        enum_value(pb.JobState, request.state, "state")
        records, next_token = await self.stores.jobs.list(
            current_tenant(), **paging, state=convert.state_from_proto(request.state)
        )
        places = await self.queue_places(current_tenant(), records)
        return pb.ListJobsResponse(
            jobs=[convert.job_to_proto(record, places.get(record.id)) for record in records],
            next_page_token=next_token,
        )

    async def queue_places(self, tenant: str, records: list[JobRecord]) -> dict[str, QueuePlace]:
        """The place in the queue of each of the tenant's QUEUED ``records`` (store/queue.py:
        bounded reads, none when no record is queued)."""
        queued = [record.id for record in records if record.state is JobState.QUEUED]
        if not queued:
            return {}
        return await cancellable(
            self.queue.places(
                tenant,
                queued,
                slice_s=self.settings.slice_seconds,
                idle_after_s=self.settings.lease_seconds,
            )
        )

    async def CancelJob(self, request: pb.CancelJobRequest, context: Context) -> pb.Job:
        _check_id(request.job_id, "job_id")
        record = await self.stores.jobs.cancel(current_tenant(), request.job_id)
        logger.info("cancel requested for job %s (now %s)", record.id, record.state.value)
        return convert.job_to_proto(record)

    async def DeleteJob(
        self, request: pb.DeleteJobRequest, context: Context
    ) -> pb.DeleteJobResponse:
        _check_id(request.job_id, "job_id")
        tenant = current_tenant()
        await self.stores.jobs.delete(tenant, request.job_id, force=request.force)
        self._forget_job(tenant, request.job_id)
        logger.info("job %s deleted by tenant %s", request.job_id, tenant)
        return pb.DeleteJobResponse(job_id=request.job_id)

    # --- metrics ----------------------------------------------------------------------------

    async def StreamMetrics(
        self, request: pb.StreamMetricsRequest, context: Context
    ) -> AsyncIterator[pb.MetricEvent]:
        job = await self._job(request.job_id)
        async with self.metric_events(job, request.after, request.history_only) as events:
            async for event in events:
                yield event

    @asynccontextmanager
    async def metric_events(
        self, job: JobRecord, after: str, history_only: bool = False
    ) -> AsyncIterator[AsyncIterator[pb.MetricEvent]]:
        """A metric stream of ``job`` (StreamMetrics, the dashboard's server-sent events): its
        events after ``after``, in one of its tenant's stream slots, live ones through the job's
        shared follower (event_fanout.py)."""
        with self.streams.hold(job.tenant, poll="GetJob"):
            # aclosing: a cancelled call leaves its job's follower at once, not at collection.
            async with aclosing(self._events(job, after, history_only)) as events:
                yield events

    def begin_shutdown(self) -> None:
        """End live metric streams now (UNAVAILABLE, resumable elsewhere), so a graceful
        shutdown is not held up by followers that would never finish on their own: shared
        followers stop at once, a stream reading Redis by itself at its next poll."""
        self._draining = True
        self.fanout.close()

    async def _events(
        self, job: JobRecord, after: str, history_only: bool
    ) -> AsyncIterator[pb.MetricEvent]:
        """Replay from ``after``, then follow live; ends after the terminal state event."""
        # Replay what the stream holds already, in batches.
        while True:
            batch = await self._read(job.id, after, block_ms=None)
            for event in batch:
                yield event
                if convert.is_terminal_event(event):
                    return
            if batch:
                after = batch[-1].resume_token
            if len(batch) < REPLAY_BATCH:
                break
        if history_only:
            return
        if await self._has_ended(job):
            # It may have ended after the replay's last read: send what it wrote since.
            for event in await self._read(job.id, after, block_ms=None):
                yield event
            return
        async with aclosing(self._follow(job, after)) as live:
            async for event in live:
                yield event

    async def _follow(self, job: JobRecord, after: str) -> AsyncIterator[pb.MetricEvent]:
        """Follow live from ``after``: through the job's shared follower once this stream has
        caught up with it, reading Redis by itself while behind it."""
        reader = LiveReader(self.fanout, job)
        try:
            while True:
                if self._draining:
                    raise UnavailableError(
                        "this server is shutting down; reconnect and pass the last "
                        f"resume_token as `after` ({after or 'empty'}) to continue without a gap",
                        reason="SHUTTING_DOWN",
                    )
                batch, ended = await reader.next_batch(after)
                for event in batch:
                    yield event
                    after = event.resume_token
                    if convert.is_terminal_event(event):
                        return
                if ended:
                    return
        finally:
            reader.close()

    async def _poll(self, job: JobRecord, after: str) -> tuple[list[pb.MetricEvent], bool]:
        """One blocking read of the job's events, by a stream or by the job's shared follower:
        (events, whether the stream has ended)."""
        batch = await self._read(job.id, after, block_ms=self.settings.stream_block_ms)
        if batch:
            return batch, False
        if await self._has_ended(job):
            # The terminal event is behind the caller's token; flush what came meanwhile.
            return await self._read(job.id, after, block_ms=None), True
        return [], False

    async def _read(self, job_id: str, after: str, *, block_ms: int | None) -> list[pb.MetricEvent]:
        entries = await cancellable(
            self.stores.events.read(job_id, after=after, count=REPLAY_BATCH, block_ms=block_ms)
        )
        return [convert.event_to_proto(job_id, token, kind, data) for token, kind, data in entries]

    async def _has_ended(self, job: JobRecord) -> bool:
        current = await cancellable(self.stores.jobs.get(job.tenant, job.id))
        return current.state.is_terminal

    # --- serving ----------------------------------------------------------------------------

    @tracing.traced_rpc("Reconstruct")
    async def Reconstruct(
        self, request: pb.ReconstructRequest, context: Context
    ) -> pb.ReconstructResponse:
        job = await self._serving_job(request.job_id)
        v = self._input(request.input)
        loaded = await self.models.model_for(job, request.checkpoint_step)
        out = await self.models.reconstruct(
            loaded,
            v,
            k=request.k,
            mean_field=request.mean_field,
            seed=request.seed,
            caller=caller_of(context),
        )
        return pb.ReconstructResponse(output=array_to_tensor(out), checkpoint_step=loaded.step)

    @tracing.traced_rpc("SampleHidden")
    async def SampleHidden(
        self, request: pb.SampleHiddenRequest, context: Context
    ) -> pb.SampleHiddenResponse:
        job = await self._serving_job(request.job_id)
        mode = enum_value(pb.HiddenMode, request.mode, "mode")
        v = self._input(request.input)
        loaded = await self.models.model_for(job, request.checkpoint_step)
        out = await self.models.hidden(
            loaded,
            v,
            sample=mode == pb.HIDDEN_MODE_SAMPLE,
            seed=request.seed,
            caller=caller_of(context),
        )
        return pb.SampleHiddenResponse(output=array_to_tensor(out), checkpoint_step=loaded.step)

    async def _serving_job(self, job_id: str) -> JobRecord:
        """The job for a serving call: a record read in the last moment (see RecentJobs) or a
        fresh read, which also decides NOT_FOUND and FAILED_PRECONDITION."""
        _check_id(job_id, "job_id")
        return await self.recent_jobs.read(current_tenant(), job_id, self.stores.jobs.get)

    def _input(self, tensor: pb.Tensor) -> np.ndarray:
        return tensor_to_array(
            tensor, field="input", max_elements=self.settings.max_tensor_elements
        )

    # --- datasets and export ----------------------------------------------------------------

    async def UploadDataset(
        self, request_iterator: AsyncIterator[pb.UploadDatasetRequest], context: Context
    ) -> pb.UploadDatasetResponse:
        tenant = current_tenant()
        with self.uploads.hold(tenant):
            info, created = await self._receive_upload(tenant, request_iterator)
        return pb.UploadDatasetResponse(
            dataset_id=info.id, shape=list(info.shape), size_bytes=info.size_bytes, created=created
        )

    async def _receive_upload(
        self, tenant: str, request_iterator: AsyncIterator[pb.UploadDatasetRequest]
    ) -> tuple[DatasetInfo, bool]:
        """Stream the chunks into Redis as they come; the whole array is never held here."""
        upload: Upload | None = None
        content: UploadContent | None = None
        try:
            async for part in request_iterator:
                which = part.WhichOneof("part")
                if upload is None:
                    if which != "header":
                        raise InvalidArgumentError("header", "send the header as the first message")
                    self._check_dataset_header(part.header)
                    content = UploadContent(part.header)
                    upload = self.stores.datasets.begin(
                        tenant,
                        shape=tuple(part.header.shape),
                        dtype=upload_dtype(part.header.dtype).name,
                        name=part.header.name,
                        on_chunk=content.update,
                    )
                    continue
                if which != "chunk":
                    raise InvalidArgumentError("header", "send the header only once, first")
                await upload.write(part.chunk)
            if upload is None or content is None:
                raise InvalidArgumentError("header", "the upload was empty; send a header first")
            await upload.finish()  # the last chunk too, before its values are in the range
            return await upload.commit(content.value_range())
        except BaseException:
            if upload is not None:
                await upload.abort()
            raise

    async def ListDatasets(
        self, request: pb.ListDatasetsRequest, context: Context
    ) -> pb.ListDatasetsResponse:
        page, next_token = await self.stores.datasets.list(current_tenant(), **_paging(request))
        return pb.ListDatasetsResponse(
            datasets=[_dataset_to_proto(info) for info in page], next_page_token=next_token
        )

    async def DeleteDataset(
        self, request: pb.DeleteDatasetRequest, context: Context
    ) -> pb.DeleteDatasetResponse:
        _check_id(request.dataset_id, "dataset_id")
        tenant = current_tenant()
        # Refused while one of the tenant's QUEUED or RUNNING jobs trains on it (a queued job
        # loads the bytes when it starts, and again when it is resumed): store/datasets.py.
        try:
            await self.stores.datasets.delete(tenant, request.dataset_id)
        except DatasetInUseError as in_use:
            # References of jobs that ended, left by a process that died before its index step,
            # are released here; only jobs still queued or running refuse the delete.
            active = await self.stores.jobs.still_active(tenant, in_use.job_ids)
            if active:
                raise DatasetInUseError(request.dataset_id, active) from None
            await self.stores.datasets.delete(tenant, request.dataset_id)
        return pb.DeleteDatasetResponse(dataset_id=request.dataset_id)

    def _check_dataset_header(self, header: pb.DatasetHeader) -> None:
        enum_value(pb.DType, header.dtype, "header.dtype")
        check_dataset_shape(header.shape, upload_dtype(header.dtype).itemsize, self.settings)
        if len(header.name) > self.settings.max_string_length:
            raise InvalidArgumentError(
                "header.name", f"at most {self.settings.max_string_length} characters"
            )
        if header.sha256 and not _SHA256_HEX.fullmatch(header.sha256):
            raise InvalidArgumentError("header.sha256", "must be 64 lower-case hex digits")

    async def ExportModel(
        self, request: pb.ExportModelRequest, context: Context
    ) -> AsyncIterator[pb.ExportModelResponse]:
        job = await self._job(request.job_id)
        checkpoints = self.stores.checkpoints
        if request.checkpoint_step < 0:
            raise InvalidArgumentError("checkpoint_step", "must be >= 0 (0 = latest)")
        export_format = model_export.requested_format(request.format)
        if request.checkpoint_step:
            checkpoint = await checkpoints.get(job.id, request.checkpoint_step)
        else:
            checkpoint = await checkpoints.latest(job.id)
        payload = await model_export.export_payload(
            job.id, checkpoint, export_format, self.models.pool
        )
        header = pb.ModelExportHeader(
            config_json=checkpoint.config_json,
            step=checkpoint.step,
            sha256=payload.sha256,
            size_bytes=len(payload.data),
            format=payload.format,
        )
        yield pb.ExportModelResponse(header=header)
        data = payload.data
        # Chunks stay well under the message limit (a deployment may set it below 1 MiB).
        chunk = max(1, min(EXPORT_CHUNK_BYTES, self.settings.max_message_bytes // 2))
        for start in range(0, len(data), chunk):
            yield pb.ExportModelResponse(chunk=data[start : start + chunk])

    # --- sweeps (ssdrbm_server/sweeps/) -----------------------------------------------------

    async def StartSweep(self, request: pb.StartSweepRequest, context: Context) -> pb.Sweep:
        tenant = current_tenant()
        find_upload = functools.partial(self.stores.datasets.info, tenant)
        return await self.sweeps.start(request, tenant, find_upload)

    async def GetSweep(self, request: pb.GetSweepRequest, context: Context) -> pb.Sweep:
        _check_id(request.sweep_id, "sweep_id")
        return await self.sweeps.get(current_tenant(), request.sweep_id)

    async def ListSweeps(
        self, request: pb.ListSweepsRequest, context: Context
    ) -> pb.ListSweepsResponse:
        return await self.sweeps.list(current_tenant(), **_paging(request))

    async def CancelSweep(self, request: pb.CancelSweepRequest, context: Context) -> pb.Sweep:
        _check_id(request.sweep_id, "sweep_id")
        return await self.sweeps.cancel(current_tenant(), request.sweep_id)

    async def StreamSweep(
        self, request: pb.StreamSweepRequest, context: Context
    ) -> AsyncIterator[pb.SweepUpdate]:
        _check_id(request.sweep_id, "sweep_id")
        tenant = current_tenant()
        await self.sweeps.sweeps.get(tenant, request.sweep_id)  # NOT_FOUND before the limits
        with self.streams.hold(tenant, poll="GetSweep"):  # counted with the metric streams
            async with aclosing(self.sweeps.stream(tenant, request.sweep_id)) as updates:
                async for update in updates:
                    yield update

    async def DeleteSweep(
        self, request: pb.DeleteSweepRequest, context: Context
    ) -> pb.DeleteSweepResponse:
        _check_id(request.sweep_id, "sweep_id")
        tenant = current_tenant()
        deleted = await self.sweeps.delete(
            tenant, request.sweep_id, force=request.force, keep_runs=request.keep_runs
        )
        for job_id in deleted:
            self._forget_job(tenant, job_id)
        return pb.DeleteSweepResponse(sweep_id=request.sweep_id, deleted_jobs=len(deleted))

    # --- helpers ----------------------------------------------------------------------------

    def _forget_job(self, tenant: str, job_id: str) -> None:
        """After a delete: this process's serving caches forget the job at once; other API
        processes within their record reuse time (recent_jobs.py), then they read NOT_FOUND."""
        self.recent_jobs.forget(tenant, job_id)
        self.models.cache.forget(job_id)

    async def _job(self, job_id: str) -> JobRecord:
        return await self.tenant_job(current_tenant(), job_id)

    async def tenant_job(self, tenant: str, job_id: str) -> JobRecord:
        """The tenant's job; another tenant's is NOT_FOUND, worded like a missing one."""
        _check_id(job_id, "job_id")
        return await cancellable(self.stores.jobs.get(tenant, job_id))


def caller_of(context: Context) -> Caller:
    """The tenant and the time left before the client stops waiting (None: no deadline)."""
    return Caller(tenant=current_tenant(), time_remaining=context.time_remaining())


def _unsubmitted(job: resolver.ResolvedJob) -> pb.Job:
    """What StartTraining would create for a validate_only request: no id, nothing stored."""
    return pb.Job(
        name=job.spec.name,
        spec=job.spec,
        total_steps=job.total_steps,
        n_visible=job.n_visible,
        checkpoint_step=-1,
    )


def _paging(
    request: pb.ListJobsRequest | pb.ListDatasetsRequest | pb.ListSweepsRequest,
) -> dict[str, Any]:
    """A listing request's checked ``page_size`` and ``page_token``, as the stores take them:
    the default page size for 0, refused above the maximum; a token no longer than an id."""
    requested = request.page_size
    if requested > MAX_PAGE_SIZE:
        raise InvalidArgumentError("page_size", f"must be at most {MAX_PAGE_SIZE}, got {requested}")
    _check_id(request.page_token, "page_token", required=False)
    return {"page_size": requested or DEFAULT_PAGE_SIZE, "page_token": request.page_token}


def _check_id(value: str, field: str, *, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgumentError(field, "is required")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgumentError(field, f"is longer than {MAX_ID_LENGTH} characters")


class UploadContent:
    """Checks an upload's bytes chunk by chunk (finite values, the header's sha256) and keeps
    the smallest and largest value, which the resolver uses; chunks hold whole elements."""

    def __init__(self, header: pb.DatasetHeader) -> None:
        self.header = header
        self.dtype = upload_dtype(header.dtype)
        self._digest = hashlib.sha256()
        self._low = math.inf
        self._high = -math.inf

    def update(self, chunk: bytes) -> None:
        self._digest.update(chunk)
        values = np.frombuffer(chunk, dtype=self.dtype)
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise InvalidArgumentError("chunk", "the data contains NaN or Inf; send finite values")
        if values.size:
            self._low = min(self._low, float(values.min()))
            self._high = max(self._high, float(values.max()))

    def value_range(self) -> tuple[float, float]:
        """The range, after checking the header's sha256 against every byte received."""
        expected = self.header.sha256
        if expected and self._digest.hexdigest() != expected:
            raise InvalidArgumentError(
                "header.sha256",
                f"the received bytes hash to {self._digest.hexdigest()}, not {expected}; the "
                "upload was corrupted or the header is wrong",
            )
        return self._low, self._high


def _dataset_to_proto(info: DatasetInfo) -> pb.Dataset:
    dataset = pb.Dataset(
        dataset_id=info.id,
        name=info.name,
        shape=list(info.shape),
        dtype=upload_dtype_code(info.dtype),
        size_bytes=info.size_bytes,
    )
    if info.created_at:
        dataset.created_at.FromNanoseconds(int(info.created_at * 1e9))
    return dataset
