"""The spectral step's two ingredients for a gradient matrix G: the polar factor U Vᵀ and ‖σ(G)‖₁.

The S∞ step of Stochastic Spectral Descent is ``W -= lr * ‖σ(G)‖₁ * U Vᵀ`` with ``G = U Σ Vᵀ``
the thin SVD. Each function below computes the pair a different way, as a :class:`Polar` (or,
for the fused optimizer path, a :class:`FactoredPolar`).

Direction: U Vᵀ over G's *numerical range* only (singular values below
``max(m, n) * eps * σ_max`` count as zero). A CD gradient has rank ≤ 2B, far below min(m, n);
a full-rank U Vᵀ would add unit steps along pure rounding noise. This is the minimum-norm
minimiser of the S∞ upper bound, and every method here agrees on it. Nuclear norm:
``‖σ(G)‖₁ = ⟨G, U Vᵀ⟩``, exact for an exact polar factor and never an overestimate for the
approximate ones (Newton–Schulz, randomized).

Stacks: :func:`polar_svd`, :func:`polar_gram_factors`, :func:`polar_newton_schulz` and
:func:`polar_newton_schulz_factors` also take a stack (M, m, n), one gradient per run of a pack,
and give each run's solo result bit for bit on the CPU (:mod:`ssdcore.batched`). A run whose
gradient is not finite gets a NaN nuclear norm, instead of failing the batched ``eigh`` for all.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ssdcore.batched import (
    addmm,
    matmul,
    per_matrix,
    per_matrix_scalar,
    stacked_copy,
    stacked_empty,
)
from ssdcore.optim.threads import one_cpu_thread

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

    direction: Tensor  # (..., m, n) U Vᵀ over the numerical range
    nuclear_norm: Tensor  # (...) ‖σ(G)‖₁


class FactoredPolar(NamedTuple):
    """Polar factor kept as a product ``left @ right`` so a step can fuse it into one addmm."""

    left: Tensor  # (..., m, r)
    right: Tensor  # (..., r, n)
    nuclear_norm: Tensor  # (...)


def _kept(singular_values: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Mask of singular values above the numerical-rank tolerance (as ``torch.linalg.pinv``)."""
    largest = singular_values.amax(dim=-1, keepdim=True)
    return singular_values > largest * max(shape[-2:]) * torch.finfo(singular_values.dtype).eps


def _as_matrix(factored: FactoredPolar) -> Polar:
    return Polar(matmul(factored.left, factored.right), factored.nuclear_norm)


def _svd_factors(grad: Tensor) -> FactoredPolar:
    u, s, vh = torch.linalg.svd(grad, full_matrices=False)  # (m, k), (k,), (k, n)
    return FactoredPolar(u * _kept(s, grad.shape).unsqueeze(-2), vh, s.sum(dim=-1))


def polar_svd(grad: Tensor) -> Polar:
    """Exact polar factor from ``torch.linalg.svd``: the reference, O(m n min(m, n)), for
    gradients without low-rank factors (e.g. the GRBM's full precision matrix)."""
    return _as_matrix(_svd_factors(grad))


