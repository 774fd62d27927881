"""A log-likelihood with both stochastic bounds: reverse AIS below, AIS above.

AIS estimates Z without bias, so -F(v) - log Ẑ errs high (Jensen) — optimistic; reverse AIS
(`reverse_ais.py`) errs low — conservative. Both use the same annealing path (the data's base
rates for a BRBM). The gap between them says how far either can be trusted: a wide gap means more
temperatures, or a model whose sweeps mix too slowly to be measured this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssdcore.evaluation.ais import DEFAULT_AIS_BETAS, DEFAULT_AIS_CHAINS, ais_log_partition
from ssdcore.evaluation.likelihood import log_likelihood
from ssdcore.evaluation.reverse_ais import (
    DEFAULT_RAISE_CHAINS,
    DEFAULT_RAISE_EXAMPLES,
    reverse_ais_log_likelihood,
)
from ssdcore.models.base import RBM


@dataclass(frozen=True)
class LikelihoodBounds:
    """Mean test log-likelihood (nats per example) bracketed by two stochastic bounds."""

    lower: float  # reverse AIS: conservative
    lower_stderr: float
    upper: float  # AIS: optimistic
    upper_stderr: float

    @property
    def gap(self) -> float:
        return self.upper - self.lower

    def as_dict(self, prefix: str = "ll") -> dict[str, float]:
        return {
            f"{prefix}_lower": self.lower,
            f"{prefix}_lower_stderr": self.lower_stderr,
            f"{prefix}_upper": self.upper,
            f"{prefix}_upper_stderr": self.upper_stderr,
            f"{prefix}_gap": self.gap,
        }


@torch.no_grad()
def certified_log_likelihood(
    model: RBM,
    test: torch.Tensor,
    *,
    data: torch.Tensor,
    n_betas: int = DEFAULT_AIS_BETAS,
    ais_chains: int = DEFAULT_AIS_CHAINS,
    reverse_chains: int = DEFAULT_RAISE_CHAINS,
    max_examples: int | None = DEFAULT_RAISE_EXAMPLES,
    seed: int = 0,
) -> LikelihoodBounds:
    """Both bounds of the mean log p(v) over `test`; `data` is the training data (base rates)."""
    forward = ais_log_partition(model, ais_chains, n_betas, seed, data=data)
    reverse = reverse_ais_log_likelihood(
        model,
        test,
        data=data,
        n_chains=reverse_chains,
        n_betas=n_betas,
        max_examples=max_examples,
        seed=seed,
    )
    return LikelihoodBounds(
        lower=reverse.mean_log_likelihood,
        lower_stderr=reverse.stderr,
        upper=log_likelihood(model, test.to(model.W), forward.log_z),
        upper_stderr=forward.stderr,
    )
