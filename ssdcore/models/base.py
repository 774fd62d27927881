"""The RBM base class: parameters named as in the paper (W, b, a) and the shared interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class GibbsKernel:
    """Detached tensors that define one block-Gibbs sweep of a model, precomputed once per update.

    The fast sampler (`ssdcore.sampling`) only needs these, so the per-sweep work is a few fused
    torch calls with no Python-side model logic. A pack's kernel (`ssdcore.pack`) holds the same
    tensors with a leading run axis, and the same sweeps run on it.

    hidden input:  x = v @ hidden_weight + a                   (B, H)
    visible input: m = h @ W.T + b                              (B, V)
    Bernoulli visibles are sampled from sigmoid(m); Gaussian ones are m + noise, with noise
    `eps * noise_scale` (diagonal covariance) or `eps @ noise_transform` (full covariance).
    """

    hidden_weight: torch.Tensor  # (V, H): W for the BRBM, C⁻¹W for the GRBM
    hidden_bias: torch.Tensor  # (H,)
    weight: torch.Tensor  # (V, H)
    visible_bias: torch.Tensor  # (V,)
    gaussian: bool
    noise_scale: torch.Tensor | None = None  # (V,) or (1,): standard deviations
    noise_transform: torch.Tensor | None = None  # (V, V): eps @ noise_transform ~ N(0, C)
    precision: torch.Tensor | None = None  # (V,) or (1,): diagonal of C⁻¹ (diagonal forms)

    @cached_property
    def weight_t(self) -> torch.Tensor:
        """Wᵀ (H, V) as a view, made once per kernel rather than once per sweep."""
        return self.weight.mT

    def correlate_(self, noise: torch.Tensor) -> torch.Tensor:
        """N(0, C) rows from standard normal rows ``noise`` (scaled in place for a diagonal C)."""
        return correlate_(noise, self.noise_scale, self.noise_transform)

    def of_run(self, run: int) -> GibbsKernel:
        """Run ``run``'s kernel, from a pack's kernel (tensors with a leading run axis)."""
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        picked = {k: v[run] if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        return GibbsKernel(**picked)


def correlate_(
    noise: torch.Tensor, scale: torch.Tensor | None, transform: torch.Tensor | None
) -> torch.Tensor:
    """N(0, C) rows from standard normal rows: ``noise @ transform`` (full C), ``noise`` scaled
    by the standard deviations ``scale`` in place (diagonal C), or ``noise`` itself (C = I)."""
    if transform is not None:
        return noise @ transform
    return noise if scale is None else noise.mul_(scale)


def check_visible(v: torch.Tensor, n_visible: int, name: str = "v") -> None:
    """Raise ValueError unless `v` is a (B, n_visible) floating tensor."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (batch, {n_visible})")
    if v.ndim != 2 or v.shape[1] != n_visible:
        raise ValueError(
            f"{name} has shape {tuple(v.shape)}; expected (batch, {n_visible}) — "
            "reshape the data to one flattened example per row"
        )
    if not v.is_floating_point():
        raise ValueError(f"{name} has dtype {v.dtype}; convert it with .float()")


# The parameters every RBM has, in the order it registers them (named as in the paper).
BASE_PARAMETERS = ("W", "b", "a")


