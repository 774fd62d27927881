"""ONNX graphs of trained models, for inference servers (onnxruntime, Triton) without torch.

The graph takes `input` (B, V) float32, B dynamic, and gives `hidden_probs` (B, H) = σ(v W' + a)
and `reconstruction` (B, V), the visible mean of hidden_probs (σ(h Wᵀ + b) for the BRBM,
b + h Wᵀ for the GRBM): one mean-field up-down pass, as `model.reconstruct(v, k=1,
mean_field=True)`. The tensors come from the model's own `gibbs_kernel()`: W is stored once,
and the GRBM's C⁻¹W (`v W'` = `v C⁻¹ W`) is folded into a second matrix, which changes only the
rounding of the hidden input (agreement to about 1e-6, not bit for bit). Built node by node with
the `onnx` helper API, so the export needs neither a torch exporter nor onnxscript.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ssdcore.models.base import RBM

# Opset 17 and IR version 8 (the IR version that introduced it) load in every onnxruntime since
# 1.12 and in Triton's onnxruntime backend; the graph uses no operator newer than opset 13.
OPSET = 17
IR_VERSION = 8
INPUT_NAME = "input"
HIDDEN_OUTPUT = "hidden_probs"
RECONSTRUCTION_OUTPUT = "reconstruction"
BATCH_DIM = "batch"
PRODUCER = "ssdrbm"
CONFIG_METADATA_KEY = "ssdrbm.config"  # the model's config() as JSON, in metadata_props


def _initializer(name: str, tensor: torch.Tensor) -> onnx.TensorProto:
    """A float32 graph constant from a (detached) torch tensor on any device."""
    array = np.ascontiguousarray(tensor.detach().cpu().numpy(), dtype=np.float32)
    return numpy_helper.from_array(array, name=name)


def build_onnx_model(
    model: RBM, *, graph_name: str = "rbm", metadata: Mapping[str, str] | None = None
) -> onnx.ModelProto:
    """The ONNX graph of `model`'s hidden probabilities and mean-field reconstruction. `metadata`
    adds string entries to the model's metadata_props (the config is always there, under
    `CONFIG_METADATA_KEY`). Raises ValueError for a model kind it does not know."""
    if model.kind not in ("bernoulli", "gaussian"):
        raise ValueError(f"no ONNX export for model kind {model.kind!r}")
    kernel = model.gibbs_kernel()
    if kernel.gaussian != (model.kind == "gaussian"):
        raise ValueError(f"model kind {model.kind!r} disagrees with its Gibbs kernel")
    initializers = [
        _initializer("weight", kernel.weight),  # (V, H)
        _initializer("hidden_bias", kernel.hidden_bias),  # (H,)
        _initializer("visible_bias", kernel.visible_bias),  # (V,)
    ]
    # The BRBM (and the GRBM with C = I) goes up and down through the same W: store it once.
    hidden_weight = "weight"
    if not torch.equal(kernel.hidden_weight, kernel.weight):
        hidden_weight = "hidden_weight"
        initializers.append(_initializer(hidden_weight, kernel.hidden_weight))  # (V, H): C⁻¹W
    visible_input = RECONSTRUCTION_OUTPUT if kernel.gaussian else "visible_input"
    nodes = [
        helper.make_node(
            "Gemm", [INPUT_NAME, hidden_weight, "hidden_bias"], ["hidden_input"], name="up"
        ),
        helper.make_node("Sigmoid", ["hidden_input"], [HIDDEN_OUTPUT], name="hidden_sigmoid"),
        # h Wᵀ + b with the one (V, H) weight: Gemm transposes its second operand.
        helper.make_node(
            "Gemm",
            [HIDDEN_OUTPUT, "weight", "visible_bias"],
            [visible_input],
            name="down",
            transB=1,
        ),
    ]
    if not kernel.gaussian:
        nodes.append(
            helper.make_node(
                "Sigmoid", [visible_input], [RECONSTRUCTION_OUTPUT], name="visible_sigmoid"
            )
        )
    graph = helper.make_graph(
        nodes,
        graph_name,
        inputs=[_float_matrix(INPUT_NAME, model.n_visible)],
        outputs=[
            _float_matrix(HIDDEN_OUTPUT, model.n_hidden),
            _float_matrix(RECONSTRUCTION_OUTPUT, model.n_visible),
        ],
        initializer=initializers,
    )
    onnx_model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name=PRODUCER,
        doc_string=(
            f"{model.kind} RBM, {model.n_visible} visible and {model.n_hidden} hidden units: "
            f"{HIDDEN_OUTPUT} = p(h=1|{INPUT_NAME}), {RECONSTRUCTION_OUTPUT} = mean-field "
            "up-down pass"
        ),
    )
    entries = {CONFIG_METADATA_KEY: json.dumps(model.config(), sort_keys=True), **(metadata or {})}
    helper.set_model_props(onnx_model, dict(entries))
    onnx.checker.check_model(onnx_model)
    return onnx_model


def model_to_onnx_bytes(
    model: RBM, *, graph_name: str = "rbm", metadata: Mapping[str, str] | None = None
) -> bytes:
    """`build_onnx_model(model)` serialized: the bytes of a `.onnx` file."""
    return build_onnx_model(model, graph_name=graph_name, metadata=metadata).SerializeToString()


def _float_matrix(name: str, width: int) -> onnx.ValueInfoProto:
    """A (batch, width) float32 graph input or output, the batch dimension left dynamic."""
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [BATCH_DIM, width])
