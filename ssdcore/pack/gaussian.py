"""CD-k / PCD-k gradients of M Gaussian RBMs of one shape and variance form, batched.

The solo estimator's functions (:func:`ssdcore.models.gaussian.diagonal_kernel_tensors`,
:func:`ssdcore.sampling.gibbs_sweeps`, :mod:`ssdcore.gradients`) run on tensors with a leading
run dimension, as for the Bernoulli pack (:mod:`ssdcore.pack.gradients`). Pieces run run by run,
each for a stated reason:

- the normal draws: each run's come from its own torch generator, and a generator fills one
  tensor per call (:meth:`ssdcore.pack.random.PackedRandom.normal_`);
- ``mv`` products with the row weights and the isotropic sum over units: a batched product with
  a vector takes another BLAS kernel than ``mv``, and a full reduction another summation order
  (:mod:`ssdcore.batched`);
- on the CPU with k ≥ 2, each run's whole chain, through the solo
  :class:`~ssdcore.sampling.GibbsChain` on its slices: the solo chain may integrate the visible
  layer out of its intermediate sweeps (:class:`~ssdcore.sampling.CollapsedSweep`), which takes
  a Cholesky factor per run and decides on the host whether it exists.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdcore.batched import stacked_empty
from ssdcore.gradients import unit_sums, variance_gradient, weighted_row_sums
from ssdcore.models.base import GibbsKernel
from ssdcore.pack.gradients import PackedCD
from ssdcore.pack.models import PACKABLE_VARIANCES
from ssdcore.pack.random import PackedRandom


class PackedGaussianCD(PackedCD):
    """Batched CD-k (PCD-k) for Gaussian RBMs of one variance form (see the module docstring).
    ``estimate(..., variance)`` takes the stacked variance parameter ((M, V) ``log_var``, (M, 1)
    ``log_c``, None for ``identity``) and also fills ``grad_variance``. ``dense_row_sums`` says
    whether the solo estimator has the dense weight gradient for the variance gradient's row sums
    (else it takes them from the factors)."""

    gaussian = True
    row_blocks = False

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
        # On the CPU the solo chain may collapse intermediate sweeps (see the module docstring).
        self.per_run_chains = torch.device(device).type == "cpu" and k > 1

    def _write_gradients(self, runs: slice, kernel: GibbsKernel) -> tuple[Tensor, Tensor]:
        factors = super()._write_gradients(runs, kernel)
        if kernel.precision is None:
            return factors
        assert self.centered is not None and self.grad_variance is not None
        if self.dense_row_sums:
            assert self.weight_product is not None
            grad_W, product = self.grad_W[runs], self.weight_product[runs]
        else:  # the solo route without a dense gradient: from the factors
            grad_W = product = None
        row_sums = weighted_row_sums(kernel.weight, grad_W, factors, product)
        grad = variance_gradient(
            self.visible[runs],
            kernel.visible_bias,
            self.weights,
            kernel.precision,
            row_sums,
            self.centered[runs],
        )
        self.grad_variance[runs].copy_(grad if self.variance == "diagonal" else unit_sums(grad))
        return factors
