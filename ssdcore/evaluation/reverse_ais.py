"""Reverse AIS (RAISE; Burda, Grosse & Salakhutdinov 2015): a conservative log p(v) estimate.

Forward AIS is a generative model of its own (base draw, then the sweeps T_1 … T_K of the
annealing path, `annealing.py`) with distribution p_ann. Running the same sweeps backwards from
a data point (each is reversible for its p_βk) gives an unbiased estimate of p_ann(v):

    ŵ(v) = f_1(v) / Z_0 · Π_{k=0}^{K-1} f_βk(v_k) / f_βk+1(v_k)

so log mean ŵ is a stochastic *lower* bound of log p_ann(v). p_ann can fit the data better than
the RBM when the sweeps at β = 1 mix slowly (an MNIST 784×16 Nesterov model: 0.7 nats above the
exact log p at 1 000 temperatures). Appending S sweeps at β = 1 (in reverse: before annealing
down, with no weight) gives p_ann,S with KL(p_ann,S ‖ p) non-increasing in S; on that model
S = 200 took the gap to +0.03. `equilibration_sweeps` sets S (default: one per temperature).
The estimate then errs low where AIS's errs high, and the two bracket log p(v) (`certified.py`),
in expectation, with standard errors.

Cost: one chain per (test example, repeat); `max_examples` evaluates a seeded random subset.
-F(v) is exact and cheap for every row; what reverse AIS estimates is the per-example offset
c(v) = log p̂(v) + F(v), which varies little, so the mean is mean_all(-F) + mean_subset(c) with
standard error std(c)/√n (the chains' noise and the choice of the subset).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ssdcore.evaluation.ais import DEFAULT_AIS_BETAS, annealing_schedule
from ssdcore.evaluation.annealing import annealing_path
from ssdcore.models.base import RBM, check_visible
from ssdcore.sampling import RandomSource

# Chains per test example: a few make each example's estimate less noisy (and so the bound
# tighter); the bound is valid with one.
DEFAULT_RAISE_CHAINS = 4
# Test examples evaluated: a seeded random subset keeps the cost bounded on large test sets.
DEFAULT_RAISE_EXAMPLES = 500


@dataclass(frozen=True)
class ReverseAISResult:
    """Conservative mean log p(v) over all test rows, its standard error, and the evaluated rows'
    offsets c(v) = log p̂(v) + F(v) with their row indices."""

    mean_log_likelihood: float
    stderr: float
    offsets: torch.Tensor  # (n_examples,) float64
    rows: torch.Tensor  # (n_examples,) indices into the test rows
    n_examples: int


@torch.no_grad()
def reverse_ais_log_likelihood(
    model: RBM,
    test: torch.Tensor,
    *,
    data: torch.Tensor | None = None,
    base_visible_bias: torch.Tensor | None = None,
    n_chains: int = DEFAULT_RAISE_CHAINS,
    n_betas: int = DEFAULT_AIS_BETAS,
    equilibration_sweeps: int | None = None,
    max_examples: int | None = DEFAULT_RAISE_EXAMPLES,
    seed: int = 0,
) -> ReverseAISResult:
    """Conservative estimate of the mean log p(v) over the rows of `test` (nats per example).

    `data` (training data) or `base_visible_bias` sets a Bernoulli RBM's base model, as for
    `ais_log_partition`; use the same one for both so they share the annealing path.
    `equilibration_sweeps` (default: `n_betas`) sweeps at β = 1 come first (module docstring).

    The standard error is the spread of the per-example estimates over √n: it covers the chains'
    noise and, when `max_examples` picks a subset, the choice of the subset.
    """
    check_visible(test, model.n_visible, "test")
    if n_chains < 1:
        raise ValueError(f"n_chains must be at least 1, got {n_chains}")
    index = _choose_rows(test.shape[0], max_examples, seed)
    source = RandomSource(model.W.device, seed)
    path = annealing_path(model, source, base_visible_bias, data)
    test = test.to(model.W)
    v = test[index.to(test.device)].repeat_interleave(n_chains, dim=0)
    log_w = torch.full((v.shape[0],), -path.log_z_base, dtype=torch.float64, device=v.device)
    betas = annealing_schedule(int(n_betas)).tolist()
    sweeps = len(betas) if equilibration_sweeps is None else int(equilibration_sweeps)
    if sweeps < 0:
        raise ValueError(f"equilibration_sweeps must be at least 0, got {sweeps}")
    for _ in range(sweeps):  # at β = 1 every sweep keeps p invariant: no weight
        v = path.transition(v, 1.0)
    # Backwards along the path: sweep at β_k+1 to reach v_k, then weigh f_βk(v_k) / f_βk+1(v_k).
    for upper, lower in itertools.pairwise(reversed(betas)):
        v = path.transition(v, upper)
        log_w += path.log_ratio(v, upper, lower)
    offsets = torch.logsumexp(log_w.view(-1, n_chains), dim=1) - math.log(n_chains)
    n = offsets.numel()
    stderr = float(offsets.std(unbiased=True) / math.sqrt(n)) if n > 1 else math.inf
    mean = float(path.log_f1(test).mean() + offsets.mean())
    return ReverseAISResult(mean, stderr, offsets.cpu(), index, n)


def _choose_rows(n_rows: int, max_examples: int | None, seed: int) -> torch.Tensor:
    """Indices of the rows to evaluate: all of them, or a seeded random subset."""
    if max_examples is None or n_rows <= max_examples:
        return torch.arange(n_rows)
    if max_examples < 2:
        raise ValueError(f"max_examples must be at least 2 (or None for all), got {max_examples}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n_rows, generator=generator)[:max_examples]
