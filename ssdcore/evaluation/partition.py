"""Exact log partition function by enumerating the binary states of one layer.

Bernoulli RBM: summing out the other layer in closed form,
    log Z = logsumexp_h [aᵀh + Σ_i softplus(b + Wh)_i]     (or the same over v with a, b swapped),
so the cost is O(2^n · (V + H)) for the n units enumerated (the smaller layer, n ≤ 24).
Gaussian RBM: the visible integral is Gaussian,
    ∫ exp(-E(v, h)) dv = (2π)^(V/2) |C|^(1/2) exp(aᵀh + bᵀC⁻¹Wh + ½ hᵀWᵀC⁻¹Wh),
so only the hidden states are enumerated (n_hidden ≤ 24), at O(2^H · H) cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ssdcore.models.base import RBM
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.gaussian import GaussianRBM

MAX_ENUMERATED_UNITS = 24
_CHUNK_BITS = 14  # 16384 states per chunk
# Gaussian RBM: 2^12 low states × 2^10 high states per block (32 MB in float64).
_LOW_BITS = 12
_HIGH_CHUNK_BITS = 10


@torch.no_grad()
def exact_log_partition(model: RBM, *, dtype: torch.dtype = torch.float64) -> float:
    """log Z of `model`, exactly (in `dtype` arithmetic), by enumeration.

    Raises ValueError when the layer to enumerate has more than 24 units; use
    `ais_log_partition` for larger models.
    """
    if isinstance(model, GaussianRBM):
        return _gaussian_log_partition(model, dtype)
    if isinstance(model, BernoulliRBM):
        return _bernoulli_log_partition(model, dtype)
    raise TypeError(f"exact_log_partition does not know {type(model).__name__}")


def _bernoulli_log_partition(model: BernoulliRBM, dtype: torch.dtype) -> float:
    W, b, a = (p.detach().to(dtype) for p in (model.W, model.b, model.a))
    if min(model.n_hidden, model.n_visible) > MAX_ENUMERATED_UNITS:
        raise ValueError(
            f"exact log Z enumerates 2^min(n_visible, n_hidden) states; this model has "
            f"n_visible={model.n_visible}, n_hidden={model.n_hidden} (limit "
            f"{MAX_ENUMERATED_UNITS}) — use ais_log_partition instead"
        )
    if model.n_hidden > model.n_visible:
        # The energy is symmetric in (v, b) ↔ (h, a) with W transposed: enumerate v instead.
        W, b, a = W.t(), a, b

    def log_terms(h: torch.Tensor) -> torch.Tensor:
        return h @ a + F.softplus(torch.addmm(b, h, W.t())).sum(dim=1)

    return _logsumexp_over_states(W.shape[1], log_terms, W.device, dtype)


def _gaussian_log_partition(model: GaussianRBM, dtype: torch.dtype) -> float:
    if model.n_hidden > MAX_ENUMERATED_UNITS:
        raise ValueError(
            f"exact log Z enumerates 2^n_hidden states; n_hidden={model.n_hidden} exceeds "
            f"{MAX_ENUMERATED_UNITS} — use ais_log_partition instead"
        )
    W, b, a = (p.detach().to(dtype) for p in (model.W, model.b, model.a))
    precision = model.precision_matrix().detach().to(dtype)
    precision_w = precision @ W  # (V, H)
    coupling = W.t() @ precision_w  # WᵀC⁻¹W (H, H)
    linear = a + b @ precision_w  # a + WᵀC⁻¹b (H,)

    log_det_c = -torch.logdet(precision)
    constant = 0.5 * model.n_visible * math.log(2 * math.pi) + 0.5 * float(log_det_c)
    return constant + _logsumexp_quadratic(linear, coupling)


def _logsumexp_quadratic(linear: torch.Tensor, coupling: torch.Tensor) -> float:
    """logsumexp over s ∈ {0, 1}^H of sᵀ·linear + ½·sᵀ·coupling·s.

    Splitting s into low and high bits, s = (l, u), the exponent is
    t(l) + t(u) + lᵀ A_lu u: for each chunk of high states one (2^low × H) @ (H × chunk) product
    gives every cross term, so the cost is O(2^H · H) rather than O(2^H · H²).
    """
    n_units = linear.numel()
    n_low = min(n_units, _LOW_BITS)
    device, dtype = linear.device, linear.dtype

    def own_terms(states: torch.Tensor, part: slice) -> torch.Tensor:
        block = coupling[part, part]
        return states @ linear[part] + 0.5 * ((states @ block) * states).sum(dim=1)

    low_part, high_part = slice(0, n_low), slice(n_low, n_units)
    low = next(_states(n_low, device, dtype, chunk_bits=n_low))  # (2^low, low)
    low_terms = own_terms(low, low_part)  # (2^low,)
    cross = low @ coupling[low_part, high_part]  # (2^low, H - low)
    partial = []
    for high in _states(n_units - n_low, device, dtype, chunk_bits=_HIGH_CHUNK_BITS):
        exponent = low_terms[:, None] + own_terms(high, high_part)[None, :] + cross @ high.t()
        partial.append(torch.logsumexp(exponent.flatten(), dim=0))
    return float(torch.logsumexp(torch.stack(partial), dim=0))


def _logsumexp_over_states(
    n_units: int,
    log_terms: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> float:
    """logsumexp of log_terms(s) over all s ∈ {0, 1}^n_units, in chunks."""
    partial = [
        torch.logsumexp(log_terms(states), dim=0) for states in _states(n_units, device, dtype)
    ]
    return float(torch.logsumexp(torch.stack(partial), dim=0))


def _states(
    n_units: int, device: torch.device, dtype: torch.dtype, chunk_bits: int = _CHUNK_BITS
) -> Iterator[torch.Tensor]:
    """All binary vectors of length n_units, as chunks of rows (bit j of the index → unit j)."""
    total = 1 << n_units
    chunk = 1 << min(chunk_bits, n_units)
    shifts = torch.arange(n_units, device=device)
    for start in range(0, total, chunk):
        index = torch.arange(start, min(start + chunk, total), device=device)
        yield ((index.unsqueeze(1) >> shifts) & 1).to(dtype)
