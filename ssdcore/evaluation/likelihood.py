"""Log-likelihood of data given log Z (exact or estimated)."""

from __future__ import annotations

import math

from torch import Tensor

from ssdcore.evaluation.metrics import mean_free_energy
from ssdcore.models.base import RBM


def log_likelihood(model: RBM, v: Tensor, log_z: float) -> float:
    """Mean log p(v) = -F(v) - log Z over the rows of `v` (nats per example). For a Gaussian RBM
    this is a log density, so it depends on the data's scale."""
    log_z = float(log_z)
    if not math.isfinite(log_z):
        raise ValueError(f"log_z must be finite, got {log_z}")
    return -mean_free_energy(model, v) - log_z
