"""The Open Inference Protocol (KServe v2) over the service's own serving path.

Other services fetch features from trained models with any KServe v2 client (``tritonclient``,
``kserve``): a model is a job (its id, or its name when unique within the tenant), a model version
is a checkpoint step. The protocol is served on the ssdrbm gRPC server itself, as
``inference.GRPCInferenceService``, behind the same interceptors (latency, error mapping,
authentication), and as REST/JSON on the service's HTTP front (``http_front.py``, ``http_port``).

- ``names.py``: model name and version → the tenant's job and checkpoint step.
- ``codec.py``: KServe tensors (FP32 / UINT8 / BOOL, raw or typed contents) ⇄ float32 arrays.
- ``engine.py``: the protocol's operations for a tenant, on ``serving.ModelServer``.
- ``servicer.py``: the gRPC service (generic handlers on the standard service path).
- ``rest.py``: the REST/JSON form of the protocol, as routes of the HTTP front.
"""

from ssdrbm_server.inference.engine import InferenceEngine
from ssdrbm_server.inference.servicer import (
    InferenceServicer,
    add_inference_service,
    inference_handler,
)

__all__ = ["InferenceEngine", "InferenceServicer", "add_inference_service", "inference_handler"]
