"""ExportModel's payloads: a checkpoint's safetensors as stored, or the ONNX graph built from it.

The ONNX graph (``ssdcore.onnx_export``) is built off the event loop, in the serving pool: loading
the model and copying its weights into the graph take milliseconds to a fraction of a second for
large models, too long to hold every other call.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.request_checks import enum_value
from ssdrbm_server.serving import load_model
from ssdrbm_server.store.checkpoints import Checkpoint, sha256_hex

logger = logging.getLogger(__name__)

DEFAULT_FORMAT = pb.EXPORT_FORMAT_SAFETENSORS  # what EXPORT_FORMAT_UNSPECIFIED means


@dataclass(frozen=True)
class ExportPayload:
    """The bytes ExportModel streams, their format (never UNSPECIFIED) and their sha256."""

    format: int
    data: bytes
    sha256: str


def requested_format(value: int) -> int:
    """The request's ``format``, checked; UNSPECIFIED is the default format."""
    enum_value(pb.ExportFormat, value, "format")
    return value or DEFAULT_FORMAT


async def export_payload(
    job_id: str, checkpoint: Checkpoint, export_format: int, pool: Executor
) -> ExportPayload:
    """The payload of ``checkpoint`` in ``export_format`` (a checked, non-UNSPECIFIED value)."""
    if export_format == pb.EXPORT_FORMAT_SAFETENSORS:
        return ExportPayload(export_format, checkpoint.data, checkpoint.sha256)
    loop = asyncio.get_running_loop()
    data = await loop.run_in_executor(pool, _onnx_bytes, job_id, checkpoint)
    logger.info(
        "built ONNX graph of job %s at step %d (%d bytes)", job_id, checkpoint.step, len(data)
    )
    return ExportPayload(export_format, data, sha256_hex(data))


def _onnx_bytes(job_id: str, checkpoint: Checkpoint) -> bytes:
    from ssdcore.onnx_export import model_to_onnx_bytes  # onnx is imported on first use

    model = load_model(checkpoint)
    metadata = {"ssdrbm.job_id": job_id, "ssdrbm.step": str(checkpoint.step)}
    return model_to_onnx_bytes(model, graph_name=f"rbm_{job_id}", metadata=metadata)
