"""The Open Inference Protocol (KServe v2) over the service's own serving path.

Other services fetch features from trained models with any KServe v2 client (``tritonclient``,
``kserve``): a model is a job (its id, or its name when unique within the tenant), a model version
is a checkpoint step. It is served on the gRPC server itself, behind the same interceptors, and as
REST/JSON on the HTTP front; docs/ARCHITECTURE.md lists the modules.
"""

from ssdrbm_server.inference.engine import InferenceEngine
from ssdrbm_server.inference.servicer import (
    InferenceServicer,
    add_inference_service,
    inference_handler,
)

__all__ = ["InferenceEngine", "InferenceServicer", "add_inference_service", "inference_handler"]
