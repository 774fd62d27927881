"""CD-k / PCD-k gradients of M Gaussian RBMs of one shape and variance form, batched.

The solo estimator (:class:`ssdcore.CDEstimator` with a :class:`~ssdcore.GaussianRBM`) builds
the model's Gibbs kernel (standard deviations ``exp(½ log σ²)``, precisions ``σ⁻²``, the hidden
weights ``C⁻¹W``), runs the sweeps, and writes every gradient of :mod:`ssdcore.gradients`:

    W: left @ right with left = (v C⁻¹)ᵀ (V, 2B), right = w ⊙ p (2B, H)
    a: Σ_n w_n p_n          b: C⁻¹ Σ_n w_n v_n
    log_var: ½ C⁻¹ Σ_n w_n (v_n - b)² - rowsum(W ⊙ ∂L/∂W)      log_c: its sum over units

Here the same operations run with a leading run dimension: elementwise ops on the stacks (the
same float operation per element), ``baddbmm`` / ``bmm`` where the solo step has ``addmm`` /
``mm`` (bit for bit on the CPU, as for the Bernoulli pack: :mod:`ssdcore.pack.gradients`).
Pieces done run by run, each for a stated reason:

- the normal draws: each run's come from its own torch generator (the solo estimator's), and a
  generator fills one tensor per call;
- ``mv`` products with the row weights and the isotropic sum over units: as in the Bernoulli
  pack, a batched product with a vector takes another BLAS kernel than ``mv``, and a full
  reduction another summation order than a batched one;
- the row sums from the gradient's factors (only where the solo step has no dense gradient);
- on the CPU with k ≥ 2, each run's whole chain: the solo chain may integrate the visible
  layer out of its intermediate sweeps (:class:`~ssdcore.sampling.CollapsedSweep`), which takes
  a Cholesky factor per run and decides on the host whether it exists; the pack runs each
  run's chain through the solo :class:`~ssdcore.sampling.GibbsChain` on its slices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdcore.models.base import GibbsKernel
from ssdcore.pack.aligned import stacked_empty
from ssdcore.pack.gradients import PackedCD
from ssdcore.pack.models import VARIANCE_PARAMETERS
from ssdcore.pack.random import PackedRandom
from ssdcore.sampling import GibbsChain


class PackedGaussianCD(PackedCD):
    """Batched CD-k (PCD-k) for Gaussian RBMs of one variance form (see the module docstring).

    ``estimate(weight, visible_bias, hidden_bias, batch, variance)`` takes the stacked variance
    parameter ((M, V) ``log_var``, (M, 1) ``log_c``, None for ``identity``) and also fills
    ``grad_variance``. ``dense_row_sums`` says whether the solo estimator has the dense weight
    gradient for the variance gradient's row sums (else it takes them from the factors).
    """

    def __init__(
        self,
        n_runs: int,
        n_visible: int,
        n_hidden: int,
        batch_size: int,
        *,
        variance: str,
        k: int,
        persistent: bool,
        random: PackedRandom,
        device: torch.device,
        dense_weight_grad: bool = True,
        dense_row_sums: bool = True,
    ) -> None:
        if variance not in VARIANCE_PARAMETERS:
            raise ValueError(
                f"variance must be one of {tuple(VARIANCE_PARAMETERS)}, got {variance!r}"
            )
        super().__init__(
            n_runs,
            n_visible,
            n_hidden,
            batch_size,
            k=k,
            persistent=persistent,
            random=random,
            device=device,
            dense_weight_grad=dense_weight_grad or (variance != "identity" and dense_row_sums),
            runs_per_chunk=n_runs,
        )
        self.variance = variance
        self.dense_row_sums = dense_row_sums
        M, V, H, B = n_runs, n_visible, n_hidden, batch_size

        def stack(*shape: int) -> Tensor:
            return stacked_empty(M, shape, device=device)

        self.noise = stack(B, V)
        scaled = variance != "identity"
        width = 1 if variance == "isotropic" else V
        self.scale = stack(width) if scaled else None  # standard deviations
        self.precision = stack(width) if scaled else None
        self.visible_precision = stack(2 * B, V) if scaled else None  # v C⁻¹ rows
        self.centered = stack(2 * B, V) if scaled else None
        self.weight_product = stack(V, H) if scaled else None
        self.hidden_weight = stack(V, H) if scaled else None  # C⁻¹W (W itself for C = I)
        self.grad_variance = stack(width) if scaled else None
        self.squared_moment = stack(V) if scaled else None
        # On the CPU the solo chain may collapse intermediate sweeps (see the module docstring).
        self.per_run_chains = torch.device(device).type == "cpu" and k > 1
        self._solo_chains: dict[int, GibbsChain] = {}
        self.factors = (self.visible.mT, self.right)

    @torch.no_grad()
    def estimate(  # type: ignore[override]
        self,
        weight: Tensor,
        visible_bias: Tensor,
        hidden_bias: Tensor,
        batch: Tensor,
        variance: Tensor | None = None,
    ) -> None:
        hidden_weight = self._kernel(weight, variance)
        self._estimate_all(weight, hidden_weight, visible_bias, hidden_bias, batch)
        self._write_gaussian_gradients(weight, visible_bias)

    def _kernel(self, weight: Tensor, variance: Tensor | None) -> Tensor:
        """The Gibbs kernel's tensors, as :meth:`GaussianRBM.gibbs_kernel` computes them;
        returns the hidden weights C⁻¹W."""
        if self.variance == "identity":
            return weight
        assert variance is not None and self.scale is not None and self.precision is not None
        assert self.hidden_weight is not None
        torch.exp(0.5 * variance, out=self.scale)
        torch.pow(self.scale, -2, out=self.precision)
        return torch.mul(weight, self.precision.unsqueeze(-1), out=self.hidden_weight)

    def _estimate_all(
        self,
        weight: Tensor,
        hidden_weight: Tensor,
        visible_bias: Tensor,
        hidden_bias: Tensor,
        batch: Tensor,
    ) -> None:
        B, runs = self.batch_size, slice(0, weight.shape[0])
        visible_rows, probs_rows = self.visible, self.hidden_probs
        hidden_bias_rows = hidden_bias.unsqueeze(1)  # (M, 1, H)
        visible_rows[:, :B].copy_(batch)
        hidden_data = probs_rows[:, :B]
        torch.baddbmm(hidden_bias_rows, batch, hidden_weight, out=hidden_data).sigmoid_()
        start = self._chain_start(runs, hidden_data)
        visible, probs = visible_rows[:, B:], probs_rows[:, B:]
        if self.per_run_chains:
            for run in range(weight.shape[0]):
                self._solo_chain(run).run(
                    self._run_kernel(run, weight, hidden_weight, visible_bias, hidden_bias),
                    start[run],
                    self.k,
                    visible[run],
                    probs[run],
                )
        else:
            self._sweeps(
                start, weight, hidden_weight, visible_bias, hidden_bias_rows, visible, probs
            )
        if self.persistent:
            self.random.bernoulli_(probs, out=self.chains, runs=runs)
            self.has_chains = [True] * len(self.has_chains)

    def _sweeps(
        self,
        start: Tensor,
        weight: Tensor,
        hidden_weight: Tensor,
        visible_bias: Tensor,
        hidden_bias_rows: Tensor,
        visible: Tensor,
        probs: Tensor,
    ) -> None:
        """k plain sweeps h → v → h for every run (:meth:`GibbsChain.run` without collapsing)."""
        visible_bias_rows, weight_t = visible_bias.unsqueeze(1), weight.mT
        hidden = start
        for sweep in range(self.k):
            torch.baddbmm(visible_bias_rows, hidden, weight_t, out=visible)
            for run, source in enumerate(self._sources()):
                source.normal_(self.noise[run])
            if self.scale is not None:
                visible.addcmul_(self.noise, self.scale.unsqueeze(1))
            else:
                visible.add_(self.noise)
            torch.baddbmm(hidden_bias_rows, visible, hidden_weight, out=probs).sigmoid_()
            if sweep < self.k - 1:
                hidden = self.random.bernoulli_(probs, out=self.hidden)

    def _sources(self) -> list:
        random = self.random
        return [random.shared] * len(random.sources) if random.shared else random.sources

    def _solo_chain(self, run: int) -> GibbsChain:
        chain = self._solo_chains.get(run)
        if chain is None:
            V, H = self.visible.shape[-1], self.hidden.shape[-1]
            device = self.visible.device
            chain = GibbsChain(self.batch_size, V, H, device, self._sources()[run])
            self._solo_chains[run] = chain
        return chain

    def _run_kernel(
        self,
        run: int,
        weight: Tensor,
        hidden_weight: Tensor,
        visible_bias: Tensor,
        hidden_bias: Tensor,
    ) -> GibbsKernel:
        return GibbsKernel(
            hidden_weight=hidden_weight[run],
            hidden_bias=hidden_bias[run],
            weight=weight[run],
            visible_bias=visible_bias[run],
            gaussian=True,
            noise_scale=None if self.scale is None else self.scale[run],
            precision=None if self.precision is None else self.precision[run],
        )

    def _write_gaussian_gradients(self, weight: Tensor, visible_bias: Tensor) -> None:
        right = torch.mul(self.hidden_probs, self._weights_column, out=self.right)
        if self.precision is None:
            weighted = self.visible  # C = I
        else:
            assert self.visible_precision is not None
            weighted = torch.mul(
                self.visible, self.precision.unsqueeze(1), out=self.visible_precision
            )
        left = weighted.mT  # (M, V, 2B)
        self.factors = (left, right)
        if self.dense_weight_grad:
            torch.bmm(left, right, out=self.grad_W)
        torch.sum(right, dim=1, out=self.grad_a)
        for run in range(left.shape[0]):  # mv per run (see the module docstring)
            torch.mv(left[run], self.weights, out=self.grad_b[run])
        if self.precision is not None:
            self._write_variance_gradient(weight, visible_bias, left, right)

    def _write_variance_gradient(
        self, weight: Tensor, visible_bias: Tensor, left: Tensor, right: Tensor
    ) -> None:
        assert self.centered is not None and self.squared_moment is not None
        assert self.grad_variance is not None and self.precision is not None
        centered = torch.sub(self.visible, visible_bias.unsqueeze(1), out=self.centered)
        centered.square_()
        for run in range(centered.shape[0]):  # Σ_n w_n (v_n - b)², mv per run
            torch.mv(centered[run].t(), self.weights, out=self.squared_moment[run])
        if self.dense_row_sums:
            assert self.weight_product is not None
            rowsum = torch.mul(weight, self.grad_W, out=self.weight_product).sum(dim=-1)
        else:  # the solo route without a dense gradient: Σ_n left_in (W rightᵀ)_in
            rowsum = torch.stack(
                [
                    (weight[run] @ right[run].t()).mul_(left[run]).sum(dim=1)
                    for run in range(len(weight))
                ]
            )
        grad = self.squared_moment.mul(self.precision).mul_(0.5).sub_(rowsum)
        if self.variance == "diagonal":
            self.grad_variance.copy_(grad)
        else:  # isotropic: the solo full sum over units, run by run
            for run in range(grad.shape[0]):
                self.grad_variance[run].copy_(grad[run].sum().reshape(1))
