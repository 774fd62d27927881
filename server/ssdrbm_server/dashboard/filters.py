"""A model's filters as a PNG: each hidden unit's column of W, shaped as the data's images and
laid out in a grid, or W itself as one heat-map when the data are not images.

The encoder is a few lines over zlib (8-bit grayscale, one IDAT chunk), so the service needs no
imaging library. The picture is bounded before it is built: at most ``MAX_FILTERS`` filters
and ``MAX_FILTER_PIXELS`` values of each.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.catalog import FREY_FACE_WIDTH, MNIST_WIDTH

MAX_FILTERS = 200  # hidden units drawn, the first ones
MAX_FILTER_PIXELS = 4096  # values of each filter drawn (a heat-map's columns)
GAP = 1  # pixels between two filters of the grid
# (rows, columns) of the built-in image datasets' examples.
IMAGE_SHAPES = {"mnist": (28, MNIST_WIDTH // 28), "freyface": (28, FREY_FACE_WIDTH // 28)}


def image_shape(spec: bytes, n_visible: int) -> tuple[int, int] | None:
    """The (rows, columns) of one example of the job's data: the built-in dataset's shape when
    it is an image dataset, else a square when ``n_visible`` is one, else None."""
    dataset = pb.StartTrainingRequest.FromString(spec).dataset
    if dataset.WhichOneof("source") == "builtin":
        shape = IMAGE_SHAPES.get(dataset.builtin.name)
        if shape is not None and shape[0] * shape[1] == n_visible:
            return shape
    side = math.isqrt(n_visible)
    return (side, side) if side > 1 and side * side == n_visible else None


def filters_png(weights: np.ndarray, shape: tuple[int, int] | None) -> bytes:
    """The columns of ``weights`` (n_visible × n_hidden) as a PNG grid of ``shape`` images, or
    the matrix as one heat-map (a row per hidden unit) without a shape."""
    weights = weights[:MAX_FILTER_PIXELS, :MAX_FILTERS]
    if shape is None:
        return png(_gray(weights.T, axis=None))
    rows, columns = shape
    count = weights.shape[1]
    across = math.ceil(math.sqrt(count))
    down = math.ceil(count / across)
    tiles = _gray(weights.T, axis=1)  # each filter stretched over its own range
    canvas = np.full(
        (down * (rows + GAP) - GAP, across * (columns + GAP) - GAP), 255, dtype=np.uint8
    )
    for index, tile in enumerate(tiles):
        top, left = (index // across) * (rows + GAP), (index % across) * (columns + GAP)
        canvas[top : top + rows, left : left + columns] = tile.reshape(rows, columns)
    return png(canvas)


def _gray(values: np.ndarray, axis: int | None) -> np.ndarray:
    """``values`` scaled to 0–255 over their range (per row with ``axis=1``); NaN is black."""
    values = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    low = values.min(axis=axis, keepdims=True)
    span = values.max(axis=axis, keepdims=True) - low
    scaled = (values - low) / np.where(span > 0, span, 1.0)
    return np.round(scaled * 255).astype(np.uint8)


def png(pixels: np.ndarray) -> bytes:
    """An 8-bit grayscale PNG of a 2-D uint8 array."""
    height, width = pixels.shape
    raw = b"".join(b"\x00" + row.tobytes() for row in pixels)  # filter type 0 on every row
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 6))
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
