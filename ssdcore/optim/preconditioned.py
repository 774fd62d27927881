"""Preconditioned SSD: RMSprop- or Adam-style diagonal rescaling around the spectral step.

Following Carlson et al.'s preconditioned spectral descent (NIPS 2015, "RMSspectral"), the step
is taken in the geometry of ``‖D^{1/2} ⊙ Δ‖_S∞`` with ``D = sqrt(v̂) + eps`` (``v̂`` the
bias-corrected running mean of ``g ⊙ g``, floored at ``damping`` times its mean). Substituting
``Y = D^{1/2} ⊙ Δ`` gives the plain S∞ problem for the rescaled gradient, hence

    Δ = -lr * D^{-1/2} ⊙ (‖σ(D^{-1/2} ⊙ G)‖₁ · U Vᵀ),   U Σ Vᵀ = svd(D^{-1/2} ⊙ G)

and likewise in l∞ for vectors. ``"adam"`` first replaces the gradient by its bias-corrected
running mean. The rescaled gradient is full-rank, so ``method="lowrank"`` is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from ssdcore.optim.ssd import SSD


class PreconditionedSSD(SSD):
    """SSD with a diagonal RMSprop (``"rmsprop"``) or Adam (``"adam"``) preconditioner.

    Args:
        params: parameters or parameter groups; a group may set ``preconditioner=None`` (plain
            SSD) or ``geometry="euclidean"`` (plain SGD).
        lr: step size, > 0.
        preconditioner: ``"rmsprop"`` or ``"adam"``.
        method: polar method for matrices: ``"svd"``, ``"randomized"`` or ``"newton-schulz"``.
        **kwargs: the remaining :class:`~ssdcore.optim.SSD` settings, among them ``betas``
            (first moment, Adam only, and second moment decay), ``eps`` (added to ``sqrt(v̂)``)
            and ``damping`` (relative floor of ``sqrt(v̂)``: rarely active coordinates step at
            most ``damping^{-1/2}`` times further than the rest; 0 turns it off).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        *,
        preconditioner: str = "rmsprop",
        method: str = "svd",
        **kwargs: Any,
    ) -> None:
        if preconditioner not in ("rmsprop", "adam"):
            raise ValueError(
                f"Invalid preconditioner: {preconditioner!r} (choose 'rmsprop' or 'adam')"
            )
        super().__init__(params, lr, method=method, preconditioner=preconditioner, **kwargs)
