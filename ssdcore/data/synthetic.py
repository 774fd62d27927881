"""The paper's synthetic data: binary vectors drawn from a random Bernoulli RBM.

Section "Simulation Study": n_v = 100, n_h = 25, W with i.i.d. N(0, 0.5) entries (variance 0.5),
zero biases; 4000 training and 1000 held-out examples.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssdcore.evaluation.partition import _states
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.sampling import GibbsChain, RandomSource

WEIGHT_VARIANCE = 0.5
# Up to this many hidden units the generator samples exactly (2^H states are enumerated).
MAX_EXACT_HIDDEN = 20
# Chains started from random bits agree with 50 sweeps already (moments within sampling noise
# of 1000-sweep chains for the paper's 100×25 model); 200 leaves a wide margin.
DEFAULT_GIBBS_SWEEPS = 200


def synthetic_rbm_model(n_visible: int = 100, n_hidden: int = 25, seed: int = 0) -> BernoulliRBM:
    """The generating RBM: W ~ N(0, 0.5) element-wise (std √0.5), b = 0, a = 0; seeded."""
    generator = torch.Generator().manual_seed(seed)
    model = BernoulliRBM(n_visible, n_hidden, init_std=0.0)
    with torch.no_grad():
        weight = torch.randn(n_visible, n_hidden, generator=generator) * math.sqrt(WEIGHT_VARIANCE)
        model.W.copy_(weight)
    return model


@torch.no_grad()
def synthetic_rbm_data(
    n_visible: int = 100,
    n_hidden: int = 25,
    n_samples: int = 5000,
    seed: int = 0,
    *,
    method: str = "auto",
    gibbs_sweeps: int = DEFAULT_GIBBS_SWEEPS,
) -> torch.Tensor:
    """`n_samples` binary examples (float32, (n_samples, n_visible)) from `synthetic_rbm_model`.

    method:
    - "exact": h is drawn from its marginal p(h) ∝ exp(aᵀh) Π_i (1 + exp(b + Wh)_i) over all
      2^n_hidden states, then v ~ p(v | h): independent, exact samples (n_hidden ≤ 20);
    - "gibbs": one independent block-Gibbs chain per example, started from uniform random
      bits and run for `gibbs_sweeps` sweeps; approximate where the chains mix slowly;
    - "auto" (default): "exact" when n_hidden ≤ 20, else "gibbs" (the paper's n_h = 25).
    The result is a deterministic function of the arguments.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be positive, got {n_samples}")
    if method not in ("auto", "exact", "gibbs"):
        raise ValueError(f"method must be 'auto', 'exact' or 'gibbs', got {method!r}")
    if method == "auto":
        method = "exact" if n_hidden <= MAX_EXACT_HIDDEN else "gibbs"
    if method == "exact" and n_hidden > MAX_EXACT_HIDDEN:
        raise ValueError(
            f"method='exact' enumerates 2^n_hidden states; n_hidden={n_hidden} exceeds "
            f"{MAX_EXACT_HIDDEN} — use method='gibbs'"
        )
    model = synthetic_rbm_model(n_visible, n_hidden, seed)
    source = RandomSource("cpu", seed + 1)
    chain = GibbsChain(n_samples, n_visible, n_hidden, torch.device("cpu"), source)
    visible = torch.empty(n_samples, n_visible)
    if method == "exact":
        hidden = _exact_hidden(model, n_samples, seed)
    else:
        if gibbs_sweeps < 1:
            raise ValueError(f"gibbs_sweeps must be positive, got {gibbs_sweeps}")
        start = torch.full((n_samples, n_hidden), 0.5)
        hidden = source.bernoulli_(start, out=torch.empty(n_samples, n_hidden))
        probs = torch.empty(n_samples, n_hidden)
        chain.run(model.gibbs_kernel(), hidden, gibbs_sweeps, visible, probs)
        hidden = source.bernoulli_(probs, out=torch.empty_like(probs))
    chain.sample_visible_(model.gibbs_kernel(), hidden, visible)
    return visible


def _exact_hidden(model: BernoulliRBM, n_samples: int, seed: int) -> torch.Tensor:
    """Draw h from its exact marginal by inverse-CDF sampling over all 2^H states."""
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    log_weights = torch.cat(
        [
            states @ a + F.softplus(torch.addmm(b, states, W.t())).sum(dim=1)
            for states in _states(model.n_hidden, W.device, torch.float64)
        ]
    )
    cdf = torch.cumsum(torch.softmax(log_weights, dim=0), dim=0)
    generator = torch.Generator().manual_seed(seed)
    uniform = torch.rand(n_samples, generator=generator, dtype=torch.float64) * cdf[-1]
    index = torch.searchsorted(cdf, uniform).clamp_(max=cdf.numel() - 1)
    shifts = torch.arange(model.n_hidden)
    return ((index.unsqueeze(1) >> shifts) & 1).to(torch.float32)
