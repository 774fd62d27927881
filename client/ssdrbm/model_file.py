"""Read exported models without torch: a small safetensors reader on numpy.

The safetensors format is an 8-byte little-endian header length, a JSON header mapping each tensor
name to its dtype, shape and byte range (plus an optional ``__metadata__`` of strings), then the
raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SAFETENSORS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
MODEL_PREFIX = "model."  # how training checkpoints name the model's own tensors


class SafetensorsError(ValueError):
    """The bytes are not a well-formed safetensors file."""


def read_safetensors(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse safetensors ``data`` into ``({name: array}, metadata)``; arrays are native copies."""
    if len(data) < 8:
        raise SafetensorsError("too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(len(data) - 8, _MAX_HEADER_BYTES):
        raise SafetensorsError(f"header length {header_len} exceeds the {len(data)} bytes given")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + header_len :]
    tensors = {name: _read_tensor(name, entry, body) for name, entry in header.items()}
    return tensors, metadata


def _read_tensor(name: str, entry: Any, body: memoryview) -> np.ndarray:
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise SafetensorsError(f"{name}: entry needs dtype, shape and data_offsets") from None
    if dtype_name == "BF16":
        dtype = np.dtype("<u2")  # widened to float32 below
    elif dtype_name in _DTYPES:
        dtype = np.dtype(_DTYPES[dtype_name])
    else:
        raise SafetensorsError(f"{name}: unsupported dtype {dtype_name}")
    count = int(np.prod(shape, dtype=np.int64))
    if not 0 <= begin <= end <= len(body) or end - begin != count * dtype.itemsize:
        raise SafetensorsError(f"{name}: byte range {begin}..{end} does not fit shape {shape}")
    array = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape)
    if dtype_name == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(dtype.newbyteorder("="))


@dataclass(frozen=True)
class ExportedModel:
    """A trained model as exported by the service: its JSON config and named numpy tensors."""

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    step: int = 0

    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """The model's parameters by name (W, b, a, log_var, ...).

        A training checkpoint also holds optimizer and sampler state; its model parameters are
        the entries prefixed ``model.``.
        """
        model = {
            name.removeprefix(MODEL_PREFIX): array
            for name, array in self.tensors.items()
            if name.startswith(MODEL_PREFIX)
        }
        return model or self.tensors

    @property
    def weights(self) -> np.ndarray:
        """W, shape (n_visible, n_hidden)."""
        return self.parameters["W"]

    @property
    def kind(self) -> str:
        """Either "bernoulli" or "gaussian" (the config's ``type``)."""
        kind = self.config.get("type") or self.config.get("kind") or "bernoulli"
        return str(kind).lower()

    def hidden_probs(self, v: np.ndarray) -> np.ndarray:
        """p(h=1|v) = σ(vᵀC⁻¹W + a), computed locally (C = I for Bernoulli models)."""
        v = np.asarray(v, dtype=np.float64)
        parameters = self.parameters
        if "precision" in parameters:
            scaled = v @ parameters["precision"].astype(np.float64)
        elif self.kind.startswith("gaussian"):
            scaled = v / self.visible_variance()
        else:
            scaled = v
        activation = scaled @ self.weights.astype(np.float64) + parameters["a"]
        return 1.0 / (1.0 + np.exp(-activation))

    def visible_variance(self) -> np.ndarray:
        """Per-visible-unit variance of a Gaussian model (ones for identity or Bernoulli)."""
        n_visible = self.weights.shape[0]
        parameters = self.parameters
        if "log_var" in parameters:
            return np.exp(parameters["log_var"].astype(np.float64))
        if "log_c" in parameters:
            return np.full(n_visible, float(np.exp(parameters["log_c"].reshape(-1)[0])))
        if "precision" in parameters:
            return np.diag(np.linalg.inv(parameters["precision"].astype(np.float64)))
        return np.ones(n_visible)

    @classmethod
    def from_bytes(cls, data: bytes, config: dict[str, Any] | None = None, step: int = 0):
        """Parse safetensors bytes; the config defaults to the file's ``config`` metadata."""
        tensors, metadata = read_safetensors(data)
        if config is None:
            config = json.loads(metadata.get("config", "{}"))
        return cls(config=config, tensors=tensors, step=step)

    @classmethod
    def load(cls, directory: str | Path) -> ExportedModel:
        """Read a directory written by :meth:`ssdrbm.Client.export_model`."""
        directory = Path(directory)
        config = json.loads((directory / CONFIG_NAME).read_text())
        data = (directory / SAFETENSORS_NAME).read_bytes()
        return cls.from_bytes(data, config=config, step=int(config.get("step", 0)))
