"""SSD step rules: how long a spectral group's step is along its steepest direction.

``"paper"`` is the step of Carlson et al. as the paper writes it: ``W -= lr·‖σ(G)‖₁·D`` with
``D = UVᵀ`` for a matrix, ``x -= lr·‖g‖₁·sign(g)`` for a vector. ``"normalized"`` keeps the
direction and takes the Euclidean length of the SGD step ``-lr·G``, so that one ``lr`` holds
across model sizes:

    W -= lr · (‖G‖_F / √k) · D            x -= lr · (‖g‖₂ / √nnz(g)) · sign(g)

with ``k = min(m, n, r)`` the largest rank G can have (r the rank of its factors, 2B for a CD
gradient). ``‖D‖_F = √rank G``, so ``‖ΔW‖_F = lr‖G‖_F·√(rank G / k)``: the SGD step's length
exactly for a gradient of full rank (the CD gradient's usual case), less otherwise. k is a
count, not a measurement: ``‖D‖_F`` computed from the factors of an ill-conditioned gradient
loses everything to cancellation.

Derivation. SGD's step size roughly transfers across n_h (docs/RESULTS.md §2) because a hidden
unit's weights move by ``lr·‖G_{:,j}‖``, and a column of the CD gradient (an average over that
unit's own activity) does not grow with n_h. The S∞-steepest direction D has every singular
value 1: it lifts the gradient's bulk of small singular directions to the size of its dominant
one (the data mean against the model mean). The paper's step therefore has Frobenius norm
``lr·‖σ‖₁·√rank`` against SGD's ``lr·‖G‖_F``, a ratio ``√(rank · r)`` with
``r = ‖σ‖₁² / ‖σ‖₂² ≥ 1``; rank = min(n_v, n_h, 2B) grows with n_h, so the mean move of a unit's
weights grows with it (``tests/test_step_rules.py`` measures 3.1× SGD's move at 8 hidden units
and 12.3× at 128 on CD gradients of a 100-visible model). In the paper's terms: the step
``-η‖σ‖₁D`` minimises ``⟨G, Δ⟩ + ‖Δ‖²_S∞/(2η)`` and is safe for ``η ≤ 1/L``, with ``L`` the
loss's smoothness in S∞;
its bound for W, ``n_v n_h`` (from ``Var(vᵀΔh) ≤ ‖v‖²‖h‖²``), grows with the size — the
worst case, every unit aligned. The normalized rule is the paper's step with
``η = lr / √(k · r)``: the growth measured on the gradient itself instead of the worst case.
Then ``‖ΔW‖_F = lr‖G‖_F`` (full rank), each unit's weights move as far as under SGD on average,
and ``lr`` transfers as SGD's does. It stays a descent step: ``⟨G, ΔW⟩ = -lr‖G‖_F ‖σ‖₁ / √k``.
The vector rule is the same argument in l∞.

Everything is tensor arithmetic on the device (no host sync), so the step stays capturable in
a CUDA graph; ``‖G‖_F²`` costs one pass over the dense gradient, or ``O((m + n) r²)`` from its
factors (in float64). docs/RESULTS.md §6 has the measurement (``python -m experiments
transfer``): on MNIST the paper rule's best step falls 10× from 32 to 512 hidden units, the
normalized rule's stays at 0.1.

Each length is written once for one parameter or a stack of M runs' (a leading run axis, as in
:mod:`ssdcore.pack`): full reductions run matrix by matrix (:func:`ssdcore.batched.per_matrix`),
so a run's length in a stack is its solo length bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdcore.batched import per_matrix

STEP_RULES = ("paper", "normalized")
DEFAULT_STEP_RULE = "paper"


def check_step_rule(step_rule: object) -> None:
    """Raise ``ValueError`` for an unknown step rule."""
    if step_rule not in STEP_RULES:
        raise ValueError(f"Invalid step_rule: {step_rule!r} (choose one of {STEP_RULES})")


def frobenius_squared(grad: Tensor | None, factors: tuple[Tensor, Tensor] | None) -> Tensor:
    """``‖G‖_F²`` of the dense gradient, or of ``left @ right`` without forming it (per run
    for a stack: ``(M,)``)."""
    if grad is not None:
        return per_matrix(_squared_sum, grad)
    if factors is None:
        raise RuntimeError("parameter has neither a gradient nor gradient factors")
    return per_matrix(_factors_squared_sum, *factors)


def _squared_sum(grad: Tensor) -> Tensor:
    return grad.square().sum()


def _factors_squared_sum(left: Tensor, right: Tensor) -> Tensor:
    # In float64: the data and chain terms of a CD gradient's factors largely cancel late in
    # training, and float32 would lose the small difference (or make it negative).
    dtype, left, right = left.dtype, left.double(), right.double()
    return ((left.mT @ left) * (right @ right.mT)).sum().clamp_min(0).to(dtype)


def max_rank(shape: tuple[int, ...], factors: tuple[Tensor, Tensor] | None) -> int:
    """k: the largest rank a gradient of ``shape`` (a matrix's, or a stack's of them, with these
    factors) can have."""
    bound = min(shape[-2:])
    return bound if factors is None else min(bound, factors[0].shape[-1])


def spectral_length(
    nuclear_norm: Tensor,
    step_rule: str,
    grad: Tensor | None,
    factors: tuple[Tensor, Tensor] | None,
    shape: tuple[int, ...],
) -> Tensor:
    """The factor on ``-lr·D``: ``‖σ(G)‖₁`` (paper) or ``‖G‖_F / √k`` (normalized)."""
    if step_rule == "paper":
        return nuclear_norm
    squared = frobenius_squared(grad, factors).to(nuclear_norm.dtype)
    return (squared / max_rank(shape, factors)).sqrt()


def linf_length(grad: Tensor, step_rule: str) -> Tensor:
    """The factor on ``-lr·sign(g)``: ``‖g‖₁`` (paper) or ``‖g‖₂ / ‖sign(g)‖₂`` (normalized);
    over the last dimension (``()`` for a vector, ``(M, 1)`` for a stack of M, to broadcast
    against ``g``). A vector's reduction is far below the size at which torch
    splits one across threads, so a stack's rows are each the solo result."""
    dim = -1 if grad.ndim else None
    if step_rule == "paper":
        length = torch.linalg.vector_norm(grad, 1, dim=dim)
    else:
        nonzero = torch.count_nonzero(grad, dim=dim).to(grad.dtype).clamp_min(1)
        length = torch.linalg.vector_norm(grad, dim=dim) / nonzero.sqrt()
    return length.unsqueeze(-1) if grad.ndim > 1 else length
