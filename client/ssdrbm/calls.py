"""Every call of the service, written once for the blocking and the asyncio clients.

A call is written here as *steps*: a generator that yields what it needs done on the network
(an *effect*) and gets the answer back from the ``yield``::

    def get_job(client, job_id):
        response = yield from unary(client, "GetJob", rbm_pb2.GetJobRequest(job_id=job_id))
        return Job.from_proto(response)

The effects are few: :class:`Call` (start an RPC and wait for its response; its request is an
iterable of messages for a client stream), :class:`Open` (start a server stream; the answer is
the call) and :class:`Next` (the stream's next message, None at its end), :class:`Sleep`, and
:class:`Emit` (hand an item to whoever iterates a listing or a stream). A failed RPC comes back
as its ``grpc.RpcError``, raised at the ``yield``.

So everything but the I/O is here, once: the retry and reconnect decisions, the mapping of gRPC
errors to :mod:`ssdrbm.errors`, pagination, streams, splitting serving batches, the upload's
chunks, the export's checks (a call of one request and one answer is :func:`unary`, its request
built by the client's method). :class:`ssdrbm.Client` (``client.py``)
performs the effects on a blocking channel, :class:`ssdrbm.aio.AsyncClient` (``aio.py``) awaits
them on a ``grpc.aio`` channel (each about twenty lines: ``_run``, ``_walk``, ``_perform``,
with :class:`Walk` feeding the answers back). Every public method of the blocking client only
runs its call's steps, and the asyncio client's methods are those same methods, awaited.

To add a call: write its steps here, then a method of :class:`ssdrbm.Client` that runs them
(``self._run(steps)`` for a result, ``self._iterate(steps)`` for emitted items), and name it in
:class:`ssdrbm.aio.AsyncClient`'s list; ``tests/test_client_calls.py`` checks that both clients
keep the same methods.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import numpy as np

from ssdrbm import export, reconnect, serving
from ssdrbm.connection import TLS, Connection
from ssdrbm.datasets import Dataset, UploadedDataset, load_array, upload_messages
from ssdrbm.errors import ResourceExhausted, Unavailable, from_rpc_error, retry_delay
from ssdrbm.events import Job, JobState, MetricEvent, StateEvent, event_from_proto
from ssdrbm.model_file import ExportedModel
from ssdrbm.retry import Backoff, RetryPolicy, is_retryable
from ssdrbm.spec import from_message
from ssdrbm.sweeps import Sweep
from ssdrbm.tensors import DEFAULT_MAX_BATCH_BYTES, from_tensor, to_tensor
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 50

# -- effects: what a call asks its client to do ---------------------------------------------------


@dataclass(frozen=True)
class Call:
    """Start RPC ``method`` of RBMService and answer with its response."""

    method: str
    request: Any  # a message, or an iterable of messages for a client stream
    timeout: float | None  # seconds; None: no deadline
    metadata: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Open(Call):
    """Start a server-streaming RPC and answer with the call (read it with :class:`Next`)."""


@dataclass(frozen=True)
class Next:
    """Answer with the stream's next message, or None once it has ended."""

    call: Any


@dataclass(frozen=True)
class Sleep:
    """Wait before the next attempt."""

    seconds: float


@dataclass(frozen=True)
class Emit:
    """Hand ``item`` to the caller of a method that iterates (listings, streams)."""

    item: Any


Effect = Call | Next | Sleep | Emit
Steps = Generator[Effect, Any, T]


class Walk(Generic[T]):
    """A client's handle on running steps: iterate it for the effects to perform, set ``reply``
    (or ``error``, a failed RPC) before taking the next; ``result`` is the steps' return value
    once the iteration ends. Leaving the iteration early closes the steps, which cancels any
    stream they hold open."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self.reply: Any = None
        self.error: grpc.RpcError | None = None
        self.result: Any = None  # the steps' return value, once the iteration has ended

    def __iter__(self) -> Iterator[Effect]:
        with closing(self._steps):
            while True:
                try:
                    effect = self._resume()
                except StopIteration as done:
                    self.result = done.value
                    return
                yield effect

    def _resume(self) -> Effect:
        """Hand the steps the last effect's answer; returns the next effect."""
        reply, error = self.reply, self.error
        self.reply, self.error = None, None
        return self._steps.send(reply) if error is None else self._steps.throw(error)


