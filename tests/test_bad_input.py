"""The bad-input catalogue: every field of every request at its edges (empty, zero, negative,
huge, NaN/Inf, wrong byte length, unknown enum, unicode and oversized strings), each answered
with its own status code and a message naming the field; then property-based fuzzing of the
request messages. After every case the server still answers health checks and ordinary calls.

One service (no worker) serves the whole module; a finished job with a real model checkpoint,
a queued job without one, and an uploaded dataset are its fixtures.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest
import redis
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from ssdrbm_server.store.page_tokens import encode_page_token
from tests.fixtures.jobs import N_VISIBLE, finish_with_checkpoint, tiny_request
from tests.fixtures.redis import RedisServer
from tests.fixtures.service import RunningService, make_settings

pb = rbm_pb2
C = grpc.StatusCode
OK = C.OK
INVALID = C.INVALID_ARGUMENT
NOT_FOUND = C.NOT_FOUND
PRECONDITION = C.FAILED_PRECONDITION
EXHAUSTED = C.RESOURCE_EXHAUSTED
# Codes a bad request may get; INTERNAL or UNKNOWN would mean the server did not foresee it.
CLIENT_ERRORS = {OK, INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED}
U32, U64, I64 = 2**32 - 1, 2**64 - 1, 2**63 - 1
MAX_DATASET_BYTES = 1 << 20


@dataclass
class Env:
    running: RunningService
    stub: rbm_pb2_grpc.RBMServiceStub
    trained: str  # job with a checkpoint at step 10 (16 visibles, 8 hidden)
    queued: str  # job without a checkpoint
    dataset: str  # uploaded (50, 16) float32


@pytest.fixture(scope="module")
def env(redis_server: RedisServer) -> Iterator[Env]:
    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    settings = make_settings(
        redis_server.url,
        run_worker=False,
        max_jobs_per_tenant=10_000,
        max_dataset_bytes=MAX_DATASET_BYTES,
    )
    running = RunningService(settings)
    try:
        stub = running.stub()
        trained = stub.StartTraining(tiny_request()).job.id
        finish_with_checkpoint(redis_server.url, trained)
        queued = stub.StartTraining(tiny_request()).job.id
        dataset = upload(stub, header(shape=[50, 16]), [np.ones((50, 16), "<f4").tobytes()])
        yield Env(running, stub, trained, queued, dataset.dataset_id)
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def still_healthy(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each case: health SERVING and an ordinary call answers."""
    yield
    if "env" not in request.fixturenames:
        return
    env: Env = request.getfixturevalue("env")
    health = health_pb2_grpc.HealthStub(env.running.channel())
    assert health.Check(health_pb2.HealthCheckRequest()).status == (
        health_pb2.HealthCheckResponse.SERVING
    )
    assert env.stub.GetJob(pb.GetJobRequest(job_id=env.trained)).id == env.trained


def header(**fields: Any) -> pb.DatasetHeader:
    return pb.DatasetHeader(**{"dtype": pb.DTYPE_FLOAT32, **fields})


def upload(
    stub: rbm_pb2_grpc.RBMServiceStub, head: pb.DatasetHeader | None, chunks: list[bytes]
) -> pb.UploadDatasetResponse:
    parts = [] if head is None else [pb.UploadDatasetRequest(header=head)]
    parts += [pb.UploadDatasetRequest(chunk=chunk) for chunk in chunks]
    return stub.UploadDataset(iter(parts))


