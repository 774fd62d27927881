"""ONNX export: the core graph builder against the torch model, and ExportModel(format=ONNX)
through the service, the SDK and the CLI, run in onnxruntime against SampleHidden and
Reconstruct(mean_field=True, k=1); the Triton model folder; `model(v)` for torch tooling."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from ssdrbm import Client, InvalidArgument
from ssdrbm import export as client_export
from ssdrbm.cli import main
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore import BernoulliRBM, GaussianRBM, onnx_export
from ssdcore.models.base import RBM
from ssdcore.models.gaussian import VARIANCE_KINDS
from tests.fixtures.jobs import rpc_error
from tests.fixtures.redis import RedisServer
from tests.fixtures.service import RunningService, make_settings

# float32 products summed in another order (onnxruntime's GEMM, C⁻¹W folded into one matrix)
# differ from torch's by a few ulps of the activations; 1e-5 bounds that with a wide margin.
TOLERANCE = 1e-5
N_VISIBLE = 16
N_HIDDEN = 8
JOB_TIMEOUT_S = 120


def run_onnx(data: bytes, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hidden_probs, reconstruction) of the graph in ``data`` for inputs ``v``, on the CPU."""
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    hidden, reconstruction = session.run(
        [onnx_export.HIDDEN_OUTPUT, onnx_export.RECONSTRUCTION_OUTPUT],
        {onnx_export.INPUT_NAME: v.astype(np.float32)},
    )
    return hidden, reconstruction


# --- the core builder against the torch model -------------------------------------------------


def random_model(kind: str, variance: str | None = None, seed: int = 0) -> RBM:
    """A model with every parameter moved well away from its initial value."""
    torch.manual_seed(seed)
    if kind == "bernoulli":
        model: RBM = BernoulliRBM(N_VISIBLE, N_HIDDEN, init_std=1.0)
    else:
        model = GaussianRBM(N_VISIBLE, N_HIDDEN, variance, init_std=0.5)
    with torch.no_grad():
        model.a.normal_()
        model.b.normal_()
        for name, parameter in model.named_parameters():
            if name in ("log_var", "log_c"):
                parameter.uniform_(-1.5, 1.5)  # variances from 0.2 to 4.5
            elif name == "precision":
                factor = 0.3 * torch.randn(N_VISIBLE, N_VISIBLE)
                parameter.copy_(factor @ factor.T + 0.5 * torch.eye(N_VISIBLE))
    model.constrain_()
    return model


