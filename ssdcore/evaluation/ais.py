"""Annealed importance sampling (AIS) estimate of log Z (Neal 2001; Salakhutdinov & Murray 2008).

Chains start from the base model (β = 0) and follow the path of `annealing.py` to the model:
at each temperature a chain's weight gains log f_βk(v) - log f_βk-1(v), then one Gibbs sweep
leaves p_βk invariant; log Z ≈ log Z_0 + log mean_n w_n. The estimate of Z is unbiased, so
log Ẑ errs low and a log-likelihood from it errs high (Jensen); reverse AIS is its conservative
partner (`certified.py` reports both). The standard error std(w)/(√n·mean(w)) is itself noisy,
understates the error when a few chains dominate, and does not cover a poor base model's bias.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ssdcore.evaluation.annealing import annealing_path
from ssdcore.models.base import RBM
from ssdcore.sampling import RandomSource

# AIS settings when the caller gives none: chains averaged, intermediate temperatures.
DEFAULT_AIS_CHAINS = 100
DEFAULT_AIS_BETAS = 1000


@dataclass(frozen=True)
class AISResult:
    """An AIS estimate of log Z, its standard error and the per-chain log weights."""

    log_z: float
    stderr: float
    log_weights: torch.Tensor  # (n_chains,)


def annealing_schedule(n_betas: int) -> torch.Tensor:
    """n_betas inverse temperatures from 0 to 1, denser near 1 where the weights change most.
    Proportions follow Salakhutdinov & Murray (2008): about 3.5% of the points on [0, 0.5], 27.5% on
    [0.5, 0.9] and the rest on [0.9, 1]."""
    if n_betas < 2:
        raise ValueError(f"n_betas must be at least 2, got {n_betas}")
    n_first = max(1, round(0.035 * n_betas))
    n_second = max(1, round(0.275 * n_betas))
    n_third = max(1, n_betas - n_first - n_second)
    parts = [
        torch.linspace(0.0, 0.5, n_first + 1, dtype=torch.float64)[:-1],
        torch.linspace(0.5, 0.9, n_second + 1, dtype=torch.float64)[:-1],
        torch.linspace(0.9, 1.0, n_third, dtype=torch.float64),
    ]
    return torch.cat(parts)


@torch.no_grad()
def ais_log_partition(
    model: RBM,
    n_chains: int = DEFAULT_AIS_CHAINS,
    n_betas: int = DEFAULT_AIS_BETAS,
    seed: int = 0,
    *,
    data: torch.Tensor | None = None,
    base_visible_bias: torch.Tensor | None = None,
) -> AISResult:
    """Estimate log Z by AIS with `n_chains` independent chains and `n_betas` temperatures. A
    Bernoulli RBM needs its training `data` (its base rates set the base model), or
    `base_visible_bias` computed from it by `data_base_rates`; without either this refuses. A
    Gaussian RBM's base is its own N(b, C) and needs neither."""
    if n_chains < 2:
        raise ValueError(f"n_chains must be at least 2 to estimate an error, got {n_chains}")
    betas = annealing_schedule(int(n_betas)).tolist()
    source = RandomSource(model.W.device, seed)
    path = annealing_path(model, source, base_visible_bias, data)
    v = path.sample_base(n_chains)
    log_w = torch.zeros(n_chains, dtype=torch.float64, device=model.W.device)
    for previous, beta in itertools.pairwise(betas):
        log_w += path.log_ratio(v, previous, beta)
        v = path.transition(v, beta)
    log_z, stderr = _combine(log_w)
    return AISResult(path.log_z_base + log_z, stderr, log_w)


def _combine(log_weights: torch.Tensor) -> tuple[float, float]:
    """log mean exp of the log weights and its delta-method standard error."""
    n = log_weights.numel()
    top = log_weights.max()
    weights = torch.exp(log_weights - top)  # in (0, 1], the largest is exactly 1
    mean = weights.mean()
    log_mean = float(top + torch.log(mean))
    stderr = float(weights.std(unbiased=True) / (math.sqrt(n) * mean))
    return log_mean, stderr
