"""What a job's training process (``child.py``'s one loop) does the same way for a solo job
and a packed run: its Trainer, evaluations and Metrics messages, blow-up recovery and Backoff
messages, checkpoint contents, device and ``runtime``, and the pacing of polls and heartbeats.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from ssdrbm.spec import METHODS
from ssdrbm.v1 import rbm_pb2

from ssdcore import checkpoint as ssdcheckpoint
from ssdcore.blowup import BackoffEvent, BlowUp, BlowUpError, Recoverable, Recovery
from ssdcore.models import model_from_config
from ssdcore.training import Trainer
from ssdrbm_server.job_spec import (
    centering_config,
    log_likelihood_method,
    model_config,
    optimizer_config,
    tempering_config,
)
from ssdrbm_server.worker.datasets import SplitData

logger = logging.getLogger(__name__)

MAX_STEPS_BETWEEN_POLLS = 10  # train at most this many steps before looking for a stop request
# Heartbeats go out at most this often, and at least four times per heartbeat deadline.
ALIVE_MAX_INTERVAL_S = 1.0


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def runtime(
    spec: rbm_pb2.OptimizerSpec, *, device: str, weight_method: str | None, cuda_graph: bool
) -> rbm_pb2.Runtime:
    """What ran: the device, the polar method of W (SSD jobs) and whether AUTO chose it."""
    runtime = rbm_pb2.Runtime(device=device, cuda_graph=cuda_graph)
    parts = [f"device: {device}"]
    if weight_method is not None:
        runtime.method = METHODS[weight_method]
        automatic = spec.method == rbm_pb2.POLAR_METHOD_AUTO
        chosen = f" (auto on {device.split(':')[0]})" if automatic else ""
        parts.append(f"method: {weight_method}{chosen}")
    if cuda_graph:
        parts.append("CUDA graph")
    runtime.summary = ", ".join(parts)
    return runtime


def build_trainer(
    spec: rbm_pb2.StartTrainingRequest, data: SplitData, device: torch.device
) -> Trainer:
    """A fresh Trainer for the job (a packed run continues one: ssdcore.pack.pack_trainers)."""
    model = model_from_config(model_config(spec, data.n_visible), device=device)
    return Trainer(
        model,
        data.train.to(device),
        optimizer=optimizer_config(spec.optimizer),
        batch_size=spec.training.batch_size,
        cd_k=spec.training.cd_k,
        persistent=spec.training.persistent,
        tempering=tempering_config(spec.training),
        centering=centering_config(spec.training),
        seed=spec.training.seed,
        valid_data=None if data.valid is None else data.valid.to(device),
    )


def evaluate_job(
    trainer: Trainer, spec: rbm_pb2.StartTrainingRequest, *, with_ais: bool
) -> dict[str, Any]:
    """The job's metric event values, with its ``log_likelihood_method``."""
    return trainer.evaluate(
        log_likelihood=log_likelihood_method(spec, with_ais=with_ais),
        ais_chains=spec.eval.ais_chains,
        ais_betas=spec.eval.ais_betas,
    )


def job_recovery(spec: rbm_pb2.StartTrainingRequest, backoffs: int, *, label: str = "") -> Recovery:
    """The job's blow-up recovery (``fit``'s rule with its backoff settings), ``backoffs``
    already taken (kept in its record across attempts); ``label`` names it in the log."""
    return Recovery(
        max_backoffs=spec.training.max_backoffs,
        factor=spec.training.backoff_factor,
        backoffs=backoffs,
        lr_setting="optimizer.lr",
        max_backoffs_setting="training.max_backoffs",
        label=label,
    )


def check_start(
    recovery: Recovery,
    values: dict[str, Any],
    run: Recoverable,
    *,
    resumed: bool,
    recovery_state: str,
) -> BlowUp | None:
    """The evaluation before training (``values``, of ``run`` now) through the recovery: a
    fresh job's baseline and first rollback point (``Recovery.check``); a resumed job's
    detector references from its checkpoint's ``recovery_state``, judging the evaluation without
    taking it in (``Recovery.resume``), so the run goes on as if never stopped (a checkpoint
    written before that state was kept restarts them here, logged)."""
    if resumed and recovery_state:
        return recovery.resume(json.loads(recovery_state), values, run)
    if resumed:
        logger.info(
            "the checkpoint at step %s keeps no blow-up detector references (written by an "
            "older version); they restart from this step",
            values.get("step"),
        )
    return recovery.check(values, run)


def checkpoint_parts(
    trainer: Trainer, recovery: Recovery
) -> tuple[dict[str, bytes], dict[str, Any]]:
    """A checkpoint message's binary parts and fields: everything a resume needs to go on
    exactly as the run would have (model, trainer state, config, the recovery's references)."""
    blobs = {
        "model": ssdcheckpoint.model_to_bytes(trainer.model),
        "trainer": ssdcheckpoint.trainer_to_bytes(trainer),
    }
    fields = {
        "config_json": json.dumps(trainer.model.config(), sort_keys=True),
        "recovery_state": json.dumps(recovery.state_dict(), sort_keys=True),
    }
    return blobs, fields


def backoff_message(event: BackoffEvent) -> rbm_pb2.Backoff:
    return rbm_pb2.Backoff(
        step=event.step,
        rollback_step=event.rolled_back_to,
        reason=event.reason,
        old_lr=event.old_lr,
        new_lr=event.new_lr,
        backoff=event.backoff,
        max_backoffs=event.max_backoffs,
    )


def rollback_needs_checkpoint(event: BackoffEvent, last_checkpoint: int) -> bool:
    """Whether the rollback point must be checkpointed before the backoff is recorded: unless
    it is the last checkpoint (or step 0, which a restart without one starts from again), so a
    crash at any moment retrains the same steps: before the checkpoint, from an earlier one to
    the blow-up; between it and the backoff, from the rollback point with the old count (the
    blow-up again: the resumed detector keeps its references); after both, with the new count.
    """
    return event.rolled_back_to != max(last_checkpoint, 0)


def failure_reason(error: BlowUpError, last_checkpoint: int) -> str:
    """Why the job failed: the recovery's message, and the checkpoint it keeps."""
    kept = f"step {last_checkpoint}" if last_checkpoint >= 0 else "none"
    return f"{error} (the last good checkpoint is {kept})"


_LL_METHODS = {
    "exact": rbm_pb2.LOG_LIKELIHOOD_METHOD_EXACT,
    "ais": rbm_pb2.LOG_LIKELIHOOD_METHOD_AIS,
}


def metrics_message(values: dict[str, Any], *, step: int, total: int) -> rbm_pb2.Metrics:
    """A Metrics message from Trainer.evaluate()'s dict (keys named as the proto's fields)."""
    metrics = rbm_pb2.Metrics(step=step, total_steps=total)
    for name, value in values.items():
        if value is None or name in ("step", "total_steps"):
            continue
        if name == "log_likelihood_method":
            metrics.log_likelihood_method = _LL_METHODS.get(str(value).lower(), 0)
        elif name not in rbm_pb2.Metrics.DESCRIPTOR.fields_by_name:
            continue
        elif isinstance(value, list):  # a repeated field: the tempering's swap rate per pair
            getattr(metrics, name).extend(float(item) for item in value)
        else:
            setattr(metrics, name, float(value))
    return metrics
