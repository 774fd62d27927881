"""The blocking Python SDK: :class:`Client`.

from ssdrbm import Client

with Client("localhost:50051") as client:
    job = client.start_training(n_hidden=25, steps=500)
    final = client.wait(job.id)
    features = client.sample_hidden(job.id, x)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ssdrbm import export, reconnect, serving
from ssdrbm.connection import TLS, Connection
from ssdrbm.datasets import (
    DEFAULT_CHUNK_BYTES,
    Dataset,
    UploadedDataset,
    load_array,
    upload_messages,
)
from ssdrbm.errors import (
    ResourceExhausted,
    SSDRBMError,
    Unavailable,
    from_rpc_error,
    retry_delay,
)
from ssdrbm.events import Job, JobState, MetricEvent, StateEvent, event_from_proto
from ssdrbm.model_file import ExportedModel
from ssdrbm.retry import RetryPolicy, call_with_retry, is_retryable
from ssdrbm.server_info import ServerInfo
from ssdrbm.spec import TrainingDefaults, training_request
from ssdrbm.sweeps import Sweep, sweep_request
from ssdrbm.tensors import DEFAULT_MAX_BATCH_BYTES
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 50


class Client:
    """A connection to the ssdrbm service.

    Args:
        target: ``host:port``; defaults to ``$SSDRBM_TARGET`` or ``localhost:50051``.
        token: bearer token; defaults to ``$SSDRBM_TOKEN``.
        tls: ``True`` for TLS with system roots, a :class:`~ssdrbm.TLS` for a CA file or mutual
            TLS, ``False`` for plaintext; defaults to the ``SSDRBM_TLS*`` variables.
        timeout: deadline in seconds of each unary call (default ``$SSDRBM_TIMEOUT`` or 30).
        retry: backoff for calls that failed with UNAVAILABLE (``ssdrbm.retry.NO_RETRY`` turns
            it off). Every call is idempotent, StartTraining through its ``request_id``, which is
            generated when not given — so a retry never creates a second job.
        max_batch_bytes: largest input tensor per Reconstruct/SampleHidden request.
        reconnect_s: how long a metric stream tries to reconnect after losing its connection.
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
        self._channel = self.connection.sync_channel()
        self._stub = rbm_pb2_grpc.RBMServiceStub(self._channel)

    @property
    def target(self) -> str:
        """The address this client talks to."""
        return self.connection.target

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _pages(self, method: str, request: Any, field: str) -> Iterator[Any]:
        """Every item (``field`` of each response) of a paged List call, fetching the next page
        with ``next_page_token`` as the iteration reaches it."""
        while True:
            response = self._call(method, request)
            yield from getattr(response, field)
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token

    def _call(self, method: str, request: Any) -> Any:
        """A unary call with the deadline, the token and retries on UNAVAILABLE.

        Every unary call is idempotent: reads, cancel, and StartTraining through its request_id.
        """
        stub_method = getattr(self._stub, method)
        try:
            return call_with_retry(
                lambda: stub_method(
                    request, timeout=self.connection.timeout, metadata=self.connection.metadata()
                ),
                self.retry,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.target) from None

    # -- jobs ----------------------------------------------------------------------------------

    def start_training(self, **kwargs: Any) -> Job:
        """Submit a training job and return it at once (usually QUEUED).

        Keyword arguments mirror ``StartTrainingRequest`` (defaults in brackets):
        ``model`` ["bernoulli"] or "gaussian"; ``variance`` (Gaussian: "identity", "isotropic",
        ["diagonal"], "full"); ``min_variance`` (Gaussian variance floor [1e-4]); ``n_hidden``
        [64]; ``optimizer`` ["ssd"], "sgd", "nesterov", "ssd-preconditioned"; ``method``
        ["lowrank"], "svd", "randomized", "newton-schulz"; ``preconditioner`` ("rmsprop",
        "adam"); ``lr`` [0.01]; ``momentum``; ``weight_decay``; ``max_spectral_norm``; ``rank``;
        ``per_parameter`` ({"W": "ssd"} for hybrids); ``per_parameter_lr`` ({"W": 1e-3}: one
        parameter's step size); ``step_rule`` (SSD: ["paper"], "normalized" — the SGD step's
        length, one lr for every model size); ``schedule`` (step-size schedule: "cosine,0.05",
        "exponential,0.5,2000", "inverse-time,500", or a mapping of StepSizeSchedule fields
        [constant]) and ``warmup_steps`` [0]; ``cd_k`` [1]; ``persistent`` [False];
        ``centered`` [False] (centered training; ``centering_sliding_factor``: how far its
        offsets move per step); ``tempering`` (parallel
        tempering of the PCD chains: the number of temperatures, 0 for the server's default)
        and ``tempering_min_beta`` (the hottest inverse temperature); ``batch_size`` [100];
        ``steps`` [1000] or ``epochs``; ``seed`` [0]; ``checkpoint_every``; ``eval_every``;
        ``ais``; ``ais_chains``; ``ais_betas``; ``validation_fraction``; ``dataset``
        ["synthetic"], "mnist", "freyface" with ``dataset_options``, or ``dataset_id`` from
        :meth:`upload_dataset`; ``preprocess`` ("none", "binarize", "scale", "standardize");
        ``request_id`` (generated when missing); ``name``. Zeros mean "the server's default".
        """
        request = training_request(**kwargs)
        # The request_id makes a repeat return the original job, so retrying cannot duplicate it.
        return Job.from_proto(self._call("StartTraining", request).job)

    def training_defaults(self) -> TrainingDefaults:
        """The defaults the service fills into unset fields: step sizes per model and
        optimizer, and a minimal request resolved (every other default)."""
        return TrainingDefaults.from_proto(
            self._call("GetTrainingDefaults", rbm_pb2.GetTrainingDefaultsRequest())
        )

    def server_info(self) -> ServerInfo:
        """The service's version, API and optional features (``GetServerInfo``)."""
        return ServerInfo.from_proto(self._call("GetServerInfo", rbm_pb2.GetServerInfoRequest()))

    def get_job(self, job_id: str) -> Job:
        """The job's current record; :class:`~ssdrbm.errors.NotFound` when it does not exist."""
        return Job.from_proto(self._call("GetJob", rbm_pb2.GetJobRequest(job_id=job_id)))

    def list_jobs(
        self, state: JobState | str | None = None, *, page_size: int = DEFAULT_PAGE_SIZE
    ) -> Iterator[Job]:
        """Every job of the caller, newest first, fetching pages as the iteration goes."""
        state_number = JobState(state).to_proto() if state else 0
        request = rbm_pb2.ListJobsRequest(page_size=page_size, state=state_number)
        for message in self._pages("ListJobs", request, "jobs"):
            yield Job.from_proto(message)

    def cancel(self, job_id: str) -> Job:
        """Ask the job to stop; returns its record (a finished job is left as it is)."""
        return Job.from_proto(self._call("CancelJob", rbm_pb2.CancelJobRequest(job_id=job_id)))

    def delete_job(self, job_id: str, *, force: bool = False) -> None:
        """Delete a finished job with its metrics and checkpoints (it is NOT_FOUND afterwards);
        a queued or running job raises FailedPrecondition unless ``force`` cancels it first."""
        request = rbm_pb2.DeleteJobRequest(job_id=job_id, force=force)
        self._call("DeleteJob", request)

    # -- sweeps (ssdrbm/sweeps.py) --------------------------------------------------------------

    def start_sweep(self, **kwargs: Any) -> Sweep:
        """Start a sweep: one job per point of ``axes`` (and ``seeds``), all checked first.

        Takes :func:`ssdrbm.sweeps.sweep_request`'s keywords: ``axes`` ({"lr": [1e-3, 1e-2],
        "optimizer": ["ssd", "sgd"]}, or :class:`~ssdrbm.sweeps.Range` values with ``random=N``),
        ``seeds``, ``sample_seed``, ``rank_by``, ``early_stop`` (MIN_STEPS or (MIN_STEPS, ETA)),
        ``rungs``, ``name``, ``request_id`` (generated when missing), ``validate_only``, and
        :meth:`start_training`'s keywords for what every run shares.
        """
        return Sweep.from_proto(self._call("StartSweep", sweep_request(**kwargs)))

    def get_sweep(self, sweep_id: str) -> Sweep:
        """The sweep with its leaderboard (runs best first)."""
        return Sweep.from_proto(self._call("GetSweep", rbm_pb2.GetSweepRequest(sweep_id=sweep_id)))

    def list_sweeps(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[Sweep]:
        """Every sweep of the caller, newest first (without their runs: see get_sweep)."""
        request = rbm_pb2.ListSweepsRequest(page_size=page_size)
        for message in self._pages("ListSweeps", request, "sweeps"):
            yield Sweep.from_proto(message)

    def cancel_sweep(self, sweep_id: str) -> Sweep:
        """Cancel every queued or running run of the sweep."""
        request = rbm_pb2.CancelSweepRequest(sweep_id=sweep_id)
        return Sweep.from_proto(self._call("CancelSweep", request))

    def delete_sweep(self, sweep_id: str, *, force: bool = False, keep_runs: bool = False) -> int:
        """Delete the sweep and its runs' jobs (their metrics and checkpoints); returns how many
        jobs were deleted. Queued or running runs raise FailedPrecondition unless ``force``
        cancels them first; ``keep_runs`` deletes only the sweep and keeps its jobs."""
        request = rbm_pb2.DeleteSweepRequest(sweep_id=sweep_id, force=force, keep_runs=keep_runs)
        return self._call("DeleteSweep", request).deleted_jobs

    def stream_sweep(self, sweep_id: str, *, timeout: float | None = None) -> Iterator[Sweep]:
        """The live leaderboard: a :class:`~ssdrbm.sweeps.Sweep` on every change (and every
        few seconds) until the sweep ends. Each update is whole, so a dropped connection is
        simply opened again."""
        deadline = reconnect.deadline_after(timeout)
        backoff = reconnect.Reconnect(self.retry, self.reconnect_s)
        while True:
            call = self._stub.StreamSweep(
                rbm_pb2.StreamSweepRequest(sweep_id=sweep_id),
                timeout=reconnect.remaining(deadline),
                metadata=self.connection.metadata(),
            )
            try:
                for message in call:
                    backoff.reset()
                    sweep = Sweep.from_proto(message.sweep)
                    yield sweep
                    if sweep.done:
                        return
                return
            except grpc.RpcError as error:
                if not is_retryable(error) or not backoff.wait(retry_delay(error)):
                    raise from_rpc_error(error, self.target) from None
            finally:
                call.cancel()

    # -- metrics -------------------------------------------------------------------------------

    def stream_metrics(
        self,
        job_id: str,
        after: str | None = None,
        *,
        follow: bool = True,
        timeout: float | None = None,
    ) -> Iterator[MetricEvent]:
        """The job's metric and state events: history first, then live until the job ends.

        A dropped connection is re-opened from the last event's resume token, so the events come
        exactly once and in order. ``after`` starts after a known token; ``follow=False`` stops
        after the history; ``timeout`` bounds the whole stream (DeadlineExceeded after it).
        """
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
                for message in call:
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
                if not is_retryable(error) or not backoff.wait(retry_delay(error)):
                    raise from_rpc_error(error, self.target) from None
                logger.info("metric stream of %s dropped (%s); resuming", job_id, error.code())
                continue
            finally:
                call.cancel()
            if not follow or (received == 0 and self.get_job(job_id).done):
                return
            # The server closed the stream before the job ended (e.g. it is draining): resume.
            if not backoff.wait():
                raise Unavailable(reconnect.STREAM_KEEPS_CLOSING.format(job_id), target=self.target)

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[MetricEvent], None] | None = None,
    ) -> Job:
        """Follow the job until it ends and return its final record (any terminal state)."""
        for event in self.stream_metrics(job_id, timeout=timeout):
            if on_event is not None:
                on_event(event)
        return self.get_job(job_id)

    # -- serving -------------------------------------------------------------------------------

    def _batched(
        self, x: np.ndarray, method: str, build: Callable[[np.ndarray, int], Any], same: bool
    ) -> np.ndarray:
        plan = serving.BatchPlan.for_input(x, self.max_batch_bytes)
        outputs: list[np.ndarray] = []
        start = 0
        while start < plan.batch.shape[0]:
            rows = plan.next_slice(start)
            try:
                response = self._call(method, build(plan.batch[rows], start))
            except ResourceExhausted:
                if plan.shrink():
                    continue
                raise
            outputs.append(serving.output_array(response))
            start = rows.stop
        return plan.assemble(outputs, same_shape=same)

    def reconstruct(
        self,
        job_id: str,
        x: np.ndarray,
        k: int = 1,
        *,
        mean_field: bool = False,
        seed: int = 0,
        checkpoint_step: int = 0,
    ) -> np.ndarray:
        """Visible vectors after ``k`` Gibbs steps (or mean field) through the trained model.

        ``x`` is (batch, n_visible), a single vector or a stack of images; the result has the
        same shape. Large batches are split into several requests. ``seed`` 0 means random.
        """

        def build(rows: np.ndarray, start: int) -> rbm_pb2.ReconstructRequest:
            return serving.reconstruct_request(
                job_id,
                rows,
                k=k,
                mean_field=mean_field,
                seed=serving.chunk_seed(seed, start),
                checkpoint_step=checkpoint_step,
            )

        return self._batched(x, "Reconstruct", build, same=True)

    def sample_hidden(
        self,
        job_id: str,
        x: np.ndarray,
        mode: str = "probs",
        *,
        seed: int = 0,
        checkpoint_step: int = 0,
    ) -> np.ndarray:
        """Hidden features of ``x``: probabilities (``mode="probs"``) or 0/1 samples ("sample").

        Returns (batch, n_hidden), or (n_hidden,) for a single vector.
        """
        mode_number = serving.hidden_mode(mode)

        def build(rows: np.ndarray, start: int) -> rbm_pb2.SampleHiddenRequest:
            return serving.sample_hidden_request(
                job_id,
                rows,
                mode=mode_number,
                seed=serving.chunk_seed(seed, start),
                checkpoint_step=checkpoint_step,
            )

        return self._batched(x, "SampleHidden", build, same=False)

    # -- datasets and models -------------------------------------------------------------------

    def upload_dataset(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> str:
        """Upload an array (or a ``.npy`` file) and return its dataset id for ``dataset_id=``."""
        return self.upload_dataset_details(data, name=name, chunk_bytes=chunk_bytes).id

    def upload_dataset_details(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> UploadedDataset:
        """Like :meth:`upload_dataset`; returns the id with shape, size and whether it is new."""
        array = load_array(data)
        # Uploads are content-addressed, so sending the same bytes again is safe to retry.
        timeout = self.connection.timeout + array.nbytes / 5e6
        try:
            response = call_with_retry(
                lambda: self._stub.UploadDataset(
                    upload_messages(array, name=name, chunk_bytes=chunk_bytes),
                    timeout=timeout,
                    metadata=self.connection.metadata(),
                ),
                self.retry,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.target) from None
        return UploadedDataset(
            id=response.dataset_id,
            shape=tuple(response.shape),
            size_bytes=response.size_bytes,
            created=response.created,
        )

    def list_datasets(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[Dataset]:
        """The caller's uploaded datasets, ordered by id, fetching pages as the iteration goes."""
        request = rbm_pb2.ListDatasetsRequest(page_size=page_size)
        for message in self._pages("ListDatasets", request, "datasets"):
            yield Dataset.from_proto(message)

    def delete_dataset(self, dataset_id: str) -> None:
        """Remove a dataset from the caller's datasets; its bytes go once no tenant uses them.
        :class:`~ssdrbm.errors.FailedPrecondition` while a queued or running job of the
        caller trains on it; :class:`~ssdrbm.errors.NotFound` for an unknown id. Deleting
        again is NotFound, so a retried delete may report that."""
        self._call("DeleteDataset", rbm_pb2.DeleteDatasetRequest(dataset_id=dataset_id))

    def _download(
        self,
        job_id: str,
        checkpoint_step: int,
        export_format: int = rbm_pb2.EXPORT_FORMAT_SAFETENSORS,
    ) -> export.ModelDownload:
        request = rbm_pb2.ExportModelRequest(
            job_id=job_id, checkpoint_step=checkpoint_step, format=export_format
        )
        try:
            return call_with_retry(
                lambda: export.collect_export(
                    self._stub.ExportModel(
                        request,
                        timeout=self.connection.timeout,
                        metadata=self.connection.metadata(),
                    ),
                    export_format,
                ),
                self.retry,
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error, self.target) from None

    def fetch_model(self, job_id: str, *, checkpoint_step: int = 0) -> ExportedModel:
        """The job's latest (or a given) checkpoint as numpy tensors plus its config."""
        return self._download(job_id, checkpoint_step).model()

    def export_model(
        self,
        job_id: str,
        path: str | Path,
        *,
        checkpoint_step: int = 0,
        format: str = "safetensors",
        model_name: str | None = None,
    ) -> Path:
        """Write the job's model to ``path`` in ``format``:

        - ``"safetensors"``: ``model.safetensors`` and ``config.json`` into directory ``path``;
        - ``"onnx"``: the ONNX graph into file ``path`` (input ``input``, outputs
          ``hidden_probs`` and the mean-field ``reconstruction``, batch dimension dynamic);
        - ``"triton"``: a Triton model repository in directory ``path``:
          ``<model_name>/config.pbtxt`` and ``<model_name>/1/model.onnx``; ``model_name``
          defaults to the job id.

        The bytes are checked against the sha256 the service announces. Returns the directory
        (for Triton, the model's folder) or the file.
        """
        export_format = export.wire_format(format)
        if format == "triton":
            export.check_model_name(model_name or job_id)
        download = self._download(job_id, checkpoint_step, export_format)
        return download.save(path, format, model_name=model_name or job_id)


__all__ = ["Client", "SSDRBMError"]
