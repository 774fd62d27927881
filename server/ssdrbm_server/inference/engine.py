"""The Open Inference Protocol's operations for one tenant, on the service's serving path.

Both transports (gRPC servicer.py, REST rest.py) call these with the caller's tenant; the
computing is ``serving.ModelServer``'s, shared with SampleHidden and Reconstruct: the same model
cache, thread pool, per-tenant slots, output budget and deadline checks, so the numbers and the
limits are those of ssdrbm.v1. Outputs:

- ``hidden_probs``: p(h = 1 | v), (B, H), as SampleHidden with HIDDEN_MODE_PROBABILITIES;
- ``hidden_sample``: 0/1 draws from it, (B, H), seeded by the ``seed`` parameter;
- ``reconstruction``: one mean-field step, (B, V), as Reconstruct with k = 1, mean_field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence, Sized
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from ssdrbm.v1 import rbm_pb2

from ssdrbm_server.errors import InvalidArgumentError, NotFoundError
from ssdrbm_server.inference.codec import INPUT_NAME, OUTPUT_DATATYPE
from ssdrbm_server.inference.names import ModelNames, parse_version
from ssdrbm_server.request_bounds import items_at_most, quoted
from ssdrbm_server.serving import Caller, ModelServer
from ssdrbm_server.store.records import JobRecord

HIDDEN_PROBS = "hidden_probs"
HIDDEN_SAMPLE = "hidden_sample"
RECONSTRUCTION = "reconstruction"
OUTPUTS = (HIDDEN_PROBS, HIDDEN_SAMPLE, RECONSTRUCTION)
DEFAULT_OUTPUTS = (HIDDEN_PROBS,)
SERVER_NAME = "ssdrbm"
PLATFORM = "ssdrbm"
READY_TIMEOUT_S = 1.0  # ServerReady waits this long for Redis's PING
UNKNOWN_DIM = -1  # the protocol's "any size" dimension


@dataclass(frozen=True)
class TensorInfo:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    """ModelMetadata of one model: its canonical name (the job id) and retained versions."""

    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class InferResult:
    """ModelInfer's answer: the job id, the checkpoint step used, and the named outputs."""

    model_name: str
    model_version: str
    outputs: list[tuple[str, np.ndarray]]


def bound_outputs(outputs: Sized) -> None:
    """Refuse more requested outputs than the model has, before any of them is read."""
    items_at_most("outputs", outputs, len(OUTPUTS), f"name each of {', '.join(OUTPUTS)} once")


def requested_outputs(names: Sequence[str]) -> tuple[str, ...]:
    """The outputs to compute: the ones named (checked, each once), or the default."""
    if not names:
        return DEFAULT_OUTPUTS
    bound_outputs(names)
    for index, name in enumerate(names):
        if name not in OUTPUTS:
            raise InvalidArgumentError(
                f"outputs[{index}].name",
                f"unknown output {quoted(name)}; choose from {', '.join(OUTPUTS)}",
            )
    if len(set(names)) != len(names):
        raise InvalidArgumentError("outputs", f"name each output once, got {list(names)}")
    return tuple(names)


class InferenceEngine:
    """ServerReady, ModelReady, ModelMetadata and ModelInfer for a tenant."""

    def __init__(self, names: ModelNames, models: ModelServer, redis: aioredis.Redis) -> None:
        self.names = names
        self.models = models
        self.redis = redis

    async def server_ready(self) -> bool:
        """True while Redis, where models and checkpoints live, answers."""
        try:
            await asyncio.wait_for(self.redis.ping(), READY_TIMEOUT_S)
        except (TimeoutError, RedisError, OSError):
            return False
        return True

    async def model_ready(self, tenant: str, name: str, version: str) -> bool:
        """True once the job has a checkpoint (at ``version``, when one is named)."""
        job = await self.names.job(tenant, name)
        step = parse_version(version)
        if job.checkpoint_step < 0:
            return False
        return step == 0 or step in await self.names.versions(job)

    async def metadata(self, tenant: str, name: str, version: str) -> ModelInfo:
        """The model's versions, input and outputs (shapes from its spec; -1 until known)."""
        job = await self.names.job(tenant, name)
        step = parse_version(version)
        versions = await self.names.versions(job)
        if step and step not in versions:
            raise _version_not_found(job, step, versions)
        n_visible = job.n_visible or UNKNOWN_DIM
        n_hidden = rbm_pb2.StartTrainingRequest.FromString(job.spec).model.n_hidden or UNKNOWN_DIM
        width = {HIDDEN_PROBS: n_hidden, HIDDEN_SAMPLE: n_hidden, RECONSTRUCTION: n_visible}
        return ModelInfo(
            name=job.id,
            versions=tuple(str(s) for s in versions),
            platform=PLATFORM,
            inputs=(TensorInfo(INPUT_NAME, "FP32", (UNKNOWN_DIM, n_visible)),),
            outputs=tuple(
                TensorInfo(output, OUTPUT_DATATYPE, (UNKNOWN_DIM, width[output]))
                for output in OUTPUTS
            ),
        )

    async def infer(
        self,
        caller: Caller,
        name: str,
        version: str,
        v: np.ndarray,
        *,
        outputs: Sequence[str],
        seed: int,
    ) -> InferResult:
        """The requested outputs for ``v`` (B, V) float32, each under the serving budgets."""
        selected = requested_outputs(outputs)
        job = await self.names.job(caller.tenant, name)
        step = parse_version(version)
        try:
            loaded = await self.models.model_for(job, step)
        except NotFoundError:
            raise _version_not_found(job, step, await self.names.versions(job)) from None
        results = []
        for output in selected:
            if output == RECONSTRUCTION:
                out = await self.models.reconstruct(
                    loaded, v, k=1, mean_field=True, seed=0, caller=caller
                )
            else:
                sample = output == HIDDEN_SAMPLE
                out = await self.models.hidden(loaded, v, sample=sample, seed=seed, caller=caller)
            results.append((output, out))
        return InferResult(job.id, str(loaded.step), results)


def _version_not_found(job: JobRecord, step: int, versions: list[int]) -> NotFoundError:
    retained = ", ".join(str(s) for s in versions) or "none yet"
    return NotFoundError(
        f"model {job.id} has no version {step} (retained checkpoint steps: {retained}); "
        "use one of those or an empty version for the latest",
        resource_type="model_version",
        resource_name=f"{job.id}/{step}",
    )
