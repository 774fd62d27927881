"""The Open Inference Protocol (KServe v2) on the ssdrbm server, spoken by an unmodified
``tritonclient.grpc.InferenceServerClient``: health, model readiness before and after the first
checkpoint, metadata with versions, ModelInfer with FP32 / UINT8 / BOOL and typed contents, output
selection, numbers equal to the SDK's SampleHidden and Reconstruct (mean field), the job-name
alias, bad input, and tenancy and authentication as on ssdrbm.v1."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton
from ssdrbm import Client
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from ssdcore import BernoulliRBM
from ssdcore.checkpoint import model_to_bytes
from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.exposure import check_exposure
from ssdrbm_server.store import FencedJob, JobState, LeaseStore, connect
from tests.fixtures.jobs import N_HIDDEN, N_VISIBLE, tiny_request
from tests.fixtures.service import RunningService

ALPHA, BETA = "alpha-secret-1", "beta-secret-2"
STEPS = (10, 20)  # checkpoints the stand-in worker writes; the versions served
TOLERANCE = 1e-6
ROWS = 5
OUTPUT_BUDGET = 8 * N_VISIBLE  # elements per computed output: 8 rows of reconstruction


def free_port() -> int:
    """A TCP port free right now on loopback (the REST endpoint takes a fixed port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


class StandInWorker:
    """Claims a queued job and writes real model checkpoints at chosen steps, through the same
    fenced store code a worker uses (no training process: the suite stays quick)."""

    def __init__(self, running: RunningService, job_id: str) -> None:
        self.running = running
        self.job_id = job_id
        self.fenced: FencedJob | None = None
        self.redis = connect(running.settings.redis_url)

    def _run(self, coroutine: Any) -> Any:
        return self.running.run_in_loop(coroutine)

    def claim(self) -> None:
        async def claim() -> FencedJob:
            lease = await LeaseStore(self.redis).claim(self.job_id, "stand-in", lease_ms=60_000)
            assert lease is not None
            fenced = FencedJob(self.redis, lease)
            await fenced.update(n_visible=N_VISIBLE)
            return fenced

        self.fenced = self._run(claim())

    def checkpoint(self, step: int) -> None:
        torch.manual_seed(step)  # a different model per step, so versions are told apart
        model = BernoulliRBM(N_VISIBLE, N_HIDDEN)
        with torch.no_grad():
            model.W.mul_(8.0)  # features far from 0.5, so a wrong model shows
        assert self.fenced is not None
        self._run(
            self.fenced.put_checkpoint(
                step,
                data=model_to_bytes(model),
                config_json=json.dumps(model.config(), sort_keys=True),
                trainer_state=b"",
            )
        )

    def finish(self) -> None:
        assert self.fenced is not None
        self._run(self.fenced.finish(JobState.SUCCEEDED, step=STEPS[-1], message="finished"))
        self.close()

    def close(self) -> None:
        self._run(self.redis.aclose())


@pytest.fixture
def secured(service_factory: Callable[..., RunningService]) -> RunningService:
    return service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens=f"{ALPHA}=alpha,{BETA}=beta",
        max_serving_output_elements=OUTPUT_BUDGET,
        http_port=free_port(),
    )


@pytest.fixture
def triton_client(secured: RunningService) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(url=secured.target)
    yield client
    client.close()


def trained_job(secured: RunningService, name: str = "features") -> str:
    """A RUNNING job of tenant alpha with checkpoints at STEPS (all retained while it runs)."""
    job_id = secured.stub(token=ALPHA).StartTraining(tiny_request(name=name)).job.id
    worker = StandInWorker(secured, job_id)
    worker.claim()
    for step in STEPS:
        worker.checkpoint(step)
    worker.close()
    return job_id


def visible(rows: int = ROWS, seed: int = 3) -> np.ndarray:
    return (np.random.default_rng(seed).random((rows, N_VISIBLE)) < 0.4).astype(np.float32)


