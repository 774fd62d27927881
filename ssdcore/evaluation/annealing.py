"""The annealing path from a tractable base model (β = 0) to an RBM (β = 1), shared by forward
AIS (`ais.py`, log Z) and reverse AIS (`reverse_ais.py`, a conservative log p(v)).

The unnormalized visible marginals along the path are

    Bernoulli: log f_β(v) = ((1-β)·b_A + β·b)ᵀv + Σ_j softplus(β·(vᵀW + a)_j)
    Gaussian:  log f_β(v) = -½(v - b)ᵀC⁻¹(v - b) + Σ_j softplus(β·(vᵀC⁻¹W + a)_j)

so f_1(v) = exp(-F(v)); the bases (bias-only model with bias b_A, or N(b, C), uniform hidden
units) have log Z_0 = Σ_i softplus(b_A,i) + H·log 2, or (V/2)·log 2π + ½·log|C| + H·log 2.
`transition(v, β)` is one block-Gibbs sweep, reversible for p_β(v), which lets reverse AIS run
it backwards. A BRBM's b_A should be the logit of the data's mean (`data_base_rates`): with the
model's own visible bias, AIS on trained MNIST models misses log Z by several nats while
reporting a small standard error.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from ssdcore.models.base import RBM
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.gaussian import GaussianRBM
from ssdcore.sampling import RandomSource

# Data means are clamped to [ε, 1-ε] before the logit, so an always-off pixel gets a finite bias.
BASE_RATE_CLAMP = 1e-3


def data_base_rates(data: torch.Tensor) -> torch.Tensor:
    """The AIS base visible bias for a BRBM: logit of the (clamped) mean of each visible unit."""
    if data.ndim != 2 or data.shape[0] == 0:
        raise ValueError(f"data must be a non-empty (N, V) tensor, got shape {tuple(data.shape)}")
    mean = data.double().mean(dim=0).clamp(BASE_RATE_CLAMP, 1 - BASE_RATE_CLAMP)
    return (torch.log(mean) - torch.log1p(-mean)).to(data.dtype)


class AnnealingPath(Protocol):
    """What forward and reverse AIS need from one model's path; see the module docstring."""

    log_z_base: float

    def sample_base(self, n: int) -> torch.Tensor: ...

    def log_ratio(self, v: torch.Tensor, beta_from: float, beta_to: float) -> torch.Tensor: ...

    def transition(self, v: torch.Tensor, beta: float) -> torch.Tensor: ...

    def log_f1(self, v: torch.Tensor) -> torch.Tensor: ...


def annealing_path(
    model: RBM,
    source: RandomSource,
    base_visible_bias: torch.Tensor | None,
    data: torch.Tensor | None = None,
) -> AnnealingPath:
    """The path for `model`; a BRBM needs `base_visible_bias`, or the training `data` whose
    `data_base_rates` it is."""
    if isinstance(model, GaussianRBM):
        return GaussianPath(model, source)
    if isinstance(model, BernoulliRBM):
        if base_visible_bias is None and data is not None:
            base_visible_bias = data_base_rates(data.to(model.W))
        if base_visible_bias is None:
            raise ValueError(
                "annealing a Bernoulli RBM needs the data's base rates: pass data=<training data> "
                "(or base_visible_bias=data_base_rates(data)); the model's own visible bias as "
                "base misses log Z by nats on trained models while its standard error stays small"
            )
        return BernoulliPath(model, source, base_visible_bias)
    raise TypeError(f"no annealing path for {type(model).__name__}")


class BernoulliPath:
    """Path from the independent-pixel model with bias b_A to a BRBM."""

    def __init__(self, model: BernoulliRBM, source: RandomSource, base: torch.Tensor) -> None:
        self.W, self.b, self.a = model.W.detach(), model.b.detach(), model.a.detach()
        self.base = base.to(self.b).reshape(self.b.shape)
        self.bias_shift = self.b - self.base  # d/dβ of the visible bias term
        self.source = source
        self.n_hidden = model.n_hidden
        self.log_z_base = float(F.softplus(self.base.double()).sum()) + self.n_hidden * math.log(2)

    def sample_base(self, n: int) -> torch.Tensor:
        v = torch.empty(n, self.W.shape[0], device=self.W.device, dtype=self.W.dtype)
        return self.source.bernoulli_(torch.sigmoid(self.base).expand_as(v).contiguous(), out=v)

    def log_ratio(self, v: torch.Tensor, beta_from: float, beta_to: float) -> torch.Tensor:
        """log f_to(v) - log f_from(v), per row, in float64."""
        x = torch.addmm(self.a, v, self.W)
        delta = (beta_to - beta_from) * (v @ self.bias_shift)
        delta += (F.softplus(beta_to * x) - F.softplus(beta_from * x)).sum(dim=1)
        return delta.double()

    def transition(self, v: torch.Tensor, beta: float) -> torch.Tensor:
        x = torch.addmm(self.a, v, self.W)
        h = self.source.bernoulli_(torch.sigmoid(beta * x), out=torch.empty_like(x))
        probs = torch.addmm(self.b, h, self.W.t(), beta=beta, alpha=beta)
        probs.add_(self.base, alpha=1.0 - beta).sigmoid_()
        return self.source.bernoulli_(probs, out=torch.empty_like(v))

    def log_f1(self, v: torch.Tensor) -> torch.Tensor:
        x = torch.addmm(self.a, v, self.W)
        return (v @ self.b + F.softplus(x).sum(dim=1)).double()


class GaussianPath:
    """Path from N(b, C) with uniform hidden units to a GRBM (C is the model's covariance)."""

    def __init__(self, model: GaussianRBM, source: RandomSource) -> None:
        self.kernel = model.gibbs_kernel()
        self.model = model
        self.source = source
        self.log_z_base = (
            0.5 * model.n_visible * math.log(2 * math.pi)
            + 0.5 * float(model.log_det_covariance())
            + model.n_hidden * math.log(2.0)
        )

    def _noise(self, n: int) -> torch.Tensor:
        """N(0, C) rows."""
        weight = self.kernel.weight
        eps = torch.empty(n, weight.shape[0], device=weight.device, dtype=weight.dtype)
        return self.kernel.correlate_(self.source.normal_(eps))

    def sample_base(self, n: int) -> torch.Tensor:
        return self._noise(n).add_(self.kernel.visible_bias)

    def _hidden_input(self, v: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.kernel.hidden_bias, v, self.kernel.hidden_weight)

    def log_ratio(self, v: torch.Tensor, beta_from: float, beta_to: float) -> torch.Tensor:
        x = self._hidden_input(v)
        return (F.softplus(beta_to * x) - F.softplus(beta_from * x)).sum(dim=1).double()

    def transition(self, v: torch.Tensor, beta: float) -> torch.Tensor:
        x = self._hidden_input(v)
        h = self.source.bernoulli_(torch.sigmoid(beta * x), out=torch.empty_like(x))
        out = self._noise(v.shape[0]).add_(self.kernel.visible_bias)
        return out.addmm_(h, self.kernel.weight.t(), alpha=beta)  # v ~ N(b + βWh, C)

    def log_f1(self, v: torch.Tensor) -> torch.Tensor:
        return -self.model.free_energy(v).double()
