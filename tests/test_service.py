"""The gRPC service end to end: a real in-process server and worker, real Redis, loopback stubs.

One small job is trained once per module (its own Redis, so per-test flushes elsewhere cannot
touch it) and then exercised through every RPC; the error cases each have their own test.
Served outputs are checked against numpy computed from the exported safetensors weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from ssdrbm.events import Metrics
from ssdrbm.v1 import rbm_pb2 as pb
from ssdrbm.v1 import rbm_pb2_grpc

from ssdcore.step_sizes import default_lr
from ssdrbm_server import serving
from ssdrbm_server.store.records import JobState
from tests.fixtures.jobs import tiny_request
from tests.fixtures.redis import RedisServer
from tests.fixtures.service import RunningService, make_settings

N_VISIBLE, N_HIDDEN, N_EXAMPLES = 12, 6, 240
STEPS, EVAL_EVERY, CHECKPOINT_EVERY = 60, 10, 20
JOB_TIMEOUT_S = 120.0
PROB_TOLERANCE = 1e-5  # float32 forward pass vs numpy float64

Stub = rbm_pb2_grpc.RBMServiceStub


# --- helpers ----------------------------------------------------------------------------------


def dataset_array(seed: int = 0) -> np.ndarray:
    """Binary data with structure: two prototypes with 10 % of the bits flipped."""
    rng = np.random.default_rng(seed)
    prototypes = rng.random((2, N_VISIBLE)) < 0.5
    rows = prototypes[rng.integers(0, 2, N_EXAMPLES)]
    flips = rng.random(rows.shape) < 0.1
    return (rows ^ flips).astype(np.float32)


def upload(stub: Stub, data: np.ndarray, *, chunk: int = 1000, **header: object) -> object:
    raw = np.ascontiguousarray(data, dtype="<f4").tobytes()
    head = pb.DatasetHeader(shape=list(data.shape), dtype=pb.DTYPE_FLOAT32, **header)
    parts = [pb.UploadDatasetRequest(header=head)]
    parts += [pb.UploadDatasetRequest(chunk=raw[i : i + chunk]) for i in range(0, len(raw), chunk)]
    return stub.UploadDataset(iter(parts), timeout=30)


def synthetic_request(**training: object) -> pb.StartTrainingRequest:
    return pb.StartTrainingRequest(
        model=pb.ModelSpec(n_hidden=N_HIDDEN),
        optimizer=pb.OptimizerSpec(kind=pb.OPTIMIZER_KIND_SGD, lr=0.05),
        training=pb.TrainingSpec(batch_size=20, **training),
        eval=pb.EvalSpec(every=EVAL_EVERY),
        dataset=pb.DatasetRef(
            builtin=pb.BuiltinDataset(
                name="synthetic",
                options={"n_visible": str(N_VISIBLE), "n_hidden": "3", "n_samples": "240"},
            )
        ),
    )


def tensor(array: np.ndarray) -> pb.Tensor:
    data = np.ascontiguousarray(array, dtype="<f4")
    return pb.Tensor(shape=list(data.shape), data=data.tobytes())


def from_tensor(message: pb.Tensor) -> np.ndarray:
    return np.frombuffer(message.data, dtype="<f4").reshape(tuple(message.shape))


def events(stub: Stub, job_id: str, after: str = "", **kw: object) -> list[pb.MetricEvent]:
    request = pb.StreamMetricsRequest(job_id=job_id, after=after, **kw)
    return list(stub.StreamMetrics(request, timeout=JOB_TIMEOUT_S))


def states(stream: list[pb.MetricEvent]) -> list[str]:
    return [
        pb.JobState.Name(e.state.state).removeprefix("JOB_STATE_")
        for e in stream
        if e.WhichOneof("event") == "state"
    ]


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, pb.Job):
            list(result)  # streaming responses fail on iteration
    return caught.value.code(), caught.value.details()


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def export(stub: Stub, job_id: str, step: int = 0) -> tuple[pb.ModelExportHeader, bytes]:
    parts = list(stub.ExportModel(pb.ExportModelRequest(job_id=job_id, checkpoint_step=step)))
    assert parts[0].WhichOneof("part") == "header"
    assert all(p.WhichOneof("part") == "chunk" for p in parts[1:])
    return parts[0].header, b"".join(p.chunk for p in parts[1:])


# --- a job trained once for the module ----------------------------------------------------------


class Trained:
    """The module's service, its Redis, and one finished job with its full event history."""

    def __init__(self, running: RunningService, job: pb.Job, history: list[pb.MetricEvent]):
        self.running = running
        self.stub = running.stub()
        self.job = job
        self.history = history


