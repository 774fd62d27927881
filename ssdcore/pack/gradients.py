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

from ssdcore.pack.aligned import stacked_empty
from ssdcore.pack.random import PackedRandom


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
    ) -> None:
        M, V, H, B = n_runs, n_visible, n_hidden, batch_size
        self.k = k
        self.persistent = persistent
        self.random = random
        self.dense_weight_grad = dense_weight_grad
        self.batch_size = B

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
        B = self.batch_size
        hidden_bias_rows = hidden_bias.unsqueeze(1)  # (M, 1, H)
        visible_data = self.visible[:, :B]
        visible_data.copy_(batch)
        hidden_data = self.hidden_probs[:, :B]
        torch.baddbmm(hidden_bias_rows, visible_data, weight, out=hidden_data).sigmoid_()
        start = self._chain_start(hidden_data)
        self._run_chain(weight, visible_bias, hidden_bias_rows, start)
        if self.persistent:
            self.random.bernoulli_(self.hidden_probs[:, B:], out=self.chains)
            self.has_chains = [True] * len(self.has_chains)
        self._write_gradients()

    def _chain_start(self, hidden_data: Tensor) -> Tensor:
        """Binary hidden states the chains start from: drawn from the data's p(h | v), or the
        persistent chains where a run has them (only that run's source draws otherwise)."""
        if not self.persistent or not any(self.has_chains):
            return self.random.bernoulli_(hidden_data, out=self.hidden_start)
        if all(self.has_chains):
            return self.chains
        self.hidden_start.copy_(self.chains)
        for run, has in enumerate(self.has_chains):
            if not has:
                self.random.bernoulli_run_(run, hidden_data[run], out=self.hidden_start[run])
        return self.hidden_start

    def _run_chain(
        self, weight: Tensor, visible_bias: Tensor, hidden_bias_rows: Tensor, start: Tensor
    ) -> None:
        """k sweeps h → v → h, written into the model rows: v_k and p(h | v_k)."""
        B = self.batch_size
        visible, probs = self.visible[:, B:], self.hidden_probs[:, B:]
        visible_bias_rows = visible_bias.unsqueeze(1)  # (M, 1, V)
        weight_t = weight.mT
        hidden = start
        for sweep in range(self.k):
            torch.baddbmm(visible_bias_rows, hidden, weight_t, out=visible).sigmoid_()
            self.random.bernoulli_(visible, out=visible)
            torch.baddbmm(hidden_bias_rows, visible, weight, out=probs).sigmoid_()
            if sweep < self.k - 1:
                hidden = self.random.bernoulli_(probs, out=self.hidden)

    def _write_gradients(self) -> None:
        right = torch.mul(self.hidden_probs, self._weights_column, out=self.right)
        left = self.visible.mT  # (M, V, 2B)
        if self.dense_weight_grad:
            torch.bmm(left, right, out=self.grad_W)
        torch.sum(right, dim=1, out=self.grad_a)
        # One mv per run, as the solo estimator: a batched product with a vector takes another
        # BLAS kernel (gemm, not gemv) whose last-bit rounding differs at some sizes, and the
        # l∞ step's sign(∂b) turns such a difference into a different step.
        for run in range(self.grad_b.shape[0]):
            torch.mv(left[run], self.weights, out=self.grad_b[run])
        self.factors = (left, right)

    def reset_chains(self, run: int) -> None:
        """Forget run ``run``'s persistent chains; its next estimate restarts them from data."""
        self.has_chains[run] = False
