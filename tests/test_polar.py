"""Every polar method against torch.linalg.svd in float64, on random and on real CD gradients.

Reference: the polar factor over the numerical range, U_r V_rᵀ with singular values above
max(m, n)·eps·σ_max, and the nuclear norm Σσ, both from a float64 SVD.
Tolerances are relative Frobenius errors of the direction and relative errors of ‖σ‖₁.
"""

from __future__ import annotations

import pytest
import torch

from ssdcore import BernoulliRBM, CDEstimator, GaussianRBM
from ssdcore.optim import polar
from ssdcore.optim.polar import (
    polar_gram,
    polar_gram_factors,
    polar_lowrank,
    polar_lowrank_factors,
    polar_lowrank_qr,
    polar_newton_schulz,
    polar_newton_schulz_factors,
    polar_randomized,
    polar_svd,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# float32 methods that are exact in exact arithmetic stay within these of the float64 SVD.
EXACT_DIRECTION_RTOL = 1e-4
EXACT_NUCLEAR_RTOL = 1e-5
# Newton–Schulz is an iteration: looser, and measured far below these on the cases here.
NS_DIRECTION_RTOL = 1e-2
NS_NUCLEAR_RTOL = 1e-3


def reference(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_r V_rᵀ, ‖σ‖₁) from a float64 SVD, dropping numerically zero singular values."""
    g = grad.double()
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    keep = s > s.max() * max(g.shape) * torch.finfo(torch.float64).eps * 1e3
    return u[:, keep] @ vh[keep], s.sum()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def random_matrix(m: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(m, n, generator=torch.Generator().manual_seed(seed))


def cd_gradient(n_visible: int, n_hidden: int, batch: int, seed: int):
    """A real CD-1 weight gradient and its factors from a BernoulliRBM on random binary data."""
    torch.manual_seed(seed)
    model = BernoulliRBM(n_visible, n_hidden)
    data = torch.bernoulli(torch.full((batch, n_visible), 0.3))
    estimator = CDEstimator(model, k=1, seed=seed)
    estimator.estimate(data)
    left, right = model.W.grad_factors
    return model.W.grad.clone(), left.clone(), right.clone()


RANDOM_SHAPES = [(40, 25), (25, 40), (64, 64), (1, 7)]


@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_svd_matches_float64_reference_on_random_matrices(shape):
    grad = random_matrix(*shape, seed=1)
    direction, nuclear = reference(grad)
    result = polar_svd(grad)
    assert relative(result.direction, direction) < EXACT_DIRECTION_RTOL
    assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < EXACT_NUCLEAR_RTOL


@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_newton_schulz_matches_svd_on_random_matrices(shape):
    grad = random_matrix(*shape, seed=2)
    direction, nuclear = reference(grad)
    result = polar_newton_schulz(grad)
    assert relative(result.direction, direction) < NS_DIRECTION_RTOL
    assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < NS_NUCLEAR_RTOL


@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_randomized_with_full_rank_sketch_is_exact(shape):
    grad = random_matrix(*shape, seed=3)
    direction, nuclear = reference(grad)
    generator = torch.Generator().manual_seed(0)
    result = polar_randomized(grad, min(shape), generator=generator)
    assert relative(result.direction, direction) < EXACT_DIRECTION_RTOL
    assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < EXACT_NUCLEAR_RTOL


def test_lowrank_is_exact_to_float64_precision():
    left = random_matrix(50, 12, seed=4).double()
    right = random_matrix(12, 30, seed=5).double()
    direction, nuclear = reference(left @ right)
    result = polar_lowrank(left, right)
    assert relative(result.direction, direction) < 1e-10
    assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < 1e-12


def test_lowrank_handles_rank_deficient_factors():
    """Repeated columns (e.g. a chain that did not move) make the factors rank-deficient."""
    left = random_matrix(30, 6, seed=6).double()
    left = torch.cat([left, left[:, :3]], dim=1)  # rank 6 from 9 columns
    right = random_matrix(9, 20, seed=7).double()
    direction, nuclear = reference(left @ right)
    result = polar_lowrank(left, right)
    assert relative(result.direction, direction) < 1e-10
    assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < 1e-12
    assert torch.linalg.matrix_rank(result.direction) == torch.linalg.matrix_rank(left @ right)


@pytest.mark.parametrize(("n_visible", "n_hidden", "batch"), [(60, 40, 8), (30, 12, 20)])
def test_every_method_matches_svd_on_real_cd_gradients(n_visible, n_hidden, batch):
    grad, left, right = cd_gradient(n_visible, n_hidden, batch, seed=8)
    assert torch.allclose(left @ right, grad, atol=1e-6)
    # The float64 product of the factors is the gradient without float32 rounding noise.
    direction, nuclear = reference(left.double() @ right.double())
    rank = min(2 * batch, n_visible, n_hidden)
    generator = torch.Generator().manual_seed(0)
    exact = {
        "svd": polar_svd(grad),
        "lowrank": polar_lowrank(left, right),
        "randomized": polar_randomized(grad, rank, generator=generator),
    }
    for name, result in exact.items():
        assert relative(result.direction, direction) < EXACT_DIRECTION_RTOL, name
        assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < EXACT_NUCLEAR_RTOL, name
    ns = polar_newton_schulz(grad)
    assert abs(float(ns.nuclear_norm) / float(nuclear) - 1) < NS_NUCLEAR_RTOL
    # Directions of tiny singular values converge slowly; weight errors by G itself.
    assert abs(float((grad * (ns.direction - direction.float())).sum())) < NS_NUCLEAR_RTOL * float(
        nuclear
    )


def test_lowrank_on_cd_gradient_in_float64_is_exact():
    _grad, left, right = cd_gradient(60, 40, 8, seed=9)
    direction, nuclear = reference(left.double() @ right.double())
    result = polar_lowrank(left.double(), right.double())
    assert relative(result.direction, direction) < 1e-10
    assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < 1e-12


def test_factored_form_multiplies_to_the_direction():
    left, right = random_matrix(20, 5, seed=10), random_matrix(5, 35, seed=11)
    for a, b in [(left, right), (right.mT, left.mT)]:  # tall and wide
        factored = polar_lowrank_factors(a, b)
        direction, _ = reference(a.double() @ b.double())
        assert relative(factored.left @ factored.right, direction) < EXACT_DIRECTION_RTOL


def test_randomized_residual_correction_recovers_a_flat_tail():
    """With a flat tail the corrected direction is exact; without it the tail is missing."""
    generator = torch.Generator().manual_seed(12)
    u = torch.linalg.qr(torch.randn(50, 20, generator=generator, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(40, 20, generator=generator, dtype=torch.float64)).Q
    s = torch.cat([torch.tensor([10.0, 8.0, 6.0, 4.0]), torch.ones(16)]).double()
    grad = (u * s) @ v.mT
    direction, nuclear = reference(grad)
    sketch = torch.Generator().manual_seed(0)
    corrected = polar_randomized(grad, 4, generator=sketch)
    plain = polar_randomized(grad, 4, residual_correction=False, generator=sketch)
    # Two power iterations leave ~(σ_tail/σ_4)^5 ≈ 1e-3 of the top subspace in the residual.
    assert relative(corrected.direction, direction) < 1e-2
    assert abs(float(corrected.nuclear_norm) / float(nuclear) - 1) < 1e-3
    assert relative(plain.direction, direction) > 0.5
    assert float(plain.nuclear_norm) < float(nuclear) - 15.0


@pytest.mark.parametrize("method", ["svd", "newton-schulz", "randomized"])
def test_direction_is_a_partial_isometry(method):
    grad = random_matrix(30, 20, seed=13)
    if method == "svd":
        result = polar_svd(grad)
    elif method == "newton-schulz":
        result = polar_newton_schulz(grad)
    else:
        result = polar_randomized(grad, 20, generator=torch.Generator().manual_seed(0))
    singular_values = torch.linalg.svdvals(result.direction.double())
    assert torch.allclose(singular_values, torch.ones_like(singular_values), atol=1e-3)
    assert torch.allclose(result.nuclear_norm, (grad * result.direction).sum(), rtol=1e-5)


def test_svd_drops_numerically_zero_directions():
    left, right = random_matrix(30, 3, seed=14), random_matrix(3, 25, seed=15)
    result = polar_svd(left @ right)
    assert torch.linalg.matrix_rank(result.direction) == 3


# --- Gram-matrix routes (float64 Gram matrices of float32 inputs) ------------------------------


def assert_exact(result_direction, result_nuclear, grad64: torch.Tensor) -> None:
    """The float32 tolerances above, against the float64 SVD of ``grad64``."""
    direction, nuclear = reference(grad64)
    assert relative(result_direction, direction) < EXACT_DIRECTION_RTOL
    assert abs(float(result_nuclear) / float(nuclear) - 1) < EXACT_NUCLEAR_RTOL


@pytest.mark.parametrize("shape", [(120, 12), (12, 120), (64, 64), (1, 7)])
def test_gram_matches_float64_svd_on_thin_wide_and_square_matrices(shape):
    grad = random_matrix(*shape, seed=20)
    result = polar_gram(grad)
    assert_exact(result.direction, result.nuclear_norm, grad.double())
    factored = polar_gram_factors(grad)
    assert relative(factored.left @ factored.right, result.direction) < 1e-6


def test_gram_drops_the_null_space_of_a_rank_deficient_thin_matrix():
    left, right = random_matrix(120, 5, seed=21), random_matrix(5, 12, seed=22)
    grad = left @ right  # rank 5 of 12, plus float32 rounding noise the drop tolerance removes
    result = polar_gram(grad)
    assert_exact(result.direction, result.nuclear_norm, left.double() @ right.double())
    assert torch.linalg.matrix_rank(result.direction) == 5


def test_gram_on_an_ill_conditioned_matrix_keeps_singular_values_above_the_drop_tolerance():
    """Squaring κ in float64 still resolves σ down to max(m, n)·eps32·σ_max (here 1e-4·σ_max)."""
    generator = torch.Generator().manual_seed(23)
    u = torch.linalg.qr(torch.randn(200, 20, generator=generator, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(20, 20, generator=generator, dtype=torch.float64)).Q
    grad = ((u * torch.logspace(0, -4, 20, dtype=torch.float64)) @ v.mT).float()
    result = polar_gram(grad)
    assert torch.linalg.matrix_rank(result.direction.double(), rtol=1e-3) == 20
    assert_exact(result.direction, result.nuclear_norm, grad.double())


def test_gram_in_float64_takes_the_svd_and_stays_exact():
    grad = random_matrix(50, 12, seed=24).double()
    direction, nuclear = reference(grad)
    result = polar_gram(grad)
    assert relative(result.direction, direction) < 1e-10
    assert abs(float(result.nuclear_norm) / float(nuclear) - 1) < 1e-12


@pytest.mark.parametrize(("m", "k", "n"), [(60, 8, 40), (40, 8, 60)])
def test_lowrank_float32_factors_match_float64_svd(m, k, n):
    left, right = random_matrix(m, k, seed=25), random_matrix(k, n, seed=26)
    factored = polar_lowrank_factors(left, right)
    assert_exact(
        factored.left @ factored.right, factored.nuclear_norm, left.double() @ right.double()
    )


def test_lowrank_duplicate_samples_take_the_eigenvector_root_and_stay_exact():
    """A chain that lands on its data row gives equal columns of L and opposite rows of R."""
    left = (torch.rand(50, 10, generator=torch.Generator().manual_seed(27)) < 0.3).float()
    right = random_matrix(10, 30, seed=28)
    left[:, 7] = left[:, 2]  # the same visible sample twice ...
    right[7] = -right[2]  # ... with weights -1/B and +1/B: its terms cancel exactly
    left[:, 9] = left[:, 3]  # a repeated sample whose terms do not cancel
    grams = left.double().mT @ left.double(), right.double() @ right.double().mT
    root = polar._choose_root(*grams, (50, 30))
    assert root is not None and root.inverse_transposed is not None  # no Cholesky: singular
    factored = polar_lowrank_factors(left, right)
    grad64 = left.double() @ right.double()
    assert_exact(factored.left @ factored.right, factored.nuclear_norm, grad64)
    assert torch.linalg.matrix_rank(factored.left @ factored.right) == torch.linalg.matrix_rank(
        grad64
    )


def test_lowrank_nearly_dependent_factors_take_the_qr_route_and_stay_exact():
    """κ far beyond what float64 Gram matrices resolve (but not exactly singular): QR route."""
    generator = torch.Generator().manual_seed(29)
    left = torch.randn(50, 6, generator=generator)
    left[:, 5] = left[:, 4] + 1e-6 * torch.randn(50, generator=generator)
    right = torch.randn(6, 30, generator=generator)
    right[5] = right[4] + 1e-6 * torch.randn(30, generator=generator)
    grams = left.double().mT @ left.double(), right.double() @ right.double().mT
    assert polar._choose_root(*grams, (50, 30)) is None
    factored = polar_lowrank_factors(left, right)
    qr = polar_lowrank_qr(left, right)
    assert relative(factored.left @ factored.right, qr.left @ qr.right) < 1e-6
    assert_exact(
        factored.left @ factored.right, factored.nuclear_norm, left.double() @ right.double()
    )


def test_binary_factor_gram_is_exact_in_float32():
    binary = (torch.rand(784, 40, generator=torch.Generator().manual_seed(30)) < 0.5).float()
    assert torch.equal(polar._gram64(binary, columns=True), binary.double().mT @ binary.double())
    real = random_matrix(784, 40, seed=31)
    assert torch.equal(polar._gram64(real, columns=True), real.double().mT @ real.double())


@pytest.mark.parametrize("variance", ["diagonal", "full"])
def test_lowrank_matches_svd_on_gaussian_rbm_cd_factors(variance):
    torch.manual_seed(32)
    model = GaussianRBM(30, 20, variance=variance)
    data = torch.rand(6, 30)
    CDEstimator(model, k=2, seed=32).estimate(data)
    left, right = model.W.grad_factors
    factored = polar_lowrank_factors(left, right)
    assert_exact(
        factored.left @ factored.right, factored.nuclear_norm, left.double() @ right.double()
    )


@pytest.mark.parametrize("route", ["lowrank", "gram"])
def test_non_finite_gradients_are_never_turned_into_a_zero_step(route):
    """NaN must reach the parameters (or raise LinAlgError), so training detects divergence."""
    left = torch.full((30, 4), float("nan"))
    right = torch.ones(4, 20)
    try:
        if route == "lowrank":
            result = polar_lowrank_factors(left, right)
        else:
            result = polar_gram_factors(left)
    except torch.linalg.LinAlgError:
        return
    assert not torch.isfinite(result.nuclear_norm)


@pytest.mark.parametrize(("rows", "rank", "cols"), [(50, 8, 30), (30, 8, 50), (64, 16, 40)])
def test_factored_newton_schulz_is_the_dense_iteration(rows, rank, cols):
    """Same polynomial of the same singular values: equal to the dense iteration up to float32
    rounding, and as close to the float64 polar factor as the dense one."""
    left = random_matrix(rows, rank, seed=11)
    right = random_matrix(rank, cols, seed=12)
    dense = polar_newton_schulz(left @ right)
    factored = polar_newton_schulz_factors(left, right)
    result = factored.left @ factored.right
    assert relative(result, dense.direction) < 1e-4
    assert abs(float(factored.nuclear_norm) / float(dense.nuclear_norm) - 1) < 1e-5
    direction, nuclear = reference(left.double() @ right.double())
    assert relative(result, direction) < NS_DIRECTION_RTOL
    assert abs(float(factored.nuclear_norm) / float(nuclear) - 1) < NS_NUCLEAR_RTOL


def test_factored_newton_schulz_on_a_real_cd_gradient():
    """CD gradients have tiny singular values, whose slow directions round differently in the
    two forms; weighted by G itself (as for the dense iteration above) both agree closely."""
    grad, left, right = cd_gradient(60, 40, 8, seed=13)  # rank 16 < 40
    dense = polar_newton_schulz(grad)
    factored = polar_newton_schulz_factors(left, right)
    result = factored.left @ factored.right
    assert relative(result, dense.direction) < NS_DIRECTION_RTOL
    assert abs(float(factored.nuclear_norm) / float(dense.nuclear_norm) - 1) < 1e-5
    direction, nuclear = reference(left.double() @ right.double())
    assert abs(float(factored.nuclear_norm) / float(nuclear) - 1) < NS_NUCLEAR_RTOL
    weighted_error = float((grad * (result - direction.float())).sum())
    assert abs(weighted_error) < NS_NUCLEAR_RTOL * float(nuclear)