class ClientBase:
    """What both clients hold: the resolved connection, the retry policy, the serving batch
    limit, the streams' reconnect budget, and the stub on a channel of ``_grpc`` (blocking, or
    ``grpc.aio``)."""

    _grpc: Any = grpc

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
        self._channel = self.connection.channel(self._grpc)
        self._stub = rbm_pb2_grpc.RBMServiceStub(self._channel)

    def _iterate(self, steps: Steps[None]) -> Any:
        """Run a call's steps, yielding the items they emit (``_walk``: blocking or async)."""
        return self._walk(Walk(steps))  # type: ignore[attr-defined]

    def _call(self, method: str, request: Any, convert: Callable[[Any], Any]) -> Any:
        """Run :func:`unary` on this client's transport (``_run``): its result, or for the asyncio
        client an awaitable, which every method therefore returns."""
        return self._run(unary(self, method, request, convert))  # type: ignore[attr-defined]

    @property
    def target(self) -> str:
        """The address this client talks to."""
        return self.connection.target


# -- the plumbing of every call -------------------------------------------------------------------


def _start(
    client: ClientBase, method: str, request: Any, timeout: float | None, effect: type = Call
) -> Steps[Any]:
    """One attempt of a call: its response (``Open``: the call), or its RpcError raised."""
    return (yield effect(method, request, timeout, client.connection.metadata()))


def _retried(client: ClientBase, attempt: Callable[[], Steps[T]]) -> Steps[T]:
    """Run ``attempt`` again after UNAVAILABLE as ``client.retry`` allows; any other error, or
    the last one, is raised as an :class:`~ssdrbm.errors.SSDRBMError`."""
    backoff = Backoff(client.retry)
    while True:
        try:
            return (yield from attempt())
        except grpc.RpcError as error:
            delay = backoff.after(error)
            if delay is None:
                raise from_rpc_error(error, client.target) from None
        yield Sleep(delay)


def unary(
    client: ClientBase, method: str, request: Any, convert: Callable[[Any], Any] = lambda x: x
) -> Steps[Any]:
    """A unary call with the deadline, the token and retries on UNAVAILABLE; its response, as
    ``convert`` makes it.

    Every unary call is idempotent: reads, cancels, deletes, and StartTraining and StartSweep
    through their request_id (which makes a repeat return the original job or sweep).
    """
    timeout = client.connection.timeout
    return convert((yield from _retried(client, lambda: _start(client, method, request, timeout))))


def _pages(
    client: ClientBase, method: str, request: Any, field: str, convert: Callable[[Any], Any]
) -> Steps[None]:
    """Emit every item (``field`` of each response, converted) of a paged List call, fetching
    the next page with ``next_page_token`` as the iteration reaches it."""
    while True:
        response = yield from unary(client, method, request)
        for message in getattr(response, field):
            yield Emit(convert(message))
        if not response.next_page_token:
            return
        request.page_token = response.next_page_token


def _reconnect_delay(
    client: ClientBase, backoff: reconnect.Reconnect, error: grpc.RpcError
) -> float:
    """The sleep before re-opening a stream that failed with ``error``; raises the error as an
    SSDRBMError when it is not worth retrying or the reconnect budget is spent."""
    delay = backoff.next_delay(retry_delay(error)) if is_retryable(error) else None
    if delay is None:
        raise from_rpc_error(error, client.target) from None
    return delay


# -- jobs -----------------------------------------------------------------------------------------


def get_job(client: ClientBase, job_id: str) -> Steps[Job]:
    request = rbm_pb2.GetJobRequest(job_id=job_id)
    return (yield from unary(client, "GetJob", request, Job.from_proto))


def list_jobs(client: ClientBase, state: JobState | str | None, page_size: int) -> Steps[None]:
    state_number = JobState(state).to_proto() if state else 0
    request = rbm_pb2.ListJobsRequest(page_size=page_size, state=state_number)
    yield from _pages(client, "ListJobs", request, "jobs", Job.from_proto)


