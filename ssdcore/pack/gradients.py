"""CD-k / PCD-k gradients of M RBMs of one shape as batched products.

The solo estimator's functions (:func:`ssdcore.sampling.gibbs_sweeps`,
:func:`ssdcore.gradients.write_weight_gradients_`) run on a kernel and rows with a leading run
dimension, where their products are ``baddbmm`` / ``bmm``: on the CPU those give the per-run
results bit for bit (``tests/test_pack.py``), and the draws come from each run's own source
(:mod:`ssdcore.pack.random`), so each run's estimate is its solo estimate. What this module
adds is the buffers' layout: each run's rows at the solo buffers' offsets.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdcore.batched import ALIGNMENT_BYTES, stacked_empty
from ssdcore.gradients import row_weights, weighted_visible_, write_weight_gradients_
from ssdcore.models.base import GibbsKernel
from ssdcore.models.gaussian import diagonal_kernel_tensors
from ssdcore.pack.random import PackedRandom
from ssdcore.sampling import GibbsChain, gibbs_sweeps, hidden_probs_

# Floats in ALIGNMENT_BYTES: a row block of a multiple of this many floats ends aligned.
_ALIGNED_FLOATS = ALIGNMENT_BYTES // 4
# Bytes of one chunk's buffers the CPU path aims to keep in cache (L2 + a share of L3).
CHUNK_CACHE_BYTES = 2 * 1024 * 1024


def default_runs_per_chunk(
    n_runs: int, n_visible: int, n_hidden: int, batch_size: int, device: torch.device
) -> int:
    """Runs per chunk: all of them on a GPU, else as many as fit CHUNK_CACHE_BYTES."""
    if torch.device(device).type != "cpu":
        return n_runs
    # visible and draw scratch (2B×V, B×V ×2), hidden rows (2B×H ×2, B×H ×3), W and ∂W.
    floats = 4 * batch_size * n_visible + 7 * batch_size * n_hidden + 2 * n_visible * n_hidden
    return max(1, min(n_runs, CHUNK_CACHE_BYTES // (4 * floats)))


class PackedCD:
    """Batched CD-k (or PCD-k with ``persistent``) for Bernoulli RBMs.
    ``estimate(weight, visible_bias, hidden_bias, batch)`` reads parameters (M, V, H), (M, V),
    (M, H) and the data batch (M, B, V) and fills ``grad_W`` (when ``dense_weight_grad``),
    ``grad_b``, ``grad_a`` and ``factors``. PCD chains are ``chains`` (M, B, H) with
    ``has_chains`` (M,) saying which runs have theirs yet (a run inserted at step 0 has none)."""

    gaussian = False
    # Contiguous stand-ins for row blocks (see __init__); the Gaussian estimator does without.
    row_blocks = True

    def __init__(
        self,
        n_runs: int,
        n_visible: int,
        n_hidden: int,
        batch_size: int,
        *,
        k: int,
        persistent: bool,
        random: PackedRandom,
        device: torch.device,
        dense_weight_grad: bool = True,
        runs_per_chunk: int | None = None,
    ) -> None:
        M, V, H, B = n_runs, n_visible, n_hidden, batch_size
        self.k = k
        self.persistent = persistent
        self.random = random
        self.dense_weight_grad = dense_weight_grad
        self.batch_size = B
        # Runs estimated together: the whole pack on a GPU; on the CPU as many as keep one
        # chunk's buffers in cache (a whole pack's buffers streamed through memory made each
        # batched kernel ~3x slower per run than the solo kernel on cache-resident buffers).
        self.runs_per_chunk = runs_per_chunk or default_runs_per_chunk(M, V, H, B, device)

        def stack(*shape: int) -> Tensor:  # run slices aligned as solo buffers are
            return stacked_empty(M, shape, device=device)

        # Each buffer mirrors one of the solo estimator's (same offsets within a run's slice).
        self.visible = stack(2 * B, V)  # rows [0, B) data, [B, 2B) model
        self.hidden_probs = stack(2 * B, H)
        self.right = stack(2 * B, H)  # w_n · p_n
        self.weights = row_weights(B, B, device)  # the solo estimator's

        # Contiguous stand-ins for the (B, ·) row blocks of those buffers, used when a block's
        # size keeps every run's block at the solo block's alignment (a multiple of 16
        # floats): batched products into a contiguous output take one MKL batch call, into a
        # strided slice torch falls back to one addmm per run (same results, ~1.5x the time).
        def block(width: int) -> Tensor | None:
            aligned = self.row_blocks and (B * width) % _ALIGNED_FLOATS == 0
            return stack(B, width) if aligned else None

        self._blocks = {
            "data_hidden": block(H),
            "model_hidden": block(H),
            "model_visible": block(V),
        }
        self.hidden_start = stack(B, H)
        self.hidden = stack(B, H)  # intermediate binary hidden states
        self.chains = stack(B, H).zero_()
        self.has_chains = [False] * M
        self.grad_W = stack(V, H)
        self.grad_b = stack(V)
        self.grad_a = stack(H)
        self.factors: tuple[Tensor, Tensor] = (self.visible.mT, self.right)
        # Gaussian scratch (PackedGaussianCD): normal draws, the rows v C⁻¹, the kernel.
        self.noise: Tensor | None = None
        self.visible_precision: Tensor | None = None
        self.scale = self.precision = self.hidden_weight = None
        self.per_run_chains = False
        self._solo_chains: dict[int, GibbsChain] = {}

    @torch.no_grad()
    def estimate(
        self,
        weight: Tensor,
        visible_bias: Tensor,
        hidden_bias: Tensor,
        batch: Tensor,
        variance: Tensor | None = None,
    ) -> None:
        """Estimate every run's gradient, ``runs_per_chunk`` runs at a time (see __init__);
        ``variance`` is a Gaussian model's stacked variance parameter."""
        n_runs = weight.shape[0]
        for start in range(0, n_runs, self.runs_per_chunk):
            runs = slice(start, min(n_runs, start + self.runs_per_chunk))
            run_variance = None if variance is None else variance[runs]
            kernel = self._kernel(
                runs, weight[runs], visible_bias[runs], hidden_bias[runs], run_variance
            )
            self._sample(runs, kernel, batch[runs])
            self._write_gradients(runs, kernel)
        weighted = self.visible if self.visible_precision is None else self.visible_precision
        self.factors = (weighted.mT, self.right)

    def _kernel(
        self,
        runs: slice,
        weight: Tensor,
        visible_bias: Tensor,
        hidden_bias: Tensor,
        variance: Tensor | None,
    ) -> GibbsKernel:
        """The runs' Gibbs kernel, as the model's ``gibbs_kernel`` computes it (a Gaussian
        model's diagonal or isotropic ``variance`` into the Gaussian estimator's buffers)."""
        if variance is None:
            return GibbsKernel(weight, hidden_bias, weight, visible_bias, gaussian=self.gaussian)
        assert self.hidden_weight is not None and self.scale is not None
        scale, precision, hidden_weight = diagonal_kernel_tensors(
            weight,
            variance,
            hidden_weight_out=self.hidden_weight[runs],
            scale_out=self.scale[runs],
            precision_out=self.precision[runs],
        )
        return GibbsKernel(
            hidden_weight,
            hidden_bias,
            weight,
            visible_bias,
            gaussian=True,
            noise_scale=scale,
            precision=precision,
        )

    def _sample(self, runs: slice, kernel: GibbsKernel, batch: Tensor) -> None:
        """The data rows' p(h | v) and the chains' k sweeps, into the runs' rows."""
        B = self.batch_size
        visible_rows, probs_rows = self.visible[runs], self.hidden_probs[runs]
        visible_rows[:, :B].copy_(batch)
        fast_hidden = self._blocks["data_hidden"] is not None
        hidden_data = self._blocks["data_hidden"][runs] if fast_hidden else probs_rows[:, :B]
        hidden_probs_(kernel, batch, hidden_data)
        if fast_hidden:
            probs_rows[:, :B].copy_(hidden_data)
        start = self._chain_start(runs, hidden_data)
        # k sweeps h → v → h, ending with v_k and p(h | v_k) in the model rows
        fast_visible = self._blocks["model_visible"] is not None
        visible = self._blocks["model_visible"][runs] if fast_visible else visible_rows[:, B:]
        probs = self._blocks["model_hidden"][runs] if fast_hidden else probs_rows[:, B:]
        if self.per_run_chains:
            for offset in range(visible.shape[0]):
                chain = self._solo_chain(runs.start + offset)
                chain.run(
                    kernel.of_run(offset), start[offset], self.k, visible[offset], probs[offset]
                )
        else:
            draws = self.random.for_runs(runs)
            noise = None if self.noise is None else self.noise[runs]
            gibbs_sweeps(kernel, draws, start, self.k, visible, probs, self.hidden[runs], noise)
        if fast_visible:
            visible_rows[:, B:].copy_(visible)
        if fast_hidden:
            probs_rows[:, B:].copy_(probs)
        self._keep_chains(runs, probs)

    def _solo_chain(self, run: int) -> GibbsChain:
        """Run ``run``'s own solo chain over its slices (see :class:`PackedGaussianCD`)."""
        chain = self._solo_chains.get(run)
        if chain is None:
            V, H = self.visible.shape[-1], self.hidden.shape[-1]
            device = self.visible.device
            chain = GibbsChain(self.batch_size, V, H, device, self.random.source(run))
            self._solo_chains[run] = chain
        return chain

    def _keep_chains(self, runs: slice, probs: Tensor) -> None:
        """PCD: draw the runs' persistent chains from the model rows' p(h | v_k)."""
        if self.persistent:
            self.random.bernoulli_(probs, out=self.chains[runs], runs=runs)
            self.has_chains[runs] = [True] * len(self.has_chains[runs])

    def _chain_start(self, runs: slice, hidden_data: Tensor) -> Tensor:
        """Binary hidden states the chains start from: drawn from the data's p(h | v), or the
        persistent chains where a run has them (only that run's source draws otherwise)."""
        has_chains = self.has_chains[runs] if self.persistent else [False]
        if not any(has_chains):
            return self.random.bernoulli_(hidden_data, out=self.hidden_start[runs], runs=runs)
        chains = self.chains[runs]
        if all(has_chains):
            return chains
        start = self.hidden_start[runs]
        start.copy_(chains)
        for offset, has in enumerate(has_chains):
            if not has:
                run = runs.start + offset
                self.random.source(run).bernoulli_(hidden_data[offset], out=start[offset])
        return start

    def _write_gradients(self, runs: slice, kernel: GibbsKernel) -> tuple[Tensor, Tensor]:
        """The solo estimator's gradients of the chunk's runs (C⁻¹ = ``kernel.precision``, a
        diagonal per run, for a Gaussian RBM); returns ∂W's factors. ∂b takes one mv per run,
        as the solo estimator (:func:`ssdcore.batched.mv`): the l∞ step's sign(∂b) would turn
        a last-bit difference into a different step."""
        weighted_out = None if self.visible_precision is None else self.visible_precision[runs]
        return write_weight_gradients_(
            weighted_visible_(self.visible[runs], kernel.precision, weighted_out),
            self.hidden_probs[runs],
            self.weights,
            right=self.right[runs],
            grad_W=self.grad_W[runs] if self.dense_weight_grad else None,
            grad_a=self.grad_a[runs],
            grad_b=self.grad_b[runs],
        )

    def reset_chains(self, run: int) -> None:
        """Forget run ``run``'s persistent chains; its next estimate restarts them from data."""
        self.has_chains[run] = False