def outcome(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    """(status code, details) of a call; streaming answers are drained."""
    try:
        result = call()
        if not isinstance(result, Message):
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return OK, ""


def tensor(shape: list[int], values: np.ndarray | None = None, data: bytes | None = None):
    if data is None:
        if values is None:
            values = np.full(shape, 0.5, dtype="<f4")
        data = np.asarray(values, dtype="<f4").tobytes()
    return pb.Tensor(shape=shape, data=data)


def good_input(rows: int = 2) -> pb.Tensor:
    return tensor([rows, N_VISIBLE])


def with_nan(value: float) -> pb.Tensor:
    values = np.full((2, N_VISIBLE), 0.5, dtype="<f4")
    values[1, 3] = value
    return tensor([2, N_VISIBLE], values)


# --- the catalogue --------------------------------------------------------------------------


def start(**changes: Any) -> Callable[[Env], Any]:
    """StartTraining with fields changed: keys are dotted paths, values set or merged."""

    def call(env: Env) -> Any:
        request = tiny_request()
        for path, value in changes.items():
            *parents, leaf = path.split(".")
            target = request
            for name in parents:
                target = getattr(target, name)
            if isinstance(value, dict):
                getattr(target, leaf).update(value)
            elif isinstance(value, Message):
                getattr(target, leaf).CopyFrom(value)
            else:
                setattr(target, leaf, value)
        return env.stub.StartTraining(request)

    return call


def start_with(build: Callable[[pb.StartTrainingRequest], None]) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        request = tiny_request()
        build(request)
        return env.stub.StartTraining(request)

    return call


START_CASES = {
    "n_hidden zero": (start(**{"model.n_hidden": 0}), INVALID, "model.n_hidden"),
    "n_hidden huge": (start(**{"model.n_hidden": U32}), INVALID, "model.n_hidden"),
    "model kind unknown": (start(**{"model.kind": 99}), INVALID, "model.kind"),
    "variance unknown": (start(**{"model.variance": 99}), INVALID, "model.variance"),
    "variance on bernoulli": (
        start(**{"model.variance": pb.VARIANCE_KIND_FULL}),
        INVALID,
        "model.variance",
    ),
    "lr zero": (start(**{"optimizer.lr": 0.0}), INVALID, "optimizer.lr"),
    "lr negative": (start(**{"optimizer.lr": -0.1}), INVALID, "optimizer.lr"),
    "lr NaN": (start(**{"optimizer.lr": math.nan}), INVALID, "optimizer.lr"),
    "lr Inf": (start(**{"optimizer.lr": math.inf}), INVALID, "optimizer.lr"),
    "momentum one": (start(**{"optimizer.momentum": 1.0}), INVALID, "optimizer.momentum"),
    "momentum negative": (start(**{"optimizer.momentum": -0.1}), INVALID, "optimizer.momentum"),
    "momentum NaN": (start(**{"optimizer.momentum": math.nan}), INVALID, "optimizer.momentum"),
    "weight decay negative": (
        start(**{"optimizer.weight_decay": -1.0}),
        INVALID,
        "optimizer.weight_decay",
    ),
    "weight decay Inf": (
        start(**{"optimizer.weight_decay": math.inf}),
        INVALID,
        "optimizer.weight_decay",
    ),
    "spectral bound negative": (
        start(**{"optimizer.max_spectral_norm": -1.0}),
        INVALID,
        "optimizer.max_spectral_norm",
    ),
    "spectral bound NaN": (
        start(**{"optimizer.max_spectral_norm": math.nan}),
        INVALID,
        "optimizer.max_spectral_norm",
    ),
    "optimizer kind unknown": (start(**{"optimizer.kind": 42}), INVALID, "optimizer.kind"),
    "polar method unknown": (start(**{"optimizer.method": 42}), INVALID, "optimizer.method"),
    "preconditioner unknown": (
        start(**{"optimizer.preconditioner": 42}),
        INVALID,
        "optimizer.preconditioner",
    ),
    "rank huge": (start(**{"optimizer.rank": U32}), INVALID, "optimizer.rank"),
    "per-parameter unknown name": (
        start(**{"optimizer.per_parameter": {"Z": pb.OPTIMIZER_KIND_SGD}}),
        INVALID,
        "optimizer.per_parameter[Z]",
    ),
    "per-parameter unicode name": (
        start(**{"optimizer.per_parameter": {"Ω": pb.OPTIMIZER_KIND_SGD}}),
        INVALID,
        "optimizer.per_parameter[Ω]",
    ),
    "per-parameter unknown kind": (
        start(**{"optimizer.per_parameter": {"W": 77}}),
        INVALID,
        "optimizer.per_parameter[W]",
    ),
    "per-parameter unspecified kind": (
        start(**{"optimizer.per_parameter": {"W": pb.OPTIMIZER_KIND_UNSPECIFIED}}),
        INVALID,
        "optimizer.per_parameter[W]",
    ),
    "per-parameter step size zero": (
        start(**{"optimizer.per_parameter_lr": {"W": 0.0}}),
        INVALID,
        "optimizer.per_parameter_lr[W]",
    ),
    "per-parameter step size NaN": (
        start(**{"optimizer.per_parameter_lr": {"b": math.nan}}),
        INVALID,
        "optimizer.per_parameter_lr[b]",
    ),
    "per-parameter step size unknown name": (
        start(**{"optimizer.per_parameter_lr": {"Ω": 0.1}}),
        INVALID,
        "optimizer.per_parameter_lr[Ω]",
    ),
    "variance floor on bernoulli": (
        start(**{"model.min_variance": 0.01}),
        INVALID,
        "model.min_variance",
    ),
    "variance floor negative": (
        start(**{"model.min_variance": -1.0}),
        INVALID,
        "model.min_variance",
    ),
    "variance floor Inf": (
        start(**{"model.min_variance": math.inf}),
        INVALID,
        "model.min_variance",
    ),
    "cd_k zero": (start(**{"training.cd_k": 0}), INVALID, "training.cd_k"),
    "cd_k huge": (start(**{"training.cd_k": U32}), INVALID, "training.cd_k"),
    "batch larger than the data": (
        start(**{"training.batch_size": 10_000}),
        INVALID,
        "training.batch_size",
    ),
    "batch huge": (start(**{"training.batch_size": U32}), INVALID, "training.batch_size"),
    "backoff factor one": (
        start(**{"training.backoff_factor": 1.0}),
        INVALID,
        "training.backoff_factor",
    ),
    "backoffs huge": (start(**{"training.max_backoffs": U32}), INVALID, "training.max_backoffs"),
    "both steps and epochs": (start(**{"training.epochs": 3}), INVALID, "training.steps"),
    "steps huge": (start(**{"training.steps": U64}), INVALID, "training.steps"),
    "seed largest": (start(**{"training.seed": I64}), OK, ""),
    "seed past int64": (start(**{"training.seed": I64 + 1}), INVALID, "training.seed"),
    "seed huge": (start(**{"training.seed": U64}), INVALID, "training.seed"),
    "epochs huge": (
        start(**{"training.steps": 0, "training.epochs": U32}),
        INVALID,
        "training.epochs",
    ),
    "validation fraction one": (
        start(**{"eval.validation_fraction": 1.0}),
        INVALID,
        "eval.validation_fraction",
    ),
    "validation fraction negative": (
        start(**{"eval.validation_fraction": -0.5}),
        INVALID,
        "eval.validation_fraction",
    ),
    "validation fraction NaN": (
        start(**{"eval.validation_fraction": math.nan}),
        INVALID,
        "eval.validation_fraction",
    ),
    "validation fraction tiny": (
        start(**{"eval.validation_fraction": 1e-300}),
        INVALID,
        "eval.validation_fraction",
    ),
    "AIS chains huge": (start(**{"eval.ais_chains": U32}), INVALID, "eval.ais_chains"),
    "AIS temperatures huge": (start(**{"eval.ais_betas": U32}), INVALID, "eval.ais_betas"),
    "raw pixels for binary units": (
        start(
            dataset=pb.DatasetRef(
                builtin=pb.BuiltinDataset(name="mnist"), preprocess=pb.PREPROCESS_NONE
            )
        ),
        INVALID,
        "dataset.preprocess",
    ),
    "polar method without SSD": (
        start(**{"optimizer.kind": pb.OPTIMIZER_KIND_SGD, "optimizer.method": 1}),
        INVALID,
        "optimizer.method",
    ),
    "builtin unknown": (
        start(**{"dataset.builtin.name": "imagenet"}),
        INVALID,
        "dataset.builtin.name",
    ),
    "builtin unicode": (
        start(**{"dataset.builtin.name": "データ"}),
        INVALID,
        "dataset.builtin.name",
    ),
    "builtin empty": (start(**{"dataset.builtin.name": ""}), INVALID, "dataset.builtin.name"),
    "builtin option negative": (
        start(**{"dataset.builtin.options": {"n_visible": "-3"}}),
        INVALID,
        "dataset.builtin.options[n_visible]",
    ),
    "builtin option not a number": (
        start(**{"dataset.builtin.options": {"n_samples": "many"}}),
        INVALID,
        "dataset.builtin.options[n_samples]",
    ),
    "builtin option huge": (
        start(**{"dataset.builtin.options": {"n_samples": "9" * 40}}),
        INVALID,
        "dataset.builtin.options[n_samples]",
    ),
    "builtin option unknown": (
        start(**{"dataset.builtin.options": {"colour": "1"}}),
        INVALID,
        "dataset.builtin.options",
    ),
    "builtin option oversized": (
        start(**{"dataset.builtin.options": {"n_samples": "1" * 100_000}}),
        INVALID,
        "dataset.builtin.options",
    ),
    "preprocess unknown": (start(**{"dataset.preprocess": 77}), INVALID, "dataset.preprocess"),
    "dataset id empty": (
        start_with(lambda r: setattr(r.dataset, "dataset_id", "")),
        INVALID,
        "dataset.dataset_id",
    ),
    "dataset id unknown": (
        start_with(lambda r: setattr(r.dataset, "dataset_id", "ab" * 32)),
        NOT_FOUND,
        "dataset",
    ),
    "dataset id path": (
        start_with(lambda r: setattr(r.dataset, "dataset_id", "../../etc/passwd")),
        NOT_FOUND,
        "dataset",
    ),
    "dataset id unicode": (
        start_with(lambda r: setattr(r.dataset, "dataset_id", "ü" * 64)),
        NOT_FOUND,
        "dataset",
    ),
    "dataset id oversized": (
        start_with(lambda r: setattr(r.dataset, "dataset_id", "a" * 100_000)),
        INVALID,
        "dataset.dataset_id",
    ),
    "request id oversized": (start(request_id="r" * 129), INVALID, "request_id"),
    "request id control characters": (start(request_id="a\x00b"), INVALID, "request_id"),
    "name oversized": (start(name="n" * 100_000), INVALID, "name"),
    "name newline": (start(name="two\nlines"), INVALID, "name"),
    "unicode name and request id": (start(name="模型 ☃", request_id="请求-😀"), OK, ""),
    "model over the byte budget": (
        start(**{"model.n_hidden": 65_536, "dataset.builtin.options": {"n_visible": "4096"}}),
        EXHAUSTED,
        "SSDRBM_MAX_MODEL_BYTES",
    ),
    "checkpoint over the store's value limit": (
        start(**{"model.n_hidden": 12_000, "dataset.builtin.options": {"n_visible": "4096"}}),
        EXHAUSTED,
        "SSDRBM_MAX_VALUE_BYTES",
    ),
    "cd_k at its bound on a wide hidden layer": (
        start(**{"model.n_hidden": 65_536, "training.cd_k": 10_000}),
        EXHAUSTED,
        "SSDRBM_MAX_STEP_FLOPS",
    ),
    "AIS settings at their bounds": (
        start(**{"eval.ais": True, "eval.ais_chains": 100_000, "eval.ais_betas": 1_000_000}),
        EXHAUSTED,
        "SSDRBM_MAX_EVAL_FLOPS",
    ),
}


def get(job_id: str) -> Callable[[Env], Any]:
    return lambda env: env.stub.GetJob(pb.GetJobRequest(job_id=job_id))


def cancel(job_id: str) -> Callable[[Env], Any]:
    return lambda env: env.stub.CancelJob(pb.CancelJobRequest(job_id=job_id))


def listing(**fields: Any) -> Callable[[Env], Any]:
    return lambda env: env.stub.ListJobs(pb.ListJobsRequest(**fields))


def stream(job_id: str | None = None, **fields: Any) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        request = pb.StreamMetricsRequest(
            job_id=env.trained if job_id is None else job_id, history_only=True, **fields
        )
        return env.stub.StreamMetrics(request)

    return call


JOB_ID_CASES = {
    "empty": ("", INVALID, "job_id"),
    "oversized": ("j" * 100_000, INVALID, "job_id"),
    "unknown": ("0" * 32, NOT_FOUND, "not found"),
    "unicode": ("ジョブ" * 4, NOT_FOUND, "not found"),
    "key injection": ("0" * 32 + ":metrics", NOT_FOUND, "not found"),
    "path": ("../../job", NOT_FOUND, "not found"),
    "upper case": ("A" * 32, NOT_FOUND, "not found"),
}

JOB_CASES = {}
for label, (job_id, code, text) in JOB_ID_CASES.items():
    JOB_CASES[f"GetJob {label}"] = (get(job_id), code, text)
    JOB_CASES[f"CancelJob {label}"] = (cancel(job_id), code, text)
    JOB_CASES[f"StreamMetrics {label}"] = (stream(job_id), code, text)

JOB_CASES |= {
    "ListJobs page size huge": (listing(page_size=U32), INVALID, "page_size"),
    "ListJobs state unknown": (listing(state=99), INVALID, "state"),
    "ListJobs token garbage": (listing(page_token="abc"), INVALID, "page_token"),
    "ListJobs token negative": (listing(page_token="-1"), INVALID, "page_token"),
    "ListJobs token oversized": (listing(page_token="9" * 100_000), INVALID, "page_token"),
    "ListJobs token unicode": (listing(page_token="١٢٣"), INVALID, "page_token"),
    "ListJobs token a bare position": (listing(page_token="9" * 18), INVALID, "page_token"),
    "ListJobs token of another tenant": (
        listing(page_token=encode_page_token("someone-else", 5)),
        INVALID,
        "page_token",
    ),
    "ListJobs token far away": (listing(page_token=encode_page_token("default", 10**17)), OK, ""),
    "StreamMetrics token garbage": (stream(after="garbage"), INVALID, "after"),
    "StreamMetrics token overflow": (stream(after=f"{U64 + 1}-0"), INVALID, "after"),
    "StreamMetrics token three parts": (stream(after="1-2-3"), INVALID, "after"),
    "StreamMetrics token unicode": (stream(after="١-٢"), INVALID, "after"),
    "StreamMetrics token oversized": (stream(after="1" * 100_000), INVALID, "after"),
    "StreamMetrics token in the future": (stream(after=f"{I64}-0"), OK, ""),
}


def reconstruct(job: str = "trained", **fields: Any) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        values = {"input": good_input(), **fields}
        return env.stub.Reconstruct(pb.ReconstructRequest(job_id=getattr(env, job), **values))

    return call


def hidden(job: str = "trained", **fields: Any) -> Callable[[Env], Any]:
    def call(env: Env) -> Any:
        values = {"input": good_input(), **fields}
        return env.stub.SampleHidden(pb.SampleHiddenRequest(job_id=getattr(env, job), **values))

    return call


def export(job: str = "trained", **fields: Any) -> Callable[[Env], Any]:
    return lambda env: env.stub.ExportModel(
        pb.ExportModelRequest(job_id=getattr(env, job), **fields)
    )


TENSOR_CASES = {
    "no input": (pb.Tensor(), INVALID, "input.shape"),
    "one dimension": (tensor([N_VISIBLE]), INVALID, "input.shape"),
    "three dimensions": (tensor([2, N_VISIBLE, 1]), INVALID, "input.shape"),
    "zero rows": (tensor([0, N_VISIBLE], data=b""), INVALID, "input.shape"),
    "negative rows": (tensor([-1, N_VISIBLE], data=b""), INVALID, "input.shape"),
    "wrong width": (tensor([2, N_VISIBLE - 1]), INVALID, "n_visible=16"),
    "bytes short by one": (
        tensor([2, N_VISIBLE], data=b"\0" * (8 * N_VISIBLE - 1)),
        INVALID,
        "input.data",
    ),
    "float64 bytes": (
        tensor([2, N_VISIBLE], data=np.zeros((2, N_VISIBLE)).tobytes()),
        INVALID,
        "input.data",
    ),
    "NaN": (with_nan(math.nan), INVALID, "input.data"),
    "Inf": (with_nan(math.inf), INVALID, "input.data"),
    "minus Inf": (with_nan(-math.inf), INVALID, "input.data"),
    "shape overflows": (tensor([2**62, 2**62], data=b""), EXHAUSTED, "elements"),
}

SERVING_CASES = {}
for label, (value, code, text) in TENSOR_CASES.items():
    SERVING_CASES[f"Reconstruct {label}"] = (reconstruct(input=value), code, text)
    SERVING_CASES[f"SampleHidden {label}"] = (hidden(input=value), code, text)

SERVING_CASES |= {
    "Reconstruct k huge": (reconstruct(k=U32), INVALID, "k"),
    "Reconstruct negative checkpoint": (reconstruct(checkpoint_step=-1), INVALID, "checkpoint"),
    "Reconstruct unknown checkpoint": (reconstruct(checkpoint_step=I64), NOT_FOUND, "step"),
    "Reconstruct before a checkpoint": (reconstruct(job="queued"), PRECONDITION, "checkpoint"),
    "Reconstruct largest seed": (reconstruct(seed=U64), OK, ""),
    "Reconstruct mean field, many steps": (reconstruct(k=1000, mean_field=True), OK, ""),
    "SampleHidden mode unknown": (hidden(mode=9), INVALID, "mode"),
    "SampleHidden negative checkpoint": (hidden(checkpoint_step=-5), INVALID, "checkpoint"),
    "SampleHidden before a checkpoint": (hidden(job="queued"), PRECONDITION, "checkpoint"),
    "SampleHidden largest seed": (hidden(mode=pb.HIDDEN_MODE_SAMPLE, seed=U64), OK, ""),
    "ExportModel negative checkpoint": (export(checkpoint_step=-1), INVALID, "checkpoint_step"),
    "ExportModel unknown checkpoint": (export(checkpoint_step=12345), NOT_FOUND, "12345"),
    "ExportModel before a checkpoint": (export(job="queued"), PRECONDITION, "checkpoint"),
}


def put(head: pb.DatasetHeader | None, *chunks: bytes) -> Callable[[Env], Any]:
    return lambda env: upload(env.stub, head, list(chunks))


def floats(rows: int, cols: int, dtype: str = "<f4", bad: float | None = None) -> bytes:
    values = np.ones((rows, cols), dtype=dtype)
    if bad is not None:
        values[-1, -1] = bad
    return values.tobytes()


UPLOAD_CASES = {
    "empty stream": (put(None), INVALID, "header"),
    "chunk before header": (put(None, b"\0" * 4), INVALID, "header"),
    "two headers": (
        lambda env: env.stub.UploadDataset(
            iter([pb.UploadDatasetRequest(header=header(shape=[1, 1]))] * 2)
        ),
        INVALID,
        "header",
    ),
    "no shape": (put(header()), INVALID, "header.shape"),
    "one dimension": (put(header(shape=[5]), floats(1, 5)), INVALID, "header.shape"),
    "four dimensions": (put(header(shape=[1, 1, 1, 4]), floats(1, 4)), INVALID, "header.shape"),
    "zero rows": (put(header(shape=[0, 4])), INVALID, "header.shape"),
    "negative width": (put(header(shape=[4, -4])), INVALID, "header.shape"),
    "dtype unknown": (put(header(shape=[1, 4], dtype=42), floats(1, 4)), INVALID, "header.dtype"),
    "name oversized": (put(header(shape=[1, 4], name="x" * 100_000)), INVALID, "header.name"),
    "sha256 malformed": (put(header(shape=[1, 4], sha256="xyz")), INVALID, "header.sha256"),
    "sha256 mismatch": (
        put(header(shape=[1, 4], sha256="0" * 64), floats(1, 4)),
        INVALID,
        "header.sha256",
    ),
    "too few bytes": (put(header(shape=[2, 4]), floats(1, 4)), INVALID, "chunk"),
    "too many bytes": (put(header(shape=[1, 4]), floats(2, 4)), INVALID, "chunk"),
    "float32 NaN": (put(header(shape=[2, 4]), floats(2, 4, bad=math.nan)), INVALID, "NaN"),
    "float64 Inf": (
        put(header(shape=[2, 4], dtype=pb.DTYPE_FLOAT64), floats(2, 4, "<f8", math.inf)),
        INVALID,
        "NaN",
    ),
    "over the size limit": (put(header(shape=[1 << 20, 1])), EXHAUSTED, "limit"),
    "shape overflows": (put(header(shape=[2**62, 2**62])), EXHAUSTED, "limit"),
    "uint8 with a unicode name": (
        put(header(shape=[3, 4], dtype=pb.DTYPE_UINT8, name="画像 ☃"), bytes(range(12))),
        OK,
        "",
    ),
}


def raw(method: str, kind: str, *payloads: bytes) -> Callable[[Env], Any]:
    """Call ``method`` with raw bytes as the request (or as each part of a request stream)."""

    def call(env: Env) -> Any:
        channel = env.running.channel()
        path = f"/ssdrbm.v1.RBMService/{method}"
        if kind == "stream-request":
            return channel.stream_unary(path)(iter(payloads))
        if kind == "stream-response":
            return channel.unary_stream(path)(payloads[0])
        return channel.unary_unary(path)(payloads[0])

    return call


CORRUPT = b"\xff\xff\xff\xff"  # a field number 0 and a truncated varint: not a message
valid_header = pb.UploadDatasetRequest(header=header(shape=[1, 4])).SerializeToString()
WIRE_CASES = {
    "GetJob corrupt bytes": (raw("GetJob", "unary", CORRUPT), INVALID, "ssdrbm.v1.GetJobRequest"),
    "StartTraining corrupt bytes": (
        raw("StartTraining", "unary", CORRUPT),
        INVALID,
        "ssdrbm.v1.StartTrainingRequest",
    ),
    "StreamMetrics corrupt bytes": (
        raw("StreamMetrics", "stream-response", CORRUPT),
        INVALID,
        "ssdrbm.v1.StreamMetricsRequest",
    ),
    "UploadDataset corrupt part": (
        raw("UploadDataset", "stream-request", valid_header, CORRUPT),
        INVALID,
        "ssdrbm.v1.UploadDatasetRequest",
    ),
    "GetJob string field with invalid UTF-8": (
        raw("GetJob", "unary", b"\x0a\x02\xc3\x28"),
        INVALID,
        "request",
    ),
}

CATALOGUE = START_CASES | JOB_CASES | SERVING_CASES | UPLOAD_CASES | WIRE_CASES


@pytest.mark.parametrize("case", CATALOGUE.keys())
def test_catalogue(env: Env, case: str) -> None:
    call, expected, text = CATALOGUE[case]
    code, details = outcome(lambda: call(env))
    assert code is expected, (case, code, details)
    assert text in details, (case, details)
    if code is INVALID:
        # The message starts with the field's name and goes on to say what to change.
        assert re.match(r"^[\w.\[\]\u0080-\uffff]+: \S", details), details


def test_an_uploaded_dataset_that_does_not_fit_the_model_is_named(env: Env) -> None:
    request = tiny_request(dataset=pb.DatasetRef(dataset_id=env.dataset))
    request.training.batch_size = 1000
    code, details = outcome(lambda: env.stub.StartTraining(request))
    assert code is INVALID and details.startswith("training.batch_size")


# --- property-based fuzzing -----------------------------------------------------------------

EDGE_INTS = [0, 1, 2, 255, 256, 2**31 - 1, 2**31, U32]
u32 = st.one_of(st.sampled_from(EDGE_INTS), st.integers(0, U32))
u64 = st.one_of(st.sampled_from([*EDGE_INTS, 2**63, U64]), st.integers(0, U64))
i64 = st.one_of(st.sampled_from([-1, 0, 1, 10, -(2**63), I64]), st.integers(-(2**63), I64))
doubles = st.floats(allow_nan=True, allow_infinity=True)
enums = st.integers(0, 40)
text = st.text(max_size=300)

model_specs = st.builds(pb.ModelSpec, kind=enums, variance=enums, n_hidden=u32)
optimizer_specs = st.builds(
    pb.OptimizerSpec,
    kind=enums,
    lr=doubles,
    momentum=doubles,
    method=enums,
    preconditioner=enums,
    weight_decay=doubles,
    max_spectral_norm=doubles,
    rank=u32,
    per_parameter=st.dictionaries(st.sampled_from(["W", "a", "b", "log_var", "?"]), enums),
)
training_specs = st.builds(
    pb.TrainingSpec,
    cd_k=u32,
    persistent=st.booleans(),
    batch_size=u32,
    steps=u64,
    epochs=u32,
    seed=u64,
    checkpoint_every=u32,
)
eval_specs = st.builds(
    pb.EvalSpec,
    every=u32,
    ais=st.booleans(),
    ais_chains=u32,
    ais_betas=u32,
    validation_fraction=doubles,
)
builtin_options = st.dictionaries(
    st.sampled_from(["n_visible", "n_hidden", "n_samples", "seed", "limit", "x"]),
    st.one_of(st.integers(-5, 10**6).map(str), text),
    max_size=4,
)
dataset_refs = st.one_of(
    st.builds(
        pb.DatasetRef,
        builtin=st.builds(
            pb.BuiltinDataset,
            name=st.sampled_from(["synthetic", "mnist", "freyface", "", "x"]),
            options=builtin_options,
        ),
        preprocess=enums,
    ),
    st.builds(pb.DatasetRef, dataset_id=text, preprocess=enums),
)
start_requests = st.builds(
    pb.StartTrainingRequest,
    model=model_specs,
    optimizer=optimizer_specs,
    training=training_specs,
    eval=eval_specs,
    dataset=dataset_refs,
    request_id=text,
    name=text,
)
tensors = st.builds(
    pb.Tensor,
    shape=st.lists(st.sampled_from([-1, 0, 1, 2, N_VISIBLE, 2**31, 2**62]), max_size=4),
    data=st.binary(max_size=256),
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples on every run; no example database
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def assert_foreseen(code: grpc.StatusCode, details: str) -> None:
    assert code in CLIENT_ERRORS, (code, details)
    if code is INVALID:
        assert re.match(r"^[^\s:]+: \S", details), details


@FUZZ
@given(request=start_requests)
def test_fuzzed_start_training(env: Env, request: pb.StartTrainingRequest) -> None:
    code, details = outcome(lambda: env.stub.StartTraining(request))
    assert_foreseen(code, details)
    if code is OK:  # whatever was accepted is a complete, valid spec
        job = env.stub.GetJob(pb.GetJobRequest(job_id=env.stub.StartTraining(request).job.id))
        assert job.spec.optimizer.lr > 0 and job.spec.training.cd_k >= 1
        assert job.total_steps >= 1 and job.spec.model.n_hidden >= 1


@FUZZ
@given(
    which=st.sampled_from(["trained", "queued"]),
    value=tensors,
    k=u32,
    seed=u64,
    step=i64,
    mode=enums,
    mean_field=st.booleans(),
)
def test_fuzzed_serving(
    env: Env,
    which: str,
    value: pb.Tensor,
    k: int,
    seed: int,
    step: int,
    mode: int,
    mean_field: bool,
) -> None:
    job_id = getattr(env, which)
    calls = [
        lambda: env.stub.Reconstruct(
            pb.ReconstructRequest(
                job_id=job_id,
                input=value,
                k=k,
                mean_field=mean_field,
                checkpoint_step=step,
                seed=seed,
            )
        ),
        lambda: env.stub.SampleHidden(
            pb.SampleHiddenRequest(
                job_id=job_id, input=value, mode=mode, checkpoint_step=step, seed=seed
            )
        ),
        lambda: env.stub.ExportModel(pb.ExportModelRequest(job_id=job_id, checkpoint_step=step)),
    ]
    for call in calls:
        assert_foreseen(*outcome(call))


@FUZZ
@given(
    job_id=st.one_of(text, st.just("0" * 32)),
    after=st.one_of(text, st.from_regex(r"\A[0-9]{1,22}-[0-9]{1,22}\Z")),
    page_size=u32,
    page_token=text,
    state=enums,
)
def test_fuzzed_jobs_and_streams(
    env: Env, job_id: str, after: str, page_size: int, page_token: str, state: int
) -> None:
    calls = [
        lambda: env.stub.GetJob(pb.GetJobRequest(job_id=job_id)),
        lambda: env.stub.CancelJob(pb.CancelJobRequest(job_id=job_id)),
        lambda: env.stub.StreamMetrics(
            pb.StreamMetricsRequest(job_id=env.trained, after=after, history_only=True)
        ),
        lambda: env.stub.ListJobs(
            pb.ListJobsRequest(page_size=page_size, page_token=page_token, state=state)
        ),
    ]
    for call in calls:
        assert_foreseen(*outcome(call))


@FUZZ
@given(
    shape=st.lists(st.integers(-2, 300), max_size=4),
    dtype=enums,
    name=text,
    sha256=st.one_of(st.just(""), text, st.text("0123456789abcdef", min_size=64, max_size=64)),
    chunks=st.lists(st.binary(max_size=600), max_size=4),
    header_first=st.booleans(),
)
def test_fuzzed_uploads(
    env: Env,
    shape: list[int],
    dtype: int,
    name: str,
    sha256: str,
    chunks: list[bytes],
    header_first: bool,
) -> None:
    head = pb.DatasetHeader(shape=shape, dtype=dtype, name=name, sha256=sha256)
    parts = [pb.UploadDatasetRequest(chunk=chunk) for chunk in chunks]
    parts.insert(0 if header_first else len(parts), pb.UploadDatasetRequest(header=head))
    assert_foreseen(*outcome(lambda: env.stub.UploadDataset(iter(parts))))


RPC_KINDS = {
    "StartTraining": "unary",
    "GetJob": "unary",
    "ListJobs": "unary",
    "CancelJob": "unary",
    "Reconstruct": "unary",
    "SampleHidden": "unary",
    "StreamMetrics": "stream-response",
    "ExportModel": "stream-response",
    "UploadDataset": "stream-request",
}


@FUZZ
@given(
    method=st.sampled_from(sorted(RPC_KINDS)),
    payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=3),
)
def test_fuzzed_wire_bytes(env: Env, method: str, payloads: list[bytes]) -> None:
    """Arbitrary bytes as the serialized request: parsed or refused, never an internal error."""
    code, details = outcome(lambda: raw(method, RPC_KINDS[method], *payloads)(env))
    assert_foreseen(code, details)
