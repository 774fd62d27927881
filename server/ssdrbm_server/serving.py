"""Model serving: Reconstruct and SampleHidden against a job's checkpoints.

Models are loaded from checkpoints (safetensors, never pickle) into an LRU cache keyed by job id
and checkpoint step: one Redis read per new checkpoint, not one per request. Large computations
run in a thread pool (torch releases the GIL); tiny ones run inline, because handing a batch-1
request to the pool (a queue, a thread wake-up, a cross-thread future, GIL hand-offs) costs more
CPU than its matrix products.

Every call's output elements are checked against ``max_serving_output_elements`` before it
computes. A pooled call computes its rows in chunks of ``serving_chunk_rows`` and, between
chunks, stops once its caller has gone or its deadline has passed, so a client that gave up no
longer holds a pool thread. A tenant has at most ``max_serving_calls_per_tenant`` calls in the
pool; a further one waits up to ``serving_wait_seconds`` (or its deadline) for a slot, so a short
burst is smoothed over while one tenant's flood cannot hold every pool thread for long.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ssdrbm_server.call_slots import CallSlots, SlotCap
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from ssdrbm_server.metrics import ServiceMetrics
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


def load_model(checkpoint: Checkpoint) -> torch.nn.Module:
    """Rebuild a checkpoint's model (safetensors + JSON config), in eval mode."""
    from ssdcore.checkpoint import model_from_bytes  # torch-heavy; imported on first use

    try:
        model = model_from_bytes(checkpoint.data)
    except ValueError as exc:  # intact bytes (sha256 matched) that are no model of ours
        raise FailedPreconditionError(
            f"the checkpoint at step {checkpoint.step} cannot be read as a model ({exc}); "
            "use another checkpoint_step"
        ) from exc
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

    def forget(self, job_id: str) -> None:
        """Drop every cached model of ``job_id`` (deleted), latest and named steps alike."""
        names = (job_id, f"{job_id}:latest")
        for key in [key for key in self._models if key[0] in names]:
            del self._models[key]

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


class Abandoned(Exception):
    """A computation stopped between chunks: its caller left or its deadline passed."""


@dataclass
class Chunking:
    """How one call computes its rows: chunk size, and the stop signal the event loop sets.

    ``cancelled`` is set from the event loop and read by the computing thread between chunks
    (a threading.Event, since the two run on different threads).
    """

    rows: int
    deadline: float | None = None  # time.monotonic() past which the caller no longer waits
    metrics: ServiceMetrics | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def stop_reason(self) -> str | None:
        if self.cancelled.is_set():
            return "the client cancelled the call"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "the client's deadline passed"
        return None

    def count(self, outcome: str, chunks: int) -> None:
        if self.metrics is not None and chunks:
            self.metrics.serving_chunks.labels(outcome=outcome).inc(chunks)


def _in_chunks(
    v: np.ndarray, width: int, chunking: Chunking, rows_out: Callable[[torch.Tensor], torch.Tensor]
) -> np.ndarray:
    """``rows_out`` applied to ``v`` (B, V) chunk by chunk, written into one (B, width) array;
    raises Abandoned between chunks once the caller has gone."""
    out = np.empty((v.shape[0], width), dtype=np.float32)
    starts = range(0, v.shape[0], chunking.rows)
    for done, start in enumerate(starts):
        reason = chunking.stop_reason()
        if reason is not None:
            chunking.count("abandoned", len(starts) - done)
            logger.info("serving stopped after %d of %d chunks: %s", done, len(starts), reason)
            raise Abandoned(reason)
        stop = start + chunking.rows
        out[start:stop] = rows_out(torch.from_numpy(v[start:stop])).to(torch.float32).numpy()
        chunking.count("computed", 1)
    return out


def _reconstruct(
    model: torch.nn.Module, v: np.ndarray, k: int, mean_field: bool, seed: int, chunking: Chunking
) -> np.ndarray:
    generator = _generator(seed)  # one for all chunks: a seeded call is reproducible
    with torch.inference_mode():
        return _in_chunks(  # (B, V)
            v,
            v.shape[1],
            chunking,
            lambda rows: model.reconstruct(rows, k=k, mean_field=mean_field, generator=generator),
        )


def _hidden(
    model: torch.nn.Module, v: np.ndarray, sample: bool, seed: int, chunking: Chunking
) -> np.ndarray:
    generator = _generator(seed)
    width = int(model.n_hidden)
    with torch.inference_mode():
        if sample:
            return _in_chunks(
                v, width, chunking, lambda r: model.sample_hidden(r, generator=generator)
            )
        return _in_chunks(v, width, chunking, model.hidden_probs)  # (B, H)


@dataclass(frozen=True)
class Caller:
    """Who asks, and how long they wait (seconds; None: no deadline)."""

    tenant: str = ""
    time_remaining: float | None = None


