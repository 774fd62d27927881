"""Which models a pack trains, and what a pack needs to know of each kind.

Bernoulli RBMs, or Gaussian RBMs of one variance form among :data:`PACKABLE_VARIANCES`. The full
covariance is not packed: its V×V precision is projected onto the SPD cone by an eigendecomposition
decided on the host after every step, and its gradient and noise need per-run V×V products and
Cholesky factors; the solo Trainer runs it.
"""

from __future__ import annotations

from typing import Any

import torch

from ssdcore.models.base import RBM
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.factory import model_from_config
from ssdcore.models.factory import parameter_names as model_parameter_names
from ssdcore.models.gaussian import DEFAULT_VARIANCE, VARIANCE_PARAMETERS, GaussianRBM

# The Gaussian variance forms a pack runs: all but the full covariance (see above).
PACKABLE_VARIANCES = tuple(form for form in VARIANCE_PARAMETERS if form != "full")


def check_packable(model_config: dict[str, Any]) -> None:
    """ValueError naming the model setting a pack does not run."""
    kind = model_config.get("type")
    if kind == BernoulliRBM.kind:
        return
    if kind != GaussianRBM.kind:
        raise ValueError(
            f"model type {kind!r} cannot be packed; packs train {BernoulliRBM.kind!r} and "
            f"{GaussianRBM.kind!r} RBMs"
        )
    variance = model_config.get("variance", DEFAULT_VARIANCE)
    if variance not in PACKABLE_VARIANCES:
        raise ValueError(
            f"a Gaussian RBM with variance={variance!r} cannot be packed (its V×V precision is "
            f"projected per run on the host); packs run variance in {PACKABLE_VARIANCES}; "
            "train it with the solo Trainer"
        )


def model_signature(model_config: dict[str, Any]) -> tuple:
    """What runs of one pack share about their model: kind, variance form and shape (the
    variance bounds may differ: each run's are applied to its own slice)."""
    check_packable(model_config)
    kind = model_config["type"]
    variance = model_config.get("variance", DEFAULT_VARIANCE) if kind == GaussianRBM.kind else None
    return (kind, variance, int(model_config["n_visible"]), int(model_config["n_hidden"]))


def variance_parameter(model_config: dict[str, Any]) -> str | None:
    """The name of a Gaussian model's variance parameter (None for Bernoulli and C = I)."""
    _, variance, _, _ = model_signature(model_config)
    return None if variance is None else VARIANCE_PARAMETERS[variance]


def parameter_names(model_config: dict[str, Any]) -> tuple[str, ...]:
    """The model's parameter names, as ``named_parameters()`` gives them."""
    kind, variance, _, _ = model_signature(model_config)
    return model_parameter_names(kind, variance)


def template_model(model_config: dict[str, Any], device: torch.device | str = "cpu") -> RBM:
    """A model of the configuration's kind, form and shape (weights zero): what the solo
    optimizer would be built for, to read its parameter groups and default step sizes."""
    check_packable(model_config)
    return model_from_config({**model_config, "init_std": 0.0}, device=device)
