"""Evaluation: log Z against brute force and numerical integration, AIS, PLL and the metrics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from ssdcore import (
    BernoulliRBM,
    GaussianRBM,
    ais_log_partition,
    exact_log_partition,
    free_energy_gap,
    log_likelihood,
    pseudo_log_likelihood,
    reconstruction_error,
    spectral_norm,
)
from ssdcore.evaluation import annealing_schedule, saturated_hidden_fraction


@pytest.fixture(autouse=True)
def _single_thread():
    # Tiny tensors: one thread avoids OpenMP hand-offs, which dominate on busy 2-core machines.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def all_states(n: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)), dtype=torch.float64)


def bernoulli_model(n_visible: int, n_hidden: int, std: float = 0.8, seed: int = 0):
    torch.manual_seed(seed)
    model = BernoulliRBM(n_visible, n_hidden, init_std=std)
    with torch.no_grad():
        model.b.normal_()
        model.a.normal_()
    return model


def gaussian_model(variance: str, n_visible: int, n_hidden: int, std: float = 0.5, seed: int = 0):
    torch.manual_seed(seed)
    model = GaussianRBM(n_visible, n_hidden, variance=variance, init_std=std)
    with torch.no_grad():
        model.b.normal_(0, 0.5)
        model.a.normal_(0, 0.5)
        if variance == "isotropic":
            model.log_c.fill_(-0.3)
        elif variance == "diagonal":
            model.log_var.copy_(torch.linspace(-0.5, 0.4, n_visible))
        elif variance == "full":
            off = torch.full((n_visible, n_visible), 0.3)
            model.precision.copy_(off + torch.diag(torch.linspace(1.2, 2.0, n_visible)))
    return model


@pytest.mark.parametrize(("n_visible", "n_hidden"), [(5, 4), (3, 6)])
def test_exact_log_partition_equals_brute_force_over_visible_and_hidden(n_visible, n_hidden):
    model = bernoulli_model(n_visible, n_hidden)
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    v, h = all_states(n_visible), all_states(n_hidden)
    # -E(v, h) = vᵀWh + bᵀv + aᵀh for every pair, (2^V, 2^H)
    negative_energy = v @ W @ h.t() + (v @ b)[:, None] + (h @ a)[None, :]
    expected = float(torch.logsumexp(negative_energy.flatten(), 0))
    assert exact_log_partition(model) == pytest.approx(expected, abs=1e-9)


def gaussian_log_partition_by_quadrature(model: GaussianRBM) -> float:
    """log ∫ Σ_h exp(-E(v, h)) dv on a fine grid (1 or 2 visible units), in float64."""
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    precision = model.precision_matrix().detach().double()
    std = torch.sqrt(torch.diag(torch.linalg.inv(precision)))
    # The mixture means b + Wh lie within ±Σ|W| of b; 9 standard deviations beyond is negligible.
    reach = W.abs().sum(1) + 9 * std
    n_grid = 1201 if model.n_visible == 1 else 401
    axes = [
        torch.linspace(float(lo), float(hi), n_grid, dtype=torch.float64)
        for lo, hi in zip(b - reach, b + reach, strict=True)
    ]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, model.n_visible)
    h = all_states(model.n_hidden)
    centered = grid - b
    quadratic = 0.5 * ((centered @ precision) * centered).sum(1)  # (G,)
    coupling = grid @ precision @ W @ h.t() + (h @ a)[None, :]  # (G, 2^H)
    log_integrand = torch.logsumexp(coupling, dim=1) - quadratic
    cell = math.prod(float(ax[1] - ax[0]) for ax in axes)
    # Trapezoid weights: halve the edges of each axis.
    edge = torch.ones(n_grid, dtype=torch.float64)
    edge[[0, -1]] = 0.5
    weights = edge if model.n_visible == 1 else edge[:, None] * edge[None, :]
    return float(torch.logsumexp(log_integrand + torch.log(weights.flatten()), 0)) + math.log(cell)


@pytest.mark.parametrize(
    ("variance", "n_visible"),
    [("identity", 1), ("isotropic", 1), ("diagonal", 1), ("identity", 2), ("isotropic", 2),
     ("diagonal", 2), ("full", 2)],
)  # fmt: skip
def test_gaussian_exact_log_partition_equals_numerical_integration(variance, n_visible):
    model = gaussian_model(variance, n_visible, n_hidden=3, std=0.8)
    expected = gaussian_log_partition_by_quadrature(model)
    # The trapezoid rule on a smooth, rapidly decaying integrand: error far below 1e-6.
    assert exact_log_partition(model) == pytest.approx(expected, abs=1e-6)


def test_gaussian_exact_log_partition_block_split_matches_direct_sum():
    # 14 hidden units: the enumeration splits them into low and high bits; compare with the
    # closed form summed directly over all 2^14 states (validated by quadrature above).
    model = gaussian_model("full", 4, 14, std=0.3)
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    precision = model.precision_matrix().detach().double()
    h = all_states(14)
    exponent = h @ (a + b @ precision @ W) + 0.5 * ((h @ W.t() @ precision @ W) * h).sum(1)
    expected = (
        float(torch.logsumexp(exponent, 0))
        + 2 * math.log(2 * math.pi)
        - 0.5 * float(torch.logdet(precision))
    )
    assert exact_log_partition(model) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("std", "bias"),
    [(0.8, 60.0), (0.8, -60.0), (0.8, 400.0), (30.0, 0.0), (200.0, 0.0)],
)
def test_exact_log_partition_with_extreme_parameters_equals_brute_force(std, bias):
    # bias ±60 / 400: units that are linear in every state (summed in closed form) or never on;
    # std 30: pre-activations spanning ~100 nats, so only two factors share a log (padding);
    # std 200: a span beyond float64's range, so every unit takes its own softplus.
    model = bernoulli_model(7, 5, std=std)
    with torch.no_grad():
        model.b[::2] += bias
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    v, h = all_states(7), all_states(5)
    negative_energy = v @ W @ h.t() + (v @ b)[:, None] + (h @ a)[None, :]
    expected = float(torch.logsumexp(negative_energy.flatten(), 0))
    assert exact_log_partition(model) == pytest.approx(expected, rel=1e-12)


def softplus_log_partition(model: BernoulliRBM) -> float:
    """log Z summed over the hidden states with one float64 softplus per visible unit."""
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    index = torch.arange(1 << model.n_hidden)
    h = ((index[:, None] >> torch.arange(model.n_hidden)) & 1).double()
    return float(torch.logsumexp(h @ a + F.softplus(h @ W.t() + b).sum(1), 0))


def test_exact_log_partition_at_18_hidden_units_matches_softplus_reference():
    # 100 × 18: the block-split product enumeration against a direct float64 sum over 2^18
    # states. float64 agrees to rounding; float32 arithmetic to 1e-6 of |log Z| (measured
    # 2e-9 to 2.2e-7 relative on random and trained 100 × 18–20 models).
    model = bernoulli_model(100, 18, std=0.5)
    expected = softplus_log_partition(model)
    assert exact_log_partition(model) == pytest.approx(expected, rel=1e-12)
    assert exact_log_partition(model, dtype=torch.float32) == pytest.approx(expected, rel=1e-6)


def test_exact_log_partition_refuses_too_many_units():
    with pytest.raises(ValueError, match="ais_log_partition"):
        exact_log_partition(BernoulliRBM(29, 30))
    with pytest.raises(ValueError, match="ais_log_partition"):
        exact_log_partition(GaussianRBM(2, 29))


@pytest.mark.parametrize("case", ["bernoulli", "gaussian-diagonal", "gaussian-full"])
def test_ais_agrees_with_exact_within_its_reported_error(case):
    if case == "bernoulli":
        model = bernoulli_model(20, 16, std=0.3)
    else:
        model = gaussian_model(case.split("-")[1], 8, 16, std=0.3)
    exact = exact_log_partition(model)
    # A random model's own visible bias is as good a base as any (no data exists for it).
    base = model.b.detach() if case == "bernoulli" else None
    result = ais_log_partition(model, n_chains=100, n_betas=1000, seed=0, base_visible_bias=base)
    assert result.log_weights.shape == (100,)
    assert 0 < result.stderr < 0.5
    # Within 3 reported standard errors, plus 0.02 nats for the error estimate's own noise.
    assert abs(result.log_z - exact) < 3 * result.stderr + 0.02


def test_ais_is_reproducible_and_its_schedule_is_sane():
    model = bernoulli_model(10, 6, std=0.3)
    data = torch.rand(30, 10).round()
    first = ais_log_partition(model, n_chains=20, n_betas=50, seed=3, data=data)
    assert ais_log_partition(model, n_chains=20, n_betas=50, seed=3, data=data).log_z == first.log_z
    betas = annealing_schedule(1000)
    assert betas.shape == (1000,) and betas[0] == 0 and betas[-1] == 1
    assert bool((betas[1:] > betas[:-1]).all())


def test_log_likelihood_normalizes_over_all_binary_inputs():
    model = bernoulli_model(6, 5)
    log_z = exact_log_partition(model)
    v = all_states(6).float()
    with torch.no_grad():
        log_p = -model.free_energy(v).double() - log_z
    assert float(torch.logsumexp(log_p, 0)) == pytest.approx(0.0, abs=1e-5)
    assert log_likelihood(model, v, log_z) == pytest.approx(float(log_p.mean()), abs=1e-5)
    with pytest.raises(ValueError, match="finite"):
        log_likelihood(model, v, float("nan"))


def brute_force_pll(model: BernoulliRBM, v: torch.Tensor) -> torch.Tensor:
    """Σ_i log p(v_i | v_-i) by evaluating the free energy of both values of every bit."""
    result = torch.zeros(v.shape[0], dtype=torch.float64)
    with torch.no_grad():
        for i in range(model.n_visible):
            ones, zeros = v.clone(), v.clone()
            ones[:, i], zeros[:, i] = 1.0, 0.0
            f1, f0 = model.free_energy(ones).double(), model.free_energy(zeros).double()
            log_p1 = F.logsigmoid(f0 - f1)
            result += torch.where(v[:, i] == 1, log_p1, torch.log1p(-log_p1.exp()))
    return result


def test_pseudo_log_likelihood_exact_and_random_modes():
    model = bernoulli_model(9, 5)
    v = (torch.rand(40, 9, generator=torch.Generator().manual_seed(0)) < 0.5).float()
    expected = float(brute_force_pll(model, v).mean())
    assert pseudo_log_likelihood(model, v) == pytest.approx(expected, abs=1e-4)
    # The one-random-bit estimate is unbiased: its average over many draws approaches the exact.
    generator = torch.Generator().manual_seed(1)
    estimates = [
        pseudo_log_likelihood(model, v, bits="random", generator=generator) for _ in range(300)
    ]
    spread = torch.tensor(estimates).std() / math.sqrt(len(estimates))
    assert abs(sum(estimates) / len(estimates) - expected) < 4 * float(spread)
    with pytest.raises(TypeError, match="BernoulliRBM"):
        pseudo_log_likelihood(GaussianRBM(9, 5), v)


def test_reconstruction_error_free_energy_gap_and_spectral_norm():
    model = bernoulli_model(8, 4)
    v = (torch.rand(30, 8, generator=torch.Generator().manual_seed(0)) < 0.5).float()
    with torch.no_grad():
        recon = torch.sigmoid(model.hidden_probs(v) @ model.W.t() + model.b)
        expected = float(((recon - v) ** 2).sum(1).mean())
        gap = float(model.free_energy(v[15:]).mean() - model.free_energy(v[:15]).mean())
    assert reconstruction_error(model, v) == pytest.approx(expected, rel=1e-6)
    assert free_energy_gap(model, v[:15], v[15:]) == pytest.approx(gap, abs=1e-5)
    top = float(torch.linalg.svdvals(model.W.detach()).max())
    assert spectral_norm(model.W) == pytest.approx(top, rel=1e-6)


def test_saturated_hidden_fraction_counts_units_saturated_on_every_row():
    model = BernoulliRBM(2, 5)
    v = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    with torch.no_grad():
        model.W.zero_()
        # Hidden inputs per unit: always +20 (stuck on), always -20 (stuck off), ±15 depending
        # on v₀ (saturated on every row, either way: stuck too), 0, and +20 except 5 on one row.
        model.a.copy_(torch.tensor([20.0, -20.0, -15.0, 0.0, 20.0]))
        model.W[0, 2] = 30.0
        model.W[1, 4] = -15.0
    assert saturated_hidden_fraction(model, v) == pytest.approx(3 / 5)
    assert saturated_hidden_fraction(model, v[:2]) == pytest.approx(4 / 5)  # no row with v₁ = 1
    # 13.8 ≈ logit(1 - 1e-6) is the edge: p(h) within 1e-6 of 0 or 1.
    with torch.no_grad():
        model.a.fill_(13.7)
    assert saturated_hidden_fraction(model, torch.zeros(1, 2)) == 0.0
    with torch.no_grad():
        model.a.fill_(-13.9)
    assert saturated_hidden_fraction(model, torch.zeros(1, 2)) == 1.0
