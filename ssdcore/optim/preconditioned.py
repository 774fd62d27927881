"""Preconditioned SSD: RMSprop- or Adam-style diagonal rescaling around the spectral step.

Following Carlson et al.'s preconditioned spectral descent (NIPS 2015, "RMSspectral"), the
spectral step is taken in the geometry of the rescaled norm ``‖D^{1/2} ⊙ Δ‖_S∞``, where
``D = sqrt(v̂) + eps`` and ``v̂`` is the (bias-corrected) running mean of ``g ⊙ g``. Substituting
``Y = D^{1/2} ⊙ Δ`` into ``⟨G, Δ⟩ + c ‖D^{1/2} ⊙ Δ‖²_S∞`` gives the plain S∞ problem for the
rescaled gradient ``D^{-1/2} ⊙ G``, hence

    Δ = -lr * D^{-1/2} ⊙ (‖σ(D^{-1/2} ⊙ G)‖₁ · U Vᵀ),   U Σ Vᵀ = svd(D^{-1/2} ⊙ G)

and likewise ``D^{-1/2} ⊙ (‖D^{-1/2} ⊙ g‖₁ sign(g))`` for vectors. ``D`` is floored at
``damping`` times its mean (see ``damping`` below). With ``"adam"`` the gradient
is first replaced by its bias-corrected running mean (momentum before the geometry, as in Adam).
The rescaled gradient is full-rank, so ``method="lowrank"`` is refused; ``"svd"`` is the default.
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
        betas: decay of the first moment (Adam only) and of the second moment.
        eps: added to ``sqrt(v̂)`` before the square-root scaling.
        damping: relative floor: ``sqrt(v̂)`` is raised to at least ``damping`` times its mean
            over the parameter, so rarely active coordinates cannot take steps more than
            ``damping^{-1/2}`` times larger than the rest (0 turns the floor off).
        **kwargs: the remaining :class:`~ssdcore.optim.SSD` settings; ``betas``, ``eps`` and
            ``damping`` above are among them and keep SSD's defaults.
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
