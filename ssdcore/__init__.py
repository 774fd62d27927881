"""ssdcore: Bernoulli and Gaussian RBMs trained by CD/PCD with SGD or Stochastic Spectral Descent.

Pure torch; no service dependencies. See docs/ARCHITECTURE.md for the public interfaces.
"""

from __future__ import annotations

from ssdcore import data
from ssdcore.data import load_frey_face, load_mnist, preprocess, synthetic_rbm_data
from ssdcore.errors import BlowUpError, DivergenceError
from ssdcore.evaluation import (
    AISResult,
    LikelihoodBounds,
    ais_log_partition,
    certified_log_likelihood,
    data_base_rates,
    exact_log_partition,
    free_energy_gap,
    log_likelihood,
    pseudo_log_likelihood,
    reconstruction_error,
    reverse_ais_log_likelihood,
    spectral_norm,
)
from ssdcore.gradients import CDEstimator, CDStats
from ssdcore.models import RBM, BernoulliRBM, GaussianRBM, model_from_config

# --- optimizers and training ---
# isort: split
from ssdcore import optim
from ssdcore.centering import CenteringConfig
from ssdcore.optim import OptimizerConfig, build_optimizer
from ssdcore.tempering import TemperingConfig
from ssdcore.training import Trainer, fit, steps_per_epoch

# --- end optimizers and training ---

__all__ = [
    "RBM",
    "AISResult",
    "BernoulliRBM",
    "BlowUpError",
    "CDEstimator",
    "CDStats",
    "CenteringConfig",
    "DivergenceError",
    "GaussianRBM",
    "LikelihoodBounds",
    "OptimizerConfig",
    "TemperingConfig",
    "Trainer",
    "ais_log_partition",
    "build_optimizer",
    "certified_log_likelihood",
    "data",
    "data_base_rates",
    "exact_log_partition",
    "fit",
    "free_energy_gap",
    "load_frey_face",
    "load_mnist",
    "log_likelihood",
    "model_from_config",
    "optim",
    "preprocess",
    "pseudo_log_likelihood",
    "reconstruction_error",
    "reverse_ais_log_likelihood",
    "spectral_norm",
    "steps_per_epoch",
    "synthetic_rbm_data",
]
