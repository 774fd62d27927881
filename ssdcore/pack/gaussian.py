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

from dataclasses import dataclass

import torch
from torch import Tensor

from ssdcore.batched import stacked_empty
from ssdcore.models.base import GibbsKernel
from ssdcore.pack.gradients import PackedCD
from ssdcore.pack.models import PACKABLE_VARIANCES
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
        runs_per_chunk: int | None = None,
    ) -> None:
        if variance not in PACKABLE_VARIANCES:
            raise ValueError(f"variance must be one of {PACKABLE_VARIANCES}, got {variance!r}")
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
            # The whole pack at once by default: unlike the Bernoulli step, chunks sized to the
            # cache did not help here (8 runs, B = 100, H = 64, one CPU thread: per run-step
            # 212 µs whole vs 237-258 µs in chunks of 3-5 at V = 100, equal within noise at
            # V = 300 and 784, where the normal draws and elementwise passes dominate).
            runs_per_chunk=runs_per_chunk or n_runs,
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
        """Every run's gradient, ``runs_per_chunk`` runs at a time (kept in cache on the CPU,
        as the Bernoulli estimator's chunks)."""
        n_runs = weight.shape[0]
        for first in range(0, n_runs, self.runs_per_chunk):
            runs = slice(first, min(n_runs, first + self.runs_per_chunk))
            chunk = _Chunk(
                runs,
                weight[runs],
                visible_bias[runs],
                hidden_bias[runs],
                self._kernel(runs, weight[runs], None if variance is None else variance[runs]),
            )
            self._sample(chunk, batch[runs])
            self._write_gaussian_gradients(chunk)
        weighted = self.visible if self.visible_precision is None else self.visible_precision
        self.factors = (weighted.mT, self.right)

    def _kernel(self, runs: slice, weight: Tensor, variance: Tensor | None) -> Tensor:
        """The Gibbs kernel's tensors, as :meth:`GaussianRBM.gibbs_kernel` computes them;
        returns the hidden weights C⁻¹W."""
        if self.variance == "identity":
            return weight
        assert variance is not None and self.scale is not None and self.precision is not None
        assert self.hidden_weight is not None
        scale = torch.exp(0.5 * variance, out=self.scale[runs])
        precision = torch.pow(scale, -2, out=self.precision[runs])
        return torch.mul(weight, precision.unsqueeze(-1), out=self.hidden_weight[runs])

    def _sample(self, chunk: _Chunk, batch: Tensor) -> None:
        """The data rows' p(h | v) and the chains' k sweeps, into the chunk's rows."""
        B, runs = self.batch_size, chunk.runs
        visible_rows, probs_rows = self.visible[runs], self.hidden_probs[runs]
        hidden_bias_rows = chunk.hidden_bias.unsqueeze(1)  # (R, 1, H)
        visible_rows[:, :B].copy_(batch)
        hidden_data = probs_rows[:, :B]
        torch.baddbmm(hidden_bias_rows, batch, chunk.hidden_weight, out=hidden_data).sigmoid_()
        start = self._chain_start(runs, hidden_data)
        visible, probs = visible_rows[:, B:], probs_rows[:, B:]
        if self.per_run_chains:
            for offset in range(len(chunk.weight)):
                run = runs.start + offset
                self._solo_chain(run).run(
                    self._run_kernel(chunk, offset),
                    start[offset],
                    self.k,
                    visible[offset],
                    probs[offset],
                )
        else:
            self._sweeps(chunk, start, visible, probs)
        if self.persistent:
            self.random.bernoulli_(probs, out=self.chains[runs], runs=runs)
            self.has_chains[runs] = [True] * len(self.has_chains[runs])

    def _sweeps(self, chunk: _Chunk, start: Tensor, visible: Tensor, probs: Tensor) -> None:
        """k plain sweeps h → v → h for the chunk's runs (:meth:`GibbsChain.run` without
        collapsing)."""
        runs = chunk.runs
        visible_bias_rows, weight_t = chunk.visible_bias.unsqueeze(1), chunk.weight.mT
        hidden_bias_rows = chunk.hidden_bias.unsqueeze(1)
        noise = self.noise[runs]
        scale = None if self.scale is None else self.scale[runs].unsqueeze(1)
        sources = self._sources()[runs]
        hidden = start
        for sweep in range(self.k):
            torch.baddbmm(visible_bias_rows, hidden, weight_t, out=visible)
            for offset, source in enumerate(sources):
                source.normal_(noise[offset])
            if scale is not None:
                visible.addcmul_(noise, scale)
            else:
                visible.add_(noise)
            torch.baddbmm(hidden_bias_rows, visible, chunk.hidden_weight, out=probs).sigmoid_()
            if sweep < self.k - 1:
                hidden = self.random.bernoulli_(probs, out=self.hidden[runs], runs=runs)

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

    def _run_kernel(self, chunk: _Chunk, offset: int) -> GibbsKernel:
        run = chunk.runs.start + offset
        return GibbsKernel(
            hidden_weight=chunk.hidden_weight[offset],
            hidden_bias=chunk.hidden_bias[offset],
            weight=chunk.weight[offset],
            visible_bias=chunk.visible_bias[offset],
            gaussian=True,
            noise_scale=None if self.scale is None else self.scale[run],
            precision=None if self.precision is None else self.precision[run],
        )

    def _write_gaussian_gradients(self, chunk: _Chunk) -> None:
        runs = chunk.runs
        right = torch.mul(self.hidden_probs[runs], self._weights_column, out=self.right[runs])
        if self.precision is None:
            weighted = self.visible[runs]  # C = I
        else:
            assert self.visible_precision is not None
            weighted = torch.mul(
                self.visible[runs],
                self.precision[runs].unsqueeze(1),
                out=self.visible_precision[runs],
            )
        left = weighted.mT  # (R, V, 2B)
        if self.dense_weight_grad:
            torch.bmm(left, right, out=self.grad_W[runs])
        torch.sum(right, dim=1, out=self.grad_a[runs])
        grad_b = self.grad_b[runs]
        for offset in range(left.shape[0]):  # mv per run (see the module docstring)
            torch.mv(left[offset], self.weights, out=grad_b[offset])
        if self.precision is not None:
            self._write_variance_gradient(chunk, left, right)

    def _write_variance_gradient(self, chunk: _Chunk, left: Tensor, right: Tensor) -> None:
        runs, weight = chunk.runs, chunk.weight
        assert self.centered is not None and self.squared_moment is not None
        assert self.grad_variance is not None and self.precision is not None
        centered = torch.sub(
            self.visible[runs], chunk.visible_bias.unsqueeze(1), out=self.centered[runs]
        )
        centered.square_()
        squared_moment = self.squared_moment[runs]
        for offset in range(centered.shape[0]):  # Σ_n w_n (v_n - b)², mv per run
            torch.mv(centered[offset].t(), self.weights, out=squared_moment[offset])
        if self.dense_row_sums:
            assert self.weight_product is not None
            product = torch.mul(weight, self.grad_W[runs], out=self.weight_product[runs])
            rowsum = product.sum(dim=-1)
        else:  # the solo route without a dense gradient: Σ_n left_in (W rightᵀ)_in
            rowsum = torch.stack(
                [
                    (weight[offset] @ right[offset].t()).mul_(left[offset]).sum(dim=1)
                    for offset in range(len(weight))
                ]
            )
        grad = squared_moment.mul(self.precision[runs]).mul_(0.5).sub_(rowsum)
        grad_variance = self.grad_variance[runs]
        if self.variance == "diagonal":
            grad_variance.copy_(grad)
        else:  # isotropic: the solo full sum over units, run by run
            for offset in range(grad.shape[0]):
                grad_variance[offset].copy_(grad[offset].sum().reshape(1))


@dataclass(frozen=True)
class _Chunk:
    """The runs ``runs`` of a pack: their parameters' slices and hidden weights C⁻¹W."""

    runs: slice
    weight: Tensor
    visible_bias: Tensor
    hidden_bias: Tensor
    hidden_weight: Tensor
