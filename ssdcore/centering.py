"""Centered RBM training (Montavon & Müller 2012; Melchior, Fischer & Wiskott 2016).

A centered RBM measures its units from offsets, μ (V,) for the visibles and λ (H,) for the
hidden units: E_c(v, h) = -(x - μ)ᵀ W (h - λ) - b_cᵀ (v - μ) - a_cᵀ (h - λ), with x = v for the
Bernoulli RBM and x = C⁻¹v for the Gaussian one (whose quadratic form ½(v - b_c)ᵀC⁻¹(v - b_c)
takes the term vᵀC⁻¹Wλ). Either way it is an ordinary RBM with the same W and

    b = b_c - W λ,        a = a_c - Wᵀ μ                                           (1)

(C appears in neither map, so the variance gradients are the same in both coordinates). The
stored and served model stays that ordinary RBM; centering lives only in training.

Gradients, by the chain rule through (1):

    ∇W_c = ∇W - ∇b λᵀ - μ ∇aᵀ = Σ_n w_n (x_n - μ)(p_n - λ)ᵀ,   ∇b_c = ∇b,   ∇a_c = ∇a     (2)

for the CD estimate (w_n = -1/B on data rows, +1/B_model on model rows, Σ_n w_n = 0): still of
rank ≤ 2B, with factors (x_n - μ) and w_n (p_n - λ), so SSD's exact low-rank step needs no
dense product. :meth:`Centering.step` moves the biases into centered coordinates (b += Wλ,
a += Wᵀμ), lets the optimizer step on (2) (its momentum and SSD state live in centered
coordinates), and moves back with the new W.

Offsets: μ starts at the data mean of x and λ at the mean hidden probability over the data;
after each step both slide towards the batch's data-phase means by ``sliding_factor`` (0 keeps
them fixed). In the ordinary parameterization kept here, the reparameterization a centered model
makes when an offset moves is the identity, so an offset update never changes the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ssdcore.gradients import CDStats, row_weights
from ssdcore.models.base import RBM
from ssdcore.models.gaussian import GaussianRBM

# How fast the offsets follow the data-phase means (Melchior et al. use 0.01 for λ).
DEFAULT_SLIDING_FACTOR = 0.01
# Rows of the training data that set the initial offsets.
INITIAL_OFFSET_EXAMPLES = 10_000


@dataclass(frozen=True)
class CenteringConfig:
    """Centered training: ``sliding_factor`` ν in [0, 1] moves the offsets each step."""

    sliding_factor: float = DEFAULT_SLIDING_FACTOR

    def __post_init__(self) -> None:
        factor = self.sliding_factor
        if not (
            isinstance(factor, int | float) and not isinstance(factor, bool) and 0 <= factor <= 1
        ):
            raise ValueError(
                f"sliding_factor must be a number in [0, 1] (0 keeps the offsets fixed), "
                f"got {factor!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"sliding_factor": float(self.sliding_factor)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CenteringConfig:
        return cls(sliding_factor=float(values["sliding_factor"]))


def scaled_visible(model: RBM, v: Tensor) -> Tensor:
    """x = C⁻¹v for a Gaussian RBM, v itself for a Bernoulli one: what the hidden units read."""
    return model.apply_precision(v) if isinstance(model, GaussianRBM) else v


@torch.no_grad()
def centered_gradient(
    grad_w: Tensor, grad_b: Tensor, grad_a: Tensor, visible: Tensor, hidden: Tensor
) -> Tensor:
    """∇W_c = ∇W - ∇b λᵀ - μ ∇aᵀ (equation (2)), out of place, for any float dtype."""
    return grad_w - torch.outer(grad_b, hidden) - torch.outer(visible, grad_a)


def to_centered(model: RBM, visible: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """The centered biases (b_c, a_c) = (b + Wλ, a + Wᵀμ) of ``model`` at offsets (μ, λ)."""
    weight = model.W.detach()
    return model.b.detach() + weight @ hidden, model.a.detach() + weight.t() @ visible


class Centering:
    """Offsets (μ, λ) of one model and the centered step; owned by the Trainer. ``visible`` (V,) and
    ``hidden`` (H,) are float32 tensors on the model's device, updated in place (so a captured CUDA
    graph keeps reading them)."""

    def __init__(self, model: RBM, config: CenteringConfig, train_data: Tensor) -> None:
        if not isinstance(config, CenteringConfig):
            raise ValueError(f"centering must be a CenteringConfig, got {config!r}")
        self.model = model
        self.config = config
        self.visible, self.hidden = initial_offsets(model, train_data[:INITIAL_OFFSET_EXAMPLES])
        self._row_weights: dict[tuple[int, int], Tensor] = {}
        self._left: Tensor | None = None  # (2B, V) rows x_n - μ (its transpose is the factor)
        self._right: Tensor | None = None  # (2B, H) rows w_n (p_n - λ)
        self._batch_visible = torch.empty_like(self.visible)  # ⟨x⟩ over this step's data rows

    @torch.no_grad()
    def step(self, stats: CDStats, optimizer: torch.optim.Optimizer) -> None:
        """Centre the gradients the estimator wrote, take the optimizer step in centered
        coordinates, return to the ordinary ones, then slide the offsets."""
        self._center_gradients(stats)
        model, weight = self.model, self.model.W
        model.b.addmv_(weight, self.hidden)
        model.a.addmv_(weight.t(), self.visible)
        optimizer.step()
        model.b.addmv_(weight, self.hidden, alpha=-1)
        model.a.addmv_(weight.t(), self.visible, alpha=-1)
        factor = self.config.sliding_factor  # the offsets slide towards the batch's means
        if factor != 0:
            self.visible.lerp_(self._batch_visible, factor)
            self.hidden.lerp_(stats.hidden_data.mean(dim=0), factor)

    def _center_gradients(self, stats: CDStats) -> None:
        model = self.model
        grad_b, grad_a = model.b.grad, model.a.grad
        assert grad_b is not None and grad_a is not None, "estimate() writes the bias gradients"
        left, right = model.W.grad_factors  # (V, 2B), (2B, H)
        n_data = stats.visible_data.shape[0]
        rows = left.t()  # (2B, V) x_n, the estimator's layout
        # ⟨x⟩ over the data rows, read now: the optimizer consumes the factors.
        torch.mean(rows[:n_data], dim=0, out=self._batch_visible)
        if self._left is None or self._left.shape != rows.shape:
            self._left = torch.empty_like(rows)
            self._right = torch.empty_like(right)
        assert self._right is not None
        centered_rows = torch.sub(rows, self.visible, out=self._left)
        weights = self._weights(n_data, right.shape[0] - n_data, right)
        centered_right = torch.addr(right, weights, self.hidden, alpha=-1, out=self._right)
        if model.W.grad is not None:  # the dense form of the same matrix
            model.W.grad.addr_(grad_b, self.hidden, alpha=-1).addr_(self.visible, grad_a, alpha=-1)
        model.W.grad_factors = (centered_rows.t(), centered_right)

    def _weights(self, n_data: int, n_model: int, like: Tensor) -> Tensor:
        """w_n: -1/B on the data rows, +1/B_model on the model rows (the estimator's weights)."""
        key = (n_data, n_model)
        weights = self._row_weights.get(key)
        if weights is None:
            weights = self._row_weights[key] = row_weights(n_data, n_model, like.device, like.dtype)
        return weights

    def state_dict(self) -> dict[str, Tensor]:
        return {
            "visible": self.visible.detach().cpu().clone(),
            "hidden": self.hidden.detach().cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict` output (copied into the existing offset tensors)."""
        for name, offset in (("visible", self.visible), ("hidden", self.hidden)):
            saved = state[name]
            if saved.shape != offset.shape:
                raise ValueError(
                    f"saved {name} offset has shape {tuple(saved.shape)}; expected "
                    f"{tuple(offset.shape)}"
                )
            offset.copy_(saved)


@torch.no_grad()
def initial_offsets(model: RBM, data: Tensor) -> tuple[Tensor, Tensor]:
    """μ = ⟨x⟩_data (x = C⁻¹v for a GRBM), λ = ⟨p(h | v)⟩_data at the model's current state."""
    data = data.to(model.W.device, torch.float32)
    visible = scaled_visible(model, data).mean(dim=0).contiguous()
    hidden = model.hidden_probs(data).mean(dim=0).contiguous()
    if not (math.isfinite(float(visible.sum())) and math.isfinite(float(hidden.sum()))):
        raise ValueError("the initial centering offsets are not finite; check the data")
    return visible, hidden
