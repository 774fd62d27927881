"""Turn an array or a ``.npy`` file into the message stream of ``UploadDataset``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from ssdrbm.errors import InvalidArgument
from ssdrbm.spec import from_message
from ssdrbm.v1 import rbm_pb2

DEFAULT_CHUNK_BYTES = 1024 * 1024

# The upload formats, the one table (the service reads it too): the wire dtype → the numpy dtype
# its bytes hold, little-endian. DTYPE_UNSPECIFIED means float32.
UPLOAD_DTYPES = {
    rbm_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    rbm_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    rbm_pb2.DTYPE_UINT8: np.dtype("u1"),
}
# The same formats by the name a dataset's record keeps ("float32", "float64", "uint8").
UPLOAD_DTYPES_BY_NAME = {dtype.name: dtype for dtype in UPLOAD_DTYPES.values()}
_CODES_BY_NAME = {dtype.name: code for code, dtype in UPLOAD_DTYPES.items()}
# dtypes the service stores as they are; anything else numeric travels as float32.
_WIRE_DTYPES = {dtype.newbyteorder("="): code for code, dtype in UPLOAD_DTYPES.items()}


def upload_dtype(code: int) -> np.dtype:
    """The numpy dtype of a wire dtype (unset: float32); KeyError for one not in the table."""
    return UPLOAD_DTYPES[code or rbm_pb2.DTYPE_FLOAT32]


def upload_dtype_code(name: str) -> int:
    """The wire dtype of a format's name (``"float32"``, ...); KeyError for an unknown name."""
    return _CODES_BY_NAME[name]


@dataclass(frozen=True)
class UploadedDataset:
    """What the service recorded for an upload."""

    id: str
    shape: tuple[int, ...]
    size_bytes: int
    created: bool  # False when the same content was already stored


@dataclass(frozen=True)
class Dataset:
    """An uploaded dataset as the caller sees it (``Client.list_datasets``)."""

    id: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    size_bytes: int
    created_at: datetime | None

    @classmethod
    def from_proto(cls, message: rbm_pb2.Dataset) -> Dataset:
        dtype = upload_dtype(message.dtype if message.dtype in UPLOAD_DTYPES else 0).name
        return from_message(cls, message, id=message.dataset_id, dtype=dtype)


def load_array(source: np.ndarray | str | Path) -> np.ndarray:
    """The array to upload: ``source`` itself, or a ``.npy`` file read without pickle."""
    if isinstance(source, str | Path):
        try:
            return np.load(Path(source), allow_pickle=False)
        except ValueError as error:
            raise InvalidArgument(f"{source}: not a plain numeric .npy array ({error})") from None
    return np.asarray(source)


def wire_array(array: np.ndarray) -> tuple[np.ndarray, int]:
    """``array`` as C-ordered little-endian bytes of a dtype the service accepts, with its code."""
    if array.ndim not in (2, 3):
        raise InvalidArgument(
            f"dataset: expected shape (n_examples, n_features) or (n_examples, height, width), "
            f"got {array.shape}"
        )
    if array.dtype.kind not in "biuf":
        raise InvalidArgument(f"dataset: expected numbers, got dtype {array.dtype}")
    if array.dtype.kind == "b":
        array = array.astype(np.uint8)
    native = array.dtype.newbyteorder("=")
    dtype = native if native in _WIRE_DTYPES else np.dtype("float32")
    wire = np.ascontiguousarray(array, dtype=dtype.newbyteorder("<"))
    return wire, _WIRE_DTYPES[dtype]


def upload_messages(
    array: np.ndarray, *, name: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[rbm_pb2.UploadDatasetRequest]:
    """The header (with the sha256 of the bytes, so the service can check them), then chunks.

    The array is checked here, when called (InvalidArgument), not when gRPC first pulls a
    message: an error raised inside a request stream reaches the caller only as gRPC's
    "Exception iterating requests!"."""
    wire, dtype = wire_array(array)
    return _messages(wire, dtype, name, chunk_bytes)


def _messages(
    wire: np.ndarray, dtype: int, name: str, chunk_bytes: int
) -> Iterator[rbm_pb2.UploadDatasetRequest]:
    data = memoryview(wire.tobytes())
    header = rbm_pb2.DatasetHeader(
        shape=list(wire.shape), dtype=dtype, name=name, sha256=hashlib.sha256(data).hexdigest()
    )
    yield rbm_pb2.UploadDatasetRequest(header=header)
    for start in range(0, len(data), chunk_bytes):
        yield rbm_pb2.UploadDatasetRequest(chunk=bytes(data[start : start + chunk_bytes]))
