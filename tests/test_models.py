"""Models: conditionals and free energy against brute-force enumeration of the paper's energy."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from ssdcore import BernoulliRBM, CDEstimator, GaussianRBM, model_from_config
from ssdcore.models import MAX_FULL_VISIBLE, VARIANCE_KINDS
from ssdcore.models.factory import parameter_names

VARIANCES = list(VARIANCE_KINDS)


@pytest.fixture(autouse=True)
def _single_thread():
    # Tiny tensors: one thread avoids OpenMP hand-offs, which dominate on busy 2-core machines.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_bernoulli(n_visible: int = 6, n_hidden: int = 4, seed: int = 0) -> BernoulliRBM:
    torch.manual_seed(seed)
    model = BernoulliRBM(n_visible, n_hidden, init_std=0.7)
    with torch.no_grad():
        model.b.normal_()
        model.a.normal_()
    return model


def random_gaussian(variance: str, n_visible: int = 3, n_hidden: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = GaussianRBM(n_visible, n_hidden, variance=variance, init_std=0.5)
    with torch.no_grad():
        model.b.normal_()
        model.a.normal_()
        if variance == "isotropic":
            model.log_c.fill_(-0.4)
        elif variance == "diagonal":
            model.log_var.uniform_(-0.7, 0.7)
        elif variance == "full":
            root = torch.randn(n_visible, n_visible) * 0.4
            model.precision.copy_(root @ root.t() + torch.eye(n_visible))
    return model


def energy(model, v: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The paper's energies, written out directly: E(v, h) for rows v (N, V), h (N, H)."""
    W, b, a = model.W.double(), model.b.double(), model.a.double()
    v, h = v.double(), h.double()
    if isinstance(model, BernoulliRBM):
        return -((v @ W) * h).sum(1) - v @ b - h @ a
    precision = model.precision_matrix().double()
    centered = v - b
    return (
        -(v @ precision @ W * h).sum(1) + 0.5 * ((centered @ precision) * centered).sum(1) - h @ a
    )


def all_states(n: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)), dtype=torch.float64)


def brute_force_free_energy_and_probs(model, v: torch.Tensor):
    """F(v) = -log Σ_h exp(-E) and p(h_j = 1 | v), by enumerating every hidden state."""
    hidden = all_states(model.n_hidden)
    free, probs = [], []
    for row in v:
        e = energy(model, row.expand(hidden.shape[0], -1), hidden)
        free.append(-torch.logsumexp(-e, 0))
        weights = torch.softmax(-e, 0)
        probs.append(weights @ hidden)
    return torch.stack(free), torch.stack(probs)


