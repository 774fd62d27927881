"""The blocking Python SDK: :class:`Client`.

from ssdrbm import Client

with Client("localhost:50051") as client:
    job = client.start_training(n_hidden=25, steps=500)
    final = client.wait(job.id)
    features = client.sample_hidden(job.id, x)

Each method runs its call's steps (``calls.py``, shared with the asyncio client) on a blocking
channel.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from ssdrbm import calls
from ssdrbm.calls import DEFAULT_PAGE_SIZE
from ssdrbm.datasets import DEFAULT_CHUNK_BYTES, Dataset, UploadedDataset
from ssdrbm.errors import SSDRBMError
from ssdrbm.events import Job, JobState, MetricEvent
from ssdrbm.model_file import ExportedModel
from ssdrbm.server_info import ServerInfo
from ssdrbm.spec import TrainingDefaults, training_request
from ssdrbm.sweeps import Sweep, sweep_request
from ssdrbm.v1 import rbm_pb2

T = TypeVar("T")


class Client(calls.ClientBase):
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

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the transport: perform the effects of a call's steps ----------------------------------

    def _run(self, steps: calls.Steps[T]) -> T:
        """Run a call's steps to their result."""
        walk = calls.Walk(steps)
        for _ in self._walk(walk):
            pass  # calls that return a result emit nothing
        return walk.result

    def _walk(self, walk: calls.Walk[Any]) -> Iterator[Any]:
        for effect in walk:
            if isinstance(effect, calls.Emit):
                yield effect.item
            else:
                walk.reply, walk.error = self._perform(effect)

    def _perform(self, effect: calls.Effect) -> tuple[Any, grpc.RpcError | None]:
        """The effect's answer, or the RpcError it failed with."""
        try:
            if isinstance(effect, calls.Sleep):
                time.sleep(effect.seconds)
                return None, None
            if isinstance(effect, calls.Next):
                return next(effect.call, None), None
            method = getattr(self._stub, effect.method)
            return method(effect.request, timeout=effect.timeout, metadata=effect.metadata), None
        except grpc.RpcError as error:
            return None, error

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
        return self._call("StartTraining", request, lambda r: Job.from_proto(r.job))

    def training_defaults(self) -> TrainingDefaults:
        """The defaults the service fills into unset fields: step sizes per model and
        optimizer, and a minimal request resolved (every other default)."""
        request = rbm_pb2.GetTrainingDefaultsRequest()
        return self._call("GetTrainingDefaults", request, TrainingDefaults.from_proto)

    def server_info(self) -> ServerInfo:
        """The service's version, API and optional features (``GetServerInfo``)."""
        return self._call("GetServerInfo", rbm_pb2.GetServerInfoRequest(), ServerInfo.from_proto)

    def get_job(self, job_id: str) -> Job:
        """The job's current record; :class:`~ssdrbm.errors.NotFound` when it does not exist."""
        return self._run(calls.get_job(self, job_id))

    def list_jobs(
        self, state: JobState | str | None = None, *, page_size: int = DEFAULT_PAGE_SIZE
    ) -> Iterator[Job]:
        """Every job of the caller, newest first, fetching pages as the iteration goes."""
        return self._iterate(calls.list_jobs(self, state, page_size))

    def cancel(self, job_id: str) -> Job:
        """Ask the job to stop; returns its record (a finished job is left as it is)."""
        return self._call("CancelJob", rbm_pb2.CancelJobRequest(job_id=job_id), Job.from_proto)

    def delete_job(self, job_id: str, *, force: bool = False) -> None:
        """Delete a finished job with its metrics and checkpoints (it is NOT_FOUND afterwards);
        a queued or running job raises FailedPrecondition unless ``force`` cancels it first."""
        request = rbm_pb2.DeleteJobRequest(job_id=job_id, force=force)
        return self._call("DeleteJob", request, lambda _: None)

    # -- sweeps (ssdrbm/sweeps.py) --------------------------------------------------------------

    def start_sweep(self, **kwargs: Any) -> Sweep:
        """Start a sweep: one job per point of ``axes`` (and ``seeds``), all checked first.

        Takes :func:`ssdrbm.sweeps.sweep_request`'s keywords: ``axes`` ({"lr": [1e-3, 1e-2],
        "optimizer": ["ssd", "sgd"]}, or :class:`~ssdrbm.sweeps.Range` values with ``random=N``),
        ``seeds``, ``sample_seed``, ``rank_by``, ``early_stop`` (MIN_STEPS or (MIN_STEPS, ETA)),
        ``rungs``, ``name``, ``request_id`` (generated when missing), ``validate_only``, and
        :meth:`start_training`'s keywords for what every run shares.
        """
        return self._call("StartSweep", sweep_request(**kwargs), Sweep.from_proto)

    def get_sweep(self, sweep_id: str) -> Sweep:
        """The sweep with its leaderboard (runs best first)."""
        return self._call("GetSweep", rbm_pb2.GetSweepRequest(sweep_id=sweep_id), Sweep.from_proto)

    def list_sweeps(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[Sweep]:
        """Every sweep of the caller, newest first (without their runs: see get_sweep)."""
        return self._iterate(calls.list_sweeps(self, page_size))

    def cancel_sweep(self, sweep_id: str) -> Sweep:
        """Cancel every queued or running run of the sweep."""
        request = rbm_pb2.CancelSweepRequest(sweep_id=sweep_id)
        return self._call("CancelSweep", request, Sweep.from_proto)

    def delete_sweep(self, sweep_id: str, *, force: bool = False, keep_runs: bool = False) -> int:
        """Delete the sweep and its runs' jobs (their metrics and checkpoints); returns how many
        jobs were deleted. Queued or running runs raise FailedPrecondition unless ``force``
        cancels them first; ``keep_runs`` deletes only the sweep and keeps its jobs."""
        request = rbm_pb2.DeleteSweepRequest(sweep_id=sweep_id, force=force, keep_runs=keep_runs)
        return self._call("DeleteSweep", request, lambda r: r.deleted_jobs)

    def stream_sweep(self, sweep_id: str, *, timeout: float | None = None) -> Iterator[Sweep]:
        """The live leaderboard: a :class:`~ssdrbm.sweeps.Sweep` on every change (and every
        few seconds) until the sweep ends. Each update is whole, so a dropped connection is
        simply opened again."""
        return self._iterate(calls.stream_sweep(self, sweep_id, timeout))

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
        return self._iterate(calls.stream_metrics(self, job_id, after, follow, timeout))

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[MetricEvent], None] | None = None,
    ) -> Job:
        """Follow the job until it ends and return its final record (any terminal state);
        ``on_event`` is called with each of its events on the way."""
        return self._run(calls.wait(self, job_id, timeout, on_event))

    # -- serving -------------------------------------------------------------------------------

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
        return self._run(calls.reconstruct(self, job_id, x, k, mean_field, seed, checkpoint_step))

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
        return self._run(calls.sample_hidden(self, job_id, x, mode, seed, checkpoint_step))

    # -- datasets and models -------------------------------------------------------------------

    def upload_dataset(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> str:
        """Upload an array (or a ``.npy`` file) and return its dataset id for ``dataset_id=``."""
        return self._run(calls.upload_dataset_id(self, data, name, chunk_bytes))

    def upload_dataset_details(
        self,
        data: np.ndarray | str | Path,
        *,
        name: str = "",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> UploadedDataset:
        """Like :meth:`upload_dataset`; returns the id with shape, size and whether it is new."""
        return self._run(calls.upload_dataset(self, data, name, chunk_bytes))

    def list_datasets(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[Dataset]:
        """The caller's uploaded datasets, ordered by id, fetching pages as the iteration goes."""
        return self._iterate(calls.list_datasets(self, page_size))

    def delete_dataset(self, dataset_id: str) -> None:
        """Remove a dataset from the caller's datasets; its bytes go once no tenant uses them.
        :class:`~ssdrbm.errors.FailedPrecondition` while a queued or running job of the
        caller trains on it; :class:`~ssdrbm.errors.NotFound` for an unknown id. Deleting
        again is NotFound, so a retried delete may report that."""
        request = rbm_pb2.DeleteDatasetRequest(dataset_id=dataset_id)
        return self._call("DeleteDataset", request, lambda _: None)

    def fetch_model(self, job_id: str, *, checkpoint_step: int = 0) -> ExportedModel:
        """The job's latest (or a given) checkpoint as numpy tensors plus its config."""
        return self._run(calls.fetch_model(self, job_id, checkpoint_step))

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
        steps = calls.export_model(self, job_id, path, checkpoint_step, format, model_name)
        return self._run(steps)


__all__ = ["Client", "SSDRBMError"]
