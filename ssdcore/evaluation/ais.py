"""Annealed importance sampling (AIS) estimate of log Z (Neal 2001; Salakhutdinov & Murray 2008).

The chain anneals from a tractable base model at β = 0 to the model at β = 1 through

    Bernoulli: log f_β(v) = ((1-β)·b_A + β·b)ᵀv + Σ_j softplus(β·(vᵀW + a)_j)
    Gaussian:  log f_β(v) = -½(v - b)ᵀC⁻¹(v - b) + Σ_j softplus(β·(vᵀC⁻¹W + a)_j)

The base models are the visible-bias-only model with bias b_A (default: the model's own b) for
the BRBM, and the h-free Gaussian N(b, C) for the GRBM; their hidden units are uniform, so

    log Z_A = Σ_i softplus(b_A,i) + H·log 2,    or    (V/2)·log 2π + ½·log|C| + H·log 2.

Each intermediate distribution is sampled by one block-Gibbs sweep that leaves it invariant
(h ~ σ(β·x), then v from the β-tempered conditional), and the importance weight of a chain is
Σ_k [log f_βk(v_k-1) - log f_βk-1(v_k-1)]. Then log Z ≈ log Z_A + log mean_n w_n.

The standard error is the delta-method estimate std(w)/(√n·mean(w)) on the weights (computed
relative to the largest, which cancels). It is itself noisy and tends to understate the error
when a few chains dominate; more chains or more temperatures tighten both.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssdcore.models.base import RBM, GibbsKernel
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.gaussian import GaussianRBM
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

    Proportions follow Salakhutdinov & Murray (2008): about 3.5% of the points on [0, 0.5],
    27.5% on [0.5, 0.9] and the rest on [0.9, 1].
    """
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
    base_visible_bias: torch.Tensor | None = None,
) -> AISResult:
    """Estimate log Z by AIS with `n_chains` independent chains and `n_betas` temperatures.

    `base_visible_bias` (BRBM only) sets b_A of the base model; a good choice is the logit of
    the training data's mean, which makes the base closer to the model.
    """
    if n_chains < 2:
        raise ValueError(f"n_chains must be at least 2 to estimate an error, got {n_chains}")
    betas = annealing_schedule(int(n_betas)).tolist()
    source = RandomSource(model.W.device, seed)
    if isinstance(model, GaussianRBM):
        log_weights, log_z_base = _anneal_gaussian(model, n_chains, betas, source)
    elif isinstance(model, BernoulliRBM):
        log_weights, log_z_base = _anneal_bernoulli(
            model, n_chains, betas, source, base_visible_bias
        )
    else:
        raise TypeError(f"ais_log_partition does not know {type(model).__name__}")
    log_z, stderr = _combine(log_weights)
    return AISResult(log_z_base + log_z, stderr, log_weights)


def _anneal_bernoulli(
    model: BernoulliRBM,
    n_chains: int,
    betas: list[float],
    source: RandomSource,
    base_visible_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, float]:
    W, b, a = model.W.detach(), model.b.detach(), model.a.detach()
    base = b if base_visible_bias is None else base_visible_bias.to(b).reshape(b.shape)
    log_z_base = float(F.softplus(base.double()).sum()) + model.n_hidden * math.log(2.0)
    device = W.device
    v = torch.empty(n_chains, model.n_visible, device=device, dtype=W.dtype)
    source.bernoulli_(torch.sigmoid(base).expand_as(v).contiguous(), out=v)
    h = torch.empty(n_chains, model.n_hidden, device=device, dtype=W.dtype)
    probs_v = torch.empty_like(v)
    log_w = torch.zeros(n_chains, dtype=torch.float64, device=device)
    bias_shift = b - base  # d/dβ of the visible bias term
    for previous, beta in itertools.pairwise(betas):
        x = torch.addmm(a, v, W)  # (n, H)
        # log f_β(v) - log f_β'(v), evaluated at the current state
        delta = (beta - previous) * (v @ bias_shift)
        delta += (F.softplus(beta * x) - F.softplus(previous * x)).sum(dim=1)
        log_w += delta.double()
        # one Gibbs sweep leaving p_β invariant
        source.bernoulli_(torch.sigmoid(beta * x), out=h)
        torch.addmm(b, h, W.t(), beta=beta, alpha=beta, out=probs_v)
        probs_v.add_(base, alpha=1.0 - beta).sigmoid_()
        source.bernoulli_(probs_v, out=v)
    return log_w, log_z_base


def _anneal_gaussian(
    model: GaussianRBM, n_chains: int, betas: list[float], source: RandomSource
) -> tuple[torch.Tensor, float]:
    kernel = model.gibbs_kernel()
    W, b, a = kernel.weight, kernel.visible_bias, kernel.hidden_bias
    log_z_base = (
        0.5 * model.n_visible * math.log(2 * math.pi)
        + 0.5 * float(model.log_det_covariance())
        + model.n_hidden * math.log(2.0)
    )
    device = W.device
    noise = torch.empty(n_chains, model.n_visible, device=device, dtype=W.dtype)
    h = torch.empty(n_chains, model.n_hidden, device=device, dtype=W.dtype)
    v = _correlated(source.normal_(noise), kernel).add_(b)  # v ~ N(b, C)
    log_w = torch.zeros(n_chains, dtype=torch.float64, device=device)
    for previous, beta in itertools.pairwise(betas):
        x = torch.addmm(a, v, kernel.hidden_weight)  # vᵀC⁻¹W + a
        log_w += (F.softplus(beta * x) - F.softplus(previous * x)).sum(dim=1).double()
        source.bernoulli_(torch.sigmoid(beta * x), out=h)
        v = _correlated(source.normal_(noise), kernel)
        v.add_(b).addmm_(h, W.t(), alpha=beta)  # v ~ N(b + βWh, C)
    return log_w, log_z_base


def _correlated(eps: torch.Tensor, kernel: GibbsKernel) -> torch.Tensor:
    """N(0, C) rows from standard normal rows `eps`, as a new tensor."""
    if kernel.noise_transform is not None:
        return eps @ kernel.noise_transform
    if kernel.noise_scale is not None:
        return eps * kernel.noise_scale
    return eps.clone()


def _combine(log_weights: torch.Tensor) -> tuple[float, float]:
    """log mean exp of the log weights and its delta-method standard error."""
    n = log_weights.numel()
    top = log_weights.max()
    weights = torch.exp(log_weights - top)  # in (0, 1], the largest is exactly 1
    mean = weights.mean()
    log_mean = float(top + torch.log(mean))
    stderr = float(weights.std(unbiased=True) / (math.sqrt(n) * mean))
    return log_mean, stderr
