"""The spectral step's two ingredients for a gradient matrix G: the polar factor U Vᵀ and ‖σ(G)‖₁.

The S∞ steepest-descent step of Stochastic Spectral Descent is ``W -= lr * ‖σ(G)‖₁ * U Vᵀ`` where
``G = U Σ Vᵀ`` is the thin SVD. Each function below computes the pair a different way; all return
a :class:`Polar` (or, for the fused optimizer path, a :class:`FactoredPolar`).

Direction convention: U Vᵀ is taken over G's *numerical range* only, i.e. singular values below
``max(m, n) * eps * σ_max`` count as zero and their (arbitrary) singular vectors are dropped.
A CD gradient has rank ≤ 2B, far below min(m, n) for MNIST-sized models; a full-rank U Vᵀ would
add unit steps along directions that are pure rounding noise. This is the minimum-norm minimiser
of the S∞ upper bound and the one every method here agrees on.

Nuclear norm convention: ``‖σ(G)‖₁ = ⟨G, U Vᵀ⟩``, which is exact for an exact polar factor and
gives a consistent, never-overestimating value for the approximate ones (Newton–Schulz,
randomized).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

# Muon's tuned quintic coefficients (Keller Jordan, "Muon" optimizer): they push every singular
# value of a normalized matrix into roughly [0.7, 1.2] in few steps, fast also for tiny values.
MUON_QUINTIC = (3.4445, -4.7750, 2.0315)
# The order-5 Newton–Schulz polynomial (15x - 10x³ + 3x⁵)/8: f(1) = 1 with f'(1) = f''(1) = 0,
# so it polishes values already near 1 to full precision (Muon's coefficients do not converge).
CONVERGENT_QUINTIC = (15 / 8, -10 / 8, 3 / 8)
# Halko, Martinsson & Tropp (2011): oversampling of 5-10 columns and 1-2 power iterations make
# the range finder accurate for gradients whose spectrum decays slowly.
DEFAULT_OVERSAMPLE = 10
DEFAULT_POWER_ITERATIONS = 2


class Polar(NamedTuple):
    """Polar factor of a matrix and its nuclear norm."""

    direction: Tensor  # (m, n) U Vᵀ over the numerical range
    nuclear_norm: Tensor  # () ‖σ(G)‖₁


class FactoredPolar(NamedTuple):
    """Polar factor kept as a product ``left @ right`` so a step can fuse it into one addmm."""

    left: Tensor  # (m, r)
    right: Tensor  # (r, n)
    nuclear_norm: Tensor  # ()


def _kept(singular_values: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Mask of singular values above the numerical-rank tolerance (as ``torch.linalg.pinv``)."""
    tolerance = singular_values.amax() * max(shape) * torch.finfo(singular_values.dtype).eps
    return singular_values > tolerance


def polar_svd(grad: Tensor) -> Polar:
    """Exact polar factor from ``torch.linalg.svd``: the reference, O(m n min(m, n)).

    Use when the gradient has no low-rank factors (e.g. the GRBM's full precision matrix) or as
    the ground truth for the other methods.
    """
    u, s, vh = torch.linalg.svd(grad, full_matrices=False)  # (m, k), (k,), (k, n)
    direction = (u * _kept(s, grad.shape)) @ vh
    return Polar(direction, s.sum())


def polar_lowrank_factors(left: Tensor, right: Tensor) -> FactoredPolar:
    """Exact polar factor of ``G = left @ right`` without ever forming or decomposing G.

    Why: the CD gradient is ``(Vdᵀ Pd - Vmᵀ Pm) / B``, a product of an (m, 2B) and a (2B, n)
    factor. Thin QR of both factors, ``left = Ql Rl`` and ``rightᵀ = Qr Rr``, gives
    ``G = Ql (Rl Rrᵀ) Qrᵀ``; the SVD of the small core ``Rl Rrᵀ = Uc Σ Vcᵀ`` is G's SVD with
    ``U = Ql Uc`` and ``V = Qr Vc``. Cost O((m + n) r²) plus the O(m n r) final product, which
    callers fuse into the parameter update, instead of the full SVD's O(m n min(m, n)).
    Householder QR is backward stable, so the result is exact to float precision.
    """
    q_left, r_left = torch.linalg.qr(left)  # (m, r'), (r', r)
    q_right, r_right = torch.linalg.qr(right.mT)  # (n, r''), (r'', r)
    core = r_left @ r_right.mT  # (r', r'') with G = q_left @ core @ q_rightᵀ
    uc, s, vhc = torch.linalg.svd(core, full_matrices=False)
    rotation = (uc * _kept(s, (left.shape[0], right.shape[1]))) @ vhc  # (r', r'')
    # Multiply the rotation into the cheaper side before handing the two factors back.
    if q_left.shape[0] >= q_right.shape[0]:
        return FactoredPolar(q_left, rotation @ q_right.mT, s.sum())
    return FactoredPolar(q_left @ rotation, q_right.mT, s.sum())


def polar_lowrank(left: Tensor, right: Tensor) -> Polar:
    """Exact polar factor of ``left @ right`` (see :func:`polar_lowrank_factors`), as a matrix."""
    factored = polar_lowrank_factors(left, right)
    return Polar(factored.left @ factored.right, factored.nuclear_norm)