@pytest.mark.parametrize("variance", [None, *VARIANCES])
def test_free_energy_and_hidden_probs_match_enumeration(variance):
    model = random_bernoulli() if variance is None else random_gaussian(variance)
    torch.manual_seed(1)
    if variance is None:
        v = (torch.rand(5, model.n_visible) < 0.5).float()
    else:
        v = torch.randn(5, model.n_visible)
    free, probs = brute_force_free_energy_and_probs(model, v)
    with torch.no_grad():
        torch.testing.assert_close(model.free_energy(v).double(), free, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.hidden_probs(v).double(), probs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variance", ["diagonal", "full"])
def test_gaussian_visible_conditional_is_normal_with_covariance_c(variance):
    model = random_gaussian(variance)
    h = torch.tensor([[1.0, 0.0, 1.0, 1.0]]).expand(40000, -1)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        samples = model.sample_visible(h, generator).double()
        mean = model.visible_mean(h[:1]).double()[0]
        covariance = torch.linalg.inv(model.precision_matrix().double())
    # 40000 draws: the sample mean and covariance are within ~4 standard errors of the truth.
    torch.testing.assert_close(samples.mean(0), mean, atol=0.03, rtol=0)
    torch.testing.assert_close(torch.cov(samples.t()), covariance, atol=0.05, rtol=0.03)


def test_bernoulli_samples_are_binary_with_the_right_rate():
    model = random_bernoulli()
    generator = torch.Generator().manual_seed(0)
    v = torch.ones(20000, model.n_visible)
    with torch.no_grad():
        h = model.sample_hidden(v, generator)
        probs = model.hidden_probs(v[:1])[0]
    assert h.dtype == torch.float32 and set(h.unique().tolist()) <= {0.0, 1.0}
    torch.testing.assert_close(h.mean(0), probs, atol=0.015, rtol=0)


@pytest.mark.parametrize("variance", [None, "diagonal"])
def test_reconstruct_shapes_and_mean_field_is_deterministic(variance):
    model = random_bernoulli() if variance is None else random_gaussian(variance)
    v = torch.rand(7, model.n_visible)
    with torch.no_grad():
        first = model.reconstruct(v, k=2, mean_field=True)
        second = model.reconstruct(v, k=2, mean_field=True)
        sampled = model.reconstruct(v, k=3, generator=torch.Generator().manual_seed(0))
    assert first.shape == v.shape and sampled.shape == v.shape
    assert torch.equal(first, second)
    with pytest.raises(ValueError, match="k must be"):
        model.reconstruct(v, k=0)


def test_wrong_input_shape_is_a_clear_error():
    model = random_bernoulli()
    with pytest.raises(ValueError, match=r"expected \(batch, 6\)"):
        model.hidden_probs(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="float"):
        model.free_energy(torch.zeros(3, 6, dtype=torch.int64))


@pytest.mark.parametrize("variance", [None, *VARIANCES])
def test_config_round_trip_rebuilds_the_same_model(variance):
    model = random_bernoulli() if variance is None else random_gaussian(variance)
    config = json.loads(json.dumps(model.config()))
    rebuilt = model_from_config(config)
    rebuilt.load_state_dict(model.state_dict())
    v = torch.rand(4, model.n_visible)
    with torch.no_grad():
        assert torch.equal(rebuilt.free_energy(v), model.free_energy(v))
    assert type(rebuilt) is type(model)
    assert [name for name, _ in rebuilt.named_parameters()] == [
        name for name, _ in model.named_parameters()
    ]


def test_bad_configs_and_arguments_name_the_fix():
    with pytest.raises(ValueError, match="'type'"):
        model_from_config({"type": "boltzmann", "n_visible": 2, "n_hidden": 2})
    with pytest.raises(ValueError, match="n_hidden"):
        model_from_config({"type": "bernoulli", "n_visible": 2})
    with pytest.raises(ValueError, match="unknown field"):
        model_from_config({"type": "bernoulli", "n_visible": 2, "n_hidden": 2, "colour": 1})
    with pytest.raises(ValueError, match="variance must be one of"):
        GaussianRBM(3, 2, variance="spherical")
    with pytest.raises(ValueError, match="variance='diagonal'"):
        GaussianRBM(MAX_FULL_VISIBLE + 1, 2, variance="full")
    with pytest.raises(ValueError, match="positive"):
        BernoulliRBM(0, 3)


def test_parameter_names_follow_the_paper():
    names = {v: {n for n, _ in GaussianRBM(3, 2, variance=v).named_parameters()} for v in VARIANCES}
    assert names["identity"] == {"W", "b", "a"}
    assert names["isotropic"] == {"W", "b", "a", "log_c"}
    assert names["diagonal"] == {"W", "b", "a", "log_var"}
    assert names["full"] == {"W", "b", "a", "precision"}
    model = BernoulliRBM(5, 3)
    assert model.W.shape == (5, 3) and model.b.shape == (5,) and model.a.shape == (3,)
    # parameter_names answers without building the model, in named_parameters() order.
    for variance in VARIANCES:
        built = tuple(n for n, _ in GaussianRBM(3, 2, variance=variance).named_parameters())
        assert parameter_names("gaussian", variance) == built
    default = tuple(n for n, _ in GaussianRBM(3, 2).named_parameters())
    assert parameter_names("gaussian") == default
    assert parameter_names("bernoulli") == tuple(n for n, _ in model.named_parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_constrain_projects_precision_to_symmetric_positive_definite():
    model = GaussianRBM(4, 2, variance="full", min_variance=1e-2, max_variance=1e2)
    with torch.no_grad():
        model.precision.copy_(
            torch.tensor([[1.0, 3.0, 0, 0], [0, 1.0, 0, 0], [0, 0, -2.0, 0], [0, 0, 0, 500.0]])
        )
    model.constrain_()
    precision = model.precision.detach()
    assert torch.equal(precision, precision.t())
    eigenvalues = torch.linalg.eigvalsh(precision)
    assert eigenvalues.min() >= 1e-2 * 0.999 and eigenvalues.max() <= 1e2 * 1.001


def test_constrain_clamps_log_variances():
    model = GaussianRBM(3, 2, min_variance=1e-3, max_variance=10.0)
    with torch.no_grad():
        model.log_var.copy_(torch.tensor([-50.0, 0.5, 50.0]))
    model.constrain_()
    torch.testing.assert_close(
        model.log_var.exp().detach(), torch.tensor([1e-3, math.exp(0.5), 10.0])
    )


def test_init_from_data_sets_biases_and_variances():
    torch.manual_seed(0)
    x = torch.randn(500, 3) * torch.tensor([1.0, 2.0, 0.5]) + torch.tensor([1.0, -1.0, 0.0])
    model = GaussianRBM(3, 2)
    model.init_from_data(x)
    torch.testing.assert_close(model.b.detach(), x.mean(0))
    torch.testing.assert_close(model.log_var.exp().detach(), x.var(0, unbiased=False))
    binary = BernoulliRBM(2, 2)
    binary.init_from_data(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    torch.testing.assert_close(torch.sigmoid(binary.b.detach()), torch.tensor([0.75, 0.25]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variance", [None, "diagonal", "full"])
def test_cuda_models_and_cd_match_autograd(variance):
    model = (random_bernoulli() if variance is None else random_gaussian(variance)).cuda()
    v = torch.rand(8, model.n_visible, device="cuda")
    with torch.no_grad():
        assert model.hidden_probs(v).device.type == "cuda"
    stats = CDEstimator(model, k=2, seed=0).estimate(v)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    v_model = stats.visible_model.clone()
    for p in model.parameters():
        p.grad = None
    (model.free_energy(v).mean() - model.free_energy(v_model).mean()).backward()
    for name, p in model.named_parameters():
        grad = 0.5 * (p.grad + p.grad.t()) if name == "precision" else p.grad
        torch.testing.assert_close(expected[name], grad, atol=1e-4, rtol=1e-4)
