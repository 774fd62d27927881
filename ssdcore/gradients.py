"""CD-k and PCD-k gradient estimation for Bernoulli and Gaussian RBMs (the paper's appendix).

The loss is the negative log-likelihood L = mean_n F(v_n) + log Z, so for any parameter θ

    ∂L/∂θ = E_data[∂F/∂θ] - E_model[∂F/∂θ],

where CD-k replaces the model expectation by k block-Gibbs sweeps started at the data (PCD-k:
at persistent chains). With hidden probabilities p = σ(vᵀC⁻¹W + a) and weights w_n = -1/B_data on
data rows and +1/B_model on model rows, every gradient is a weighted sum over the 2B rows:

    W:       C⁻¹ Σ_n w_n v_n p_nᵀ             = left @ right  (rank ≤ 2B; C = I for the BRBM)
    a:       Σ_n w_n p_n
    b:       C⁻¹ Σ_n w_n v_n
    log_var: -rowsum(W ⊙ ∂L/∂W) + ½ C⁻¹ Σ_n w_n (v_n - b)²      (diagonal; errata: "W h")
    log_c:   the sum over units of the diagonal formula            (isotropic)
    C⁻¹:     sym(M Wᵀ - ½ Σ_n w_n (v_n - b)(v_n - b)ᵀ), M = Σ_n w_n v_n p_nᵀ   (full)

The full-precision gradient is the symmetric part, i.e. the gradient within symmetric matrices.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from ssdcore.batched import matmul, mv, over_rows, per_matrix
from ssdcore.models.base import RBM, GibbsKernel, check_visible
from ssdcore.models.gaussian import GaussianRBM
from ssdcore.sampling import GibbsChain, RandomSource, hidden_probs_, seed_from
from ssdcore.tempering import ParallelTempering, TemperingConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CDStats:
    """Views of the tensors one estimate used; overwritten by the next call to `estimate`."""

    visible_data: torch.Tensor  # (B, V)
    hidden_data: torch.Tensor  # (B, H) p(h | v_data)
    visible_model: torch.Tensor  # (B_model, V) the negative samples v_k
    hidden_model: torch.Tensor  # (B_model, H) p(h | v_k)


class _Workspace:
    """Buffers for one (data batch, chain count) shape: rows [0, B) data, [B, B + M) model."""

    def __init__(self, n_data: int, n_model: int, model: RBM, source: RandomSource):
        device = model.W.device
        f32 = {"device": device, "dtype": torch.float32}
        n_rows = n_data + n_model
        V, H = model.n_visible, model.n_hidden
        self.visible = torch.empty(n_rows, V, **f32)  # unscaled v rows
        self.hidden_probs = torch.empty(n_rows, H, **f32)  # unscaled p rows
        self.right = torch.empty(n_rows, H, **f32)  # w_n · p_n
        self.weights = row_weights(n_data, n_model, device)
        self.hidden_start = torch.empty(n_data, H, **f32)
        self.chain = GibbsChain(n_model, V, H, device, source)
        gaussian = isinstance(model, GaussianRBM)
        self.visible_precision = torch.empty(n_rows, V, **f32) if gaussian else None
        self.centered = torch.empty(n_rows, V, **f32) if gaussian else None
        self.weight_product = torch.empty(V, H, **f32) if gaussian else None


class CDEstimator:
    """Contrastive divergence CD-k, or persistent CD (PCD-k) with `persistent=True`.

    `estimate(v)` overwrites `.grad` of every model parameter (the negative log-likelihood's
    gradient; no `zero_grad()` needed) and sets `model.W.grad_factors = (left, right)`, `left`
    (V, B + B_model), `right` (B + B_model, H), with `model.W.grad == left @ right`.

    Persistent chains are binary hidden states (one per row of the first batch, started from
    the data), so a sweep goes h → v → h. Draws come from the estimator's own seeded source
    (`seed`, else drawn from `generator` or torch's global generator); `state_dict()` holds the
    chains and the source's state for an exact resume. ``tempering`` (PCD only) runs the chains
    as parallel tempering (:mod:`ssdcore.tempering`), the β = 1 chains being the negative phase.
    """

    def __init__(
        self,
        model: RBM,
        k: int = 1,
        persistent: bool = False,
        *,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        dense_weight_grad: bool = True,
        tempering: TemperingConfig | None = None,
    ):
        if not isinstance(model, RBM):
            raise TypeError(f"model must be an ssdcore RBM, got {type(model).__name__}")
        if int(k) != k or k < 1:
            raise ValueError(f"k (Gibbs sweeps per estimate) must be an integer >= 1, got {k}")
        self.model = model
        self.k = int(k)
        self.persistent = bool(persistent)
        # False: leave W.grad as None and give only grad_factors (an exact low-rank SSD step
        # needs nothing else), saving one (V, 2B) x (2B, H) product per step. The variance
        # gradients of a Gaussian RBM read W.grad, so those models always get it.
        self.dense_weight_grad = bool(dense_weight_grad)
        self.source = RandomSource(
            model.W.device, seed if seed is not None else seed_from(generator)
        )
        self.chains: torch.Tensor | None = None  # (n_chains, H) binary hidden states (PCD)
        if tempering is not None and not self.persistent:
            raise ValueError("tempering needs persistent chains: pass persistent=True (PCD)")
        self.tempering = (
            None if tempering is None else ParallelTempering(tempering, model, self.source)
        )
        self._workspaces: dict[tuple[int, int], _Workspace] = {}

    @torch.no_grad()
    def estimate(self, v_data: torch.Tensor) -> CDStats:
        """Estimate the gradient at the data batch `v_data` (B, V) and write it to `.grad`."""
        model = self.model
        check_visible(v_data, model.n_visible, "v_data")
        model.constrain_()
        kernel = model.gibbs_kernel()
        n_data = v_data.shape[0]
        resuming = self.persistent and self.chains is not None
        n_model = self.chains.shape[0] if resuming else n_data
        ws = self._workspace(n_data, n_model)
        data_rows, model_rows = slice(0, n_data), slice(n_data, n_data + n_model)

        visible_data = ws.visible[data_rows]
        visible_data.copy_(v_data)
        hidden_data = ws.hidden_probs[data_rows]
        hidden_probs_(kernel, visible_data, hidden_data)

        if resuming:
            start = self.chains
        else:
            start = self.source.bernoulli_(hidden_data, out=ws.hidden_start)
        visible_model, hidden_model = ws.visible[model_rows], ws.hidden_probs[model_rows]
        if self.tempering is not None:
            fresh = None if resuming else start
            self.tempering.run(kernel, self.k, fresh, visible_model, hidden_model)
            self.chains = self.tempering.chains[0]
        else:
            ws.chain.run(kernel, start, self.k, visible_model, hidden_model)
        if self.persistent and self.tempering is None:
            if self.chains is None:
                self.chains = torch.empty_like(hidden_model)
            self.source.bernoulli_(hidden_model, out=self.chains)

        self._write_gradients(ws, kernel)
        return CDStats(visible_data, hidden_data, visible_model, hidden_model)

    def _write_gradients(self, ws: _Workspace, kernel: GibbsKernel) -> None:
        model = self.model
        if isinstance(model, GaussianRBM) and model.variance == "full":
            assert ws.visible_precision is not None
            weighted_visible = torch.mm(
                ws.visible, model.precision.detach(), out=ws.visible_precision
            )
        else:
            weighted_visible = weighted_visible_(ws.visible, kernel.precision, ws.visible_precision)
        needs_variance = isinstance(model, GaussianRBM) and model.variance != "identity"
        # The full precision's gradient reads ∂L/∂W itself; the others need only its row sums
        # against W, which the factors give at the same cost as the dense product.
        dense = self.dense_weight_grad or (needs_variance and model.variance == "full")
        if not dense:
            model.W.grad = None
        model.W.grad_factors = write_weight_gradients_(
            weighted_visible,
            ws.hidden_probs,
            ws.weights,
            right=ws.right,
            grad_W=_grad_buffer(model.W) if dense else None,
            grad_a=_grad_buffer(model.a),
            grad_b=_grad_buffer(model.b),
        )
        if needs_variance:
            self._write_variance_gradient(model, ws, kernel)

    def _write_variance_gradient(
        self, model: GaussianRBM, ws: _Workspace, kernel: GibbsKernel
    ) -> None:
        assert ws.centered is not None
        weight = model.W.detach()
        if model.variance == "full":
            centered = torch.sub(ws.visible, model.b.detach(), out=ws.centered)  # (2B, V)
            # M = Σ_n w_n v_n p_nᵀ = C·∂L/∂W, recomputed from the unscaled rows (V is small).
            moment = ws.visible.t() @ ws.right  # (V, H)
            quadratic = centered.t() @ (centered * ws.weights.unsqueeze(1))  # (V, V)
            grad = moment @ weight.t() - 0.5 * quadratic
            _grad_buffer(model.precision).copy_(0.5 * (grad + grad.t()))
            return
        assert ws.weight_product is not None and kernel.precision is not None
        factors = model.W.grad_factors
        assert factors is not None
        rowsum = weighted_row_sums(weight, model.W.grad, factors, ws.weight_product)  # (V,)
        grad = variance_gradient(
            ws.visible, model.b.detach(), ws.weights, kernel.precision, rowsum, ws.centered
        )
        if model.variance == "diagonal":
            _grad_buffer(model.log_var).copy_(grad)
        else:
            _grad_buffer(model.log_c).copy_(unit_sums(grad))

    def _workspace(self, n_data: int, n_model: int) -> _Workspace:
        key = (n_data, n_model)
        ws = self._workspaces.get(key)
        if ws is None:
            if len(self._workspaces) >= 4:  # e.g. a last partial batch per epoch: keep a few
                self._workspaces.clear()
            ws = _Workspace(n_data, n_model, self.model, self.source)
            self._workspaces[key] = ws
        return ws

    def reset_chains(self) -> None:
        """Forget the persistent chains; the next estimate restarts them from its data batch."""
        self.chains = None
        if self.tempering is not None:
            self.tempering.chains = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Chains (PCD) and random state as tensors, for an exact resume (safetensors-friendly)."""
        state = {f"rng.{name}": tensor for name, tensor in self.source.state_dict().items()}
        if self.chains is not None:
            state["chains"] = self.chains.detach().cpu().clone()
        if self.tempering is not None:
            for name, tensor in self.tempering.state_dict().items():
                state[f"tempering.{name}"] = tensor
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state_dict()` output; chains must match the model's hidden size."""
        rng = {name[4:]: tensor for name, tensor in state.items() if name.startswith("rng.")}
        if rng:
            self.source.load_state_dict(rng)
        self._load_tempering(state)
        chains = state.get("chains")
        if chains is None:
            self.chains = None
            return
        if chains.ndim != 2 or chains.shape[1] != self.model.n_hidden:
            expected = f"(n, {self.model.n_hidden})"
            raise ValueError(f"saved chains have shape {tuple(chains.shape)}; expected {expected}")
        self.chains = chains.to(device=self.model.W.device, dtype=torch.float32).clone()
        if self.tempering is not None and self.tempering.chains is not None:
            self.chains = self.tempering.chains[0]  # the same chains, one tensor

    def _load_tempering(self, state: dict[str, torch.Tensor]) -> None:
        prefix = "tempering."
        saved = {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
        if self.tempering is None:
            if saved:
                raise ValueError("saved state has tempering chains; resume with tempering on")
            return
        if not saved:
            raise ValueError("saved state has no tempering chains; resume with tempering off")
        self.tempering.load_state_dict(saved)


# --- the gradients' arithmetic, for one run's rows or a pack's (leading run axis) ---------------


def row_weights(
    n_data: int, n_model: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> Tensor:
    """w_n: -1/B on the data rows, +1/B_model on the model rows, rounded to ``dtype``."""
    data, model = torch.full((n_data,), -1.0 / n_data), torch.full((n_model,), 1.0 / n_model)
    return torch.cat([data, model]).to(device=device, dtype=dtype)


def weighted_visible_(visible: Tensor, precision: Tensor | None, out: Tensor | None) -> Tensor:
    """The rows ``v C⁻¹`` for a diagonal precision (``(..., V)`` or ``(..., 1)``), into ``out``;
    ``visible`` itself for C = I (``precision`` None)."""
    if precision is None:
        return visible
    return torch.mul(visible, over_rows(precision), out=out)


def write_weight_gradients_(
    weighted_visible: Tensor,
    hidden_probs: Tensor,
    weights: Tensor,
    *,
    right: Tensor,
    grad_W: Tensor | None,
    grad_a: Tensor,
    grad_b: Tensor,
) -> tuple[Tensor, Tensor]:
    """∂W = left @ right (into ``grad_W``, skipped when None), ∂a = Σ_n w_n p_n and
    ∂b = Σ_n w_n (v C⁻¹)_n from the weighted rows ``v C⁻¹`` (2B, V), the hidden probabilities
    p (2B, H) and the row weights w (2B,); returns ∂W's factors ``(left, right)`` with
    ``left = (v C⁻¹)ᵀ`` and ``right = w ⊙ p`` (written into ``right``)."""
    right = torch.mul(hidden_probs, weights.unsqueeze(-1), out=right)
    left = weighted_visible.mT  # (V, 2B)
    if grad_W is not None:
        matmul(left, right, out=grad_W)
    torch.sum(right, dim=-2, out=grad_a)
    mv(left, weights, out=grad_b)
    return left, right


def weighted_row_sums(
    weight: Tensor, grad: Tensor | None, factors: tuple[Tensor, Tensor], product: Tensor | None
) -> Tensor:
    """``rowsum(W ⊙ ∂L/∂W)`` (V,), from the dense gradient when there is one (``product`` its
    scratch), else from its factors: with ∂L/∂W = left @ right,
    ``Σ_j W_ij (left right)_ij = Σ_n left_in (W rightᵀ)_in``."""
    if grad is not None:
        return torch.mul(weight, grad, out=product).sum(dim=-1)
    return per_matrix(_row_sums_from_factors, weight, *factors)


def _row_sums_from_factors(weight: Tensor, left: Tensor, right: Tensor) -> Tensor:
    return (weight @ right.t()).mul_(left).sum(dim=1)


def variance_gradient(
    visible: Tensor,
    visible_bias: Tensor,
    weights: Tensor,
    precision: Tensor,
    row_sums: Tensor,
    centered: Tensor,
) -> Tensor:
    """The diagonal log-variance gradient ``½ C⁻¹ Σ_n w_n (v_n - b)² - rowsum(W ⊙ ∂L/∂W)``
    (V,), with ``centered`` scratch for the rows ``(v_n - b)²``."""
    torch.sub(visible, over_rows(visible_bias), out=centered).square_()
    squared_moment = mv(centered.mT, weights)  # Σ_n w_n (v_n - b)²
    return squared_moment.mul_(precision).mul_(0.5).sub_(row_sums)


def unit_sums(grad: Tensor) -> Tensor:
    """The isotropic log_c gradient: the diagonal gradient summed over units, (1,)."""
    return per_matrix(lambda run_grad: run_grad.sum().reshape(1), grad, rank=1)


def _grad_buffer(parameter: torch.Tensor) -> torch.Tensor:
    """The parameter's .grad tensor, allocated on first use and reused afterwards."""
    if parameter.grad is None or parameter.grad.shape != parameter.shape:
        parameter.grad = torch.empty_like(parameter)
    return parameter.grad
