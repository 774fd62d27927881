"""Optimizers for RBMs: SGD / Nesterov, Stochastic Spectral Descent and its preconditioned form.

See :mod:`ssdcore.optim.polar` for the ways of computing the spectral step.
"""

from __future__ import annotations

from ssdcore.optim import polar
from ssdcore.optim.config import OptimizerConfig, build_optimizer
from ssdcore.optim.preconditioned import PreconditionedSSD
from ssdcore.optim.projection import project_spectral_norm_
from ssdcore.optim.sgd import SGD
from ssdcore.optim.ssd import SSD

__all__ = [
    "SGD",
    "SSD",
    "OptimizerConfig",
    "PreconditionedSSD",
    "build_optimizer",
    "polar",
    "project_spectral_norm_",
]
