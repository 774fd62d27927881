"""The Bernoulli RBM: binary visible and hidden units.

E(v, h) = -vᵀWh - bᵀv - aᵀh, so p(h_j = 1 | v) = σ(vᵀW + a)_j and p(v_i = 1 | h) = σ(Wh + b)_i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssdcore.models.base import RBM, GibbsKernel, bernoulli, check_visible

# Clip data means away from 0 and 1 before taking their logit for the visible bias.
_BIAS_INIT_CLIP = 1e-3


class BernoulliRBM(RBM):
    """RBM with binary visible units (data in [0, 1]; probabilities are accepted as inputs)."""

    kind = "bernoulli"

    def hidden_input(self, v: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.a, v, self.W)

    def visible_mean(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.addmm(self.b, h, self.W.t()))

    def sample_visible(
        self, h: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        return bernoulli(self.visible_mean(h), generator)

    def free_energy(self, v: torch.Tensor) -> torch.Tensor:
        check_visible(v, self.n_visible)
        # F(v) = -bᵀv - Σ_j softplus((vᵀW + a)_j)
        return -(v @ self.b) - F.softplus(self.hidden_input(v)).sum(dim=1)

    def gibbs_kernel(self) -> GibbsKernel:
        return GibbsKernel(
            hidden_weight=self.W.detach(),
            hidden_bias=self.a.detach(),
            weight=self.W.detach(),
            visible_bias=self.b.detach(),
            gaussian=False,
        )

    @torch.no_grad()
    def init_from_data(self, v: torch.Tensor) -> None:
        """b_i = logit of the mean of visible unit i (Hinton's practical guide, section 8)."""
        check_visible(v, self.n_visible)
        mean = v.mean(dim=0).clamp(_BIAS_INIT_CLIP, 1 - _BIAS_INIT_CLIP)
        self.b.copy_(torch.log(mean) - torch.log1p(-mean))
