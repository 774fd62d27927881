"""The gRPC service ``inference.GRPCInferenceService`` of the Open Inference Protocol.

The handlers are registered by method path with ``grpc.method_handlers_generic_handler``, using
the messages of ``ssdrbm.inference.v2`` (wire-identical to the protocol's ``inference``
package; see protos/ssdrbm/inference/v2/open_inference.proto for why they are not declared
there). The service path is listed with RBMService's in handlers.py, so the latency, error
mapping and authentication interceptors apply to it as to ssdrbm.v1; handlers raise domain
errors and read the tenant with ``current_tenant()``.
"""

from __future__ import annotations

from dataclasses import asdict

import grpc
import redis.asyncio as aioredis
import ssdrbm
from ssdrbm.inference.v2 import open_inference_pb2 as oip

from ssdrbm_server.config import Settings
from ssdrbm_server.handlers import INFERENCE_SERVICE_NAME
from ssdrbm_server.inference import codec
from ssdrbm_server.inference.engine import SERVER_NAME, InferenceEngine, bound_outputs
from ssdrbm_server.inference.names import ModelNames
from ssdrbm_server.recent_jobs import RecentJobs
from ssdrbm_server.servicer import Stores, caller_of
from ssdrbm_server.serving import ModelServer
from ssdrbm_server.tenancy import current_tenant


class InferenceServicer:
    """ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer."""

    def __init__(self, engine: InferenceEngine, *, max_tensor_elements: int) -> None:
        self.engine = engine
        self.max_tensor_elements = max_tensor_elements

    async def ServerLive(
        self, request: oip.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=True)  # answering at all is being alive

    async def ServerReady(
        self, request: oip.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=await self.engine.server_ready())

    async def ModelReady(
        self, request: oip.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelReadyResponse:
        ready = await self.engine.model_ready(current_tenant(), request.name, request.version)
        return oip.ModelReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: oip.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(name=SERVER_NAME, version=ssdrbm.__version__)

    async def ModelMetadata(
        self, request: oip.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelMetadataResponse:
        info = await self.engine.metadata(current_tenant(), request.name, request.version)
        return oip.ModelMetadataResponse(
            name=info.name,
            versions=info.versions,
            platform=info.platform,
            inputs=[asdict(tensor) for tensor in info.inputs],
            outputs=[asdict(tensor) for tensor in info.outputs],
        )

    async def ModelInfer(
        self, request: oip.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> oip.ModelInferResponse:
        v = codec.decode_input(request, max_elements=self.max_tensor_elements)
        bound_outputs(request.outputs)
        result = await self.engine.infer(
            caller_of(context),
            request.model_name,
            request.model_version,
            v,
            outputs=codec.requested_output_names(request),
            seed=codec.request_seed(request.parameters),
        )
        response = oip.ModelInferResponse(
            model_name=result.model_name, model_version=result.model_version, id=request.id
        )
        codec.add_outputs(response, result.outputs)
        return response


def inference_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """The generic handler serving ``servicer`` on ``inference.GRPCInferenceService``."""
    methods = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata")
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=getattr(oip, f"{name}Request").FromString,
            response_serializer=getattr(oip, f"{name}Response").SerializeToString,
        )
        for name in (*methods, "ModelInfer")
    }
    return grpc.method_handlers_generic_handler(INFERENCE_SERVICE_NAME, handlers)


def add_inference_service(
    server: grpc.aio.Server,
    settings: Settings,
    stores: Stores,
    models: ModelServer,
    recent_jobs: RecentJobs,
    redis: aioredis.Redis,
) -> InferenceEngine:
    """Serve the Open Inference Protocol on ``server`` (over RBMService's stores, model server
    and job-record cache); returns the engine, which the REST form shares."""
    engine = InferenceEngine(
        ModelNames(stores.jobs, stores.checkpoints, recent_jobs), models, redis
    )
    servicer = InferenceServicer(engine, max_tensor_elements=settings.max_tensor_elements)
    server.add_generic_rpc_handlers([inference_handler(servicer)])
    return engine