def infer(
    client: triton.InferenceServerClient,
    model: str,
    x: np.ndarray,
    datatype: str = "FP32",
    *,
    outputs: tuple[str, ...] = (),
    version: str = "",
    token: str = ALPHA,
    **kwargs: Any,
) -> triton.InferResult:
    tensor = triton.InferInput("input", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    requested = [triton.InferRequestedOutput(name) for name in outputs] or None
    return client.infer(
        model, [tensor], model_version=version, outputs=requested, headers=bearer(token), **kwargs
    )


def status_of(call: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), caught.value.message()


def test_health_and_server_metadata(triton_client: triton.InferenceServerClient) -> None:
    assert triton_client.is_server_live(headers=bearer(ALPHA))
    assert triton_client.is_server_ready(headers=bearer(ALPHA))
    metadata = triton_client.get_server_metadata(headers=bearer(ALPHA), as_json=True)
    assert metadata["name"] == "ssdrbm" and metadata["version"]


def test_model_ready_once_a_checkpoint_exists_and_metadata_lists_versions(
    secured: RunningService, triton_client: triton.InferenceServerClient
) -> None:
    job_id = secured.stub(token=ALPHA).StartTraining(tiny_request(name="growing")).job.id
    assert not triton_client.is_model_ready(job_id, headers=bearer(ALPHA))
    status, message = status_of(lambda: infer(triton_client, job_id, visible()))
    assert status == "StatusCode.FAILED_PRECONDITION" and "no checkpoint" in message
    worker = StandInWorker(secured, job_id)
    worker.claim()
    worker.checkpoint(STEPS[0])
    # Served while it trains: RUNNING with one checkpoint.
    assert triton_client.is_model_ready(job_id, headers=bearer(ALPHA))
    assert triton_client.is_model_ready(job_id, str(STEPS[0]), headers=bearer(ALPHA))
    assert not triton_client.is_model_ready(job_id, str(STEPS[1]), headers=bearer(ALPHA))
    worker.checkpoint(STEPS[1])
    metadata = triton_client.get_model_metadata(job_id, headers=bearer(ALPHA), as_json=True)
    assert metadata["name"] == job_id
    assert metadata["versions"] == [str(step) for step in STEPS]
    assert metadata["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": ["-1", str(N_VISIBLE)]}
    ]
    shapes = {out["name"]: out["shape"] for out in metadata["outputs"]}
    assert shapes == {
        "hidden_probs": ["-1", str(N_HIDDEN)],
        "hidden_sample": ["-1", str(N_HIDDEN)],
        "reconstruction": ["-1", str(N_VISIBLE)],
    }
    worker.finish()  # a finished job keeps its last checkpoint only (retention)
    after = triton_client.get_model_metadata(job_id, headers=bearer(ALPHA), as_json=True)
    assert after["versions"] == [str(STEPS[-1])]


def sdk(secured: RunningService) -> Client:
    return Client(secured.target, token=ALPHA)


def test_infer_equals_sample_hidden_and_reconstruct(
    secured: RunningService, triton_client: triton.InferenceServerClient
) -> None:
    job_id = trained_job(secured)
    x = visible()
    every = ("hidden_probs", "hidden_sample", "reconstruction")
    result = infer(triton_client, job_id, x, outputs=every, parameters={"seed": 7})
    response = result.get_response()
    assert response.model_name == job_id and response.model_version == str(STEPS[-1])
    client = sdk(secured)
    expected = {
        "hidden_probs": client.sample_hidden(job_id, x),
        "hidden_sample": client.sample_hidden(job_id, x, mode="sample", seed=7),
        "reconstruction": client.reconstruct(job_id, x, k=1, mean_field=True),
    }
    for name, want in expected.items():
        got = result.as_numpy(name)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=name)
    assert set(np.unique(result.as_numpy("hidden_sample"))) <= {0.0, 1.0}
    # A named version is that checkpoint, and differs from the latest.
    older = infer(triton_client, job_id, x, version=str(STEPS[0])).as_numpy("hidden_probs")
    want = client.sample_hidden(job_id, x, checkpoint_step=STEPS[0])
    np.testing.assert_allclose(older, want, rtol=0, atol=TOLERANCE)
    assert np.abs(older - expected["hidden_probs"]).max() > 0.01


