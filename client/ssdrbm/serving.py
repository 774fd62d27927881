"""Serving requests (Reconstruct, SampleHidden): their hidden modes, and large batches split.

Shared by the blocking and the asyncio clients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssdrbm.errors import InvalidArgument
from ssdrbm.tensors import as_batch, rows_per_chunk
from ssdrbm.v1 import rbm_pb2

HIDDEN_MODES = {
    "probs": rbm_pb2.HIDDEN_MODE_PROBABILITIES,
    "probabilities": rbm_pb2.HIDDEN_MODE_PROBABILITIES,
    "sample": rbm_pb2.HIDDEN_MODE_SAMPLE,
}


def hidden_mode(mode: str) -> int:
    """The proto HiddenMode for ``"probs"`` or ``"sample"``."""
    if mode not in HIDDEN_MODES:
        raise InvalidArgument(f"mode: unknown value {mode!r}; choose 'probs' or 'sample'")
    return HIDDEN_MODES[mode]


@dataclass
class BatchPlan:
    """How a (possibly large) input is cut into requests that stay under the message limit.

    The chunk size halves when the service answers RESOURCE_EXHAUSTED, so a server configured
    with a smaller limit than the SDK assumes still gets requests it accepts.
    """

    batch: np.ndarray  # (B, V) float32
    original_shape: tuple[int, ...]
    chunk_rows: int

    @classmethod
    def for_input(cls, x: np.ndarray, max_batch_bytes: int) -> BatchPlan:
        """Plan requests for ``x`` so that each input tensor holds at most ``max_batch_bytes``."""
        original_shape = np.shape(x)
        batch = as_batch(x, "x")
        if batch.shape[0] == 0:
            raise InvalidArgument("x: the batch is empty; pass at least one row")
        rows = rows_per_chunk(batch.shape[1] * batch.itemsize, max_batch_bytes)
        return cls(batch=batch, original_shape=tuple(original_shape), chunk_rows=rows)

    def shrink(self) -> bool:
        """Halve the chunk size; False when it is already a single row."""
        if self.chunk_rows == 1:
            return False
        self.chunk_rows //= 2  # at least 2 here, so at least 1 after
        return True

    def next_slice(self, start: int) -> slice:
        """The rows of the request that begins at ``start``."""
        return slice(start, min(start + self.chunk_rows, self.batch.shape[0]))

    def assemble(self, outputs: list[np.ndarray], same_shape: bool) -> np.ndarray:
        """Join the per-request outputs, restoring a single vector or image shape of the input."""
        result = np.concatenate(outputs, axis=0)
        if len(self.original_shape) == 1:
            return result[0]
        if same_shape and len(self.original_shape) > 2:
            return result.reshape(self.original_shape)
        return result