# -- sweeps ---------------------------------------------------------------------------------------


def list_sweeps(client: ClientBase, page_size: int) -> Steps[None]:
    request = rbm_pb2.ListSweepsRequest(page_size=page_size)
    yield from _pages(client, "ListSweeps", request, "sweeps", Sweep.from_proto)


def stream_sweep(client: ClientBase, sweep_id: str, timeout: float | None) -> Steps[None]:
    """Emit the sweep on every change until it ends. Each update is whole, so a dropped
    connection is simply opened again."""
    backoff = reconnect.Reconnect(client.retry, client.reconnect_s, timeout)
    request = rbm_pb2.StreamSweepRequest(sweep_id=sweep_id)
    while True:
        call = yield from _start(client, "StreamSweep", request, backoff.remaining(), Open)
        try:
            while (message := (yield Next(call))) is not None:
                backoff.reset()
                sweep = Sweep.from_proto(message.sweep)
                yield Emit(sweep)
                if sweep.done:
                    return
            return
        except grpc.RpcError as error:
            yield Sleep(_reconnect_delay(client, backoff, error))
        finally:
            call.cancel()


# -- metrics --------------------------------------------------------------------------------------


def stream_metrics(
    client: ClientBase, job_id: str, after: str | None, follow: bool, timeout: float | None
) -> Steps[None]:
    """Emit the job's events: history first, then live until the job ends. A dropped
    connection is re-opened from the last event's resume token, so the events come exactly
    once and in order."""
    token = after or ""
    backoff = reconnect.Reconnect(client.retry, client.reconnect_s, timeout)
    while True:
        request = rbm_pb2.StreamMetricsRequest(job_id=job_id, after=token, history_only=not follow)
        call = yield from _start(client, "StreamMetrics", request, backoff.remaining(), Open)
        received = 0
        try:
            while (message := (yield Next(call))) is not None:
                token = message.resume_token or token
                received += 1
                backoff.reset()
                event: MetricEvent | None = event_from_proto(message)
                if event is None:
                    continue
                yield Emit(event)
                if isinstance(event, StateEvent) and event.state.terminal:
                    return
        except grpc.RpcError as error:
            delay = _reconnect_delay(client, backoff, error)
            logger.info("metric stream of %s dropped (%s); resuming", job_id, error.code())
            yield Sleep(delay)
            continue
        finally:
            call.cancel()
        if not follow or (received == 0 and (yield from get_job(client, job_id)).done):
            return
        # The server closed the stream before the job ended (e.g. it is draining): resume.
        delay = backoff.next_delay()
        if delay is None:
            raise Unavailable(reconnect.STREAM_KEEPS_CLOSING.format(job_id), target=client.target)
        yield Sleep(delay)


def wait(
    client: ClientBase,
    job_id: str,
    timeout: float | None,
    on_event: Callable[[MetricEvent], None] | None,
) -> Steps[Job]:
    """Follow the job's events until it ends, each handed to ``on_event``; returns its final
    record (any terminal state)."""
    yield from _handled(stream_metrics(client, job_id, None, True, timeout), on_event)
    return (yield from get_job(client, job_id))


def _handled(steps: Steps[None], handle: Callable[[Any], None] | None) -> Steps[None]:
    """Run ``steps`` as part of another call, handing what they emit to ``handle`` (None: drop
    it) instead of to the caller."""
    walk = Walk(steps)
    for effect in walk:
        if isinstance(effect, Emit):
            if handle is not None:
                handle(effect.item)
            continue
        try:
            walk.reply = yield effect
        except grpc.RpcError as error:
            walk.error = error


# -- serving --------------------------------------------------------------------------------------


