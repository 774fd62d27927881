"""Model export: gather the ExportModel stream, check it, and write or parse it.

Three ways to write an export (``format=``):

- ``"safetensors"``: ``model.safetensors`` and ``config.json`` in a directory;
- ``"onnx"``: one ``.onnx`` file: input ``input`` (batch, n_visible) float32, outputs
  ``hidden_probs`` (batch, n_hidden) and ``reconstruction`` (batch, n_visible), the mean-field
  up-down pass;
- ``"triton"``: a Triton Inference Server model repository: ``DIR/<model_name>/config.pbtxt``
  and ``DIR/<model_name>/1/model.onnx``.

The bytes are written as received (no torch or onnx needed here). Shared by the blocking and the
asyncio clients.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssdrbm.errors import IntegrityError, InvalidArgument
from ssdrbm.model_file import CONFIG_NAME, SAFETENSORS_NAME, ExportedModel
from ssdrbm.spec import enum_name
from ssdrbm.v1 import rbm_pb2

# The ONNX graph's tensor names, as the service builds it (ssdcore/onnx_export.py; a test checks
# that the two agree).
ONNX_INPUT = "input"
ONNX_HIDDEN_OUTPUT = "hidden_probs"
ONNX_RECONSTRUCTION_OUTPUT = "reconstruction"
ONNX_NAME = "model.onnx"  # the file name Triton's onnxruntime backend looks for
TRITON_PLATFORM = "onnxruntime_onnx"
TRITON_CONFIG_NAME = "config.pbtxt"
TRITON_VERSION = "1"  # the model version folder
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")

# Each way of writing an export, and the format the service is asked for.
FORMATS = {
    "safetensors": rbm_pb2.EXPORT_FORMAT_SAFETENSORS,
    "onnx": rbm_pb2.EXPORT_FORMAT_ONNX,
    "triton": rbm_pb2.EXPORT_FORMAT_ONNX,
}


def wire_format(name: str) -> int:
    """The ExportFormat the service is asked for to write ``name``; InvalidArgument if unknown."""
    if name not in FORMATS:
        raise InvalidArgument(f"format: unknown {name!r}; use one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass(frozen=True)
class ModelDownload:
    """A model export as received: the header's config, format and the checked bytes."""

    config_json: str
    step: int
    data: bytes
    format: int = rbm_pb2.EXPORT_FORMAT_SAFETENSORS

    @property
    def config(self) -> dict[str, Any]:
        """The model's config (kind, sizes, variance) from the header."""
        return json.loads(self.config_json) if self.config_json else {}

    def model(self) -> ExportedModel:
        """Parse into numpy tensors (no torch needed)."""
        self._require(rbm_pb2.EXPORT_FORMAT_SAFETENSORS)
        config = json.loads(self.config_json) if self.config_json else None
        return ExportedModel.from_bytes(self.data, config=config, step=self.step)

    def save(self, path: str | Path, format: str, *, model_name: str = "") -> Path:
        """Write as ``format`` (see the module docstring), making folders where missing; returns
        the directory (for Triton, the model's folder) or the file."""
        path = Path(path)
        if format not in ("onnx", "triton"):
            self._require(rbm_pb2.EXPORT_FORMAT_SAFETENSORS)
            path.mkdir(parents=True, exist_ok=True)
            (path / SAFETENSORS_NAME).write_bytes(self.data)
            config = json.dumps(self.config, indent=2, sort_keys=True) + "\n"
            (path / CONFIG_NAME).write_text(config)
            return path
        if format == "triton":
            check_model_name(model_name)
        self._require(rbm_pb2.EXPORT_FORMAT_ONNX)
        model_dir = path / model_name
        file = path if format == "onnx" else model_dir / TRITON_VERSION / ONNX_NAME
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(self.data)
        if format == "onnx":
            return file
        sizes = int(self.config["n_visible"]), int(self.config["n_hidden"])
        (model_dir / TRITON_CONFIG_NAME).write_text(triton_config(model_name, *sizes))
        return model_dir

    def _require(self, wanted: int) -> None:
        if self.format != wanted:
            raise ValueError(f"this export holds {_format_name(self.format)} bytes")


def check_model_name(name: str) -> None:
    """A Triton model name: one plain folder name, quoted as is in ``config.pbtxt``."""
    if not _MODEL_NAME.fullmatch(name):
        raise InvalidArgument(
            f"model_name: {name!r} is not a plain folder name; use letters, digits, '-' or '_'"
        )


def triton_config(model_name: str, n_visible: int, n_hidden: int) -> str:
    """Triton's ``config.pbtxt`` for the ONNX graph.

    ``max_batch_size: 0`` means Triton does not add a batch dimension of its own: the dims are the
    tensors' full shapes, with -1 for the graph's dynamic batch dimension.
    """
    tensors = {
        "input": [(ONNX_INPUT, n_visible)],
        "output": [(ONNX_HIDDEN_OUTPUT, n_hidden), (ONNX_RECONSTRUCTION_OUTPUT, n_visible)],
    }
    lines = [
        f'name: "{model_name}"',
        f'platform: "{TRITON_PLATFORM}"',
        "max_batch_size: 0",
    ]
    for section, entries in tensors.items():
        blocks = [
            f'  {{\n    name: "{name}"\n    data_type: TYPE_FP32\n    dims: [ -1, {width} ]\n  }}'
            for name, width in entries
        ]
        lines.append(f"{section} [\n" + ",\n".join(blocks) + "\n]")
    return "\n".join(lines) + "\n"


def collect_export(messages: Any, expected_format: int) -> ModelDownload:
    """Gather an ExportModel stream (header first, then chunks) and check the format, size and
    sha256 of the received bytes against the header."""
    header, chunks = None, []
    for message in messages:
        if message.WhichOneof("part") == "header":
            header = message.header
        else:
            chunks.append(message.chunk)
    if header is None:
        raise IntegrityError("model export: the stream carried no header")
    # A service older than the format field leaves it unset and sends safetensors.
    received_format = header.format or rbm_pb2.EXPORT_FORMAT_SAFETENSORS
    if received_format != expected_format:
        raise IntegrityError(
            f"model export: asked for {_format_name(expected_format)} but the service sent "
            f"{_format_name(received_format)}; a service this old cannot export "
            f"{_format_name(expected_format)} — upgrade it"
        )
    data = b"".join(chunks)
    if header.size_bytes and len(data) != header.size_bytes:
        raise IntegrityError(
            f"model export: received {len(data)} bytes, expected {header.size_bytes}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if header.sha256 and digest != header.sha256.lower():
        raise IntegrityError("model export: sha256 of the received bytes does not match")
    return ModelDownload(header.config_json, header.step, data, received_format)


def _format_name(value: int) -> str:
    known = value in rbm_pb2.ExportFormat.values()
    return enum_name(rbm_pb2.ExportFormat, value) if known else f"format {value}"