@pytest.fixture(scope="module")
def module_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """A service with a worker and a Redis of its own, shared by the tests that train."""
    redis = RedisServer(tmp_path_factory.mktemp("service-redis"))
    redis.start()
    # Its tests read earlier checkpoints of a finished job by step: keep them all.
    running = RunningService(make_settings(redis.url, finished_checkpoints_kept=3))
    try:
        yield running
    finally:
        running.stop()
        redis.stop()


@pytest.fixture(scope="module")
def trained(module_service: RunningService) -> Trained:
    stub = module_service.stub()
    uploaded = upload(stub, dataset_array(), name="prototypes")
    request = synthetic_request(steps=STEPS, checkpoint_every=CHECKPOINT_EVERY, seed=3)
    request.dataset.Clear()
    request.dataset.dataset_id = uploaded.dataset_id
    request.request_id = "module-job"
    job = stub.StartTraining(request, timeout=30).job
    history = events(stub, job.id)
    job = stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=10)
    return Trained(module_service, job, history)


# --- the happy path -----------------------------------------------------------------------------


def test_full_job_runs_through_every_rpc(trained: Trained) -> None:
    stub, job, history = trained.stub, trained.job, trained.history
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    assert (job.step, job.total_steps, job.checkpoint_step) == (STEPS, STEPS, STEPS)
    assert job.n_visible == N_VISIBLE and job.attempt >= 1 and job.worker
    assert job.spec.training.cd_k == 1  # stored with defaults filled in
    assert job.runtime.device and job.runtime.summary.startswith("device: ")  # what ran
    assert job.latest_metrics.step == STEPS
    # The stream: QUEUED, RUNNING, metrics at every eval step in order, SUCCEEDED last.
    assert states(history) == ["QUEUED", "RUNNING", "SUCCEEDED"]
    steps = [e.metrics.step for e in history if e.WhichOneof("event") == "metrics"]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    assert set(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)) <= set(steps)
    assert all(e.job_id == job.id and e.resume_token for e in history)
    last = next(e.metrics for e in reversed(history) if e.WhichOneof("event") == "metrics")
    assert math.isfinite(last.reconstruction_error) and last.samples_per_second > 0
    # ListJobs shows it; cancelling a finished job is a no-op returning its record.
    # (Other tests add jobs to this module's service, so look for this one among them.)
    listed = stub.ListJobs(pb.ListJobsRequest(), timeout=10)
    assert job.id in [j.id for j in listed.jobs]
    succeeded = stub.ListJobs(pb.ListJobsRequest(state=pb.JOB_STATE_SUCCEEDED), timeout=10)
    assert job.id in [j.id for j in succeeded.jobs]
    for state in (pb.JOB_STATE_FAILED, pb.JOB_STATE_QUEUED):
        other = stub.ListJobs(pb.ListJobsRequest(state=state), timeout=10)
        assert job.id not in [j.id for j in other.jobs]
    cancelled = stub.CancelJob(pb.CancelJobRequest(job_id=job.id), timeout=10)
    assert cancelled.state == pb.JOB_STATE_SUCCEEDED


def test_served_outputs_match_the_exported_weights(trained: Trained) -> None:
    stub, job = trained.stub, trained.job
    header, blob = export(stub, job.id)
    assert header.step == STEPS and header.size_bytes == len(blob)
    assert hashlib.sha256(blob).hexdigest() == header.sha256
    config = json.loads(header.config_json)
    assert (config["n_visible"], config["n_hidden"]) == (N_VISIBLE, N_HIDDEN)
    weights = {name: array.astype(np.float64) for name, array in load_safetensors(blob).items()}
    W, a, b = weights["W"], weights["a"], weights["b"]  # (V, H), (H,), (V,)
    v = dataset_array(seed=1)[:5]

    hidden = stub.SampleHidden(pb.SampleHiddenRequest(job_id=job.id, input=tensor(v)), timeout=30)
    assert hidden.checkpoint_step == STEPS
    expected_h = sigmoid(v @ W + a)  # (5, H)
    np.testing.assert_allclose(from_tensor(hidden.output), expected_h, atol=PROB_TOLERANCE)

    rebuilt = stub.Reconstruct(
        pb.ReconstructRequest(job_id=job.id, input=tensor(v), k=1, mean_field=True), timeout=30
    )
    expected_v = sigmoid(expected_h @ W.T + b)  # (5, V)
    np.testing.assert_allclose(from_tensor(rebuilt.output), expected_v, atol=PROB_TOLERANCE)

    # Seeded sampling is reproducible and binary; a named checkpoint serves its own weights.
    request = pb.SampleHiddenRequest(
        job_id=job.id, input=tensor(v), mode=pb.HIDDEN_MODE_SAMPLE, seed=7
    )
    first, second = (from_tensor(stub.SampleHidden(request, timeout=30).output) for _ in "ab")
    np.testing.assert_array_equal(first, second)
    assert set(np.unique(first)) <= {0.0, 1.0}
    earlier = stub.SampleHidden(
        pb.SampleHiddenRequest(job_id=job.id, input=tensor(v), checkpoint_step=STEPS - 20),
        timeout=30,
    )
    assert earlier.checkpoint_step == STEPS - 20
    _, earlier_blob = export(stub, job.id, STEPS - 20)
    early = {n: x.astype(np.float64) for n, x in load_safetensors(earlier_blob).items()}
    np.testing.assert_allclose(
        from_tensor(earlier.output), sigmoid(v @ early["W"] + early["a"]), atol=PROB_TOLERANCE
    )