class RBM(nn.Module, ABC):
    """A restricted Boltzmann machine with binary hidden units.

    Parameters (named as in the paper): `W` (V, H) couplings, `b` (V,) visible bias,
    `a` (H,) hidden bias. Every method works on the device and dtype of the parameters.
    Sampling methods take an optional `torch.Generator` (on the parameters' device) for
    reproducible draws.
    """

    kind: str = ""

    def __init__(
        self,
        n_visible: int,
        n_hidden: int,
        *,
        init_std: float = 0.01,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if n_visible < 1 or n_hidden < 1:
            raise ValueError(
                f"n_visible and n_hidden must be positive, got {n_visible} and {n_hidden}"
            )
        if init_std < 0:
            raise ValueError(f"init_std must be non-negative, got {init_std}")
        self.n_visible = int(n_visible)
        self.n_hidden = int(n_hidden)
        self.init_std = float(init_std)
        weight = torch.randn(n_visible, n_hidden, generator=generator, dtype=torch.float32)
        weight = weight * init_std
        self.W = nn.Parameter(weight.to(device=device, dtype=torch.float32))
        self.b = nn.Parameter(torch.zeros(n_visible, device=device, dtype=torch.float32))
        self.a = nn.Parameter(torch.zeros(n_hidden, device=device, dtype=torch.float32))

    @abstractmethod
    def hidden_input(self, v: torch.Tensor) -> torch.Tensor:
        """Pre-activation of the hidden units given visible `v` (B, V) -> (B, H)."""

    @abstractmethod
    def visible_mean(self, h: torch.Tensor) -> torch.Tensor:
        """E[v | h] for hidden states `h` (B, H) -> (B, V)."""

    @abstractmethod
    def sample_visible(
        self, h: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Draw v ~ p(v | h) for hidden states `h` (B, H) -> (B, V)."""

    @abstractmethod
    def free_energy(self, v: torch.Tensor) -> torch.Tensor:
        """F(v) = -log sum_h exp(-E(v, h)) for each row of `v` (B, V) -> (B,)."""

    @abstractmethod
    def gibbs_kernel(self) -> GibbsKernel:
        """The detached tensors the fast sampler needs for one sweep at the current parameters."""

    def hidden_probs(self, v: torch.Tensor) -> torch.Tensor:
        """p(h_j = 1 | v) for visible `v` (B, V) -> (B, H)."""
        check_visible(v, self.n_visible)
        return torch.sigmoid(self.hidden_input(v))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        """`hidden_probs(v)` (B, V) -> (B, H): the model as a feature extractor, so that
        `model(v)`, `torch.export`, `torch.compile` and `torch.onnx` work on it."""
        return self.hidden_probs(v)

    def sample_hidden(
        self, v: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Draw binary h ~ p(h | v) for visible `v` (B, V) -> (B, H) float32 of 0/1."""
        probs = self.hidden_probs(v)
        return bernoulli(probs, generator)

    def reconstruct(
        self,
        v: torch.Tensor,
        k: int = 1,
        mean_field: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Run `k` Gibbs sweeps from `v` and return the visible mean of the last sweep (B, V). With
        `mean_field=False` the hidden (and intermediate visible) states are sampled; with
        `mean_field=True` probabilities and means are propagated instead, so the result is
        deterministic."""
        check_visible(v, self.n_visible)
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        current = v
        for sweep in range(k):
            probs = torch.sigmoid(self.hidden_input(current))
            h = probs if mean_field else bernoulli(probs, generator)
            last = sweep == k - 1
            current = (
                self.visible_mean(h) if mean_field or last else self.sample_visible(h, generator)
            )
        return current

    def constrain_(self) -> None:
        """Project the parameters back onto their valid set (no-op unless a subclass needs it). Call
        after every optimizer step; the CD estimator also calls it before each estimate."""

    @torch.no_grad()
    def init_from_data(self, v: torch.Tensor) -> None:
        """Set the biases (and variances) from data statistics, the usual starting point."""
        check_visible(v, self.n_visible)

    def config(self) -> dict[str, Any]:
        """A JSON-serializable description, enough to rebuild the model with model_from_config."""
        return {
            "type": self.kind,
            "n_visible": self.n_visible,
            "n_hidden": self.n_hidden,
            "init_std": self.init_std,
        }

    @property
    def device(self) -> torch.device:
        return self.W.device

    def extra_repr(self) -> str:
        return f"n_visible={self.n_visible}, n_hidden={self.n_hidden}"


def bernoulli(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A 0/1 float tensor with P(1) = probs, drawn as uniform < probs (cheaper than bernoulli)."""
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    return (uniform < probs).to(probs.dtype)
