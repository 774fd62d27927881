"""Rebuild a model from its `config()` dictionary."""

from __future__ import annotations

from typing import Any

from ssdcore.models.base import BASE_PARAMETERS, RBM
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.gaussian import DEFAULT_VARIANCE, VARIANCE_PARAMETERS, GaussianRBM

_MODEL_TYPES: dict[str, type[RBM]] = {
    BernoulliRBM.kind: BernoulliRBM,
    GaussianRBM.kind: GaussianRBM,
}


def model_from_config(config: dict[str, Any], *, device: Any = None) -> RBM:
    """Build an (untrained) model from `model.config()`; load weights with load_state_dict.

    Raises ValueError for an unknown type or missing fields, naming what to fix.
    """
    if not isinstance(config, dict):
        raise ValueError(f"model config must be a dict, got {type(config).__name__}")
    options = dict(config)
    kind = options.pop("type", None)
    if kind not in _MODEL_TYPES:
        raise ValueError(f"model config 'type' must be one of {sorted(_MODEL_TYPES)}, got {kind!r}")
    for field in ("n_visible", "n_hidden"):
        if field not in options:
            raise ValueError(f"model config is missing {field!r}")
    n_visible = int(options.pop("n_visible"))
    n_hidden = int(options.pop("n_hidden"))
    try:
        return _MODEL_TYPES[kind](n_visible, n_hidden, **options, device=device)
    except TypeError as error:
        raise ValueError(f"model config has an unknown field for type {kind!r}: {error}") from None


def parameter_names(kind: str, variance: str | None = None) -> tuple[str, ...]:
    """A model's parameter names in ``named_parameters()`` order, without building it;
    `variance` is the Gaussian RBM's form (its default when None)."""
    if kind == BernoulliRBM.kind:
        return BASE_PARAMETERS
    if kind != GaussianRBM.kind:
        raise ValueError(f"model kind must be one of {sorted(_MODEL_TYPES)}, got {kind!r}")
    extra = VARIANCE_PARAMETERS[variance or DEFAULT_VARIANCE]
    return BASE_PARAMETERS if extra is None else (*BASE_PARAMETERS, extra)