def test_metric_stream_resumes_after_any_token(trained: Trained) -> None:
    stub, job, history = trained.stub, trained.job, trained.history
    assert events(stub, job.id, history_only=True) == history
    for cut in (0, 1, len(history) // 2, len(history) - 2):
        resumed = events(stub, job.id, after=history[cut].resume_token)
        assert resumed == history[cut + 1 :]
    # After the terminal event there is nothing more, and the stream ends at once.
    assert events(stub, job.id, after=history[-1].resume_token) == []


def test_live_stream_resumed_mid_job_has_no_gap_or_repeat(module_service: RunningService) -> None:
    stub = module_service.stub()
    job = stub.StartTraining(synthetic_request(steps=STEPS, seed=1), timeout=30).job
    seen: list[pb.MetricEvent] = []
    first = stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=JOB_TIMEOUT_S)
    for event in first:
        seen.append(event)
        if event.WhichOneof("event") == "metrics":
            break  # the client drops the connection while the job runs
    first.cancel()
    seen += events(stub, job.id, after=seen[-1].resume_token)
    assert seen == events(stub, job.id, history_only=True)
    assert states(seen) == ["QUEUED", "RUNNING", "SUCCEEDED"]


def test_start_training_is_idempotent_by_request_id(service_factory) -> None:
    stub = service_factory(run_worker=False).stub()
    request = synthetic_request(steps=20)
    request.request_id = "nightly-2026-11-25"
    first = stub.StartTraining(request, timeout=30)
    again = stub.StartTraining(request, timeout=30)
    assert first.created and not again.created
    assert again.job.id == first.job.id
    other = pb.StartTrainingRequest()
    other.CopyFrom(request)
    other.request_id = "nightly-2026-11-26"
    assert stub.StartTraining(other, timeout=30).job.id != first.job.id
    listed = stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs
    assert len(listed) == 2
    # The same key with another spec is a client bug: refused, naming what differs.
    changed = pb.StartTrainingRequest()
    changed.CopyFrom(request)
    changed.optimizer.lr = 0.07
    with pytest.raises(grpc.RpcError) as caught:
        stub.StartTraining(changed, timeout=30)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "optimizer.lr" in caught.value.details() and first.job.id in caught.value.details()
    # Leaving a field unset that resolves to the stored value is the same spec.
    same = pb.StartTrainingRequest()
    same.CopyFrom(request)
    same.training.cd_k = 1  # the default, now explicit
    assert stub.StartTraining(same, timeout=30).job.id == first.job.id


