"""The Gaussian RBM: real-valued visible units with covariance C, binary hidden units.

E(v, h) = -vᵀC⁻¹Wh + ½(v - b)ᵀC⁻¹(v - b) - aᵀh   (the paper's energy), so
p(v | h) = N(b + Wh, C) and p(h_j = 1 | v) = σ(vᵀC⁻¹W + a)_j.

The covariance C takes one of four forms (`variance=`):
- "identity":  C = I, nothing learned;
- "isotropic": C = exp(log_c)·I, parameter `log_c` (1,);
- "diagonal":  C = diag(exp(log_var)), parameter `log_var` (V,) — the default; log-parameterized
               so variances stay positive whatever step the optimizer takes;
- "full":      parameter `precision` = C⁻¹ (V, V), kept symmetric positive definite by
               `constrain_()`; for small n_visible only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ssdcore.models.base import RBM, GibbsKernel, check_visible, correlate_

# Each variance form -> the name of the parameter that holds it (None: C = I, nothing to learn).
VARIANCE_PARAMETERS: dict[str, str | None] = {
    "identity": None,
    "isotropic": "log_c",
    "diagonal": "log_var",
    "full": "precision",
}
VARIANCE_KINDS = tuple(VARIANCE_PARAMETERS)
DEFAULT_VARIANCE = "diagonal"  # the form a Gaussian RBM takes when none is named
# Floor of the learned variances: binary-valued or constant pixels drive theirs to zero.
DEFAULT_MIN_VARIANCE = 1e-4
# A dense V×V precision costs O(V²) per example and O(V³) per projection; beyond this size
# the diagonal model is the practical choice.
MAX_FULL_VISIBLE = 64
# Smallest eigenvalue of the full precision relative to its largest (see _project_precision_).
_RELATIVE_FLOOR = 1e-5


class GaussianRBM(RBM):
    """RBM with Gaussian visible units; see the module docstring for the variance forms."""

    kind = "gaussian"

    def __init__(
        self,
        n_visible: int,
        n_hidden: int,
        variance: str = DEFAULT_VARIANCE,
        *,
        min_variance: float = DEFAULT_MIN_VARIANCE,
        max_variance: float = 1e4,
        init_std: float = 0.01,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__(n_visible, n_hidden, init_std=init_std, generator=generator, device=device)
        if variance not in VARIANCE_KINDS:
            raise ValueError(
                f"variance must be one of {', '.join(VARIANCE_KINDS)}; got {variance!r}"
            )
        if variance == "full" and n_visible > MAX_FULL_VISIBLE:
            raise ValueError(
                f"variance='full' supports n_visible <= {MAX_FULL_VISIBLE} (got {n_visible}); "
                "use variance='diagonal' for larger inputs"
            )
        if not 0 < min_variance < max_variance:
            raise ValueError(
                f"need 0 < min_variance < max_variance, got {min_variance} and {max_variance}"
            )
        self.variance = variance
        self.min_variance = float(min_variance)
        self.max_variance = float(max_variance)
        f32 = {"device": self.W.device, "dtype": torch.float32}
        initial = {  # C = I in every form
            "isotropic": lambda: torch.zeros(1, **f32),
            "diagonal": lambda: torch.zeros(n_visible, **f32),
            "full": lambda: torch.eye(n_visible, **f32),
        }
        name = VARIANCE_PARAMETERS[variance]
        if name is not None:
            self.register_parameter(name, nn.Parameter(initial[variance]()))

    def log_variance(self) -> torch.Tensor:
        """Log of the per-unit variances: (V,) for diagonal, (1,) for identity/isotropic. Not
        defined for the full covariance (use `precision_matrix()`)."""
        if self.variance == "diagonal":
            return self.log_var
        if self.variance == "isotropic":
            return self.log_c
        if self.variance == "identity":
            return torch.zeros(1, device=self.W.device, dtype=self.W.dtype)
        raise ValueError(
            "log_variance() is not defined for variance='full'; use precision_matrix()"
        )

    def precision_matrix(self) -> torch.Tensor:
        """C⁻¹ as a dense (V, V) matrix, for every variance form."""
        if self.variance == "full":
            return self.precision
        diag = torch.exp(-self.log_variance()).expand(self.n_visible)
        return torch.diag(diag)

    def apply_precision(self, x: torch.Tensor) -> torch.Tensor:
        """x @ C⁻¹ for rows x (B, V) -> (B, V) (C⁻¹ is symmetric)."""
        if self.variance == "full":
            return x @ self.precision
        if self.variance == "identity":
            return x
        return x * torch.exp(-self.log_variance())

    def log_det_covariance(self) -> torch.Tensor:
        """log |C| as a 0-dim tensor."""
        if self.variance == "full":
            return -torch.logdet(self.precision)
        if self.variance == "diagonal":
            return self.log_var.sum()
        return self.log_variance()[0] * self.n_visible

    def hidden_input(self, v: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.a, self.apply_precision(v), self.W)

    def visible_mean(self, h: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.b, h, self.W.t())

    def sample_visible(
        self, h: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        mean = self.visible_mean(h)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return mean + correlate_(eps, *self._noise_factors())

    def free_energy(self, v: torch.Tensor) -> torch.Tensor:
        check_visible(v, self.n_visible)
        centered = v - self.b
        quadratic = 0.5 * (self.apply_precision(centered) * centered).sum(dim=1)
        return quadratic - F.softplus(self.hidden_input(v)).sum(dim=1)

    def _noise_factors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(scale, transform): noise = eps * scale, or eps @ transform for the full covariance. For
        C⁻¹ = L Lᵀ (Cholesky), eps @ L⁻¹ has covariance L⁻ᵀL⁻¹ = C."""
        if self.variance == "identity":
            return None, None
        if self.variance == "full":
            chol = torch.linalg.cholesky(self.precision.detach())
            eye = torch.eye(self.n_visible, device=chol.device, dtype=chol.dtype)
            return None, torch.linalg.solve_triangular(chol, eye, upper=False)
        return torch.exp(0.5 * self.log_variance().detach()), None

    def _kernel_buffer(self) -> torch.Tensor:
        """A reused (V, H) tensor for C⁻¹W: allocating 4·V·H bytes per update costs page faults.
        Each `gibbs_kernel()` call overwrites it, so a kernel is valid until the next call."""
        buffer = getattr(self, "_hidden_weight_buffer", None)
        if buffer is None or buffer.shape != self.W.shape or buffer.device != self.W.device:
            buffer = torch.empty_like(self.W, requires_grad=False)
            self._hidden_weight_buffer = buffer
        return buffer

    def gibbs_kernel(self) -> GibbsKernel:
        weight = self.W.detach()
        precision = scale = transform = None
        if self.variance == "full":
            hidden_weight = self.precision.detach() @ weight
            scale, transform = self._noise_factors()
        elif self.variance == "identity":
            hidden_weight = weight
        else:
            scale, precision, hidden_weight = diagonal_kernel_tensors(
                weight, self.log_variance().detach(), hidden_weight_out=self._kernel_buffer()
            )
        return GibbsKernel(
            hidden_weight=hidden_weight,
            hidden_bias=self.a.detach(),
            weight=weight,
            visible_bias=self.b.detach(),
            gaussian=True,
            noise_scale=scale,
            noise_transform=transform,
            precision=precision,
        )

    @torch.no_grad()
    def constrain_(self) -> None:
        """Keep variances in [min_variance, max_variance]; keep the precision symmetric and SPD. For
        the full precision the projection symmetrizes and, only when an eigenvalue left
        [1/max_variance, 1/min_variance], clips the spectrum (the nearest such matrix in the
        Frobenius norm)."""
        if self.variance == "full":
            self._project_precision_()
        elif self.variance != "identity":  # log_variance() is the parameter itself
            self.log_variance().clamp_(*log_variance_bounds(self.min_variance, self.max_variance))

    def _project_precision_(self) -> None:
        """Symmetrize; clip the spectrum when it leaves the allowed range. Eigenvalues are kept in
        [max(1/max_variance, λ_max·1e-5), 1/min_variance]: the relative floor keeps the matrix
        positive definite after rounding to float32, whose error is about 1e-7·λ_max per entry.
        Computed in float64."""
        precision = self.precision
        symmetric = 0.5 * (precision.double() + precision.double().t())
        eigenvalues, eigenvectors = torch.linalg.eigh(symmetric)
        high = 1.0 / self.min_variance
        low = max(1.0 / self.max_variance, min(float(eigenvalues.max()), high) * _RELATIVE_FLOOR)
        if eigenvalues.min() < low or eigenvalues.max() > high:
            clipped = eigenvalues.clamp(low, high)
            symmetric = (eigenvectors * clipped) @ eigenvectors.t()
            symmetric = 0.5 * (symmetric + symmetric.t())
        precision.copy_(symmetric)
        # Rounding to float32 may break exact symmetry by one ulp; restore it.
        precision.copy_(torch.triu(precision) + torch.triu(precision, diagonal=1).t())

    @torch.no_grad()
    def init_from_data(self, v: torch.Tensor) -> None:
        """b = data mean; variances = data variances (clipped to the allowed range)."""
        check_visible(v, self.n_visible)
        self.b.copy_(v.mean(dim=0))
        var = v.var(dim=0, unbiased=False).clamp(self.min_variance, self.max_variance)
        if self.variance == "diagonal":
            self.log_var.copy_(torch.log(var))
        elif self.variance == "isotropic":
            self.log_c.fill_(math.log(float(var.mean())))
        elif self.variance == "full":
            self.precision.copy_(torch.diag(1.0 / var))

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "variance": self.variance,
            "min_variance": self.min_variance,
            "max_variance": self.max_variance,
        }

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, variance={self.variance!r}"


def log_variance_bounds(min_variance: float, max_variance: float) -> tuple[float, float]:
    """The interval :meth:`GaussianRBM.constrain_` clamps log variances to (a pack clamps each
    run's slice to its run's)."""
    return math.log(min_variance), math.log(max_variance)


def diagonal_kernel_tensors(
    weight: torch.Tensor,
    log_variance: torch.Tensor,
    *,
    hidden_weight_out: torch.Tensor,
    scale_out: torch.Tensor | None = None,
    precision_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gibbs kernel's tensors of a diagonal or isotropic variance: standard deviations
    ``exp(½ log σ²)``, precisions ``σ⁻²`` and hidden weights ``C⁻¹W`` (into the ``_out``
    tensors where given). For one model, or a pack's stacked runs (``ssdcore.pack``)."""
    scale = torch.exp(0.5 * log_variance, out=scale_out)
    precision = torch.pow(scale, -2, out=precision_out)
    hidden_weight = torch.mul(weight, precision.unsqueeze(-1), out=hidden_weight_out)
    return scale, precision, hidden_weight
