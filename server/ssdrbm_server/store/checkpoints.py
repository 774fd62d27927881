"""Checkpoints of a job: the last few, each verified by sha256 when read.

A checkpoint `job:{<id>}:ckpt:<step>` holds the model as safetensors (`data`: serving and
ExportModel), its JSON config, the full trainer state a worker resumes from (`trainer_state`:
optimizer, PCD chains, random generators) and the blow-up recovery's state at that step
(`recovery_state`, the detector's references as JSON, empty in checkpoints written before it was
kept), so a resumed run judges blow-ups as the uninterrupted one would. Each part carries a
sha256; `latest()` skips a checkpoint that fails it for the previous good one. Workers write
checkpoints in one fenced script (store/fencing.py); this module reads.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from ssdrbm_server.errors import FailedPreconditionError, NotFoundError
from ssdrbm_server.store.connection import Store

logger = logging.getLogger(__name__)

DEFAULT_KEEP = 3  # checkpoints retained per job: the newest and two to fall back on


@dataclass
class Checkpoint:
    """One verified checkpoint."""

    step: int
    data: bytes  # model, safetensors (ssdcore.checkpoint.model_to_bytes)
    sha256: str  # of `data`
    attempt: int  # the worker attempt that wrote it
    config_json: str  # the model's config, enough to rebuild it
    trainer_state: bytes = b""  # ssdcore.checkpoint.trainer_to_bytes; empty unless requested
    trainer_sha256: str = ""
    # ssdcore.blowup.Recovery.state_dict() as JSON, with the trainer state; empty unless
    # requested, or when the checkpoint was written before it was kept
    recovery_state: str = ""


def sha256_hex(data: bytes) -> str:
    """Hex sha256 digest of `data`."""
    return hashlib.sha256(data).hexdigest()


def checkpoint_fields(
    *,
    step: int,
    data: bytes,
    config_json: str,
    trainer_state: bytes,
    recovery_state: str,
    attempt: int,
) -> dict[str, bytes | str | int]:
    """Hash fields of a checkpoint about to be written (digests computed here)."""
    return {
        "step": step,
        "data": data,
        "sha256": sha256_hex(data),
        "config_json": config_json,
        "trainer_state": trainer_state,
        "trainer_sha256": sha256_hex(trainer_state),
        "recovery_state": recovery_state,
        "recovery_sha256": sha256_hex(recovery_state.encode()),
        "attempt": attempt,
    }


class CorruptCheckpointError(FailedPreconditionError):
    """A checkpoint's bytes do not match their recorded sha256."""

    reason = "CHECKPOINT_CORRUPT"


_MODEL_FIELDS = ("step", "data", "sha256", "attempt", "config_json")
_RESUME_FIELDS = ("trainer_state", "trainer_sha256", "recovery_state", "recovery_sha256")
_ALL_FIELDS = (*_MODEL_FIELDS, *_RESUME_FIELDS)


class CheckpointStore(Store):
    """Reads a job's retained checkpoints, verifying each."""

    async def list_steps(self, job_id: str) -> list[int]:
        """Steps of the retained checkpoints, oldest first."""
        members = await self.redis.zrange(self.keys.checkpoint_index(job_id), 0, -1)
        return sorted(int(m) for m in members)

    async def latest(self, job_id: str, *, with_trainer_state: bool = False) -> Checkpoint:
        """The newest checkpoint that passes its sha256 check, falling back to older ones;
        FailedPreconditionError when the job has none (or none intact)."""
        steps = await self.list_steps(job_id)
        for step in reversed(steps):
            try:
                return await self.get(job_id, step, with_trainer_state=with_trainer_state)
            except CorruptCheckpointError as exc:
                logger.error("job %s: %s; falling back to the previous checkpoint", job_id, exc)
            except NotFoundError:
                continue  # removed by retention between listing and reading
        if steps:
            raise FailedPreconditionError(
                f"job {job_id} has no intact checkpoint (all failed their sha256 check)",
                precondition="NO_INTACT_CHECKPOINT",
                subject=f"job:{job_id}",
            )
        raise FailedPreconditionError(
            f"job {job_id} has no checkpoint yet; wait until it has trained to its first "
            "checkpoint (see training.checkpoint_every)",
            precondition="NO_CHECKPOINT",
            subject=f"job:{job_id}",
        )

    async def get(self, job_id: str, step: int, *, with_trainer_state: bool = False) -> Checkpoint:
        """The checkpoint at `step`; NotFoundError if not retained, CorruptCheckpointError
        (FAILED_PRECONDITION) if its bytes fail the sha256 check."""
        names = _ALL_FIELDS if with_trainer_state else _MODEL_FIELDS
        values = await self.redis.hmget(self.keys.checkpoint(job_id, step), list(names))
        raw = dict(zip(names, values, strict=True))
        if raw["data"] is None:
            steps = await self.list_steps(job_id)
            raise NotFoundError(
                f"job {job_id} has no checkpoint at step {step}; retained steps: {steps or 'none'}",
                resource_type="checkpoint",
                resource_name=f"{job_id}@{step}",
            )
        checkpoint = Checkpoint(
            step=int(raw["step"]),
            data=raw["data"],
            sha256=raw["sha256"].decode(),
            attempt=int(raw["attempt"]),
            config_json=raw["config_json"].decode(),
        )
        if sha256_hex(checkpoint.data) != checkpoint.sha256:
            raise CorruptCheckpointError(
                f"checkpoint at step {step} of job {job_id} is corrupted (sha256 mismatch); "
                "use an earlier checkpoint_step"
            )
        if with_trainer_state:
            _load_resume_state(checkpoint, raw, job_id)
        return checkpoint


def _load_resume_state(checkpoint: Checkpoint, raw: dict, job_id: str) -> None:
    """The trainer and recovery states of ``checkpoint`` from its ``raw`` fields, each checked
    against its sha256 (a checkpoint written before the recovery state was kept has neither
    that state nor its digest)."""
    step = checkpoint.step
    checkpoint.trainer_state = raw["trainer_state"] or b""
    checkpoint.trainer_sha256 = (raw["trainer_sha256"] or b"").decode()
    if sha256_hex(checkpoint.trainer_state) != checkpoint.trainer_sha256:
        raise CorruptCheckpointError(
            f"trainer state at step {step} of job {job_id} is corrupted (sha256 mismatch)"
        )
    recovery_state = raw["recovery_state"] or b""
    if raw["recovery_sha256"] is not None and sha256_hex(recovery_state) != (
        raw["recovery_sha256"].decode()
    ):
        raise CorruptCheckpointError(
            f"blow-up recovery state at step {step} of job {job_id} is corrupted (sha256 mismatch)"
        )
    checkpoint.recovery_state = recovery_state.decode()