def test_validate_only_resolves_without_creating(service_factory) -> None:
    stub = service_factory(run_worker=False).stub()
    request = pb.StartTrainingRequest(model=pb.ModelSpec(n_hidden=4), validate_only=True)
    response = stub.StartTraining(request, timeout=30)
    assert not response.created and not response.job.id
    spec = response.job.spec
    assert spec.optimizer.method == pb.POLAR_METHOD_AUTO and spec.optimizer.HasField("lr")
    assert response.job.total_steps == spec.training.steps > 0 and response.job.n_visible == 100
    assert not stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs
    request.optimizer.lr = -1.0
    with pytest.raises(grpc.RpcError) as caught:
        stub.StartTraining(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    defaults = stub.GetTrainingDefaults(pb.GetTrainingDefaultsRequest(), timeout=10)
    assert defaults.example.optimizer.lr == spec.optimizer.lr
    # one entry per model, variance and optimizer for the paper rule, then the normalized
    # rule's own SSD entries (SGD and Nesterov serve both rules: no rule named)
    rules = [(entry.optimizer, entry.step_rule) for entry in defaults.step_sizes]
    assert len(rules) == 20 + 10
    assert rules.count((pb.OPTIMIZER_KIND_SSD, pb.STEP_RULE_NORMALIZED)) == 5
    assert (pb.OPTIMIZER_KIND_SGD, pb.STEP_RULE_UNSPECIFIED) in rules
    normalized = next(
        entry.lr
        for entry in defaults.step_sizes
        if entry.model == pb.MODEL_KIND_BERNOULLI
        and entry.optimizer == pb.OPTIMIZER_KIND_SSD
        and entry.step_rule == pb.STEP_RULE_NORMALIZED
    )
    assert normalized == default_lr("bernoulli", "ssd", None, "normalized")


def test_ais_checkpoints_report_both_likelihood_bounds(module_service: RunningService) -> None:
    """eval.ais: each checkpoint's event carries AIS's optimistic estimate and reverse AIS's
    conservative one (ssdcore.evaluation.certified_log_likelihood); other events neither."""
    stub = module_service.stub()
    request = tiny_request(steps=20)
    request.training.checkpoint_every = 20
    request.eval.ais, request.eval.ais_chains, request.eval.ais_betas = True, 16, 50
    job = stub.StartTraining(request, timeout=30).job
    stream = stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=JOB_TIMEOUT_S)
    events = [event.metrics for event in stream if event.WhichOneof("event") == "metrics"]
    by_step = {metrics.step: metrics for metrics in events}
    last = by_step[20]
    assert last.log_likelihood_method == pb.LOG_LIKELIHOOD_METHOD_AIS
    assert last.HasField("log_likelihood_lower") and last.log_likelihood_lower_stderr >= 0
    slack = 4 * (last.log_likelihood_stderr + last.log_likelihood_lower_stderr) + 1.0
    assert last.log_likelihood_lower <= last.log_likelihood + slack
    assert not by_step[10].HasField("log_likelihood_lower")  # no checkpoint there: no AIS
    parsed = Metrics.from_proto(last)  # the SDK's view carries the bound too
    assert parsed.log_likelihood_lower == last.log_likelihood_lower


def test_cancel_stops_a_running_job(module_service: RunningService) -> None:
    stub = module_service.stub()
    job = stub.StartTraining(synthetic_request(steps=1_000_000), timeout=30).job
    stream = stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=JOB_TIMEOUT_S)
    for event in stream:
        if event.WhichOneof("event") == "metrics":
            break  # training is under way
    # The Prometheus gauge's source sees the running job.
    service = module_service.service
    assert service is not None
    counts = module_service.run_in_loop(service.stores.jobs.count_by_state())
    assert counts[JobState.RUNNING] == 1
    stub.CancelJob(pb.CancelJobRequest(job_id=job.id), timeout=10)
    rest = list(stream)  # the stream ends by itself with the CANCELLED state
    assert states(rest)[-1] == "CANCELLED"
    final = stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=10)
    assert final.state == pb.JOB_STATE_CANCELLED and final.step < 1_000_000


def test_cancel_of_a_queued_job_is_immediate(service_factory) -> None:
    running = service_factory(run_worker=False)
    stub = running.stub()
    job = stub.StartTraining(synthetic_request(steps=10), timeout=30).job
    assert job.state == pb.JOB_STATE_QUEUED
    assert stub.CancelJob(pb.CancelJobRequest(job_id=job.id)).state == pb.JOB_STATE_CANCELLED
    assert states(events(stub, job.id)) == ["QUEUED", "CANCELLED"]


