"""Cheap training metrics: reconstruction error, pseudo-log-likelihood, free-energy gap, ‖W‖₂,
the fraction of stuck hidden units."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssdcore.models.base import RBM, check_visible
from ssdcore.models.bernoulli import BernoulliRBM

# Rows per chunk, so that evaluating a large data set never holds more than a few MB at once.
_EVAL_ROWS = 1024
# Elements (rows × flipped units × hidden units) per chunk of the exact pseudo-log-likelihood.
_PLL_CHUNK_ELEMENTS = 1 << 22
# A hidden unit is saturated on an example when p(h = 1 | v) is within this of 0 or 1. Its
# sigmoid's slope p(1 - p) is then below 1e-6, so the unit no longer responds to its input: a
# CD gradient moves it by a millionth of what it moves an unsaturated unit, and its samples are
# the same on (almost) every draw. Compared on the hidden input (the logit), where float32
# still resolves it: p within 1e-6 of 1 is a rounding step or two away from exactly 1.0.
SATURATION_PROBABILITY = 1e-6
SATURATION_LOGIT = math.log((1 - SATURATION_PROBABILITY) / SATURATION_PROBABILITY)  # ≈ 13.8


@torch.no_grad()
def reconstruction_error(
    model: RBM,
    v: torch.Tensor,
    *,
    mean_field: bool = True,
    generator: torch.Generator | None = None,
) -> float:
    """Sum of squared errors per example, averaged over examples (the paper's metric). The
    reconstruction is one Gibbs sweep v → h → E[v | h]; with `mean_field=True` (the default) h is
    p(h | v) rather than a sample, which makes the metric deterministic."""
    check_visible(v, model.n_visible)
    total = 0.0
    for chunk in v.split(_EVAL_ROWS):
        recon = model.reconstruct(chunk, k=1, mean_field=mean_field, generator=generator)
        total += float((recon - chunk).square().sum())
    return total / v.shape[0]


@torch.no_grad()
def pseudo_log_likelihood(
    model: BernoulliRBM,
    v: torch.Tensor,
    *,
    bits: str = "all",
    generator: torch.Generator | None = None,
) -> float:
    """Mean pseudo-log-likelihood Σ_i log p(v_i | v_-i) per example, for binary data. `bits="all"`
    (default) is exact: every unit is flipped in turn, using log p(v_i | v_-i) = log σ(F(v with bit
    i flipped) - F(v)); flipping bit i moves the hidden input by ±W_i, so this costs O(B·V·H)
    without recomputing the products. `bits="random"` is scikit-learn's stochastic estimate: one
    random bit per example, times V."""
    if not isinstance(model, BernoulliRBM):
        raise TypeError("pseudo_log_likelihood needs binary visible units (a BernoulliRBM)")
    check_visible(v, model.n_visible)
    if bits not in ("all", "random"):
        raise ValueError(f"bits must be 'all' or 'random', got {bits!r}")
    total = 0.0
    for chunk in v.split(_EVAL_ROWS):
        if bits == "all":
            total += float(_pll_exact(model, chunk).sum())
        else:
            total += float(_pll_random(model, chunk, generator).sum())
    return total / v.shape[0]


def _pll_exact(model: BernoulliRBM, v: torch.Tensor) -> torch.Tensor:
    hidden_input = model.hidden_input(v)  # (B, H)
    base = F.softplus(hidden_input).sum(dim=1)  # (B,)
    sign = 1.0 - 2.0 * v  # +1 where the bit flips 0 → 1, -1 for 1 → 0
    result = torch.zeros(v.shape[0], device=v.device)
    per_unit = max(1, _PLL_CHUNK_ELEMENTS // max(1, v.shape[0] * model.n_hidden))
    for start in range(0, model.n_visible, per_unit):
        units = slice(start, start + per_unit)
        # hidden input after flipping unit i: x + sign_i · W_i  → (B, units, H)
        flipped = hidden_input.unsqueeze(1) + sign[:, units].unsqueeze(2) * model.W[units]
        # F(flip) - F(v) = -b_i·sign_i - (Σ softplus(flipped) - Σ softplus(x))
        delta = -sign[:, units] * model.b[units] - (F.softplus(flipped).sum(dim=2) - base[:, None])
        result += F.logsigmoid(delta).sum(dim=1)
    return result


def _pll_random(
    model: BernoulliRBM, v: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    index = torch.randint(0, model.n_visible, (v.shape[0],), generator=generator, device=v.device)
    flipped = v.clone()
    rows = torch.arange(v.shape[0], device=v.device)
    flipped[rows, index] = 1.0 - flipped[rows, index]
    delta = model.free_energy(flipped) - model.free_energy(v)
    return model.n_visible * F.logsigmoid(delta)


@torch.no_grad()
def mean_free_energy(model: RBM, v: torch.Tensor) -> float:
    """Mean free energy F(v) over the rows of `v`."""
    check_visible(v, model.n_visible)
    total = sum(float(model.free_energy(chunk).sum()) for chunk in v.split(_EVAL_ROWS))
    return total / v.shape[0]


def free_energy_gap(model: RBM, train: torch.Tensor, valid: torch.Tensor) -> float:
    """mean F(valid) - mean F(train): grows when the model overfits the training set."""
    return mean_free_energy(model, valid) - mean_free_energy(model, train)


@torch.no_grad()
def saturated_hidden_fraction(model: RBM, v: torch.Tensor) -> float:
    """Fraction of hidden units saturated on every row of ``v``: stuck units. A unit counts when
    p(h = 1 | v) < SATURATION_PROBABILITY or > 1 - SATURATION_PROBABILITY for each example (either
    side, per example). Near 1 after a blow-up, when huge weights make every unit deterministic;
    also high for a Bernoulli RBM whose hidden units all settled "on" to carry the visible biases
    (binarized Frey Face with SGD), which is no blow-up."""
    check_visible(v, model.n_visible)
    stuck = torch.ones(model.n_hidden, dtype=torch.bool, device=v.device)
    for chunk in v.split(_EVAL_ROWS):
        stuck &= (model.hidden_input(chunk).abs() > SATURATION_LOGIT).all(dim=0)
    return float(stuck.float().mean())


@torch.no_grad()
def spectral_norm(W: torch.Tensor) -> float:
    """‖W‖₂, the largest singular value (the paper assumes ‖W‖₂ ≤ R)."""
    return float(torch.linalg.matrix_norm(W.detach(), ord=2))
