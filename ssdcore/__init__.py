"""ssdcore: Bernoulli and Gaussian RBMs trained by CD/PCD with SGD or Stochastic Spectral Descent.

Pure torch; no service dependencies. See docs/ARCHITECTURE.md for the public interfaces.
"""

from __future__ import annotations

from ssdcore.errors import DivergenceError
from ssdcore.gradients import CDEstimator, CDStats
from ssdcore.models import RBM, BernoulliRBM, GaussianRBM, model_from_config

# --- optimizers and training ---
# (exports of ssdcore.optim, Trainer and fit go here)
# --- end optimizers and training ---

__all__ = [
    "RBM",
    "BernoulliRBM",
    "CDEstimator",
    "CDStats",
    "DivergenceError",
    "GaussianRBM",
    "model_from_config",
]