def inputs_for(model: RBM, rows: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if model.kind == "bernoulli":
        return (torch.rand(rows, N_VISIBLE, generator=generator) < 0.4).float()
    return 2.0 * torch.randn(rows, N_VISIBLE, generator=generator)


MODELS = [("bernoulli", None)] + [("gaussian", variance) for variance in VARIANCE_KINDS]
MODEL_IDS = ["bernoulli"] + [f"gaussian-{variance}" for variance in VARIANCE_KINDS]


@pytest.mark.parametrize(("kind", "variance"), MODELS, ids=MODEL_IDS)
def test_graph_matches_the_torch_model(kind: str, variance: str | None) -> None:
    model = random_model(kind, variance)
    data = onnx_export.model_to_onnx_bytes(model)
    for rows in (1, 37):  # the batch dimension is dynamic
        v = inputs_for(model, rows)
        hidden, reconstruction = run_onnx(data, v.numpy())
        with torch.no_grad():
            expected_hidden = model.hidden_probs(v).numpy()
            expected_reconstruction = model.reconstruct(v, k=1, mean_field=True).numpy()
        assert hidden.shape == (rows, N_HIDDEN) and reconstruction.shape == (rows, N_VISIBLE)
        np.testing.assert_allclose(hidden, expected_hidden, rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(reconstruction, expected_reconstruction, rtol=0, atol=TOLERANCE)
    # The reconstruction is not the identity or the input: a Gaussian one is unbounded, a
    # Bernoulli one lies in (0, 1).
    if kind == "bernoulli":
        assert reconstruction.min() > 0.0 and reconstruction.max() < 1.0


def test_graph_declares_names_shapes_opset_and_config() -> None:
    model = random_model("gaussian", "diagonal")
    graph_model = onnx_export.build_onnx_model(model, metadata={"ssdrbm.step": "7"})
    assert graph_model.ir_version == onnx_export.IR_VERSION == 8
    assert [(o.domain, o.version) for o in graph_model.opset_import] == [("", 17)]

    def shape(value: onnx.ValueInfoProto) -> list[str | int]:
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    graph = graph_model.graph
    assert [(i.name, shape(i)) for i in graph.input] == [("input", ["batch", N_VISIBLE])]
    assert [(o.name, shape(o)) for o in graph.output] == [
        ("hidden_probs", ["batch", N_HIDDEN]),
        ("reconstruction", ["batch", N_VISIBLE]),
    ]
    assert all(
        i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        for i in [*graph.input, *graph.output]
    )
    props = {p.key: p.value for p in graph_model.metadata_props}
    assert json.loads(props["ssdrbm.config"]) == model.config()
    assert props["ssdrbm.step"] == "7"
    onnx.checker.check_model(graph_model, full_check=True)  # shapes infer end to end


@pytest.mark.parametrize(
    ("kind", "variance", "matrices"),
    [("bernoulli", None, 1), ("gaussian", "identity", 1), ("gaussian", "diagonal", 2)],
)
def test_w_is_stored_once_where_the_graph_goes_up_and_down_through_it(
    kind: str, variance: str | None, matrices: int
) -> None:
    graph = onnx_export.build_onnx_model(random_model(kind, variance)).graph
    shapes = [list(tensor.dims) for tensor in graph.initializer]
    assert shapes.count([N_VISIBLE, N_HIDDEN]) == matrices
    assert len(shapes) == 2 + matrices  # and the two biases


def test_the_sdk_names_the_graph_as_the_core_builds_it() -> None:
    assert client_export.ONNX_INPUT == onnx_export.INPUT_NAME
    assert client_export.ONNX_HIDDEN_OUTPUT == onnx_export.HIDDEN_OUTPUT
    assert client_export.ONNX_RECONSTRUCTION_OUTPUT == onnx_export.RECONSTRUCTION_OUTPUT


# --- model(v) for torch tooling -----------------------------------------------------------------


@pytest.mark.parametrize(("kind", "variance"), [("bernoulli", None), ("gaussian", "full")])
def test_forward_is_hidden_probs_exported_and_compiled(kind: str, variance: str | None) -> None:
    """`model(v)`, `torch.export` (dynamic batch) and a full-graph `torch.compile` give
    hidden_probs.

    The compile uses the "aot_eager" backend: it checks that dynamo captures the whole forward
    without a graph break, in about two seconds; the default inductor backend generates and
    builds C++ (about 18 s on a 2-core machine), too slow for this suite. (`torch.jit.trace`
    works too but is deprecated in this torch.)
    """
    model = random_model(kind, variance)
    v, other = inputs_for(model, 5), inputs_for(model, 9, seed=2)
    with torch.no_grad():
        expected, expected_other = model.hidden_probs(v), model.hidden_probs(other)
        torch.testing.assert_close(model(v), expected, rtol=0, atol=0)
        batch = torch.export.Dim("batch")
        exported = torch.export.export(model, (v,), dynamic_shapes=({0: batch},)).module()
        torch.testing.assert_close(exported(other), expected_other, rtol=0, atol=1e-6)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
        torch.testing.assert_close(compiled(v), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(compiled(other), expected_other, rtol=0, atol=1e-6)


# --- through the service ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedJobs:
    service: RunningService
    jobs: dict[str, str]  # kind → job id
    inputs: dict[str, np.ndarray]  # kind → (N, 16) inputs of that kind's data


def bernoulli_data(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    prototypes = (rng.random((2, N_VISIBLE)) < 0.5).astype(np.float32)
    flips = rng.random((200, N_VISIBLE)) < 0.1
    return np.abs(prototypes[rng.integers(0, 2, 200)] - flips).astype(np.float32)


def gaussian_data(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 2.0, (2, N_VISIBLE))
    scales = rng.uniform(0.3, 1.5, N_VISIBLE)  # unequal variances, learned per unit
    noise = rng.normal(0.0, 1.0, (200, N_VISIBLE)) * scales
    return (centres[rng.integers(0, 2, 200)] + noise).astype(np.float32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedJobs]:
    """A Bernoulli and a diagonal-variance Gaussian job, trained by the service's worker."""
    redis = RedisServer(tmp_path_factory.mktemp("onnx-redis"))
    redis.start()
    running = RunningService(make_settings(redis.url))
    try:
        inputs = {"bernoulli": bernoulli_data(), "gaussian": gaussian_data()}
        jobs = {}
        with Client(running.target) as client:
            for kind, x in inputs.items():
                job = client.start_training(
                    dataset_id=client.upload_dataset(x),
                    model=kind,
                    preprocess="none",  # the served model sees the inputs as given
                    n_hidden=N_HIDDEN,
                    steps=40,
                    batch_size=40,
                    eval_every=20,
                    seed=3,
                )
                jobs[kind] = job.id
            for job_id in jobs.values():
                final = client.wait(job_id, timeout=JOB_TIMEOUT_S)
                assert final.state.value == "succeeded", final.error
        yield TrainedJobs(running, jobs, inputs)
    finally:
        running.stop()
        redis.stop()


def served(client: Client, job_id: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SampleHidden probabilities and Reconstruct(mean_field=True, k=1) from the service."""
    return (
        client.sample_hidden(job_id, x, mode="probs"),
        client.reconstruct(job_id, x, k=1, mean_field=True),
    )


@pytest.mark.parametrize("kind", ["bernoulli", "gaussian"])
def test_sdk_onnx_export_runs_as_the_service_serves(
    trained: TrainedJobs, kind: str, tmp_path: Path
) -> None:
    job_id, x = trained.jobs[kind], trained.inputs[kind]
    with Client(trained.service.target) as client:
        path = client.export_model(job_id, tmp_path / "out" / "model.onnx", format="onnx")
        expected_hidden, expected_reconstruction = served(client, job_id, x)
        config = client.fetch_model(job_id).config
    assert path == tmp_path / "out" / "model.onnx"
    data = path.read_bytes()
    graph_model = onnx.load_from_string(data)
    props = {p.key: p.value for p in graph_model.metadata_props}
    assert json.loads(props["ssdrbm.config"]) == config and config["type"] == kind
    assert props["ssdrbm.job_id"] == job_id
    hidden, reconstruction = run_onnx(data, x)
    np.testing.assert_allclose(hidden, expected_hidden, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(reconstruction, expected_reconstruction, rtol=0, atol=TOLERANCE)
    # A trained model, not the initial one (weights of std 0.01 move a feature by < 0.01).
    assert np.ptp(hidden, axis=0).max() > 0.03


def test_export_header_names_the_format_and_hashes_the_streamed_bytes(
    trained: TrainedJobs,
) -> None:
    stub = trained.service.stub()
    job_id = trained.jobs["gaussian"]
    received = {}
    for export_format in (pb.EXPORT_FORMAT_UNSPECIFIED, pb.EXPORT_FORMAT_ONNX):
        request = pb.ExportModelRequest(job_id=job_id, format=export_format)
        parts = list(stub.ExportModel(request, timeout=30))
        header, chunks = parts[0].header, [part.chunk for part in parts[1:]]
        data = b"".join(chunks)
        assert len(data) == header.size_bytes
        assert header.sha256 == hashlib.sha256(data).hexdigest()
        received[header.format] = (header, data)
    assert set(received) == {pb.EXPORT_FORMAT_SAFETENSORS, pb.EXPORT_FORMAT_ONNX}
    safetensors_header, _ = received[pb.EXPORT_FORMAT_SAFETENSORS]
    onnx_header, onnx_bytes = received[pb.EXPORT_FORMAT_ONNX]
    assert onnx_header.step == safetensors_header.step
    assert onnx_header.config_json == safetensors_header.config_json
    onnx.checker.check_model(onnx.load_from_string(onnx_bytes))


def test_unknown_format_is_invalid_argument_naming_the_field(trained: TrainedJobs) -> None:
    stub = trained.service.stub()
    request = pb.ExportModelRequest(job_id=trained.jobs["bernoulli"], format=9)
    error = rpc_error(lambda: stub.ExportModel(request, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "format" in error.details() and "EXPORT_FORMAT_ONNX" in error.details()
    # The service carries on.
    ok = pb.ExportModelRequest(job_id=trained.jobs["bernoulli"], format=pb.EXPORT_FORMAT_ONNX)
    assert next(iter(stub.ExportModel(ok, timeout=30))).header.format == pb.EXPORT_FORMAT_ONNX
    with Client(trained.service.target) as client, pytest.raises(InvalidArgument, match=r"^format"):
        client.export_model(trained.jobs["bernoulli"], "unused", format="pickle")


def parse_pbtxt(text: str) -> dict:
    """The fields of a Triton config.pbtxt as written here: top-level scalars and the
    input/output lists of {name, data_type, dims}."""
    config: dict = {}
    for key, value in re.findall(r"^(\w+): (.+)$", text, flags=re.MULTILINE):
        config[key] = json.loads(value) if value.startswith('"') else value
    for section in ("input", "output"):
        body = re.search(rf"^{section} \[\n(.*?)^\]", text, flags=re.MULTILINE | re.DOTALL)
        assert body, f"no {section} section"
        config[section] = [
            {"name": name, "data_type": dtype, "dims": [int(d) for d in dims.split(",")]}
            for name, dtype, dims in re.findall(
                r'name: "([^"]+)"\s+data_type: (\w+)\s+dims: \[([^\]]+)\]', body.group(1)
            )
        ]
    return config


def test_cli_writes_an_onnx_file_and_a_triton_model_folder(
    trained: TrainedJobs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job_id, x = trained.jobs["gaussian"], trained.inputs["gaussian"]
    target = ["--target", trained.service.target]
    onnx_path = tmp_path / "model.onnx"
    code = main(["export", job_id, "--format", "onnx", "-o", str(onnx_path), *target])
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    assert out.split() == [str(onnx_path)]

    repository = tmp_path / "models"
    command = ["export", job_id, "--format", "triton", "-o", str(repository), "--json", *target]
    code = main([*command, "--model-name", "rbm_features"])
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    summary = json.loads(out)
    model_dir = repository / "rbm_features"
    assert summary["format"] == "triton" and summary["directory"] == str(model_dir)
    assert sorted(Path(p).relative_to(repository).as_posix() for p in summary["files"]) == [
        "rbm_features/1/model.onnx",
        "rbm_features/config.pbtxt",
    ]
    graph_bytes = (model_dir / "1" / "model.onnx").read_bytes()
    assert graph_bytes == onnx_path.read_bytes()  # the same graph, deterministically built

    config = parse_pbtxt((model_dir / "config.pbtxt").read_text())
    assert config["name"] == "rbm_features"
    assert config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == "0"  # dims below are full shapes, batch -1
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [-1, 16]}]
    assert config["output"] == [
        {"name": "hidden_probs", "data_type": "TYPE_FP32", "dims": [-1, N_HIDDEN]},
        {"name": "reconstruction", "data_type": "TYPE_FP32", "dims": [-1, N_VISIBLE]},
    ]
    # The config agrees with the graph it sits beside.
    graph = onnx.load_from_string(graph_bytes).graph
    declared_tensors = config["input"] + config["output"]
    for declared, value in zip(declared_tensors, [*graph.input, *graph.output], strict=True):
        dims = [d.dim_value or -1 for d in value.type.tensor_type.shape.dim]
        assert (declared["name"], declared["dims"]) == (value.name, dims)

    with Client(trained.service.target) as client:
        expected_hidden, expected_reconstruction = served(client, job_id, x)
    hidden, reconstruction = run_onnx(graph_bytes, x)
    np.testing.assert_allclose(hidden, expected_hidden, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(reconstruction, expected_reconstruction, rtol=0, atol=TOLERANCE)

    # Without --model-name the folder is named after the job; a path-like name is refused.
    assert main(["export", job_id, "--format", "triton", "-o", str(repository), *target]) == 0
    assert (repository / job_id / "config.pbtxt").read_text().startswith(f'name: "{job_id}"')
    capsys.readouterr()
    code = main([*command, "--model-name", "../escape"])
    assert code == ExitCode.USAGE
    assert "model_name" in capsys.readouterr().err
    assert not (tmp_path / "escape").exists()


WRITE_WITHOUT_TORCH_OR_ONNX = """
import importlib.abc, json, sys, tempfile
from pathlib import Path

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "onnx", "onnxruntime", "ssdcore", "ssdrbm_server"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Absent())
from ssdrbm.export import ModelDownload
from ssdrbm.v1 import rbm_pb2
config = json.dumps({"type": "bernoulli", "n_visible": 3, "n_hidden": 2})
download = ModelDownload(config, 5, b"graph", rbm_pb2.EXPORT_FORMAT_ONNX)
folder = download.save(tempfile.mkdtemp(), "triton", model_name="m")
assert (folder / "1" / "model.onnx").read_bytes() == b"graph"
assert "dims: [ -1, 3 ]" in (folder / "config.pbtxt").read_text()
print("ok")
"""


def test_the_client_writes_onnx_and_triton_without_torch_or_onnx() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WRITE_WITHOUT_TORCH_OR_ONNX],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