def _batched(
    client: ClientBase, x: np.ndarray, method: str, fixed: Any, seed: int, same_shape: bool
) -> Steps[np.ndarray]:
    """Send ``x`` in requests under ``client.max_batch_bytes`` (halved while the service answers
    RESOURCE_EXHAUSTED) and join their outputs; ``fixed`` holds each request's other fields."""
    plan = serving.BatchPlan.for_input(x, client.max_batch_bytes)
    outputs: list[np.ndarray] = []
    start = 0
    while start < plan.batch.shape[0]:
        rows = plan.next_slice(start)
        # A distinct, reproducible seed per request (0, "random", stays 0).
        request = type(fixed)(input=to_tensor(plan.batch[rows]), seed=seed + start if seed else 0)
        request.MergeFrom(fixed)
        try:
            response = yield from unary(client, method, request)
        except ResourceExhausted:
            if plan.shrink():
                continue
            raise
        outputs.append(from_tensor(response.output))
        start = rows.stop
    return plan.assemble(outputs, same_shape=same_shape)


def reconstruct(
    client: ClientBase,
    job_id: str,
    x: np.ndarray,
    k: int,
    mean_field: bool,
    seed: int,
    checkpoint_step: int,
) -> Steps[np.ndarray]:
    fixed = rbm_pb2.ReconstructRequest(
        job_id=job_id, k=k, mean_field=mean_field, checkpoint_step=checkpoint_step
    )
    return (yield from _batched(client, x, "Reconstruct", fixed, seed, same_shape=True))


def sample_hidden(
    client: ClientBase, job_id: str, x: np.ndarray, mode: str, seed: int, checkpoint_step: int
) -> Steps[np.ndarray]:
    fixed = rbm_pb2.SampleHiddenRequest(
        job_id=job_id, mode=serving.hidden_mode(mode), checkpoint_step=checkpoint_step
    )
    return (yield from _batched(client, x, "SampleHidden", fixed, seed, same_shape=False))


# -- datasets and models --------------------------------------------------------------------------


def upload_dataset(
    client: ClientBase, data: np.ndarray | str | Path, name: str, chunk_bytes: int
) -> Steps[UploadedDataset]:
    array = load_array(data)
    # Uploads are content-addressed, so sending the same bytes again is safe to retry.
    timeout = client.connection.timeout + array.nbytes / 5e6

    def attempt() -> Steps[Any]:
        messages = upload_messages(array, name=name, chunk_bytes=chunk_bytes)
        return _start(client, "UploadDataset", messages, timeout)

    response = yield from _retried(client, attempt)
    return from_message(UploadedDataset, response, id=response.dataset_id)


def upload_dataset_id(
    client: ClientBase, data: np.ndarray | str | Path, name: str, chunk_bytes: int
) -> Steps[str]:
    return (yield from upload_dataset(client, data, name, chunk_bytes)).id


def list_datasets(client: ClientBase, page_size: int) -> Steps[None]:
    request = rbm_pb2.ListDatasetsRequest(page_size=page_size)
    yield from _pages(client, "ListDatasets", request, "datasets", Dataset.from_proto)


def _download(
    client: ClientBase,
    job_id: str,
    checkpoint_step: int,
    export_format: int = rbm_pb2.EXPORT_FORMAT_SAFETENSORS,
) -> Steps[export.ModelDownload]:
    """The ExportModel stream gathered and checked, retried whole on UNAVAILABLE."""
    request = rbm_pb2.ExportModelRequest(
        job_id=job_id, checkpoint_step=checkpoint_step, format=export_format
    )

    def attempt() -> Steps[export.ModelDownload]:
        call = yield from _start(client, "ExportModel", request, client.connection.timeout, Open)
        messages = []
        try:
            while (message := (yield Next(call))) is not None:
                messages.append(message)
        finally:
            call.cancel()
        return export.collect_export(messages, export_format)

    return (yield from _retried(client, attempt))


def fetch_model(client: ClientBase, job_id: str, checkpoint_step: int) -> Steps[ExportedModel]:
    return (yield from _download(client, job_id, checkpoint_step)).model()


def export_model(
    client: ClientBase,
    job_id: str,
    path: str | Path,
    checkpoint_step: int,
    format: str,
    model_name: str | None,
) -> Steps[Path]:
    export_format = export.wire_format(format)
    if format == "triton":
        export.check_model_name(model_name or job_id)
    download = yield from _download(client, job_id, checkpoint_step, export_format)
    return download.save(path, format, model_name=model_name or job_id)