def test_uint8_bool_and_typed_contents_mean_the_same_values(
    secured: RunningService, triton_client: triton.InferenceServerClient
) -> None:
    job_id = trained_job(secured)
    binary = visible()
    want = sdk(secured).sample_hidden(job_id, binary)
    as_uint8 = infer(triton_client, job_id, binary.astype(np.uint8), "UINT8")
    as_bool = infer(triton_client, job_id, binary.astype(bool), "BOOL")
    for result in (as_uint8, as_bool):
        np.testing.assert_allclose(result.as_numpy("hidden_probs"), want, rtol=0, atol=TOLERANCE)
    # UINT8 values are not rescaled: 200 is 200.0, as the SDK sends a uint8 array.
    pixels = np.random.default_rng(5).integers(0, 256, (ROWS, N_VISIBLE), dtype=np.uint8)
    got = infer(triton_client, job_id, pixels, "UINT8").as_numpy("hidden_probs")
    np.testing.assert_allclose(got, sdk(secured).sample_hidden(job_id, pixels), atol=TOLERANCE)
    # Typed contents, in a request built with the protocol's own messages.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(secured.channel(token=ALPHA))
    for datatype, field, values in (
        ("FP32", "fp32_contents", binary.ravel().tolist()),
        ("UINT8", "uint_contents", binary.astype(np.uint8).ravel().tolist()),
        ("BOOL", "bool_contents", binary.astype(bool).ravel().tolist()),
    ):
        request = service_pb2.ModelInferRequest(model_name=job_id)
        tensor = request.inputs.add(name="input", datatype=datatype, shape=[ROWS, N_VISIBLE])
        getattr(tensor.contents, field).extend(values)
        response = stub.ModelInfer(request, timeout=30)
        [output] = response.outputs
        assert (output.name, output.datatype, list(output.shape)) == (
            "hidden_probs",
            "FP32",
            [ROWS, N_HIDDEN],
        )
        got = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(ROWS, N_HIDDEN)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=datatype)


def test_default_output_and_the_job_name_alias(
    secured: RunningService, triton_client: triton.InferenceServerClient
) -> None:
    job_id = trained_job(secured, name="digits-features")
    x = visible()
    by_id = infer(triton_client, job_id, x)
    assert [out.name for out in by_id.get_response().outputs] == ["hidden_probs"]
    by_name = infer(triton_client, "digits-features", x)
    assert by_name.get_response().model_name == job_id
    np.testing.assert_array_equal(by_name.as_numpy("hidden_probs"), by_id.as_numpy("hidden_probs"))
    assert triton_client.is_model_ready("digits-features", headers=bearer(ALPHA))
    # A name two jobs share is refused, naming the way out.
    trained_job(secured, name="twin")
    trained_job(secured, name="twin")
    status, message = status_of(lambda: infer(triton_client, "twin", x))
    assert status == "StatusCode.INVALID_ARGUMENT" and "job id" in message


