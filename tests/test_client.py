"""The Python SDK: tensor codec, request building, safetensors reader, and the full client against
a real in-process service with real Redis (including a metric stream cut mid-flight)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import socket
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file as safetensors_load_file
from safetensors.numpy import save as safetensors_save
from ssdrbm import (
    Client,
    InvalidArgument,
    JobState,
    MetricsEvent,
    NotFound,
    RetryPolicy,
    StateEvent,
    Unavailable,
    read_safetensors,
)
from ssdrbm.aio import AsyncClient
from ssdrbm.datasets import upload_messages, wire_array
from ssdrbm.model_file import ExportedModel, SafetensorsError
from ssdrbm.serving import BatchPlan
from ssdrbm.spec import training_request
from ssdrbm.tensors import as_batch, from_tensor, rows_per_chunk, to_tensor
from ssdrbm.v1 import rbm_pb2

from tests.fixtures.redis import free_port

SDK_DOC = Path(__file__).resolve().parent.parent / "docs" / "SDK.md"

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
    assert header.sha256 == hashlib.sha256(body).hexdigest()
    wire, dtype = wire_array(np.array([[True, False]]))
    assert wire.dtype == np.uint8 and dtype == rbm_pb2.DTYPE_UINT8
    assert wire_array(np.ones((2, 2), dtype=np.int32))[1] == rbm_pb2.DTYPE_FLOAT32
    with pytest.raises(InvalidArgument, match="n_examples"):
        wire_array(np.ones(4))


# --- training requests --------------------------------------------------------------------------


def test_training_request_sends_unset_fields_unset() -> None:
    """The SDK holds no defaults: what the caller leaves out is left to the server."""
    request = training_request(n_hidden=8)
    assert request.model.n_hidden == 8
    expected = rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(n_hidden=8), request_id=request.request_id
    )
    assert request == expected  # nothing else set: no lr, no method, no steps, no dataset
    assert not request.optimizer.HasField("lr") and not request.training.HasField("cd_k")
    assert re.fullmatch(r"[0-9a-f]{32}", request.request_id)
    assert training_request().request_id != request.request_id
    explicit = training_request(momentum=0.0, max_backoffs=0, lr=0.5, persistent=False)
    assert explicit.optimizer.HasField("momentum") and explicit.optimizer.momentum == 0.0
    assert explicit.training.HasField("max_backoffs") and explicit.optimizer.lr == 0.5

    hybrid = training_request(
        model="gaussian",
        variance="isotropic",
        optimizer="sgd",
        method="newton_schulz",
        per_parameter={"W": "ssd"},
        per_parameter_lr={"W": 1e-3},
        min_variance=0.01,
        cd_k=10,
        epochs=3,
        dataset_id="abc",
        preprocess="standardize",
        request_id="mine",
    )
    assert hybrid.model.variance == rbm_pb2.VARIANCE_KIND_ISOTROPIC
    assert hybrid.optimizer.method == rbm_pb2.POLAR_METHOD_NEWTON_SCHULZ
    assert dict(hybrid.optimizer.per_parameter) == {"W": rbm_pb2.OPTIMIZER_KIND_SSD}
    assert dict(hybrid.optimizer.per_parameter_lr) == {"W": pytest.approx(1e-3)}
    assert hybrid.model.min_variance == pytest.approx(0.01)
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
        ({"dataset": "mnist", "dataset_id": "x"}, "dataset, dataset_id"),
        ({"dataset_options": {"limit": 3}}, "dataset_options"),
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


def test_retry_policy_backs_off_within_its_budget() -> None:
    plain = list(RetryPolicy(attempts=4, initial_backoff_s=0.1, jitter=0.0).delays())
    assert plain == pytest.approx([0.1, 0.2, 0.4])
    waiting = list(RetryPolicy.waiting(5.0).delays())
    assert sum(waiting) == pytest.approx(5.0) and max(waiting) <= 1.2  # 1 s cap, 20% jitter
    assert list(RetryPolicy.waiting(0).delays()) == []


def test_unreachable_service_is_retried_then_reported_with_its_address() -> None:
    port = free_port()
    policy = RetryPolicy(attempts=3, initial_backoff_s=0.01)
    with (
        Client(f"127.0.0.1:{port}", retry=policy, timeout=5) as client,
        pytest.raises(Unavailable) as caught,
    ):
        client.get_job("anything")
    assert caught.value.target == f"127.0.0.1:{port}"


# --- against the real service -------------------------------------------------------------------

JOB_TIMEOUT_S = 120


def binary_data(n: int = 300, v: int = 16, seed: int = 0) -> np.ndarray:
    """Binary vectors with structure (two prototypes plus noise): something for an RBM to learn."""
    rng = np.random.default_rng(seed)
    prototypes = (rng.random((2, v)) < 0.5).astype(np.float32)
    flips = rng.random((n, v)) < 0.1
    return np.abs(prototypes[rng.integers(0, 2, n)] - flips).astype(np.float32)


def small_job(**overrides) -> dict:
    """A job that trains in a second or two."""
    return {"n_hidden": 8, "steps": 48, "batch_size": 50, "eval_every": 4, "seed": 3, **overrides}


class DroppingProxy:
    """A TCP proxy to ``upstream`` that cuts its first ``cuts`` connections after ``budget`` bytes
    have gone from the server to the client: a network that fails mid-stream, on purpose."""

    def __init__(self, upstream_port: int, *, budget: int, cuts: int) -> None:
        self.upstream_port = upstream_port
        self.budget = budget
        self.cuts_left = cuts
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self.connections += 1
                cut = self.cuts_left > 0
                self.cuts_left -= 1 if cut else 0
            budget = self.budget if cut else None
            threading.Thread(
                target=self._pump, args=(downstream, upstream, None), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, downstream, budget), daemon=True
            ).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, budget: int | None) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if budget is not None and sent + len(data) > budget:
                    sink.sendall(data[: budget - sent])  # part of a frame, then the line goes dead
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()


def test_sdk_end_to_end_with_the_metric_stream_cut_mid_flight(
    service_factory, tmp_path: Path
) -> None:
    """One job through every SDK call; its live metric stream goes through a proxy that cuts the
    connection three times, and must still arrive complete, in order, without repeats."""
    # A small tensor limit: the client must shrink its batches when the service refuses them.
    service = service_factory(max_tensor_elements=1000)
    x = binary_data()  # 300 × 16 = 4800 elements
    with Client(service.target) as client:
        dataset_id = client.upload_dataset(x, name="bits")
        again = client.upload_dataset_details(x)  # content-addressed: same bytes, same id
        assert again.id == dataset_id and not again.created and again.shape == (300, 16)

        job = client.start_training(
            dataset_id=dataset_id, name="sdk", request_id="r-1", **small_job()
        )
        assert job.state in (JobState.QUEUED, JobState.RUNNING) and job.name == "sdk"
        repeat = client.start_training(
            dataset_id=dataset_id, name="sdk", request_id="r-1", **small_job()
        )
        assert repeat.id == job.id  # idempotent: what makes retrying StartTraining safe

        # A second job, cancelled while it waits behind the first (the worker runs one at a time).
        other = client.start_training(dataset_id=dataset_id, **small_job(steps=100_000))
        client.cancel(other.id)

        proxy = DroppingProxy(service.port, budget=700, cuts=3)
        try:
            with Client(f"127.0.0.1:{proxy.port}") as through_proxy:
                final = through_proxy.wait(
                    job.id, timeout=JOB_TIMEOUT_S, on_event=(events := []).append
                )
        finally:
            proxy.close()
        assert proxy.connections >= 4  # three cut mid-stream, at least one more to finish
        assert final.state is JobState.SUCCEEDED, final.error
        assert final.step == final.total_steps == 48 and final.n_visible == 16

        history = list(client.stream_metrics(job.id, follow=False))
        assert events == history  # every event exactly once, in order, across the cuts
        assert isinstance(events[-1], StateEvent) and events[-1].state is JobState.SUCCEEDED
        steps = [e.metrics.step for e in events if isinstance(e, MetricsEvent)]
        assert steps == list(range(4, 49, 4))
        tokens = [e.resume_token for e in events]
        assert list(client.stream_metrics(job.id, after=tokens[1])) == events[2:]

        assert client.wait(other.id, timeout=JOB_TIMEOUT_S).state is JobState.CANCELLED
        assert [j.id for j in client.list_jobs(page_size=1)] == [other.id, job.id]
        assert [j.id for j in client.list_jobs("succeeded")] == [job.id]

        # Serving: features agree with the exported model evaluated locally in numpy.
        model = client.fetch_model(job.id)
        assert model.weights.shape == (16, 8) and model.config["n_visible"] == 16
        probs = client.sample_hidden(job.id, x)
        assert probs.shape == (300, 8)
        np.testing.assert_allclose(probs, model.hidden_probs(x), atol=1e-5)
        samples = client.sample_hidden(job.id, x[:50], mode="sample", seed=7)
        assert set(np.unique(samples)) <= {0.0, 1.0}
        assert client.sample_hidden(job.id, x[0]).shape == (8,)
        recon = client.reconstruct(job.id, x[:50], mean_field=True)
        assert recon.shape == (50, 16) and recon.min() >= 0.0 and recon.max() <= 1.0
        with Client(service.target, max_batch_bytes=16 * 4 * 7) as small:  # 7 rows a request
            np.testing.assert_allclose(small.sample_hidden(job.id, x), probs, atol=1e-6)

        directory = client.export_model(job.id, tmp_path / "model")
        exported = ExportedModel.load(directory)
        assert json.loads((directory / "config.json").read_text())["n_hidden"] == 8
        reference = safetensors_load_file(directory / "model.safetensors")
        assert set(reference) == set(exported.tensors)
        for name, array in reference.items():
            np.testing.assert_array_equal(exported.tensors[name], array)

        with pytest.raises(NotFound):
            client.get_job("no-such-job")
        with pytest.raises(InvalidArgument, match="lr"):
            client.start_training(n_hidden=4, lr=-1.0)
        with pytest.raises(InvalidArgument):
            client.sample_hidden(job.id, np.ones((2, 5)))  # the model has 16 visible units

    # The asyncio client on the same job gives the same answers.
    asyncio.run(_async_checks(service, job.id, x, events, probs))


async def _async_checks(service, job_id: str, x, events, probs) -> None:
    proxy = DroppingProxy(service.port, budget=700, cuts=2)
    try:
        async with AsyncClient(f"127.0.0.1:{proxy.port}") as through_proxy:
            assert [event async for event in through_proxy.stream_metrics(job_id)] == events
    finally:
        proxy.close()
    assert proxy.connections >= 3  # the asyncio stream resumed after both cuts too
    async with AsyncClient(service.target) as client:
        assert (await client.get_job(job_id)).state is JobState.SUCCEEDED
        assert [event async for event in client.stream_metrics(job_id)] == events
        assert [j.id async for j in client.list_jobs("succeeded")] == [job_id]
        np.testing.assert_allclose(await client.sample_hidden(job_id, x), probs, atol=1e-6)
        assert (await client.reconstruct(job_id, x[:3], k=2)).shape == (3, 16)
        model = await client.fetch_model(job_id)
        np.testing.assert_allclose(model.hidden_probs(x), probs, atol=1e-5)
        assert (
            await client.upload_dataset(x)
            == (await client.get_job(job_id)).spec["dataset"]["dataset_id"]
        )
        with pytest.raises(NotFound):
            await client.cancel("missing-job")


@pytest.mark.parametrize(
    ("array", "says"),
    [
        (np.zeros(3, np.float32), "n_examples"),
        (np.zeros((4, 4), np.complex64), "expected numbers"),
        (np.array([["a", "b"]]), "expected numbers"),
    ],
)
def test_an_array_the_service_cannot_take_is_refused_before_the_upload(
    service_factory, array: np.ndarray, says: str
) -> None:
    """Not gRPC's "Exception iterating requests!" (UNKNOWN) from inside the request stream:
    InvalidArgument saying what is wrong, from both clients, and nothing reaches the service."""
    idle_service = service_factory(run_worker=False)
    with Client(idle_service.target) as client:
        with pytest.raises(InvalidArgument, match=says):
            client.upload_dataset(array)
        assert list(client.list_datasets()) == []

    async def upload_async() -> None:
        async with AsyncClient(idle_service.target) as client:
            await client.upload_dataset(array)

    with pytest.raises(InvalidArgument, match=says):
        asyncio.run(upload_async())


def test_calls_wait_out_a_service_that_is_still_starting(service_factory) -> None:
    port = free_port()
    # No worker: the job only has to be recorded, exactly once.
    starter = threading.Timer(
        0.5, lambda: service_factory(listen_address=f"127.0.0.1:{port}", run_worker=False)
    )
    starter.start()
    patient = RetryPolicy(attempts=30, initial_backoff_s=0.1, max_backoff_s=0.5)
    try:
        with Client(f"127.0.0.1:{port}", retry=patient) as client:
            job = client.start_training(**small_job())  # retried: its request_id makes it safe
            assert [j.id for j in client.list_jobs()] == [job.id]  # created exactly once
    finally:
        starter.join()


class _RetryWatch(logging.Handler):
    """Sets ``retrying`` when the SDK logs that it will send a call again."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.retrying = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("retrying"):
            self.retrying.set()


