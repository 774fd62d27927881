"""RBM models: the shared base class, the Bernoulli and Gaussian RBMs, and the config factory."""

from __future__ import annotations

from ssdcore.models.base import RBM, GibbsKernel
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.factory import model_from_config
from ssdcore.models.gaussian import MAX_FULL_VISIBLE, VARIANCE_KINDS, GaussianRBM

__all__ = [
    "MAX_FULL_VISIBLE",
    "RBM",
    "VARIANCE_KINDS",
    "BernoulliRBM",
    "GaussianRBM",
    "GibbsKernel",
    "model_from_config",
]
