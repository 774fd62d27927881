"""Request building and response handling shared by the blocking and the asyncio clients."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ssdrbm.errors import IntegrityError, InvalidArgument
from ssdrbm.model_file import CONFIG_NAME, SAFETENSORS_NAME, ExportedModel
from ssdrbm.retry import RetryPolicy
from ssdrbm.tensors import as_batch, from_tensor, rows_per_chunk, to_tensor
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
        self.chunk_rows = max(1, self.chunk_rows // 2)
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


def reconstruct_request(
    job_id: str, rows: np.ndarray, *, k: int, mean_field: bool, seed: int, checkpoint_step: int
) -> rbm_pb2.ReconstructRequest:
    """One Reconstruct request for a chunk of rows."""
    return rbm_pb2.ReconstructRequest(
        job_id=job_id,
        input=to_tensor(rows),
        k=k,
        mean_field=mean_field,
        seed=seed,
        checkpoint_step=checkpoint_step,
    )


def sample_hidden_request(
    job_id: str, rows: np.ndarray, *, mode: int, seed: int, checkpoint_step: int
) -> rbm_pb2.SampleHiddenRequest:
    """One SampleHidden request for a chunk of rows."""
    return rbm_pb2.SampleHiddenRequest(
        job_id=job_id, input=to_tensor(rows), mode=mode, seed=seed, checkpoint_step=checkpoint_step
    )


def output_array(response: Any) -> np.ndarray:
    """The output tensor of a Reconstruct or SampleHidden response."""
    return from_tensor(response.output)


@dataclass(frozen=True)
class ModelDownload:
    """A model export as received: the header's config and the checked safetensors bytes."""

    config_json: str
    step: int
    data: bytes

    @classmethod
    def from_parts(cls, header: rbm_pb2.ModelExportHeader | None, chunks: list[bytes]):
        """Check size and sha256 of the received bytes against the header."""
        if header is None:
            raise IntegrityError("model export: the stream carried no header")
        data = b"".join(chunks)
        if header.size_bytes and len(data) != header.size_bytes:
            raise IntegrityError(
                f"model export: received {len(data)} bytes, expected {header.size_bytes}"
            )
        digest = hashlib.sha256(data).hexdigest()
        if header.sha256 and digest != header.sha256.lower():
            raise IntegrityError("model export: sha256 of the received bytes does not match")
        return cls(config_json=header.config_json, step=header.step, data=data)

    def model(self) -> ExportedModel:
        """Parse into numpy tensors (no torch needed)."""
        config = json.loads(self.config_json) if self.config_json else None
        return ExportedModel.from_bytes(self.data, config=config, step=self.step)

    def write(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` and ``config.json`` into ``directory`` (made if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / SAFETENSORS_NAME).write_bytes(self.data)
        config = json.loads(self.config_json) if self.config_json else {}
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return directory


def collect_export(messages: Any) -> ModelDownload:
    """Gather an ExportModel stream (header first, then chunks)."""
    header, chunks = None, []
    for message in messages:
        if message.WhichOneof("part") == "header":
            header = message.header
        else:
            chunks.append(message.chunk)
    return ModelDownload.from_parts(header, chunks)


def chunk_seed(seed: int, start: int) -> int:
    """A distinct, reproducible seed per request of a split batch (0, "random", stays 0)."""
    return seed + start if seed else 0


def deadline_after(timeout: float | None) -> float | None:
    """A ``time.monotonic()`` deadline ``timeout`` seconds from now (None: no deadline)."""
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a ``time.monotonic()`` deadline (None: no deadline)."""
    if deadline is None:
        return None
    return max(deadline - time.monotonic(), 0.0)


class Reconnect:
    """Backoff between reconnection attempts of a stream, within a time budget.

    The budget restarts whenever an event arrives, so a long stream survives many separate
    outages but gives up on one that lasts longer than ``budget_s``.
    """

    def __init__(self, policy: RetryPolicy, budget_s: float) -> None:
        self.policy = policy
        self.budget_s = budget_s
        self.reset()

    def reset(self) -> None:
        """Start a fresh budget: the stream made progress."""
        self.failures = 0
        self.since: float | None = None

    def next_delay(self) -> float | None:
        """The sleep before the next attempt, or None when the budget is spent."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since >= self.budget_s:
            return None
        delay = self.policy.initial_backoff_s * self.policy.multiplier**self.failures
        self.failures += 1
        return min(delay, self.policy.max_backoff_s, self.budget_s - (now - self.since))

    def wait(self) -> bool:
        """Sleep before reconnecting; False when it is time to give up."""
        delay = self.next_delay()
        if delay is None:
            return False
        time.sleep(delay)
        return True