def test_the_default_retry_window_outlasts_a_restart(service_factory, monkeypatch) -> None:
    """The service stops and comes back on the same port while a call is being retried: the
    call succeeds, once. SSDRBM_RETRY_S sets the default window (the default is 30 s)."""
    assert RetryPolicy().max_wait_s >= 30  # longer than a measured API restart (16-21 s)
    monkeypatch.setenv("SSDRBM_RETRY_S", "60")
    assert RetryPolicy().max_wait_s == 60
    port = free_port()
    first = service_factory(listen_address=f"127.0.0.1:{port}", run_worker=False)
    watch = _RetryWatch()
    retry_logger = logging.getLogger("ssdrbm.retry")
    retry_logger.addHandler(watch)
    previous_level = retry_logger.level
    retry_logger.setLevel(logging.DEBUG)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            assert list(client.list_jobs()) == []
            first.stop()
            result: dict = {}
            call = threading.Thread(
                target=lambda: result.update(job=client.start_training(**small_job()))
            )
            call.start()
            assert watch.retrying.wait(30), "the call was not retried"
            service_factory(listen_address=f"127.0.0.1:{port}", run_worker=False)
            call.join(90)
            assert "job" in result, "the call did not succeed after the restart"
            assert [j.id for j in client.list_jobs()] == [result["job"].id]  # created once
    finally:
        retry_logger.removeHandler(watch)
        retry_logger.setLevel(previous_level)


def test_a_bad_retry_window_names_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("SSDRBM_RETRY_S", "soon")
    with pytest.raises(ValueError, match="SSDRBM_RETRY_S"):
        RetryPolicy()
    monkeypatch.setenv("SSDRBM_RETRY_S", "0")
    assert list(RetryPolicy().delays()) == []  # 0: a single attempt


def test_the_sdk_guides_example_runs_as_written(service, monkeypatch, tmp_path: Path) -> None:
    text = SDK_DOC.read_text()
    section = text.split("## Python SDK", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    monkeypatch.setenv("SSDRBM_TARGET", service.target)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(SDK_DOC), "exec"), {"__name__": "__sdk_doc__"})