class ModelServer:
    """Runs Reconstruct / SampleHidden for jobs, with a model cache and a thread pool."""

    def __init__(
        self,
        checkpoints: CheckpointStore,
        settings: Settings,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.checkpoints = checkpoints
        self.settings = settings
        self.cache = ModelCache(settings.model_cache_size)
        self.pool = ThreadPoolExecutor(
            max_workers=settings.serving_threads, thread_name_prefix="serving"
        )
        self.metrics = metrics
        self.slots = CallSlots(  # no server cap: the pool's threads are that bound
            None,
            SlotCap(
                settings.max_serving_calls_per_tenant,
                "max_serving_calls_per_tenant",
                "tenant {tenant!r} already has {count} serving calls computing "
                "(SSDRBM_MAX_SERVING_CALLS_PER_TENANT={limit}) and none finished within "
                "{wait_s} s; retry with backoff or send fewer calls at once",
            ),
        )

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
                "writes its first one (see training.checkpoint_every) and retry",
                precondition="NO_CHECKPOINT",
                subject=f"job:{job.id}",
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
            model = await loop.run_in_executor(self.pool, load_model, checkpoint)
        except FailedPreconditionError as exc:
            logger.error("checkpoint at step %d is unreadable: %s", checkpoint.step, exc.__cause__)
            raise
        logger.info("loaded model at step %d (%s)", checkpoint.step, checkpoint.sha256[:12])
        return LoadedModel(model, checkpoint.step, int(model.n_visible), int(model.n_hidden))

    async def reconstruct(
        self,
        loaded: LoadedModel,
        v: np.ndarray,
        *,
        k: int,
        mean_field: bool,
        seed: int,
        caller: Caller | None = None,
    ) -> np.ndarray:
        """Reconstruction of ``v`` (B, V) after ``k`` Gibbs steps (0 means 1)."""
        _check_width(loaded, v)
        k = k or 1
        if k > MAX_GIBBS_STEPS:
            raise InvalidArgumentError("k", f"must be at most {MAX_GIBBS_STEPS}, got {k}")
        self._check_output(v.shape[0] * loaded.n_visible * k, f"batch × n_visible × k (k={k})", v)
        products = 2 * k  # each Gibbs sweep multiplies by W once each way
        work = functools.partial(_reconstruct, loaded.model, v, k, mean_field, seed)
        return await self._compute(_multiply_adds(loaded, v, products), caller or Caller(), work)

    async def hidden(
        self,
        loaded: LoadedModel,
        v: np.ndarray,
        *,
        sample: bool,
        seed: int,
        caller: Caller | None = None,
    ) -> np.ndarray:
        """Hidden probabilities (or samples) for ``v`` (B, V) → (B, H)."""
        _check_width(loaded, v)
        self._check_output(v.shape[0] * loaded.n_hidden, "batch × n_hidden", v)
        work = functools.partial(_hidden, loaded.model, v, sample, seed)
        return await self._compute(_multiply_adds(loaded, v, 1), caller or Caller(), work)

    def _check_output(self, elements: int, formula: str, v: np.ndarray) -> None:
        """Refuse before computing: the output (and its intermediates) would be this big."""
        limit = self.settings.max_serving_output_elements
        if elements > limit:
            rows = max(limit * v.shape[0] // elements, 0)
            raise ResourceExhaustedError(
                f"input: {formula} = {elements} output elements is over this server's limit of "
                f"{limit} (SSDRBM_MAX_SERVING_OUTPUT_ELEMENTS); send at most {rows} rows per "
                "call and split the rest over further calls",
                limit="max_serving_output_elements",
            )

    async def _compute(
        self, multiply_adds: int, caller: Caller, work: Callable[[Chunking], np.ndarray]
    ) -> np.ndarray:
        """``work(chunking)``: inline when it is tiny, else on the thread pool, holding one of the
        tenant's slots and stopped between chunks when the caller left."""
        if multiply_adds <= INLINE_MAX_MULTIPLY_ADDS:
            # Same chunks as in the pool, so a seeded call answers alike either way.
            return work(Chunking(self.settings.serving_chunk_rows))
        remaining = caller.time_remaining
        deadline = None if remaining is None else time.monotonic() + remaining
        chunking = Chunking(self.settings.serving_chunk_rows, deadline, self.metrics)
        wait_s = self.settings.serving_wait_seconds
        if remaining is not None:
            wait_s = min(wait_s, remaining)
        async with self.slots.hold_waiting(caller.tenant, wait_s):
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(self.pool, work, chunking)
            except asyncio.CancelledError:
                chunking.cancelled.set()  # the client left: the thread stops at its next chunk
                raise
            except Abandoned as exc:
                raise DeadlineExceededError(
                    f"stopped computing: {exc}; send fewer rows per call or allow a longer deadline"
                ) from None


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
