"""CD-k / PCD-k gradients of M Bernoulli RBMs of one shape as batched products.

The solo estimator (:class:`ssdcore.CDEstimator`) does, per run, ``addmm`` for each
conditional and ``mm`` for the weight gradient over the 2B rows (B data rows weighted -1/B, B
model rows weighted +1/B). Here the same products run as ``baddbmm`` / ``bmm`` over a leading
run dimension: on the CPU those give the per-run results bit for bit (checked in
``tests/test_pack.py``), and the draws come from each run's own source
(:mod:`ssdcore.pack.random`), so each run's estimate is its solo estimate.

Gradients (of the negative log-likelihood, as in :mod:`ssdcore.gradients`), per run:
``W: Σ_n w_n v_n p_nᵀ`` (V, H), ``a: Σ_n w_n p_n``, ``b: Σ_n w_n v_n``; the weight gradient
is also given as its factors ``(visibleᵀ, right)`` (rank 2B) for the factored polar steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssdcore.batched import ALIGNMENT_BYTES, stacked_empty
from ssdcore.pack.random import PackedRandom

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
    ``has_chains`` (M,) saying which runs have theirs yet (a run inserted at step 0 has none).
    """

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
        # The solo estimator's weights, in float32 exactly as it builds them.
        weights = torch.cat([torch.full((B,), -1.0 / B), torch.full((B,), 1.0 / B)])
        self.weights = weights.to(device=device, dtype=torch.float32)
        self._weights_column = self.weights.view(1, 2 * B, 1)

        # Contiguous stand-ins for the (B, ·) row blocks of those buffers, used when a block's
        # size keeps every run's block at the solo block's alignment (a multiple of 16
        # floats): batched products into a contiguous output take one MKL batch call, into a
        # strided slice torch falls back to one addmm per run (same results, ~1.5x the time).
        def block(width: int) -> Tensor | None:
            return stack(B, width) if (B * width) % _ALIGNED_FLOATS == 0 else None

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

    @torch.no_grad()
    def estimate(self, weight: Tensor, visible_bias: Tensor, hidden_bias: Tensor, batch: Tensor):
        """Estimate every run's gradient, ``runs_per_chunk`` runs at a time (see __init__)."""
        n_runs = weight.shape[0]
        for start in range(0, n_runs, self.runs_per_chunk):
            runs = slice(start, min(n_runs, start + self.runs_per_chunk))
            self._estimate_chunk(
                runs, weight[runs], visible_bias[runs], hidden_bias[runs], batch[runs]
            )
        self.factors = (self.visible.mT, self.right)

    def _estimate_chunk(
        self, runs: slice, weight: Tensor, visible_bias: Tensor, hidden_bias: Tensor, batch: Tensor
    ) -> None:
        B = self.batch_size
        visible_rows, probs_rows = self.visible[runs], self.hidden_probs[runs]
        hidden_bias_rows = hidden_bias.unsqueeze(1)  # (R, 1, H)
        visible_rows[:, :B].copy_(batch)
        fast_hidden = self._blocks["data_hidden"] is not None
        hidden_data = self._blocks["data_hidden"][runs] if fast_hidden else probs_rows[:, :B]
        torch.baddbmm(hidden_bias_rows, batch, weight, out=hidden_data).sigmoid_()
        if fast_hidden:
            probs_rows[:, :B].copy_(hidden_data)
        start = self._chain_start(runs, hidden_data)
        # k sweeps h → v → h, ending with v_k and p(h | v_k) in the model rows
        fast_visible = self._blocks["model_visible"] is not None
        visible = self._blocks["model_visible"][runs] if fast_visible else visible_rows[:, B:]
        probs = self._blocks["model_hidden"][runs] if fast_hidden else probs_rows[:, B:]
        visible_bias_rows = visible_bias.unsqueeze(1)  # (R, 1, V)
        weight_t = weight.mT
        hidden = start
        for sweep in range(self.k):
            torch.baddbmm(visible_bias_rows, hidden, weight_t, out=visible).sigmoid_()
            self.random.bernoulli_(visible, out=visible, runs=runs)
            torch.baddbmm(hidden_bias_rows, visible, weight, out=probs).sigmoid_()
            if sweep < self.k - 1:
                hidden = self.random.bernoulli_(probs, out=self.hidden[runs], runs=runs)
        if fast_visible:
            visible_rows[:, B:].copy_(visible)
        if fast_hidden:
            probs_rows[:, B:].copy_(probs)
        if self.persistent:
            self.random.bernoulli_(probs, out=self.chains[runs], runs=runs)
            self.has_chains[runs] = [True] * len(self.has_chains[runs])
        self._write_gradients(runs)

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
                self.random.bernoulli_run_(run, hidden_data[offset], out=start[offset])
        return start

    def _write_gradients(self, runs: slice) -> None:
        right = torch.mul(self.hidden_probs[runs], self._weights_column, out=self.right[runs])
        left = self.visible[runs].mT  # (R, V, 2B)
        if self.dense_weight_grad:
            torch.bmm(left, right, out=self.grad_W[runs])
        torch.sum(right, dim=1, out=self.grad_a[runs])
        # One mv per run, as the solo estimator: a batched product with a vector takes another
        # BLAS kernel (gemm, not gemv) whose last-bit rounding differs at some sizes, and the
        # l∞ step's sign(∂b) turns such a difference into a different step.
        grad_b = self.grad_b[runs]
        for offset in range(left.shape[0]):
            torch.mv(left[offset], self.weights, out=grad_b[offset])

    def reset_chains(self, run: int) -> None:
        """Forget run ``run``'s persistent chains; its next estimate restarts them from data."""
        self.has_chains[run] = False
