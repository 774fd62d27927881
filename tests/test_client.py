"""The Python SDK: tensor codec, request building, safetensors reader, and the full client against
a real in-process service with real Redis (including a metric stream cut mid-flight)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import save as safetensors_save
from ssdrbm import (
    Client,
    InvalidArgument,
    RetryPolicy,
    Unavailable,
    read_safetensors,
)
from ssdrbm._calls import BatchPlan
from ssdrbm.datasets import upload_messages, wire_array
from ssdrbm.model_file import ExportedModel, SafetensorsError
from ssdrbm.retry import call_with_retry
from ssdrbm.spec import training_request
from ssdrbm.tensors import as_batch, from_tensor, rows_per_chunk, to_tensor
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from tests.fixtures.redis import free_port

README = Path(__file__).resolve().parent.parent / "README.md"

# --- tensor codec -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, ">f4"])
def test_tensor_round_trip_is_little_endian_float32(dtype) -> None:
    array = (np.arange(24).reshape(2, 3, 4) * 1.5).astype(dtype)
    tensor = to_tensor(array)
    assert list(tensor.shape) == [2, 3, 4]
    assert tensor.data == np.asarray(array, dtype="<f4").tobytes()  # wire format from the proto
    decoded = from_tensor(tensor)
    assert decoded.dtype == np.float32 and decoded.flags.writeable
    np.testing.assert_array_equal(decoded, np.asarray(array, dtype=np.float32))


def test_tensor_with_inconsistent_size_is_refused() -> None:
    tensor = rbm_pb2.Tensor(shape=[2, 3], data=b"\x00" * 20)
    with pytest.raises(ValueError, match="needs 24 bytes but carries 20"):
        from_tensor(tensor)


def test_as_batch_accepts_vectors_and_images_and_refuses_text() -> None:
    assert as_batch(np.ones(5)).shape == (1, 5)
    assert as_batch(np.ones((3, 4, 2))).shape == (3, 8)
    with pytest.raises(ValueError, match="numeric"):
        as_batch(np.array(["a", "b"]))


def test_batch_plan_splits_under_the_byte_limit_and_restores_shapes() -> None:
    x = np.arange(10 * 6, dtype=np.float32).reshape(10, 3, 2)
    plan = BatchPlan.for_input(x, max_batch_bytes=4 * 6 * 4)  # four rows of 6 floats
    assert plan.chunk_rows == 4 == rows_per_chunk(24, 96)
    slices, start = [], 0
    while start < 10:
        rows = plan.next_slice(start)
        slices.append((rows.start, rows.stop))
        start = rows.stop
    assert slices == [(0, 4), (4, 8), (8, 10)]
    parts = [plan.batch[a:b] for a, b in slices]
    np.testing.assert_array_equal(plan.assemble(parts, same_shape=True), x)
    assert plan.shrink() and plan.chunk_rows == 2
    single = BatchPlan.for_input(np.ones(6), max_batch_bytes=1)
    assert single.chunk_rows == 1 and not single.shrink()
    assert single.assemble([np.ones((1, 4))], same_shape=False).shape == (4,)
    with pytest.raises(InvalidArgument, match="empty"):
        BatchPlan.for_input(np.ones((0, 3)), max_batch_bytes=100)


# --- datasets -----------------------------------------------------------------------------------


def test_upload_messages_carry_header_then_exact_bytes() -> None:
    array = np.random.default_rng(0).random((5, 7))  # float64 stays float64
    messages = list(upload_messages(array, name="demo", chunk_bytes=64))
    header = messages[0].header
    assert list(header.shape) == [5, 7] and header.dtype == rbm_pb2.DTYPE_FLOAT64
    body = b"".join(m.chunk for m in messages[1:])
    assert body == array.astype("<f8").tobytes()
    assert all(len(m.chunk) <= 64 for m in messages[1:])
    import hashlib

    assert header.sha256 == hashlib.sha256(body).hexdigest()
    wire, dtype = wire_array(np.array([[True, False]]))
    assert wire.dtype == np.uint8 and dtype == rbm_pb2.DTYPE_UINT8
    assert wire_array(np.ones((2, 2), dtype=np.int32))[1] == rbm_pb2.DTYPE_FLOAT32
    with pytest.raises(InvalidArgument, match="n_examples"):
        wire_array(np.ones(4))


# --- training requests --------------------------------------------------------------------------


def test_training_request_defaults_and_names() -> None:
    request = training_request()
    assert request.model.kind == rbm_pb2.MODEL_KIND_BERNOULLI
    assert request.optimizer.kind == rbm_pb2.OPTIMIZER_KIND_SSD
    assert request.optimizer.method == rbm_pb2.POLAR_METHOD_LOWRANK
    assert request.training.steps == 1000 and request.training.epochs == 0
    assert not request.training.HasField("cd_k")  # unset: the server's default of 1
    assert request.dataset.builtin.name == "synthetic"
    assert re.fullmatch(r"[0-9a-f]{32}", request.request_id)
    assert training_request().request_id != request.request_id

    hybrid = training_request(
        model="gaussian",
        variance="isotropic",
        optimizer="sgd",
        method="newton_schulz",
        per_parameter={"W": "ssd"},
        cd_k=10,
        epochs=3,
        dataset_id="abc",
        preprocess="standardize",
        request_id="mine",
    )
    assert hybrid.model.variance == rbm_pb2.VARIANCE_KIND_ISOTROPIC
    assert hybrid.optimizer.method == rbm_pb2.POLAR_METHOD_NEWTON_SCHULZ
    assert dict(hybrid.optimizer.per_parameter) == {"W": rbm_pb2.OPTIMIZER_KIND_SSD}
    assert hybrid.training.cd_k == 10 and hybrid.training.epochs == 3
    assert hybrid.training.steps == 0
    assert hybrid.dataset.dataset_id == "abc"
    assert hybrid.dataset.preprocess == rbm_pb2.PREPROCESS_STANDARDIZE
    assert hybrid.request_id == "mine"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"optimizer": "adamw"}, "optimizer"),
        ({"method": "qr"}, "method"),
        ({"per_parameter": {"W": "lbfgs"}}, r"per_parameter\[W\]"),
        ({"n_hidden": -1}, "n_hidden"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"steps": 10, "epochs": 1}, "steps, epochs"),
    ],
)
def test_training_request_names_the_bad_field(kwargs, field) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        training_request(**kwargs)


# --- safetensors without torch ------------------------------------------------------------------


def test_safetensors_reader_matches_the_reference_writer() -> None:
    rng = np.random.default_rng(1)
    tensors = {
        "W": rng.standard_normal((5, 3)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float64),
        "steps": np.array([1, -2, 3], dtype=np.int64),
        "mask": np.array([[True, False]]),
        "pixels": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "half": np.array([0.5, -2.0], dtype=np.float16),
        "scalar": np.array(7.0, dtype=np.float32),
    }
    data = safetensors_save(tensors, metadata={"config": '{"type": "bernoulli"}'})
    read, metadata = read_safetensors(data)
    assert metadata == {"config": '{"type": "bernoulli"}'}
    assert set(read) == set(tensors)
    for name, expected in tensors.items():
        assert read[name].dtype == expected.dtype, name
        assert read[name].shape == expected.shape, name
        np.testing.assert_array_equal(read[name], expected)


def _raw_safetensors(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def test_safetensors_reader_widens_bfloat16() -> None:
    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)  # exact in bfloat16
    body = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    data = _raw_safetensors({"x": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}}, body)
    np.testing.assert_array_equal(read_safetensors(data)[0]["x"], values)


def _one(entry: dict, body: bytes) -> bytes:
    return _raw_safetensors({"x": entry}, body)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", 1000) + b"{}", "header length"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (_one({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, b"\0" * 4), "does not fit"),
        (_one({"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}, b"\0" * 4), "does not fit"),
        (_one({"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}, b"\0" * 8), "unsupported"),
        (_one({"shape": [1]}, b""), "needs dtype"),
    ],
)
def test_safetensors_reader_refuses_malformed_files(data, message) -> None:
    with pytest.raises(SafetensorsError, match=message):
        read_safetensors(data)


def test_exported_model_hidden_probs_by_hand() -> None:
    W = np.array([[1.0, -1.0], [0.5, 2.0], [0.0, 1.0]], dtype=np.float32)  # (V=3, H=2)
    a = np.array([0.1, -0.2], dtype=np.float32)
    log_var = np.log(np.array([1.0, 2.0, 4.0], dtype=np.float32))
    v = np.array([[1.0, 2.0, 4.0]])
    data = safetensors_save({"model.W": W, "model.a": a, "model.log_var": log_var, "opt.m": W})
    model = ExportedModel.from_bytes(data, config={"type": "gaussian", "variance": "diagonal"})
    assert set(model.parameters) == {"W", "a", "log_var"}
    scaled = np.array([1.0, 1.0, 1.0])  # v / variance
    expected = 1 / (1 + np.exp(-(scaled @ W + a)))
    np.testing.assert_allclose(model.hidden_probs(v)[0], expected, rtol=1e-6)
    bernoulli = ExportedModel.from_bytes(safetensors_save({"W": W, "a": a}), config={})
    np.testing.assert_allclose(
        bernoulli.hidden_probs(v)[0], 1 / (1 + np.exp(-(v[0] @ W + a))), rtol=1e-6
    )


# --- connection failures (no server needed) -----------------------------------------------------


def test_unreachable_service_is_retried_then_reported_with_its_address() -> None:
    port = free_port()
    policy = RetryPolicy(attempts=3, initial_backoff_s=0.01)
    with (
        Client(f"127.0.0.1:{port}", retry=policy, timeout=5) as client,
        pytest.raises(Unavailable) as caught,
    ):
        client.get_job("anything")
    assert caught.value.target == f"127.0.0.1:{port}"


def test_retry_gives_up_at_once_on_answers_other_than_unavailable() -> None:
    attempts = []

    def call():
        attempts.append(1)
        channel = grpc.insecure_channel(f"127.0.0.1:{free_port()}")
        stub = rbm_pb2_grpc.RBMServiceStub(channel)
        try:
            return stub.GetJob(rbm_pb2.GetJobRequest(job_id="x"), timeout=0.000001)
        finally:
            channel.close()

    with pytest.raises(grpc.RpcError) as caught:
        call_with_retry(call, RetryPolicy(attempts=4), sleep=lambda s: None)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(attempts) == 1