def raw_request(
    job_id: str, x: np.ndarray, datatype: str = "FP32", **fields: Any
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=job_id, **fields)
    request.inputs.add(name="input", datatype=datatype, shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def test_bad_requests_get_the_status_and_name_the_field(
    secured: RunningService, triton_client: triton.InferenceServerClient
) -> None:
    job_id = trained_job(secured)
    x = visible()
    stub = service_pb2_grpc.GRPCInferenceServiceStub(secured.channel(token=ALPHA))

    def code_of(request: service_pb2.ModelInferRequest) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request, timeout=30)
        return caught.value.code(), caught.value.details()

    invalid = grpc.StatusCode.INVALID_ARGUMENT
    wrong_name = raw_request(job_id, x)
    wrong_name.inputs[0].name = "pixels"
    short = raw_request(job_id, x)
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    unknown_output = raw_request(job_id, x)
    unknown_output.outputs.add(name="energy")
    unknown_parameter = raw_request(job_id, x)
    unknown_parameter.parameters["temperature"].double_param = 2.0
    both = raw_request(job_id, x)
    both.inputs[0].contents.fp32_contents.extend(x.ravel().tolist())
    cases = {
        "FP64 datatype": (raw_request(job_id, x.astype(np.float64), "FP64"), invalid, "datatype"),
        "3-D shape": (raw_request(job_id, x.reshape(ROWS, 4, 4)), invalid, "shape"),
        "V mismatch": (raw_request(job_id, x[:, :10].copy()), invalid, f"n_visible={N_VISIBLE}"),
        "input name": (wrong_name, invalid, "inputs[0].name"),
        "byte count": (short, invalid, "raw_input_contents[0]"),
        "NaN": (raw_request(job_id, np.full_like(x, np.nan)), invalid, "NaN"),
        "unknown output": (unknown_output, invalid, "hidden_probs, hidden_sample"),
        "unknown parameter": (unknown_parameter, invalid, "'seed'"),
        "raw and typed": (both, invalid, "either"),
        "bad version": (raw_request(job_id, x, model_version="latest"), invalid, "version"),
        "unknown version": (
            raw_request(job_id, x, model_version="99"),
            grpc.StatusCode.NOT_FOUND,
            "10, 20",
        ),
        "unknown model": (raw_request("0" * 32, x), grpc.StatusCode.NOT_FOUND, "not found"),
        "over the output budget": (
            raw_request(job_id, visible(rows=2 * OUTPUT_BUDGET // N_HIDDEN)),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "SSDRBM_MAX_SERVING_OUTPUT_ELEMENTS",
        ),
    }
    for case, (request, want_code, hint) in cases.items():
        code, message = code_of(request)
        assert code == want_code, (case, code, message)
        assert hint in message, (case, message)
    # The server keeps serving.
    assert infer(triton_client, job_id, x).as_numpy("hidden_probs").shape == (ROWS, N_HIDDEN)


def test_other_tenants_and_missing_tokens(
    secured: RunningService, triton_client: triton.InferenceServerClient
) -> None:
    job_id = trained_job(secured, name="private")
    x = visible()
    for model in (job_id, "private"):
        for call in (
            partial(triton_client.is_model_ready, model, headers=bearer(BETA)),
            partial(triton_client.get_model_metadata, model, headers=bearer(BETA)),
            partial(infer, triton_client, model, x, token=BETA),
        ):
            status, _ = status_of(call)
            assert status == "StatusCode.NOT_FOUND", model
    for headers in (None, bearer("not-a-token")):
        for call in (
            partial(triton_client.is_server_live, headers=headers),
            partial(triton_client.is_model_ready, job_id, headers=headers),
            partial(triton_client.infer, job_id, [], headers=headers),
        ):
            status, _ = status_of(call)
            assert status == "StatusCode.UNAUTHENTICATED"


def test_reflection_still_describes_the_service_beside_the_protocol_package(
    secured: RunningService,
) -> None:
    """tritonclient's ``inference`` package and ssdrbm's messages share this process's pool."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(secured.channel())
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="ssdrbm.v1.RBMService"),
    ]
    listed, described = stub.ServerReflectionInfo(iter(requests), timeout=10)
    names = {s.name for s in listed.list_services_response.service}
    assert "ssdrbm.v1.RBMService" in names
    assert described.file_descriptor_response.file_descriptor_proto
    assert service_pb2.DESCRIPTOR.package == "inference"  # the client's own, loaded unchanged


# --- the REST/JSON form -------------------------------------------------------------------------


def rest(
    running: RunningService, path: str, body: Any = None, token: str | None = ALPHA
) -> tuple[int, Any]:
    """(HTTP status, JSON answer) of a GET, or a POST when ``body`` is given."""
    url = f"http://127.0.0.1:{running.settings.http_port}{path}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=bearer(token) if token else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.load(error)


def json_request(x: np.ndarray, datatype: str = "FP32", **fields: Any) -> dict[str, Any]:
    data = x.tolist()  # nested rows; a flat list is accepted too
    tensor = {"name": "input", "datatype": datatype, "shape": list(x.shape), "data": data}
    return {"inputs": [tensor], **fields}


def test_rest_health_metadata_readiness_and_infer(secured: RunningService) -> None:
    assert rest(secured, "/v2/health/live") == (200, {"live": True})
    assert rest(secured, "/v2/health/ready") == (200, {"ready": True})
    assert rest(secured, "/v2")[1]["name"] == "ssdrbm"
    waiting = secured.stub(token=ALPHA).StartTraining(tiny_request(name="later")).job.id
    assert rest(secured, f"/v2/models/{waiting}/ready") == (
        503,
        {"name": waiting, "ready": False},
    )
    job_id = trained_job(secured, name="rest-features")
    assert rest(secured, f"/v2/models/{job_id}/ready")[0] == 200
    status, metadata = rest(secured, "/v2/models/rest-features")
    assert status == 200 and metadata["name"] == job_id
    assert metadata["versions"] == [str(step) for step in STEPS]
    x = visible()
    client = sdk(secured)
    body = json_request(
        x,
        id="req-1",
        outputs=[{"name": "reconstruction"}, {"name": "hidden_sample"}],
        parameters={"seed": 11},
    )
    status, answer = rest(secured, f"/v2/models/{job_id}/versions/{STEPS[0]}/infer", body)
    assert status == 200, answer
    assert (answer["model_name"], answer["model_version"], answer["id"]) == (
        job_id,
        str(STEPS[0]),
        "req-1",
    )
    outputs = {out["name"]: out for out in answer["outputs"]}
    expected = {
        "reconstruction": client.reconstruct(
            job_id, x, k=1, mean_field=True, checkpoint_step=STEPS[0]
        ),
        "hidden_sample": client.sample_hidden(
            job_id, x, mode="sample", seed=11, checkpoint_step=STEPS[0]
        ),
    }
    for name, want in expected.items():
        assert outputs[name]["datatype"] == "FP32" and outputs[name]["shape"] == list(want.shape)
        got = np.asarray(outputs[name]["data"], dtype=np.float32).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=name)
    as_bool = json_request(x.astype(bool), "BOOL")
    status, answer = rest(secured, "/v2/models/rest-features/infer", as_bool)
    got = np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(ROWS, N_HIDDEN)
    np.testing.assert_allclose(got, client.sample_hidden(job_id, x), rtol=0, atol=TOLERANCE)


def test_rest_errors_tenancy_and_authentication(secured: RunningService) -> None:
    job_id = trained_job(secured)
    x = visible()
    infer_path = f"/v2/models/{job_id}/infer"
    wrong_width = json_request(x[:, :10])
    cases = {
        "datatype": (json_request(x, "FP64"), 400, "inputs[0].datatype"),
        "data kind": (json_request(x.astype(bool), "FP32"), 400, "inputs[0].data"),
        "width": (wrong_width, 400, f"n_visible={N_VISIBLE}"),
        "output": (json_request(x, outputs=[{"name": "energy"}]), 400, "outputs[0].name"),
        "seed": (json_request(x, parameters={"seed": -1}), 400, "seed"),
        "budget": (json_request(visible(rows=4 * ROWS * 4)), 429, "OUTPUT_ELEMENTS"),
    }
    for case, (body, want_status, hint) in cases.items():
        status, answer = rest(secured, infer_path, body)
        assert status == want_status and hint in answer["error"], (case, status, answer)
    assert rest(secured, f"/v2/models/{job_id}/versions/99")[0] == 404
    assert rest(secured, f"/v2/models/{job_id}/versions/x/ready")[0] == 400
    assert rest(secured, "/v2/nothing-here")[0] == 404
    assert rest(secured, infer_path)[0] == 405  # a GET
    # Another tenant's model is not found; no token or a wrong one is refused.
    assert rest(secured, f"/v2/models/{job_id}", token=BETA)[0] == 404
    assert rest(secured, infer_path, json_request(x), token=BETA)[0] == 404
    for token in (None, "not-a-token"):
        status, answer = rest(secured, "/v2", token=token)
        assert status == 401 and "token" in answer["error"]
        # Health is open, as probes need (and as gRPC health is).
        assert rest(secured, "/v2/health/live", token=token) == (200, {"live": True})


def test_a_rest_endpoint_beyond_loopback_needs_auth_and_tls() -> None:
    remote = {"http_port": 8000, "http_address": "0.0.0.0"}
    with pytest.raises(ConfigError, match="SSDRBM_HTTP_ADDRESS"):
        check_exposure(Settings(auth_mode="none", **remote))
    with pytest.raises(ConfigError, match="plaintext"):
        check_exposure(Settings(auth_mode="token", auth_tokens=f"{ALPHA}=alpha", **remote))
    check_exposure(Settings(auth_mode="none", http_port=8000))  # loopback: fine