def _inverse_roots(
    eigenvalues: Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(λ^{-1/2}, ‖σ‖₁)`` for the eigenvalues λ = σ² of the float64 Gram matrix of a ``dtype``
    matrix of ``shape``: λ^{-1/2} over the eigenvalues :func:`_kept` keeps (as σ), 0 elsewhere."""
    tolerance = (max(shape[-2:]) * torch.finfo(dtype).eps) ** 2 * eigenvalues.amax(-1, True)
    kept = eigenvalues > tolerance
    inverse_root = torch.where(kept, torch.where(kept, eigenvalues, 1.0).rsqrt(), 0.0)
    return inverse_root, _nuclear_norm(eigenvalues, shape)


def _nuclear_norm(eigenvalues: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Σ sqrt(λ) over the eigenvalues of a float64 Gram matrix above its rounding noise. A
    non-finite eigenvalue (a gradient with NaN or Inf) makes the result non-finite, so that the step
    spreads it to the parameters and divergence is detected, not hidden as a zero step."""
    noise = max(shape[-2:]) * torch.finfo(eigenvalues.dtype).eps * eigenvalues.amax(-1, True)
    return torch.where(eigenvalues <= noise, 0.0, eigenvalues).sqrt().sum(dim=-1)


def _inverse_square_root(
    gram: Tensor, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(S, ‖σ‖₁)`` for a float64 Gram matrix ``GᵀG`` of a ``dtype`` matrix G of ``shape``:
    ``S = Q Λ^{-1/2} Qᵀ`` (:func:`_inverse_roots`), so ``G S`` is G's polar factor.

    In a stack, a run's non-finite Gram matrix is decomposed as the identity and gets a NaN
    ``‖σ‖₁``, so that it fails alone (LAPACK decomposes each matrix on its own copy, so a batched
    call gives each run's solo result); a single matrix's failure is its caller's.
    """
    finite = torch.isfinite(gram).flatten(-2).all(dim=-1) if gram.ndim > 2 else None
    if finite is not None:
        identity = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        gram = torch.where(finite[..., None, None], gram, identity)
    eigenvalues, vectors = torch.linalg.eigh(gram)
    inverse_root, nuclear_norm = _inverse_roots(eigenvalues, shape, dtype)
    if finite is not None:
        nuclear_norm = torch.where(finite, nuclear_norm, torch.nan)
    return matmul(vectors * inverse_root.unsqueeze(-2), vectors.mT), nuclear_norm


def _gram_is_exact_enough(dtype: torch.dtype) -> bool:
    """Whether float64 Gram matrices resolve every singular value a ``dtype`` matrix keeps. An
    eigenvalue λ = σ² of a float64 Gram matrix is accurate to about ``eps64 · λ_max``, so σ has
    relative error about ``eps64 (σ_max / σ)² / 2``; for float32 and sides up to ~1e4 that is below
    ``eps64 / (1e4 · eps32)² ≈ 1e-10`` at the smallest kept σ. For float64 matrices squaring the
    condition number would lose the small singular values (QR / SVD routes)."""
    return dtype != torch.float64 and torch.finfo(dtype).eps >= torch.finfo(torch.float32).eps


def polar_gram_factors(grad: Tensor) -> FactoredPolar:
    """Exact polar factor of a thin matrix from its small Gram matrix, as ``left @ right``. For G
    (m, n) with n ≪ m (e.g. 784×50), ``GᵀG = Q Λ Qᵀ`` (n×n, float64) gives
    ``U Vᵀ = G · Q Λ^{-1/2} Qᵀ`` and ``‖σ‖₁ = Σ sqrt(λ)``: one O(m n²) product and an n×n
    eigendecomposition instead of an SVD, and the step fuses into one addmm. The factors are
    ``(G, S)`` for tall G, ``(S, G)`` for wide G; float64 inputs take the SVD."""
    if not _gram_is_exact_enough(grad.dtype):
        return _svd_factors(grad)
    wide = grad.shape[-2] < grad.shape[-1]
    if grad.ndim == 2:
        g64 = grad.to(torch.float64)
    else:
        g64 = stacked_empty(grad.shape[0], grad.shape[1:], dtype=torch.float64, device=grad.device)
        g64.copy_(grad)
    gram = matmul(g64, g64.mT) if wide else matmul(g64.mT, g64)  # (min, min)
    with one_cpu_thread(grad.device):
        inverse_root, nuclear_norm = _inverse_square_root(gram, grad.shape, grad.dtype)
    inverse_root = inverse_root.to(grad.dtype)
    if inverse_root.ndim > 2:
        inverse_root = stacked_copy(inverse_root)
    if wide:
        return FactoredPolar(inverse_root, grad, nuclear_norm.to(grad.dtype))
    return FactoredPolar(grad, inverse_root, nuclear_norm.to(grad.dtype))


def polar_gram(grad: Tensor) -> Polar:
    """Exact polar factor of a thin matrix (see :func:`polar_gram_factors`), as a matrix."""
    return _as_matrix(polar_gram_factors(grad))


# Largest condition number of a factor's float64 Gram matrix whose Cholesky / eigenvector
# root is trusted: the computed root then reproduces the factor to about eps64 · κ, i.e.
# better than float32 precision by a safety factor of 16. Worse-conditioned factors (nearly,
# but not exactly, dependent samples) take the QR route, which does not square κ.
GRAM_CONDITION_LIMIT = torch.finfo(torch.float32).eps / torch.finfo(torch.float64).eps / 16


def _cholesky_root(gram: Tensor) -> Tensor | None:
    """Lower-triangular D with ``gram = D Dᵀ``, or None when the Gram matrix is ill-conditioned."""
    root, info = torch.linalg.cholesky_ex(gram)
    if int(info) != 0:
        return None
    diagonal = root.diagonal()
    # (max/min pivot)² is a cheap lower estimate of κ(gram); exactly dependent columns make it
    # blow up (or the factorization fail), which is what this guard is for.
    if not bool(diagonal.amax() ** 2 <= GRAM_CONDITION_LIMIT * diagonal.amin() ** 2):
        return None
    return root


def _eigen_root(gram: Tensor, rows: int) -> tuple[Tensor, Tensor] | None:
    """``(D, D⁺ᵀ)`` with ``gram = D Dᵀ`` over its numerical range (D is k×r), or None.

    Eigenvalues up to ``max(rows, k) · eps64 · λ_max`` are the rounding noise of exactly
    dependent columns (duplicate samples) and are dropped, as ``torch.linalg.pinv`` would.
    Returns None when a kept eigenvalue is still too small to trust (see GRAM_CONDITION_LIMIT).
    """
    eigenvalues, vectors = torch.linalg.eigh(gram)
    largest = eigenvalues.amax()
    kept = eigenvalues > max(rows, gram.shape[0]) * torch.finfo(gram.dtype).eps * largest
    if not bool(kept.any()):
        return None  # a zero factor: the QR route returns the zero direction
    smallest_kept = eigenvalues[kept].amin()
    if not bool(largest <= GRAM_CONDITION_LIMIT * smallest_kept):
        return None
    vectors, root_values = vectors[:, kept], eigenvalues[kept].sqrt()
    return vectors * root_values, vectors / root_values


class _Root(NamedTuple):
    """A root D of one factor's Gram matrix (``gram = D Dᵀ``) and how to apply ``D⁺ᵀ``."""

    factor: Tensor  # D (k, r)
    inverse_transposed: Tensor | None  # D⁺ᵀ (k, r), or None: D is triangular, solve instead
    other_gram: Tensor  # the other factor's Gram matrix (k, k)
    transposed: bool  # the root belongs to L: the mixing matrix is for Gᵀ

    def apply_inverse_transposed(self, matrix: Tensor) -> Tensor:
        """``D⁺ᵀ @ matrix``."""
        if self.inverse_transposed is None:
            return torch.linalg.solve_triangular(self.factor.mT, matrix, upper=True)
        return self.inverse_transposed @ matrix


def _choose_root(gram_left: Tensor, gram_right: Tensor, shape: tuple[int, int]) -> _Root | None:
    """Cholesky of R Rᵀ, else of LᵀL (G transposed), else an eigenvector root of R Rᵀ that
    drops exactly dependent rows; None when even that is too ill-conditioned."""
    root = _cholesky_root(gram_right)
    if root is not None:
        return _Root(root, None, gram_left, False)
    root = _cholesky_root(gram_left)
    if root is not None:
        return _Root(root, None, gram_right, True)
    eigen = _eigen_root(gram_right, shape[1])
    if eigen is not None:
        return _Root(eigen[0], eigen[1], gram_left, False)
    return None


def _mixing_matrix(
    gram_left: Tensor, gram_right: Tensor, shape: tuple[int, int], dtype: torch.dtype
) -> tuple[Tensor, Tensor] | None:
    """``(X, ‖σ‖₁)`` with ``polar(L R) = L X R`` from ``LᵀL`` and ``R Rᵀ`` (float64), or None.
    Derivation: with ``R Rᵀ = D Dᵀ`` the rows of ``Q_R = D⁺ R`` are orthonormal and ``R = D Q_R``
    (R's rows lie in D's range), so ``GᵀG = Q_Rᵀ T Q_R`` with ``T = Dᵀ (LᵀL) D``. Hence
    ``(GᵀG)^{+1/2} = Q_Rᵀ T^{+1/2} Q_R`` and ``polar(G) = G (GᵀG)^{+1/2} = L D T^{+1/2} D⁺ R``; T's
    eigenvalues are G's σ². With ``T = Q Λ Qᵀ``: ``X = (D Q Λ^{-1/2}) (D⁺ᵀ Q)ᵀ``. The roles of L and
    R swap by transposing G (``polar(Gᵀ) = polar(G)ᵀ``); see :func:`_choose_root`."""
    root = _choose_root(gram_left, gram_right, shape)
    if root is None:
        return None
    core = root.factor.mT @ (root.other_gram @ root.factor)  # T (r, r)
    eigenvalues, vectors = torch.linalg.eigh(core)
    inverse_root, nuclear_norm = _inverse_roots(eigenvalues, shape, dtype)
    left_half = (root.factor @ vectors) * inverse_root  # D Q Λ^{-1/2}
    mixing = left_half @ root.apply_inverse_transposed(vectors).mT  # (k, k)
    return (mixing.mT if root.transposed else mixing), nuclear_norm


# float32 sums of integer products are exact while every partial sum stays below 2**24.
_FLOAT32_EXACT_INTEGER = 2.0**24


def _is_integer_valued(factor: Tensor) -> bool:
    """Whether every entry is an integer; one row decides cheaply for real-valued factors."""
    first_row = factor[:1]
    if not torch.equal(first_row, first_row.round()):
        return False
    return torch.equal(factor, factor.round())


def _gram64(factor: Tensor, columns: bool) -> Tensor:
    """``factorᵀ factor`` (columns) or ``factor factorᵀ`` (rows) in float64. A 0/1 factor (the
    Bernoulli RBM's visible samples) has a Gram matrix of small integers, which a float32 product
    computes exactly, at twice float64's speed: integer entries and a largest squared column norm
    below 2**24 bound every partial sum (Cauchy–Schwarz). CPU only, where float32 products are true
    float32 (no TF32)."""
    cpu_float32 = factor.device.type == "cpu" and factor.dtype == torch.float32
    if cpu_float32 and _is_integer_valued(factor):
        gram = factor.mT @ factor if columns else factor @ factor.mT
        if bool(gram.diagonal().amax() < _FLOAT32_EXACT_INTEGER):
            return gram.to(torch.float64)
    factor64 = factor.to(torch.float64)
    return factor64.mT @ factor64 if columns else factor64 @ factor64.mT


def polar_lowrank_factors(left: Tensor, right: Tensor) -> FactoredPolar:
    """Exact polar factor of ``G = left @ right`` without ever forming or decomposing G.

    The CD gradient is a product of an (m, k) and a (k, n) factor with k = 2B. From the k×k
    float64 Gram matrices ``LᵀL`` and ``R Rᵀ``, a Cholesky root and one k×k eigendecomposition
    give X with ``U Vᵀ = L X R`` (:func:`_mixing_matrix`); X goes into the shorter factor, so the
    step is the (m, k)×(k, n) addmm SGD's gradient costs, plus O((m + n) k²) products and two k×k
    factorizations on one CPU thread (:mod:`ssdcore.optim.threads`). Rank-deficient factors
    (duplicate samples) take an eigenvector root that drops their null space; factors too
    ill-conditioned for float64 Gram matrices, and float64 inputs, take :func:`polar_lowrank_qr`.
    """
    dtype = torch.promote_types(left.dtype, right.dtype)
    if not _gram_is_exact_enough(dtype):
        return polar_lowrank_qr(left, right)
    shape = (left.shape[0], right.shape[1])
    gram_left, gram_right = _gram64(left, columns=True), _gram64(right, columns=False)
    with one_cpu_thread(left.device):
        mixed = _mixing_matrix(gram_left, gram_right, shape, dtype)
    if mixed is None:
        return polar_lowrank_qr(left, right)
    mixing, nuclear_norm = mixed
    # Rounding X to the working precision costs ~eps · κ(G) in the smallest directions, as an
    # SVD of the working-precision G would; the float64 path measured ~2e-7 vs ~5e-6 relative.
    mixing = mixing.to(dtype)
    if shape[0] < shape[1]:
        return FactoredPolar(left @ mixing, right, nuclear_norm.to(dtype))
    return FactoredPolar(left, mixing @ right, nuclear_norm.to(dtype))


def polar_lowrank_qr(left: Tensor, right: Tensor) -> FactoredPolar:
    """Exact polar factor of ``G = left @ right`` by QR of both factors, for any conditioning.
    ``left = Ql Rl`` and ``rightᵀ = Qr Rr`` give ``G = Ql (Rl Rrᵀ) Qrᵀ``, and the SVD of the small
    core ``Rl Rrᵀ = Uc Σ Vcᵀ`` is G's with ``U = Ql Uc``, ``V = Qr Vc``. Householder QR never
    squares the condition number; it costs more than :func:`polar_lowrank_factors`."""
    with one_cpu_thread(left.device):
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
    return _as_matrix(polar_lowrank_factors(left, right))


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

    O(m n (rank + oversample)) per power iteration instead of a full SVD, for large gradients
    without known factors: the range finder ``Y = (G Gᵀ)^q G Ω`` (QR after every product)
    captures the top singular subspace, and the SVD of the small ``Qᵀ G`` gives ``U Λ Vᵀ``.

    Residual correction, as in the paper (Fan, §"Computation complexity"), with X read as the
    gradient G: ``R = G − U Λ Vᵀ`` holds the singular values the sketch missed, and for a flat
    tail ``R / ‖R‖_S∞`` is exactly its polar factor, so the direction is ``U Vᵀ + R / ‖R‖_S∞``
    and the scale ``⟨G, direction⟩ = ‖λ‖₁ + ‖R‖_F² / ‖R‖_S∞``: the exact S∞ step both when the
    sketch captures all of G and for a flat tail. ``‖R‖_S∞`` comes from power iterations on R;
    a residual below ``sqrt(eps) ‖G‖_F`` is rounding noise and gets no correction.
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


def _newton_schulz_coefficients(fast_steps: int, polish_steps: int) -> list[tuple[float, ...]]:
    return [MUON_QUINTIC] * fast_steps + [CONVERGENT_QUINTIC] * polish_steps


def polar_newton_schulz_factors(
    left: Tensor, right: Tensor, *, fast_steps: int = 5, polish_steps: int = 3
) -> FactoredPolar:
    """:func:`polar_newton_schulz` of ``G = left @ right``, iterated in the r×r factor space. The CD
    weight gradient has rank r = 2B, below both sides of a 784×500 W. Every iterate keeps the form
    ``X = L Y R``: with ``Q = LᵀL`` and ``P = R Rᵀ``, ``X XᵀX = L (Z Y) R`` for ``Z = Y P Yᵀ Q``, so
    the quintic step becomes ``Y ← (aI + bZ + cZ²) Y``: the same polynomial of the same singular
    values, at r×r per product (about 10× cheaper at 784×500 on the CPU). Starts from
    ``Y = I / ‖G‖_F`` (``‖G‖_F² = ⟨Q, P⟩``); ``‖σ‖₁ ≈ ⟨G, X⟩ = ⟨Q Y, P⟩``."""
    q = matmul(left.mT, left)  # (r, r)
    p = matmul(right, right.mT)  # (r, r)
    frobenius = per_matrix(_inner_product, q, p).sqrt().clamp_min(torch.finfo(left.dtype).tiny)
    eye = torch.eye(q.shape[-1], dtype=left.dtype, device=left.device)
    y = eye / per_matrix_scalar(frobenius)
    for a, b, c in _newton_schulz_coefficients(fast_steps, polish_steps):
        z = matmul(matmul(matmul(y, p), y.mT), q)
        y = addmm(y, addmm(z, z, z, beta=b, alpha=c), y, beta=a)
    nuclear_norm = per_matrix(_inner_product, matmul(q, y), p)
    return FactoredPolar(left, matmul(y, right), nuclear_norm)


def polar_newton_schulz(grad: Tensor, *, fast_steps: int = 5, polish_steps: int = 3) -> Polar:
    """Approximate polar factor by quintic Newton–Schulz iteration (as in the Muon optimizer). Only
    matrix products, so it runs at full speed on a GPU where SVD is slow. G scaled by its Frobenius
    norm has every singular value ≤ 1; the odd polynomial ``X ← a X + (b A + c A²) X``
    (``A = X Xᵀ``) acts on each separately: ``fast_steps`` with Muon's coefficients lift small
    values towards 1, ``polish_steps`` settle them at 1. Values below about ``1e-4 ‖G‖_F`` are not
    fully lifted (a negligible share of ‖σ(G)‖₁). The nuclear norm is ``⟨G, X⟩``."""
    transposed = grad.shape[-2] > grad.shape[-1]
    x = grad.mT if transposed else grad  # (small, large): the Gram matrix A is small
    norm = per_matrix(torch.linalg.vector_norm, x)
    x = x / per_matrix_scalar(norm.clamp_min(torch.finfo(grad.dtype).tiny))
    for a, b, c in _newton_schulz_coefficients(fast_steps, polish_steps):
        gram = matmul(x, x.mT)
        x = addmm(x, addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    direction = x.mT if transposed else x
    return Polar(direction, per_matrix(_inner_product, grad, direction))


def _inner_product(left: Tensor, right: Tensor) -> Tensor:
    """``⟨left, right⟩`` of two matrices, as one full reduction."""
    return (left * right).sum()
