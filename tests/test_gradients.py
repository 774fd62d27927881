"""CD/PCD gradients against autograd, the low-rank factors, PCD resume, and the fast sampler."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ssdcore import BernoulliRBM, CDEstimator, GaussianRBM
from ssdcore.models import VARIANCE_KINDS
from ssdcore.sampling import GibbsChain, RandomSource, collapsed_sweep

CASES = ["bernoulli", *(f"gaussian-{v}" for v in VARIANCE_KINDS)]


@pytest.fixture(autouse=True)
def _single_thread():
    # Tiny tensors: one thread avoids OpenMP hand-offs, which dominate on busy 2-core machines.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(case: str, n_visible: int = 7, n_hidden: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    if case == "bernoulli":
        model = BernoulliRBM(n_visible, n_hidden, init_std=0.5)
    else:
        variance = case.split("-", 1)[1]
        model = GaussianRBM(n_visible, n_hidden, variance=variance, init_std=0.4)
    with torch.no_grad():
        model.b.normal_(0, 0.5)
        model.a.normal_(0, 0.5)
        if case == "gaussian-isotropic":
            model.log_c.fill_(0.3)
        elif case == "gaussian-diagonal":
            model.log_var.uniform_(-0.5, 0.5)
        elif case == "gaussian-full":
            root = torch.randn(n_visible, n_visible) * 0.3
            model.precision.copy_(root @ root.t() + torch.eye(n_visible))
    return model


def make_data(model, n: int = 9, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if isinstance(model, BernoulliRBM):
        return (torch.rand(n, model.n_visible, generator=generator) < 0.4).float()
    return torch.randn(n, model.n_visible, generator=generator)


def autograd_of_free_energy_difference(model, v_data, v_model) -> dict[str, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    loss = model.free_energy(v_data).mean() - model.free_energy(v_model).mean()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        # The precision is symmetric: its gradient is the symmetric part.
        grads[name] = 0.5 * (p.grad + p.grad.t()) if name == "precision" else p.grad.clone()
    return grads


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("k", "persistent"), [(1, False), (3, False), (2, True)])
def test_cd_gradient_equals_autograd_of_free_energy_difference(case, k, persistent):
    model = make_model(case)
    estimator = CDEstimator(model, k=k, persistent=persistent, seed=5)
    v = make_data(model)
    for _ in range(2):  # the second call runs from the persistent chains
        stats = estimator.estimate(v)
        estimated = {name: p.grad.clone() for name, p in model.named_parameters()}
        expected = autograd_of_free_energy_difference(model, v, stats.visible_model.clone())
        assert set(estimated) == set(expected)
        for name in expected:
            # float32 sums of ~10 terms of size ≤ 10: agreement to ~1e-5 relative.
            torch.testing.assert_close(estimated[name], expected[name], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["bernoulli", "gaussian-diagonal", "gaussian-full"])
def test_low_rank_factors_reproduce_the_weight_gradient_exactly(case):
    model = make_model(case)
    v = make_data(model, n=6)
    CDEstimator(model, k=2, seed=0).estimate(v)
    left, right = model.W.grad_factors
    assert left.shape == (model.n_visible, 12) and right.shape == (12, model.n_hidden)
    assert torch.equal(left @ right, model.W.grad)


def test_cd_statistics_are_exposed():
    model = make_model("bernoulli")
    v = make_data(model)
    stats = CDEstimator(model, k=1, seed=0).estimate(v)
    with torch.no_grad():
        torch.testing.assert_close(stats.hidden_data, model.hidden_probs(v))
        torch.testing.assert_close(stats.hidden_model, model.hidden_probs(stats.visible_model))
    assert torch.equal(stats.visible_data, v)
    assert set(stats.visible_model.unique().tolist()) <= {0.0, 1.0}


def test_full_precision_stays_symmetric_positive_definite_through_training():
    model = make_model("gaussian-full", n_visible=5, n_hidden=3)
    estimator = CDEstimator(model, k=1, seed=0)
    data = torch.randn(64, 5) * torch.tensor([0.2, 1.0, 3.0, 0.5, 1.0])
    for step in range(30):
        estimator.estimate(data[(step * 16) % 64 :][:16])
        grad = model.precision.grad
        assert torch.isfinite(grad).all()
        assert torch.equal(grad, grad.t())
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=0.02)
        model.constrain_()
        precision = model.precision.detach()
        assert torch.equal(precision, precision.t())
        assert torch.linalg.eigvalsh(precision.double()).min() > 0
        assert int(torch.linalg.cholesky_ex(precision).info) == 0


def test_seeded_estimates_are_reproducible():
    model = make_model("gaussian-diagonal")
    v = make_data(model)
    CDEstimator(model, k=2, seed=11).estimate(v)
    first = model.W.grad.clone()
    CDEstimator(model, k=2, seed=11).estimate(v)
    assert torch.equal(first, model.W.grad)
    CDEstimator(model, k=2, seed=12).estimate(v)
    assert not torch.equal(first, model.W.grad)


@pytest.mark.parametrize("case", ["bernoulli", "gaussian-diagonal"])
def test_pcd_state_dict_resumes_exactly(case):
    model = make_model(case)
    batches = [make_data(model, seed=s) for s in range(4)]
    reference = CDEstimator(model, k=2, persistent=True, seed=3)
    reference.estimate(batches[0])
    saved = {name: t.clone() for name, t in reference.state_dict().items()}
    assert saved["chains"].shape == (9, model.n_hidden)
    expected = []
    for batch in batches[1:]:
        reference.estimate(batch)
        expected.append(model.W.grad.clone())
    resumed = CDEstimator(model, k=2, persistent=True, seed=999)
    resumed.load_state_dict(saved)
    for batch, grad in zip(batches[1:], expected, strict=True):
        resumed.estimate(batch)
        assert torch.equal(model.W.grad, grad)


def test_bad_arguments_are_rejected():
    model = make_model("bernoulli")
    with pytest.raises(ValueError, match="k"):
        CDEstimator(model, k=0)
    with pytest.raises(ValueError, match="expected"):
        CDEstimator(model).estimate(torch.zeros(3, 4))
    estimator = CDEstimator(model, persistent=True)
    with pytest.raises(ValueError, match="chains"):
        estimator.load_state_dict({"chains": torch.zeros(3, 99)})


# --- the sampler ------------------------------------------------------------------------------


def exact_hidden_marginal(model) -> torch.Tensor:
    """p(h) over all hidden states (index = binary number, unit 0 most significant)."""
    states = torch.tensor(list(itertools.product([0.0, 1.0], repeat=model.n_hidden)))
    states = states.double()
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    if isinstance(model, GaussianRBM):
        precision_w = model.precision_matrix().detach().double() @ W
        log_terms = states @ (a + b @ precision_w)
        log_terms = log_terms + 0.5 * ((states @ (W.t() @ precision_w)) * states).sum(1)
    else:
        log_terms = states @ a + F.softplus(states @ W.t() + b).sum(1)
    return torch.softmax(log_terms, 0)


@pytest.mark.parametrize(
    ("case", "collapse"),
    [("bernoulli", False), *((f"gaussian-{v}", c) for v in VARIANCE_KINDS for c in (True, False))],
)
def test_gibbs_chains_reach_the_exact_hidden_marginal(case, collapse):
    model = make_model(case, n_visible=12, n_hidden=3)
    n_chains = 30000
    source = RandomSource("cpu", 7)
    kernel = model.gibbs_kernel()
    chain = GibbsChain(n_chains, model.n_visible, 3, torch.device("cpu"), source)
    chain.collapse = collapse
    assert (collapsed_sweep(kernel, n_chains, 19) is not None) == (case != "bernoulli")
    visible, probs = torch.empty(n_chains, model.n_visible), torch.empty(n_chains, 3)
    chain.run(kernel, torch.zeros(n_chains, 3), 20, visible, probs)
    hidden = source.bernoulli_(probs, out=torch.empty_like(probs))
    index = (hidden.long() * torch.tensor([4, 2, 1])).sum(1)
    empirical = torch.bincount(index, minlength=8).double() / n_chains
    exact = exact_hidden_marginal(model)
    # Each frequency has standard error ≤ sqrt(0.25 / 30000) ≈ 0.0029; allow 5 of them.
    torch.testing.assert_close(empirical, exact, atol=0.0145, rtol=0)


def test_random_source_draws_have_the_right_distribution():
    source = RandomSource("cpu", 0)
    probs = torch.linspace(0.0, 1.0, 11).repeat(20000, 1)
    draws = source.bernoulli_(probs, out=torch.empty_like(probs))
    assert set(draws.unique().tolist()) <= {0.0, 1.0}
    assert draws[:, 0].sum() == 0 and draws[:, -1].sum() == 20000
    torch.testing.assert_close(draws.mean(0), probs[0], atol=0.012, rtol=0)
    normals = source.normal_(torch.empty(200001)).double()
    assert abs(normals.mean()) < 0.01 and abs(normals.var() - 1) < 0.015
    assert abs((normals**4).mean() - 3) < 0.06  # Gaussian kurtosis
    assert abs((normals.abs() > 2).double().mean() - 0.0455) < 0.002


def test_random_source_state_round_trip():
    source = RandomSource("cpu", 42)
    state = source.state_dict()
    probs = torch.full((1000,), 0.5)
    first_normal = source.normal_(torch.empty(100)).clone()
    first_bits = source.bernoulli_(probs, out=torch.empty(1000)).clone()
    source.load_state_dict(state)
    assert torch.equal(first_normal, source.normal_(torch.empty(100)))
    assert torch.equal(first_bits, source.bernoulli_(probs, out=torch.empty(1000)))


@pytest.mark.parametrize("case", ["gaussian-isotropic", "gaussian-diagonal", "gaussian-full"])
def test_variance_gradients_without_the_dense_weight_gradient_match_autograd(case):
    """With only W's factors (dense_weight_grad=False) the variance gradients come from the
    factors; they must equal autograd's, and W's factors must still multiply to its gradient."""
    model = make_model(case)
    v = make_data(model)
    stats = CDEstimator(model, k=2, seed=5, dense_weight_grad=False).estimate(v)
    estimated = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    left, right = model.W.grad_factors
    estimated["W"] = left @ right
    expected = autograd_of_free_energy_difference(model, v, stats.visible_model.clone())
    for name in expected:
        torch.testing.assert_close(estimated[name], expected[name], atol=2e-5, rtol=2e-5)
