"""The rank-dependent kernels shared by a solo run and a pack (ssdcore.batched): on a stack of M
they give each run's solo result bit for bit, and on a single matrix they are the solo ops."""

from __future__ import annotations

import torch

from ssdcore.batched import (
    ALIGNMENT_BYTES,
    add_product_,
    add_scaled_,
    add_scaled_product_,
    addmm,
    matmul,
    mv,
    over_rows,
    per_matrix,
    per_matrix_scalar,
    stacked_copy,
)
from ssdcore.models.base import GibbsKernel
from ssdcore.optim.step_rules import frobenius_squared, linf_length

M, ROWS, COLS = 3, 37, 11  # per-run sizes that are not multiples of the alignment


def _stack(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return stacked_copy(torch.randn(M, *shape, generator=generator))


def test_every_run_of_a_stack_starts_aligned_as_a_fresh_tensor():
    stack = _stack(ROWS, COLS)
    for run in range(M):
        assert stack[run].data_ptr() % ALIGNMENT_BYTES == 0
        assert stack[run].is_contiguous()


def test_products_of_a_stack_are_each_runs_solo_products():
    left, right, base = _stack(ROWS, COLS), _stack(COLS, 5, seed=1), _stack(ROWS, 5, seed=2)
    vector = torch.randn(COLS, generator=torch.Generator().manual_seed(3))
    products = matmul(left, right)
    sums = addmm(base, left, right, beta=0.5, alpha=-2.0)
    vectors = mv(left, vector)
    for run in range(M):
        assert torch.equal(products[run], matmul(left[run], right[run]))
        assert torch.equal(products[run], left[run] @ right[run])
        solo = torch.addmm(base[run], left[run], right[run], beta=0.5, alpha=-2.0)
        assert torch.equal(sums[run], solo)
        assert torch.equal(vectors[run], torch.mv(left[run], vector))
        assert products[run].data_ptr() % ALIGNMENT_BYTES == 0


def test_updates_with_per_run_step_sizes_are_each_runs_solo_update():
    grads, factors = _stack(ROWS, COLS, seed=4), (_stack(ROWS, 4, seed=5), _stack(4, COLS, seed=6))
    lengths = torch.rand(M, generator=torch.Generator().manual_seed(7))
    steps = [-0.1, -0.02, -0.3]
    column = torch.tensor(steps).view(-1, 1, 1)
    scaled, product, factored = _stack(ROWS, COLS), _stack(ROWS, COLS), _stack(ROWS, COLS)
    solo = [scaled[run].clone() for run in range(M)]
    add_scaled_(scaled, grads, column)
    add_scaled_product_(product, grads, per_matrix_scalar(lengths), column)
    add_product_(factored, *factors, steps)
    for run in range(M):
        assert torch.equal(scaled[run], add_scaled_(solo[run], grads[run], steps[run]))
        expected = _stack(ROWS, COLS)[run]
        add_scaled_product_(expected, grads[run], per_matrix_scalar(lengths[run]), steps[run])
        assert torch.equal(product[run], expected)
        expected = _stack(ROWS, COLS)[run].addmm_(
            factors[0][run], factors[1][run], alpha=steps[run]
        )
        assert torch.equal(factored[run], expected)


def test_reductions_run_matrix_by_matrix_and_values_broadcast_only_for_a_stack():
    grads, vectors = _stack(ROWS, COLS, seed=8), _stack(COLS, seed=9)
    norms = per_matrix(torch.linalg.vector_norm, grads)
    squares = frobenius_squared(grads, None)
    lengths = linf_length(vectors, "normalized")
    assert lengths.shape == (M, 1)
    for run in range(M):
        assert torch.equal(norms[run], torch.linalg.vector_norm(grads[run]))
        assert torch.equal(squares[run], frobenius_squared(grads[run], None))
        assert torch.equal(lengths[run, 0], linf_length(vectors[run], "normalized"))
    vector, number = torch.ones(COLS), torch.tensor(2.0)
    assert over_rows(vector) is vector and per_matrix_scalar(number) is number
    assert over_rows(vectors).shape == (M, 1, COLS)
    assert per_matrix_scalar(norms).shape == (M, 1, 1)


def test_a_packs_kernel_gives_each_runs_kernel():
    weight, hidden_bias, visible_bias = _stack(ROWS, COLS), _stack(COLS), _stack(ROWS)
    scale = _stack(1)
    kernel = GibbsKernel(weight, hidden_bias, weight, visible_bias, True, noise_scale=scale)
    for run in range(M):
        one = kernel.of_run(run)
        assert one.gaussian and one.noise_transform is None and one.precision is None
        assert torch.equal(one.weight_t, weight[run].t())
        for name in ("hidden_weight", "hidden_bias", "visible_bias", "noise_scale"):
            assert torch.equal(getattr(one, name), getattr(kernel, name)[run])
