"""numpy ⇄ ``ssdrbm.v1.Tensor``: a shape plus raw little-endian float32 bytes, row-major."""

from __future__ import annotations

import numpy as np

from ssdrbm.v1 import rbm_pb2

WIRE_DTYPE = np.dtype("<f4")

# gRPC's default receive limit is 4 MiB per message; requests and responses are kept well under it
# so that framing and the other fields always fit.
DEFAULT_MAX_BATCH_BYTES = 2 * 1024 * 1024


def to_tensor(array: np.ndarray) -> rbm_pb2.Tensor:
    """Encode ``array`` as a Tensor (converted to little-endian float32, C order)."""
    wire = np.ascontiguousarray(array, dtype=WIRE_DTYPE)
    return rbm_pb2.Tensor(shape=list(wire.shape), data=wire.tobytes())


def from_tensor(tensor: rbm_pb2.Tensor) -> np.ndarray:
    """Decode a Tensor into a writable float32 array, checking that bytes and shape agree."""
    shape = tuple(int(n) for n in tensor.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * WIRE_DTYPE.itemsize
    if len(tensor.data) != expected:
        raise ValueError(
            f"tensor of shape {shape} needs {expected} bytes but carries {len(tensor.data)}"
        )
    return np.frombuffer(tensor.data, dtype=WIRE_DTYPE).astype(np.float32).reshape(shape)


def as_batch(x: np.ndarray, name: str = "x") -> np.ndarray:
    """View ``x`` as a (batch, features) float32 array.

    A single vector becomes a batch of one; images (batch, height, width) are flattened row-major,
    which is how the service lays out image datasets.
    """
    array = np.asarray(x)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{name}: expected a numeric array, got dtype {array.dtype}")
    if array.ndim == 0:
        raise ValueError(f"{name}: expected a (batch, n_visible) array, got a scalar")
    if array.ndim == 1:
        array = array[None, :]
    elif array.ndim > 2:
        array = array.reshape(array.shape[0], -1)
    return np.ascontiguousarray(array, dtype=np.float32)


def rows_per_chunk(row_bytes: int, max_bytes: int = DEFAULT_MAX_BATCH_BYTES) -> int:
    """How many rows of ``row_bytes`` fit in ``max_bytes`` (at least one)."""
    return max(1, max_bytes // max(row_bytes, 1))
