"""Wire tensors ⇄ numpy: round trip, and every malformed input refused with the right error."""

from __future__ import annotations

import numpy as np
import pytest
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.errors import InvalidArgumentError, ResourceExhaustedError
from ssdrbm_server.tensors import array_to_tensor, tensor_to_array

LIMIT = 1000


def to_array(tensor: rbm_pb2.Tensor) -> np.ndarray:
    return tensor_to_array(tensor, field="input", max_elements=LIMIT)


def test_round_trip_is_exact_little_endian_row_major() -> None:
    rng = np.random.default_rng(0)
    array = rng.standard_normal((3, 5)).astype(np.float32)
    tensor = array_to_tensor(array)
    assert list(tensor.shape) == [3, 5]
    assert tensor.data == array.astype("<f4").tobytes(order="C")
    back = to_array(tensor)
    assert back.dtype == np.float32 and back.flags.writeable
    np.testing.assert_array_equal(back, array)


def test_big_endian_and_float64_arrays_are_converted() -> None:
    array = np.arange(6, dtype=">f8").reshape(2, 3)
    np.testing.assert_array_equal(to_array(array_to_tensor(array)), array.astype(np.float32))


@pytest.mark.parametrize(
    ("shape", "n_bytes", "field"),
    [
        ([6], 24, "input.shape"),  # one dimension
        ([1, 2, 3], 24, "input.shape"),  # three dimensions
        ([0, 4], 0, "input.shape"),  # empty batch
        ([2, -3], 24, "input.shape"),  # negative dimension
        ([2, 3], 20, "input.data"),  # too few bytes
        ([2, 3], 28, "input.data"),  # too many bytes
        ([2, 3], 12, "input.data"),  # float16-sized payload
    ],
)
def test_inconsistent_shape_or_size_is_invalid_argument(
    shape: list[int], n_bytes: int, field: str
) -> None:
    tensor = rbm_pb2.Tensor(shape=shape, data=b"\0" * n_bytes)
    with pytest.raises(InvalidArgumentError) as caught:
        to_array(tensor)
    assert caught.value.field == field
    assert caught.value.message.startswith(field)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_invalid_argument(bad: float) -> None:
    array = np.zeros((2, 3), dtype=np.float32)
    array[1, 2] = bad
    with pytest.raises(InvalidArgumentError, match="NaN or Inf"):
        to_array(array_to_tensor(array))


def test_element_limit_is_resource_exhausted_before_reading_data() -> None:
    # The limit is checked on the shape alone: no data needs to be sent to be refused.
    tensor = rbm_pb2.Tensor(shape=[LIMIT + 1, 1], data=b"")
    with pytest.raises(ResourceExhaustedError, match=str(LIMIT)):
        to_array(tensor)
    at_limit = array_to_tensor(np.ones((LIMIT, 1), dtype=np.float32))
    assert to_array(at_limit).shape == (LIMIT, 1)
