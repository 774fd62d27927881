"""What a job's training process does the same way for a solo job and a packed run.

The trainer it builds for a job (packed runs continue such Trainers: ssdcore.pack), the
evaluation behind each metric event and its Metrics message, the reason given when training
blew up for good, the device, and the pacing of polls and heartbeats. ``child.py`` (one job)
and ``pack_child.py`` (a pack) both ask here, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore.blowup import BlowUp, suggested_lr
from ssdcore.models import model_from_config
from ssdcore.training import Trainer
from ssdrbm_server.worker.datasets import SplitData
from ssdrbm_server.worker.spec import (
    centering_config,
    model_config,
    optimizer_config,
    tempering_config,
)

MAX_STEPS_BETWEEN_POLLS = 10  # train at most this many steps before looking for a stop request
EXACT_LL_MAX_HIDDEN = 16  # 2^16 hidden states: exact log Z is cheap enough for every event
# Heartbeats go out at most this often, and at least four times per heartbeat deadline.
ALIVE_MAX_INTERVAL_S = 1.0


def pick_device() -> torch.device:
    """CUDA when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_trainer(
    spec: rbm_pb2.StartTrainingRequest, data: SplitData, device: torch.device
) -> Trainer:
    """A fresh Trainer for the job, exactly as its training process builds it (packed runs
    too: the pack continues such Trainers, ssdcore.pack.pack_trainers)."""
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
    """The job's metric event values: AIS when asked, else the exact log-likelihood for
    small hidden layers."""
    if with_ais:
        method = "ais"
    elif spec.model.n_hidden <= EXACT_LL_MAX_HIDDEN:
        method = "exact"
    else:
        method = "none"
    return trainer.evaluate(
        log_likelihood=method, ais_chains=spec.eval.ais_chains, ais_betas=spec.eval.ais_betas
    )


def failure_reason(
    spec: rbm_pb2.StartTrainingRequest,
    backoffs: int,
    last_checkpoint: int,
    blowup: BlowUp,
    lr: float,
) -> str:
    """Why the job failed, with the step size that blew up and one to try instead."""
    training = spec.training
    spent = (
        f"after {backoffs} backoffs"
        if training.max_backoffs
        else "with backoff off (training.max_backoffs 0)"
    )
    scaled = (
        f" (optimizer.lr {spec.optimizer.lr:.3g} / {training.backoff_factor:g}^{backoffs})"
        if backoffs
        else ""
    )
    suggestion = suggested_lr(lr, training.backoff_factor)
    kept = f"step {last_checkpoint}" if last_checkpoint >= 0 else "none"
    return (
        f"training blew up {spent}: {blowup.describe()}; its step size was {lr:.3g}{scaled}; "
        f"try optimizer.lr = {suggestion:.3g} or smaller (the last good checkpoint is {kept})"
    )


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