def _spectral_norm_estimate(matvec, rmatvec, n: int, like: Tensor, iterations: int) -> Tensor:
    """Largest singular value of an implicit matrix by power iteration (a lower bound)."""
    x = torch.ones(n, dtype=like.dtype, device=like.device)
    y = matvec(x)
    for _ in range(iterations):
        x = rmatvec(y)
        x = x / x.norm().clamp_min(torch.finfo(like.dtype).tiny)
        y = matvec(x)
    return y.norm()


def polar_randomized(
    grad: Tensor,
    rank: int,
    *,
    oversample: int = DEFAULT_OVERSAMPLE,
    power_iterations: int = DEFAULT_POWER_ITERATIONS,
    residual_correction: bool = True,
    generator: torch.Generator | None = None,
) -> Polar:
    """Approximate polar factor from a randomized rank-``rank`` SVD (Halko et al. 2011).

    Why: costs O(m n (rank + oversample)) per power iteration instead of a full SVD, for large
    gradients without known factors. The randomized range finder ``Y = (G Gᵀ)^q G Ω`` (QR after
    every product for stability) captures the top singular subspace; the SVD of the small
    ``Qᵀ G`` gives ``U Λ Vᵀ``.

    Residual correction, as in the paper (Fan, §"Computation complexity"), which writes
    ``ΔX = ‖λ‖₁ U Vᵀ + ‖λ‖₁ (X − U Λ Vᵀ) / ‖X − U Λ Vᵀ‖_S∞``. We read X as the gradient G being
    decomposed (the parameter plays no role in its SVD): the residual ``R = G − U Λ Vᵀ`` holds
    the singular values the sketch missed, and when that tail is flat, ``R / ‖R‖_S∞`` is exactly
    its polar factor. So the direction is ``U Vᵀ + R / ‖R‖_S∞``. For the scale we use
    ``⟨G, direction⟩ = ‖λ‖₁ + ‖R‖_F² / ‖R‖_S∞``, which equals the paper's ‖λ‖₁ when the sketch
    captures all of G and, for a flat tail, adds the tail's nuclear norm that ‖λ‖₁ omits — so the
    step equals the exact S∞ step in both limits. ``‖R‖_S∞`` comes from a few power iterations
    on R applied implicitly; a residual below ``sqrt(eps) ‖G‖_F`` is rounding noise and gets no
    correction (it would otherwise add unit steps along noise directions).
    """
    m, n = grad.shape
    sketch = min(rank + oversample, m, n)
    omega = torch.randn(n, sketch, generator=generator, dtype=grad.dtype, device=grad.device)
    basis = torch.linalg.qr(grad @ omega).Q  # (m, sketch)
    for _ in range(power_iterations):
        co_basis = torch.linalg.qr(grad.mT @ basis).Q  # (n, sketch)
        basis = torch.linalg.qr(grad @ co_basis).Q
    ub, s, vh = torch.linalg.svd(basis.mT @ grad, full_matrices=False)  # (sketch, n) core
    keep = min(rank, s.shape[0])
    u = basis @ ub[:, :keep]  # (m, keep)
    s, vh = s[:keep], vh[:keep]  # (keep,), (keep, n)
    kept = _kept(s, grad.shape)
    direction = (u * kept) @ vh
    if residual_correction:
        residual = grad - (u * s) @ vh  # (m, n)
        # Rounding leaves a residual near eps·‖G‖; sqrt(eps)·‖G‖ separates it from a real tail.
        if residual.norm() > math.sqrt(torch.finfo(grad.dtype).eps) * grad.norm():
            tail = _spectral_norm_estimate(
                lambda x: residual @ x, lambda y: residual.mT @ y, n, grad, iterations=8
            )
            direction = direction + residual / tail
    return Polar(direction, (grad * direction).sum())


def polar_newton_schulz(grad: Tensor, *, fast_steps: int = 5, polish_steps: int = 3) -> Polar:
    """Approximate polar factor by quintic Newton–Schulz iteration (as in the Muon optimizer).

    Why: only matrix products, so it runs at full speed on a GPU where SVD is slow. G is scaled
    by its Frobenius norm so every singular value is ≤ 1, then the odd polynomial
    ``X ← a X + (b A + c A²) X`` with ``A = X Xᵀ`` acts on each singular value separately:
    ``fast_steps`` with Muon's coefficients lift small values towards 1, ``polish_steps`` with the
    convergent order-5 coefficients settle them at 1. Singular values below about
    ``1e-4 ‖G‖_F`` are not fully lifted; they carry a negligible share of ‖σ(G)‖₁.
    The nuclear norm is ``⟨G, X⟩``.
    """
    transposed = grad.shape[0] > grad.shape[1]
    x = grad.mT if transposed else grad  # (small, large): the Gram matrix A is small
    x = x / x.norm().clamp_min(torch.finfo(grad.dtype).tiny)
    for a, b, c in [MUON_QUINTIC] * fast_steps + [CONVERGENT_QUINTIC] * polish_steps:
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    direction = x.mT if transposed else x
    return Polar(direction, (grad * direction).sum())
