"""KServe v2 tensors ⇄ the float32 (B, V) arrays the serving path computes on.

The model has one input, ``input``, of shape [batch, n_visible] in one of three datatypes:
FP32, UINT8 or BOOL. Values keep their meaning, as in ssdrbm.v1 where clients send float32
values: UINT8 255 is the float 255.0 and BOOL true is 1.0 (no scaling; send what the model was
trained on). A gRPC input arrives either as ``raw_input_contents`` (little-endian bytes, one byte
per UINT8 or BOOL element) or as the typed ``contents`` field; outputs go back as FP32
``raw_output_contents``. The REST form (rest.py) decodes its JSON data with the same checks.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
from ssdrbm.inference.v2 import open_inference_pb2 as oip

from ssdrbm_server.errors import InvalidArgumentError
from ssdrbm_server.request_bounds import MAX_SEED, QUOTED_CHARS, quoted
from ssdrbm_server.tensors import check_batch_shape

INPUT_NAME = "input"
OUTPUT_DATATYPE = "FP32"
# Each accepted datatype: its raw little-endian element type, and the typed contents field.
WIRE_DTYPES = {"FP32": np.dtype("<f4"), "UINT8": np.dtype("u1"), "BOOL": np.dtype("u1")}
TYPED_CONTENTS = {"FP32": "fp32_contents", "UINT8": "uint_contents", "BOOL": "bool_contents"}
ACCEPTED = ", ".join(WIRE_DTYPES)
SEED_PARAMETER = "seed"
# Scheduling hints some clients send: meaningless for a stateless model, so accepted and unused
# (the call's gRPC deadline bounds the time).
IGNORED_PARAMETERS = frozenset({"priority", "timeout"})


def check_input_header(
    name: str, datatype: str, shape: Sequence[int], *, field: str, max_elements: int
) -> tuple[int, int]:
    """The (batch, width) of a well-formed input header, or an error naming the field."""
    if name != INPUT_NAME:
        raise InvalidArgumentError(
            f"{field}.name",
            f"unknown input {quoted(name)}; the model has one input named {INPUT_NAME!r}",
        )
    if datatype not in WIRE_DTYPES:
        raise InvalidArgumentError(
            f"{field}.datatype", f"{quoted(datatype)} is not accepted; send {ACCEPTED}"
        )
    return check_batch_shape(shape, field=field, max_elements=max_elements)


def to_model_input(
    values: np.ndarray, datatype: str, shape: tuple[int, int], *, field: str
) -> np.ndarray:
    """A writable float32 (B, V) array from the flat ``values`` of an input of ``datatype``."""
    check_element_count(values.size, datatype, shape, field=field)
    if datatype == "BOOL" and values.size and values.max() > 1:
        raise InvalidArgumentError(field, "BOOL elements must be 0 (false) or 1 (true)")
    if datatype == "UINT8" and values.size and (values.min() < 0 or values.max() > 255):
        raise InvalidArgumentError(field, "UINT8 elements must lie in 0..255")
    array = values.astype(np.float32).reshape(shape)  # a copy: torch wants it writable
    if datatype == "FP32" and not np.isfinite(array).all():
        raise InvalidArgumentError(field, "contains NaN or Inf; send finite values")
    return array


def check_element_count(count: int, datatype: str, shape: tuple[int, int], *, field: str) -> None:
    """The input's values must be as many as its (checked) shape says; counted before they are
    converted, so a short shape cannot carry a long list."""
    if count != shape[0] * shape[1]:
        raise InvalidArgumentError(
            field,
            f"shape {list(shape)} needs {shape[0] * shape[1]} {datatype} elements, got {count}",
        )


def decode_input(request: oip.ModelInferRequest, *, max_elements: int) -> np.ndarray:
    """The model input of a gRPC ModelInferRequest, from raw or typed contents."""
    if len(request.inputs) != 1:
        raise InvalidArgumentError(
            "inputs",
            f"the model takes exactly one input, {INPUT_NAME!r} [batch, n_visible]; "
            f"got {len(request.inputs)}",
        )
    tensor = request.inputs[0]
    shape = check_input_header(
        tensor.name, tensor.datatype, tensor.shape, field="inputs[0]", max_elements=max_elements
    )
    typed = [field.name for field, _ in tensor.contents.ListFields()]
    if request.raw_input_contents:
        return _from_raw(request, tensor.datatype, shape, typed)
    expected = TYPED_CONTENTS[tensor.datatype]
    if any(name != expected for name in typed):
        raise InvalidArgumentError(
            "inputs[0].contents",
            f"datatype {tensor.datatype} takes its values in contents.{expected}, got "
            f"{', '.join(typed)}",
        )
    contents = getattr(tensor.contents, expected)
    field = f"inputs[0].contents.{expected}"
    check_element_count(len(contents), tensor.datatype, shape, field=field)
    return to_model_input(np.asarray(contents), tensor.datatype, shape, field=field)


def _from_raw(
    request: oip.ModelInferRequest, datatype: str, shape: tuple[int, int], typed: list[str]
) -> np.ndarray:
    if typed:
        raise InvalidArgumentError(
            "inputs[0].contents", "send the values either in raw_input_contents or in contents"
        )
    if len(request.raw_input_contents) != 1:
        raise InvalidArgumentError(
            "raw_input_contents",
            f"needs one entry per input (1), got {len(request.raw_input_contents)}",
        )
    raw = request.raw_input_contents[0]
    dtype = WIRE_DTYPES[datatype]
    expected = shape[0] * shape[1] * dtype.itemsize
    if len(raw) != expected:
        raise InvalidArgumentError(
            "raw_input_contents[0]",
            f"shape {list(shape)} of {datatype} needs {expected} bytes, got {len(raw)}",
        )
    values = np.frombuffer(raw, dtype=dtype)
    return to_model_input(values, datatype, shape, field="raw_input_contents[0]")


def requested_output_names(request: oip.ModelInferRequest) -> list[str]:
    """The names in ``outputs`` (checked against the model's outputs by the engine)."""
    for index, output in enumerate(request.outputs):
        if output.parameters:
            shown = sorted(name[:QUOTED_CHARS] for name in itertools.islice(output.parameters, 4))
            more = len(output.parameters) - len(shown)
            got = ", ".join(shown) + (f" and {more} more" if more else "")
            raise InvalidArgumentError(
                f"outputs[{index}].parameters", f"not supported (got {got}); remove them"
            )
    return [output.name for output in request.outputs]


def request_seed(parameters: Mapping[str, oip.InferParameter]) -> int:
    """The ``seed`` request parameter (0: unseeded), refusing parameters the model has not."""
    seed = 0
    for name, parameter in parameters.items():
        if name in IGNORED_PARAMETERS:
            continue
        if name != SEED_PARAMETER:
            raise unknown_parameter(name)
        kind = parameter.WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise InvalidArgumentError(
                f"parameters[{SEED_PARAMETER!r}]", f"must be an integer, got {kind or 'nothing'}"
            )
        seed = check_seed(getattr(parameter, kind), field=f"parameters[{SEED_PARAMETER!r}]")
    return seed


def unknown_parameter(name: str) -> InvalidArgumentError:
    """The refusal of a request parameter the model has not (gRPC and REST alike)."""
    return InvalidArgumentError(
        f"parameters[{quoted(name)}]",
        f"unknown parameter; the one parameter is {SEED_PARAMETER!r} (hidden_sample)",
    )


def check_seed(value: object, *, field: str) -> int:
    """A seed in 0..2^63-1 (0 means unseeded, as in ssdrbm.v1)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise InvalidArgumentError(field, f"must be an integer in 0..{MAX_SEED}, got {value!r}")
    return value


def add_outputs(response: oip.ModelInferResponse, outputs: list[tuple[str, np.ndarray]]) -> None:
    """Each output as FP32 raw_output_contents, in the order asked for."""
    for name, array in outputs:
        data = np.ascontiguousarray(array, dtype="<f4")
        response.outputs.add(name=name, datatype=OUTPUT_DATATYPE, shape=list(data.shape))
        response.raw_output_contents.append(data.tobytes())