def test_upload_is_content_addressed_and_checked(service_factory) -> None:
    stub = service_factory(run_worker=False).stub()
    data = dataset_array()
    digest = hashlib.sha256(data.astype("<f4").tobytes()).hexdigest()
    first = upload(stub, data, sha256=digest)
    again = upload(stub, data, chunk=333)
    assert first.created and not again.created and again.dataset_id == first.dataset_id
    assert list(first.shape) == [N_EXAMPLES, N_VISIBLE]
    assert first.size_bytes == data.nbytes
    code, message = status_of(lambda: upload(stub, data, sha256="0" * 64))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header.sha256" in message
    short = pb.DatasetHeader(shape=[10, 4], dtype=pb.DTYPE_FLOAT32)
    parts = [pb.UploadDatasetRequest(header=short), pb.UploadDatasetRequest(chunk=b"\0" * 100)]
    code, message = status_of(lambda: stub.UploadDataset(iter(parts), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "160" in message
    nan = data.copy()
    nan[3, 3] = np.nan
    code, message = status_of(lambda: upload(stub, nan))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in message
    # The value range is measured on upload: data outside [0, 1] for binary units is refused
    # when the job is submitted, not when it runs.
    scaled = upload(stub, data * 4 - 1)
    request = synthetic_request(steps=10)
    request.dataset.CopyFrom(pb.DatasetRef(dataset_id=scaled.dataset_id))
    code, message = status_of(lambda: stub.StartTraining(request, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dataset.preprocess" in message
    assert "from -1 to 3" in message
    request.dataset.preprocess = pb.PREPROCESS_SCALE
    assert stub.StartTraining(request, timeout=30).created


def test_health_and_reflection_are_served(module_service: RunningService) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = module_service.channel()
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "ssdrbm.v1.RBMService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    reply = next(iter(reflection.ServerReflectionInfo(iter([request]), timeout=10)))
    names = {s.name for s in reply.list_services_response.service}
    assert {"ssdrbm.v1.RBMService", "grpc.health.v1.Health"} <= names


# --- errors: each one a test --------------------------------------------------------------------

UNKNOWN_JOB = "0" * 32


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.GetJob(pb.GetJobRequest(job_id=UNKNOWN_JOB), timeout=10),
        lambda s: s.CancelJob(pb.CancelJobRequest(job_id=UNKNOWN_JOB), timeout=10),
        lambda s: s.StreamMetrics(pb.StreamMetricsRequest(job_id=UNKNOWN_JOB), timeout=10),
        lambda s: s.ExportModel(pb.ExportModelRequest(job_id=UNKNOWN_JOB), timeout=10),
        lambda s: s.Reconstruct(
            pb.ReconstructRequest(job_id="not-an-id", input=tensor(np.zeros((1, 2)))), timeout=10
        ),
        lambda s: s.SampleHidden(
            pb.SampleHiddenRequest(job_id=UNKNOWN_JOB, input=tensor(np.zeros((1, 2)))), timeout=10
        ),
    ],
    ids=["GetJob", "CancelJob", "StreamMetrics", "ExportModel", "Reconstruct", "SampleHidden"],
)
def test_unknown_job_is_not_found(trained: Trained, call: Callable[[Stub], object]) -> None:
    code, message = status_of(lambda: call(trained.stub))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "not found" in message


def test_unknown_dataset_is_not_found(trained: Trained) -> None:
    request = synthetic_request(steps=10)
    request.dataset.Clear()
    request.dataset.dataset_id = "ab" * 32
    code, message = status_of(lambda: trained.stub.StartTraining(request, timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND and "ab" * 32 in message


def test_unknown_checkpoint_step_is_not_found(trained: Trained) -> None:
    request = pb.SampleHiddenRequest(
        job_id=trained.job.id, input=tensor(np.zeros((1, N_VISIBLE))), checkpoint_step=7
    )
    code, _ = status_of(lambda: trained.stub.SampleHidden(request, timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND


def _with(path: str, value: object) -> pb.StartTrainingRequest:
    request = synthetic_request(steps=10)
    *parents, leaf = path.split(".")
    target = request
    for parent in parents:
        target = getattr(target, parent)
    setattr(target, leaf, value)
    return request


def _full_variance_on_mnist() -> pb.StartTrainingRequest:
    request = synthetic_request(steps=10)
    request.model.kind = pb.MODEL_KIND_GAUSSIAN
    request.model.variance = pb.VARIANCE_KIND_FULL
    request.dataset.builtin.Clear()
    request.dataset.builtin.name = "mnist"
    return request


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (_with("optimizer.lr", 0.0), "optimizer.lr"),
        (_with("optimizer.lr", -0.1), "optimizer.lr"),
        (_with("optimizer.lr", math.nan), "optimizer.lr"),
        (_with("training.cd_k", 0), "training.cd_k"),
        (_with("model.n_hidden", 0), "model.n_hidden"),
        (_with("optimizer.kind", 12), "optimizer.kind"),
        (_with("optimizer.method", 12), "optimizer.method"),
        (_full_variance_on_mnist(), "model.variance"),
    ],
    ids=["lr=0", "lr<0", "lr=nan", "cd_k=0", "n_hidden=0", "optimizer", "method", "full-var"],
)
def test_bad_hyperparameters_are_invalid_argument_naming_the_field(
    trained: Trained, request_: pb.StartTrainingRequest, field: str
) -> None:
    code, message = status_of(lambda: trained.stub.StartTraining(request_, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith(f"{field}:")


@pytest.mark.parametrize(
    ("bad_input", "field"),
    [
        (pb.Tensor(shape=[2, N_VISIBLE], data=b"\0" * (4 * N_VISIBLE)), "input.data"),
        (pb.Tensor(shape=[2 * N_VISIBLE], data=b"\0" * (8 * N_VISIBLE)), "input.shape"),
        (tensor(np.zeros((2, N_VISIBLE + 1))), "input.shape"),  # the model's width is 12
    ],
    ids=["size-not-shape", "one-dim", "wrong-width"],
)
@pytest.mark.parametrize("rpc", ["Reconstruct", "SampleHidden"])
def test_inconsistent_or_wrong_width_tensor_is_invalid_argument(
    trained: Trained, bad_input: pb.Tensor, field: str, rpc: str
) -> None:
    request = getattr(pb, f"{rpc}Request")(job_id=trained.job.id, input=bad_input)
    code, message = status_of(lambda: getattr(trained.stub, rpc)(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith(field)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("rpc", ["Reconstruct", "SampleHidden"])
def test_nan_or_inf_input_is_invalid_argument(trained: Trained, bad: float, rpc: str) -> None:
    v = np.zeros((3, N_VISIBLE), dtype=np.float32)
    v[2, 5] = bad
    request = getattr(pb, f"{rpc}Request")(job_id=trained.job.id, input=tensor(v))
    code, message = status_of(lambda: getattr(trained.stub, rpc)(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NaN or Inf" in message


def test_reconstruct_before_any_checkpoint_is_failed_precondition(service_factory) -> None:
    running = service_factory(run_worker=False)  # the job stays QUEUED, without a checkpoint
    stub = running.stub()
    job = stub.StartTraining(synthetic_request(steps=10), timeout=30).job
    v = tensor(np.zeros((1, N_VISIBLE)))
    for call in (
        lambda: stub.Reconstruct(pb.ReconstructRequest(job_id=job.id, input=v), timeout=10),
        lambda: stub.SampleHidden(pb.SampleHiddenRequest(job_id=job.id, input=v), timeout=10),
        lambda: stub.ExportModel(pb.ExportModelRequest(job_id=job.id), timeout=10),
    ):
        code, message = status_of(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "checkpoint" in message


def test_message_over_the_limit_is_resource_exhausted(trained: Trained) -> None:
    limit = trained.running.settings.max_message_bytes
    rows = limit // (4 * N_VISIBLE) + 1
    request = pb.ReconstructRequest(job_id=trained.job.id, input=tensor(np.zeros((rows, 12))))
    assert request.ByteSize() > limit
    code, _ = status_of(lambda: trained.stub.Reconstruct(request, timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server is fine afterwards.
    assert trained.stub.GetJob(pb.GetJobRequest(job_id=trained.job.id), timeout=10).id


def test_limits_each_answer_resource_exhausted(service_factory) -> None:
    running = service_factory(
        run_worker=False, max_tensor_elements=100, max_jobs_per_tenant=2, max_dataset_bytes=1000
    )
    stub = running.stub()
    jobs = [stub.StartTraining(synthetic_request(steps=10), timeout=30).job for _ in range(2)]
    code, message = status_of(lambda: stub.StartTraining(synthetic_request(steps=10)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2" in message
    v = tensor(np.zeros((9, N_VISIBLE)))  # 108 elements
    code, message = status_of(
        lambda: stub.Reconstruct(pb.ReconstructRequest(job_id=jobs[0].id, input=v), timeout=10)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "100" in message
    code, message = status_of(lambda: upload(stub, np.zeros((100, 3))))  # 1200 bytes
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1000" in message


def test_concurrent_stream_limit_is_resource_exhausted(service_factory) -> None:
    running = service_factory(run_worker=False, max_streams=1)
    stub = running.stub()
    job = stub.StartTraining(synthetic_request(steps=10), timeout=30).job
    open_stream = stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=30)
    next(open_stream)  # the first stream is now being served (and follows live)
    code, message = status_of(
        lambda: stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=10)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "streams" in message
    open_stream.cancel()


def test_redis_unreachable_is_unavailable_and_the_server_recovers(redis_factory, service_factory):
    redis = redis_factory(appendonly=True)
    running = service_factory(redis.url, run_worker=False)
    stub = running.stub()
    job = stub.StartTraining(synthetic_request(steps=10), timeout=30).job
    redis.stop()
    calls = {
        "GetJob": lambda: stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=30),
        "ListJobs": lambda: stub.ListJobs(pb.ListJobsRequest(), timeout=30),
        "StartTraining": lambda: stub.StartTraining(synthetic_request(steps=10), timeout=30),
        "StreamMetrics": lambda: stub.StreamMetrics(
            pb.StreamMetricsRequest(job_id=job.id), timeout=30
        ),
    }
    for name, call in calls.items():
        code, message = status_of(call)
        assert code == grpc.StatusCode.UNAVAILABLE, name
        assert "Redis" in message
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(running.channel())
    # Alive (the overall entry) but not ready: the service's own entry follows Redis.
    assert service_health(health, "") == health_pb2.HealthCheckResponse.SERVING
    assert wait_for_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    redis.start()  # same port and append-only file: the job is still there
    assert wait_for_health(health, health_pb2.HealthCheckResponse.SERVING)
    again = stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=30)
    assert again.id == job.id and again.state == pb.JOB_STATE_QUEUED
    assert len(stub.ListJobs(pb.ListJobsRequest(), timeout=30).jobs) == 1


def service_health(health, name: str) -> int:
    from grpc_health.v1 import health_pb2

    return health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status


def wait_for_health(health, status: int, timeout_s: float = 15.0) -> bool:
    """Whether the service's health entry reaches ``status`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service_health(health, "ssdrbm.v1.RBMService") == status:
            return True
        time.sleep(0.2)
    return False


def test_diverging_job_fails_with_its_reason(module_service: RunningService) -> None:
    stub = module_service.stub()
    request = synthetic_request(steps=2000, checkpoint_every=1, max_backoffs=0)
    request.model.kind = pb.MODEL_KIND_GAUSSIAN
    request.model.variance = pb.VARIANCE_KIND_IDENTITY
    request.optimizer.lr = 1e30  # far beyond any stable step size
    job = stub.StartTraining(request, timeout=30).job
    history = events(stub, job.id)
    assert states(history)[-1] == "FAILED"
    final = stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=10)
    assert final.state == pb.JOB_STATE_FAILED
    assert "blew up" in final.error and "optimizer.lr" in final.error
    failed = next(e.state for e in history if e.state.state == pb.JOB_STATE_FAILED)
    assert failed.message
    if final.checkpoint_step >= 0:
        # The last good checkpoint is kept and still serves finite outputs.
        out = stub.Reconstruct(
            pb.ReconstructRequest(
                job_id=job.id, input=tensor(np.zeros((2, N_VISIBLE))), mean_field=True
            ),
            timeout=30,
        )
        assert np.isfinite(from_tensor(out.output)).all()


def test_tenants_are_isolated_and_tokens_required(service_factory, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# token tenant\nalpha-token team-a\nbeta-token team-b\n")
    running = service_factory(run_worker=False, auth_mode="token", auth_tokens_file=str(tokens))
    alpha, beta = running.stub(token="alpha-token"), running.stub(token="beta-token")
    job = alpha.StartTraining(synthetic_request(steps=10), timeout=30).job
    assert alpha.GetJob(pb.GetJobRequest(job_id=job.id), timeout=10).id == job.id
    code, _ = status_of(lambda: beta.GetJob(pb.GetJobRequest(job_id=job.id), timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND
    assert not beta.ListJobs(pb.ListJobsRequest(), timeout=10).jobs
    for stub in (running.stub(), running.stub(token="wrong")):
        code, _ = status_of(lambda s=stub: s.ListJobs(pb.ListJobsRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED


class ComputeProbe:
    """Sees on which thread serving computes: a profile hook (``threading.setprofile``, so on
    every thread started while it is installed) notes each start of the functions that
    ``ModelServer`` runs inline or in its pool. A computation that starts on any thread but the
    event loop's is held there until the test opens its gate, so that the test can call the
    server while that computation is in flight.
    """

    HOLD_S = 120.0  # only against a hang: the test opens the gate itself

    def __init__(self) -> None:
        self.functions = {
            serving._reconstruct.__code__: "Reconstruct",
            serving._hidden.__code__: "SampleHidden",
        }
        self.loop_thread: int | None = None
        self.starts: queue.Queue[tuple[str, int, threading.Event | None]] = queue.Queue()
        self.gates: list[threading.Event] = []

    def profile(self, frame, event: str, arg: object) -> None:  # type: ignore[no-untyped-def]
        name = self.functions.get(frame.f_code) if event == "call" else None
        if name is None:
            return
        thread = threading.get_ident()
        if thread == self.loop_thread:
            self.starts.put((name, thread, None))
            return
        gate = threading.Event()
        self.gates.append(gate)
        self.starts.put((name, thread, gate))
        gate.wait(self.HOLD_S)

    def next_start(self) -> tuple[str, int, threading.Event | None]:
        """(RPC, thread, gate) of the next computation to start; gate None on the loop."""
        return self.starts.get(timeout=JOB_TIMEOUT_S)

    def open_all(self) -> None:
        for gate in self.gates:
            gate.set()


def test_serving_runs_off_the_event_loop(trained: Trained, service_factory) -> None:
    """Reconstruct and SampleHidden batches above serving's inline limit compute on a thread of
    the pool, not the event loop's, and the loop answers other calls while such a computation
    is in flight; a tiny batch computes inline, on the loop (which shows the probe sees it)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    job_id = trained.job.id
    data = dataset_array(seed=2)
    row = N_VISIBLE * N_HIDDEN  # multiply-adds of one row through W
    # Just past INLINE_MAX_MULTIPLY_ADDS: 2k products per row to reconstruct, one for hiddens.
    k = serving.INLINE_MAX_MULTIPLY_ADDS // (2 * 64 * row) + 1
    large = {
        "Reconstruct": pb.ReconstructRequest(
            job_id=job_id, input=tensor(data[:64]), k=k, mean_field=True, seed=5
        ),
        "SampleHidden": pb.SampleHiddenRequest(
            job_id=job_id,
            input=tensor(np.resize(data, (serving.INLINE_MAX_MULTIPLY_ADDS // row + 1, N_VISIBLE))),
        ),
    }
    # What the module's server answers, to compare with.
    expected = {
        "Reconstruct": trained.stub.Reconstruct(large["Reconstruct"], timeout=60).output,
        "SampleHidden": trained.stub.SampleHidden(large["SampleHidden"], timeout=60).output,
    }

    async def current_thread() -> int:
        return threading.get_ident()

    probe = ComputeProbe()
    previous = threading.getprofile()
    threading.setprofile(probe.profile)
    try:
        # A second server on the module's Redis: its event loop and pool threads start now.
        running = service_factory(trained.running.settings.redis_url, run_worker=False)
        probe.loop_thread = running.run_in_loop(current_thread())
        stub = running.stub()
        health = health_pb2_grpc.HealthStub(running.channel())
        tiny = pb.SampleHiddenRequest(job_id=job_id, input=tensor(data[:4]))
        stub.SampleHidden(tiny, timeout=60)
        assert probe.next_start() == ("SampleHidden", probe.loop_thread, None)
        for name, call in (("Reconstruct", stub.Reconstruct), ("SampleHidden", stub.SampleHidden)):
            answer = call.future(large[name], timeout=JOB_TIMEOUT_S)
            started, thread, gate = probe.next_start()
            assert started == name
            assert thread != probe.loop_thread, f"{name} computed on the event loop's thread"
            assert gate is not None
            # Its computation is held on its thread: the loop still answers other calls.
            job = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=30)
            assert job.state == pb.JOB_STATE_SUCCEEDED
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert events(stub, job_id, history_only=True) == trained.history
            assert not answer.done()
            gate.set()
            output = answer.result().output
            np.testing.assert_array_equal(from_tensor(output), from_tensor(expected[name]))
    finally:
        threading.setprofile(previous)
        probe.open_all()


def test_shutdown_ends_live_streams_with_a_resumable_unavailable(service_factory) -> None:
    running = service_factory(run_worker=False, shutdown_grace_s=60.0)
    channel = grpc.insecure_channel(running.target)  # not closed by running.stop()
    stub = Stub(channel)
    job = stub.StartTraining(synthetic_request(steps=10), timeout=30).job
    stream = stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=JOB_TIMEOUT_S)
    first = next(stream)  # QUEUED; the stream now follows live (nothing will come)
    stopper = threading.Thread(target=running.stop)
    stopper.start()
    with pytest.raises(grpc.RpcError) as caught:
        list(stream)
    stopper.join(JOB_TIMEOUT_S)
    # Ended by the drain, not by the 60 s grace running out; the message says how to resume.
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in caught.value.details()
    assert first.resume_token in caught.value.details()
    assert not stopper.is_alive()
    channel.close()
