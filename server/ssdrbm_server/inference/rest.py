"""The REST/JSON form of the Open Inference Protocol, served by the HTTP front (http_front.py).

The routes (``/v2``, ``/v2/models/{name}[/versions/{v}]`` and its ``/ready`` and ``/infer``) call
the same ``InferenceEngine`` as the gRPC form, each behind the front's ``RequestGate`` (the gRPC
API's bearer tokens, a request slot, a bounded body); the JSON is parsed, checked and turned into
the model's input off the event loop, as is the answer's JSON.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

import numpy as np
import ssdrbm
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ssdrbm_server.config import Settings
from ssdrbm_server.errors import InvalidArgumentError
from ssdrbm_server.http_front import READY_STATUS, RequestGate, parse_json_object
from ssdrbm_server.inference import codec
from ssdrbm_server.inference.engine import SERVER_NAME, InferenceEngine, InferResult
from ssdrbm_server.serving import Caller

MODEL_PATHS = ("/v2/models/{name}", "/v2/models/{name}/versions/{version}")
# The JSON data kinds (numpy's, of the parsed nested lists) each datatype accepts.
_JSON_KINDS = {"FP32": "iuf", "UINT8": "iu", "BOOL": "b"}


@dataclass(frozen=True)
class InferCall:
    v: np.ndarray
    outputs: list[str]
    seed: int
    echo: dict[str, Any]  # fields the answer repeats: the request's "id", when it has one


def inference_routes(settings: Settings, engine: InferenceEngine, gate: RequestGate) -> list[Route]:
    """The protocol's REST routes, each behind ``gate``."""
    rest = InferenceRest(settings, engine, gate)
    routes = [Route("/v2", gate.route(rest.server_metadata), methods=["GET"])]
    for model in MODEL_PATHS:
        routes += [
            Route(model, gate.route(rest.metadata), methods=["GET"]),
            Route(f"{model}/ready", gate.route(rest.ready), methods=["GET"]),
            Route(f"{model}/infer", gate.route(rest.infer), methods=["POST"]),
        ]
    return routes


class InferenceRest:
    """The route handlers: ``(request, tenant) -> response``."""

    def __init__(self, settings: Settings, engine: InferenceEngine, gate: RequestGate) -> None:
        self.max_elements = settings.max_tensor_elements
        self.engine = engine
        self.gate = gate

    async def server_metadata(self, request: Request, tenant: str) -> Response:
        return JSONResponse({"name": SERVER_NAME, "version": ssdrbm.__version__, "extensions": []})

    async def metadata(self, request: Request, tenant: str) -> Response:
        name, version = _model(request)
        return JSONResponse(asdict(await self.engine.metadata(tenant, name, version)))

    async def ready(self, request: Request, tenant: str) -> Response:
        name, version = _model(request)
        ready = await self.engine.model_ready(tenant, name, version)
        return JSONResponse({"name": name, "ready": ready}, status_code=READY_STATUS[ready])

    async def infer(self, request: Request, tenant: str) -> Response:
        name, version = _model(request)
        body = await self.gate.body(request)
        call = await asyncio.to_thread(read_infer_call, body, self.max_elements)
        result = await self.engine.infer(
            Caller(tenant=tenant), name, version, call.v, outputs=call.outputs, seed=call.seed
        )
        payload = await asyncio.to_thread(encode_answer, result, call)
        return Response(payload, status_code=HTTPStatus.OK, media_type="application/json")


def _model(request: Request) -> tuple[str, str]:
    params = request.path_params
    return params["name"], params.get("version", "")


def read_infer_call(body: bytes, max_elements: int) -> InferCall:
    """A JSON inference request, parsed and checked (runs off the event loop)."""
    request = parse_json_object(body)
    v = decode_json_input(request, max_elements=max_elements)
    outputs = request.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise InvalidArgumentError("outputs", 'must be a list of {"name": ...} objects')
    return InferCall(
        v=v,
        outputs=[str(output.get("name", "")) for output in outputs],
        seed=_json_seed(request.get("parameters") or {}),
        echo={"id": request["id"]} if "id" in request else {},
    )


def encode_answer(result: InferResult, call: InferCall) -> bytes:
    """ModelInfer's JSON answer (runs off the event loop: outputs may hold millions of numbers)."""
    document: dict[str, Any] = {
        "model_name": result.model_name,
        "model_version": result.model_version,
        "outputs": [
            {
                "name": output,
                "datatype": codec.OUTPUT_DATATYPE,
                "shape": list(array.shape),
                "data": array.ravel().tolist(),
            }
            for output, array in result.outputs
        ],
    }
    return json.dumps({**document, **call.echo}).encode()


def decode_json_input(request: dict[str, Any], *, max_elements: int) -> np.ndarray:
    """The model input of a JSON inference request (data flat or nested, row-major)."""
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InvalidArgumentError(
            "inputs",
            f'must hold exactly one tensor {{"name": "{codec.INPUT_NAME}", "datatype": ..., '
            '"shape": [batch, n_visible], "data": [...]}',
        )
    tensor = inputs[0]
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(type(dim) is int for dim in shape):
        raise InvalidArgumentError("inputs[0].shape", "must be a list of integers")
    datatype = str(tensor.get("datatype", ""))
    rows_cols = codec.check_input_header(
        str(tensor.get("name", "")), datatype, shape, field="inputs[0]", max_elements=max_elements
    )
    try:
        values = np.asarray(tensor.get("data"))
    except ValueError:
        values = np.asarray(None)  # ragged nesting: refused below with the same message
    if values.dtype.kind not in _JSON_KINDS[datatype]:
        kind = {"FP32": "numbers", "UINT8": "integers 0..255", "BOOL": "true/false"}[datatype]
        raise InvalidArgumentError("inputs[0].data", f"a {datatype} tensor's data must be {kind}")
    return codec.to_model_input(values.ravel(), datatype, rows_cols, field="inputs[0].data")


def _json_seed(parameters: Any) -> int:
    if not isinstance(parameters, dict):
        raise InvalidArgumentError("parameters", "must be a JSON object")
    unknown = set(parameters) - {codec.SEED_PARAMETER} - codec.IGNORED_PARAMETERS
    if unknown:
        raise codec.unknown_parameter(sorted(unknown)[0])
    field = f"parameters[{codec.SEED_PARAMETER!r}]"
    return codec.check_seed(parameters.get(codec.SEED_PARAMETER, 0), field=field)
