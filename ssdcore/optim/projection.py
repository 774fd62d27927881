"""Projections that keep parameters inside the set the theory assumes."""

from __future__ import annotations

import torch
from torch import Tensor


def _cheap_spectral_norm_bound(matrix: Tensor) -> Tensor:
    """Upper bound ‖W‖₂ ≤ sqrt(‖W‖₁ ‖W‖∞) (max column sum times max row sum), O(m n)."""
    absolute = matrix.abs()
    return (absolute.sum(0).amax() * absolute.sum(1).amax()).sqrt()


@torch.no_grad()
def project_spectral_norm_(matrix: Tensor, max_norm: float) -> Tensor:
    """Clip the singular values of ``matrix`` at ``max_norm`` in place: the paper's ‖W‖₂ ≤ R.
    Euclidean projection onto the spectral-norm ball (it is the nearest matrix in Frobenius norm). A
    cheap O(m n) upper bound skips the SVD while W is safely inside the ball; once the constraint is
    active it costs one SVD per call, so use it for the theory's assumption, not for speed."""
    if bool(_cheap_spectral_norm_bound(matrix) <= max_norm):
        return matrix
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    if bool(s[0] <= max_norm):
        return matrix
    matrix.copy_((u * s.clamp_max(max_norm)) @ vh)
    return matrix
