"""Model serving: Reconstruct and SampleHidden against a job's checkpoints.

Models are loaded from checkpoints (safetensors, never pickle) into an LRU cache keyed by job id
and checkpoint step, so a steady stream of requests costs one Redis read per new checkpoint, not
one per request. Large computations run in a thread pool (torch releases the GIL, and the event
loop stays free for other calls); tiny ones run inline, because handing a batch-1 request to the
pool (a queue, a thread wake-up, a cross-thread future, GIL hand-offs) costs more CPU than its
matrix products.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ssdrbm_server.errors import FailedPreconditionError, InvalidArgumentError
from ssdrbm_server.store.checkpoints import Checkpoint, CheckpointStore
from ssdrbm_server.store.records import JobRecord

logger = logging.getLogger(__name__)

MAX_GIBBS_STEPS = 1000
# Requests with at most this many multiply-adds run on the event loop (about 0.1 ms of MKL on
# one core: batch 1-5 at 784x500, k = 1); anything larger goes to the thread pool.
INLINE_MAX_MULTIPLY_ADDS = 4_000_000


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve, and the checkpoint step it came from."""

    model: torch.nn.Module
    step: int
    n_visible: int
    n_hidden: int


def load_model(data: bytes) -> torch.nn.Module:
    """Rebuild a model from checkpoint bytes (safetensors + JSON config), in eval mode."""
    from ssdcore.checkpoint import model_from_bytes  # torch-heavy; imported on first use

    model = model_from_bytes(data)
    model.eval()
    return model


