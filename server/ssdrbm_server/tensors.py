"""Conversion between the wire ``Tensor`` (shape + little-endian float32 bytes) and numpy.

Inputs are checked before any model sees them: the byte length must match the shape, values
must be finite, and the element count must stay under the configured limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from ssdrbm.tensors import WIRE_DTYPE, to_tensor
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.errors import InvalidArgumentError, ResourceExhaustedError


def tensor_to_array(tensor: rbm_pb2.Tensor, *, field: str, max_elements: int) -> np.ndarray:
    """A 2-D float32 array (batch, features) from a request tensor, or a clear error.

    Raises InvalidArgumentError (naming ``field``) for a missing or inconsistent shape, a byte
    length that does not match it, or NaN/Inf values; ResourceExhaustedError over the limit.
    """
    shape = check_batch_shape(tensor.shape, field=field, max_elements=max_elements)
    elements = math.prod(shape)
    expected_bytes = elements * WIRE_DTYPE.itemsize
    if len(tensor.data) != expected_bytes:
        raise InvalidArgumentError(
            f"{field}.data",
            f"shape {list(shape)} needs {expected_bytes} bytes of float32, "
            f"got {len(tensor.data)} bytes",
        )
    array = np.frombuffer(tensor.data, dtype=WIRE_DTYPE).reshape(shape)
    if not np.isfinite(array).all():
        raise InvalidArgumentError(f"{field}.data", "contains NaN or Inf; send finite values")
    # frombuffer views the immutable request bytes; torch wants a writable, native-order array.
    return array.astype(np.float32, copy=True)


def check_batch_shape(shape: Sequence[int], *, field: str, max_elements: int) -> tuple[int, int]:
    """(batch, width) of a 2-D input shape within the element limit, or an error naming ``field``.

    The one shape rule of every serving input (ssdrbm.v1 tensors and Open Inference inputs).
    The number of dimensions is checked before any is read: a shape may hold millions.
    """
    if len(shape) != 2:
        shown = list(shape) if len(shape) <= 8 else f"{len(shape)} dimensions"
        raise InvalidArgumentError(
            f"{field}.shape", f"must be (batch, n_visible) with 2 dimensions, got {shown}"
        )
    shape = tuple(shape)
    if any(dim < 1 for dim in shape):
        raise InvalidArgumentError(f"{field}.shape", f"dimensions must be >= 1, got {list(shape)}")
    elements = math.prod(shape)
    if elements > max_elements:
        raise ResourceExhaustedError(
            f"{field}.shape: {list(shape)} makes {elements} elements, more than this server's "
            f"limit of {max_elements} (SSDRBM_MAX_TENSOR_ELEMENTS); send smaller batches",
            limit="max_tensor_elements",
        )
    return int(shape[0]), int(shape[1])


array_to_tensor = to_tensor  # numpy → wire tensor: the client's encoding, the one wire format