class ModelCache:
    """A small LRU of loaded models; concurrent requests for one model share a single load.

    The load runs as a task of its own, so a caller that goes away does not cancel it for the
    others waiting on it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._models: OrderedDict[tuple[str, int], LoadedModel] = OrderedDict()
        self._loading: dict[tuple[str, int], asyncio.Task[LoadedModel]] = {}

    def __len__(self) -> int:
        return len(self._models)

    async def get(
        self, key: tuple[str, int], load: Callable[[], Awaitable[LoadedModel]]
    ) -> LoadedModel:
        """The cached model for ``key``, loading it with ``load()`` on a miss."""
        cached = self._models.get(key)
        if cached is not None:
            self._models.move_to_end(key)
            return cached
        task = self._loading.get(key)
        if task is None:
            task = asyncio.ensure_future(self._load_and_keep(key, load))
            self._loading[key] = task
        return await asyncio.shield(task)

    async def _load_and_keep(
        self, key: tuple[str, int], load: Callable[[], Awaitable[LoadedModel]]
    ) -> LoadedModel:
        try:
            loaded = await load()
        finally:
            del self._loading[key]
        self._models[key] = loaded
        while len(self._models) > self.capacity:
            self._models.popitem(last=False)
        return loaded


def _generator(seed: int) -> torch.Generator | None:
    """A private generator for a seeded request (reproducible, and no shared state between
    threads); None (torch's default generator) when the caller asked for no seed."""
    if seed == 0:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _reconstruct(
    model: torch.nn.Module, v: np.ndarray, k: int, mean_field: bool, seed: int
) -> np.ndarray:
    with torch.inference_mode():
        batch = torch.from_numpy(v)  # (B, V)
        out = model.reconstruct(batch, k=k, mean_field=mean_field, generator=_generator(seed))
        return out.to(torch.float32).cpu().numpy()  # (B, V)


def _hidden(model: torch.nn.Module, v: np.ndarray, sample: bool, seed: int) -> np.ndarray:
    with torch.inference_mode():
        batch = torch.from_numpy(v)  # (B, V)
        if sample:
            out = model.sample_hidden(batch, generator=_generator(seed))  # (B, H)
        else:
            out = model.hidden_probs(batch)  # (B, H)
        return out.to(torch.float32).cpu().numpy()


class ModelServer:
    """Runs Reconstruct / SampleHidden for jobs, with a model cache and a thread pool."""

    def __init__(self, checkpoints: CheckpointStore, *, threads: int, cache_size: int) -> None:
        self.checkpoints = checkpoints
        self.cache = ModelCache(cache_size)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="serving")

    def close(self) -> None:
        """Stop the thread pool (waits for running computations)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    async def model_for(self, job: JobRecord, checkpoint_step: int) -> LoadedModel:
        """The model of ``job`` at ``checkpoint_step`` (0 = latest), loaded or cached."""
        if checkpoint_step < 0:
            raise InvalidArgumentError(
                "checkpoint_step", f"must be >= 0 (0 = latest), got {checkpoint_step}"
            )
        if checkpoint_step == 0 and job.checkpoint_step < 0:
            raise FailedPreconditionError(
                f"job {job.id} has no checkpoint yet (state {job.state.value}); wait until it "
                "writes its first one (see training.checkpoint_every) and retry"
            )
        step = checkpoint_step or job.checkpoint_step

        async def load() -> LoadedModel:
            if checkpoint_step == 0:
                checkpoint = await self.checkpoints.latest(job.id)
            else:
                checkpoint = await self.checkpoints.get(job.id, checkpoint_step)
            return await self._load(checkpoint)

        # Latest and named checkpoints are cached apart: the latest may have fallen back to an
        # older checkpoint (the newest failed its sha256 check), which a named step must not get.
        key = (job.id if checkpoint_step else f"{job.id}:latest", step)
        return await self.cache.get(key, load)

    async def _load(self, checkpoint: Checkpoint) -> LoadedModel:
        loop = asyncio.get_running_loop()
        try:
            model = await loop.run_in_executor(self.pool, load_model, checkpoint.data)
        except ValueError as exc:  # intact bytes (sha256 matched) that are no model of ours
            logger.error("checkpoint at step %d is unreadable: %s", checkpoint.step, exc)
            raise FailedPreconditionError(
                f"the checkpoint at step {checkpoint.step} cannot be read as a model ({exc}); "
                "use another checkpoint_step"
            ) from exc
        logger.info("loaded model at step %d (%s)", checkpoint.step, checkpoint.sha256[:12])
        return LoadedModel(model, checkpoint.step, int(model.n_visible), int(model.n_hidden))

    async def reconstruct(
        self, loaded: LoadedModel, v: np.ndarray, *, k: int, mean_field: bool, seed: int
    ) -> np.ndarray:
        """Reconstruction of ``v`` (B, V) after ``k`` Gibbs steps (0 means 1)."""
        _check_width(loaded, v)
        k = k or 1
        if k > MAX_GIBBS_STEPS:
            raise InvalidArgumentError("k", f"must be at most {MAX_GIBBS_STEPS}, got {k}")
        products = 2 * k  # each Gibbs sweep multiplies by W once each way
        return await self._compute(
            _multiply_adds(loaded, v, products), _reconstruct, loaded.model, v, k, mean_field, seed
        )

    async def hidden(
        self, loaded: LoadedModel, v: np.ndarray, *, sample: bool, seed: int
    ) -> np.ndarray:
        """Hidden probabilities (or samples) for ``v`` (B, V) → (B, H)."""
        _check_width(loaded, v)
        return await self._compute(
            _multiply_adds(loaded, v, 1), _hidden, loaded.model, v, sample, seed
        )

    async def _compute(
        self, multiply_adds: int, function: Callable[..., np.ndarray], *args: object
    ) -> np.ndarray:
        """``function(*args)``: inline when it is tiny, else on the thread pool."""
        if multiply_adds <= INLINE_MAX_MULTIPLY_ADDS:
            return function(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, function, *args)


def _multiply_adds(loaded: LoadedModel, v: np.ndarray, products: int) -> int:
    """The work of ``products`` (B, V) x (V, H)-sized matrix products."""
    return products * v.shape[0] * loaded.n_visible * loaded.n_hidden


def _check_width(loaded: LoadedModel, v: np.ndarray) -> None:
    if v.shape[1] != loaded.n_visible:
        raise InvalidArgumentError(
            "input.shape",
            f"has width {v.shape[1]} but the model has n_visible={loaded.n_visible}; "
            f"send shape (batch, {loaded.n_visible})",
        )
