"""Optimizer steps against their formulas, hybrids, projections, validation and configs.

Steps are compared with the formula computed independently in float64 (rtol 1e-5 in float32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ssdcore import BernoulliRBM, CDEstimator
from ssdcore.optim import (
    SGD,
    SSD,
    OptimizerConfig,
    PreconditionedSSD,
    build_optimizer,
)
from ssdcore.step_sizes import default_lr

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5
ATOL = 1e-6


def svd_step(grad: torch.Tensor) -> torch.Tensor:
    """‖σ(G)‖₁ · U Vᵀ over G's range, from a float64 SVD."""
    u, s, vh = torch.linalg.svd(grad.double(), full_matrices=False)
    keep = s > s.max() * 1e-6
    return (s.sum() * (u[:, keep] @ vh[keep])).float()


class Tiny(nn.Module):
    """Named like an RBM: W (V, H), b (V,), a (H,); the step-size table sees a Bernoulli RBM."""

    kind = "bernoulli"

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.W = nn.Parameter(torch.randn(8, 5, generator=generator))
        self.b = nn.Parameter(torch.randn(8, generator=generator))
        self.a = nn.Parameter(torch.randn(5, generator=generator))


def set_grads(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=generator)
        grads[name] = p.grad.clone()
    return grads


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --- SSD steps ------------------------------------------------------------------------------


def test_vector_step_is_l1_norm_times_sign():
    x = nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    x.grad = torch.tensor([0.5, -0.25, 0.0, 2.0])
    SSD([x], lr=0.1).step()
    expected = torch.tensor([1.0, -2.0, 3.0, 0.5]) - 0.1 * 2.75 * torch.tensor([1.0, -1, 0, 1])
    assert torch.allclose(x.detach(), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("method", ["svd", "newton-schulz", "randomized", "lowrank"])
def test_matrix_step_is_nuclear_norm_times_polar_factor(method):
    model = Tiny()
    before = snapshot(model)
    grads = set_grads(model)
    SSD([model.W], lr=0.01, method=method, rank=5).step()
    expected = before["W"] - 0.01 * svd_step(grads["W"])
    tolerance = 1e-3 if method == "newton-schulz" else RTOL
    assert torch.allclose(model.W.detach(), expected, rtol=tolerance, atol=tolerance)


def test_lowrank_uses_and_consumes_grad_factors():
    generator = torch.Generator().manual_seed(2)
    w = nn.Parameter(torch.randn(30, 20, generator=generator))
    left, right = torch.randn(30, 4, generator=generator), torch.randn(4, 20, generator=generator)
    before = w.detach().clone()
    w.grad = left @ right
    w.grad_factors = (left, right)
    SSD([w], lr=0.01, method="lowrank").step()
    assert w.grad_factors is None
    assert torch.allclose(w.detach(), before - 0.01 * svd_step(left @ right), rtol=RTOL, atol=ATOL)


def test_lowrank_works_from_factors_alone():
    generator = torch.Generator().manual_seed(3)
    w = nn.Parameter(torch.randn(30, 20, generator=generator))
    left, right = torch.randn(30, 4, generator=generator), torch.randn(4, 20, generator=generator)
    before = w.detach().clone()
    w.grad_factors = (left, right)
    SSD([w], lr=0.01).step()
    assert torch.allclose(w.detach(), before - 0.01 * svd_step(left @ right), rtol=RTOL, atol=ATOL)


def test_stale_factors_fall_back_to_the_svd_of_the_gradient():
    generator = torch.Generator().manual_seed(4)
    w = nn.Parameter(torch.randn(30, 20, generator=generator))
    left, right = torch.randn(30, 4, generator=generator), torch.randn(4, 20, generator=generator)
    grad = torch.randn(30, 20, generator=generator)  # not left @ right
    before = w.detach().clone()
    w.grad, w.grad_factors = grad, (left, right)
    SSD([w], lr=0.01).step()
    assert torch.allclose(w.detach(), before - 0.01 * svd_step(grad), rtol=RTOL, atol=ATOL)


def test_factors_do_not_outlive_their_step():
    """A second step without new factors uses the (new) dense gradient, not old factors."""
    generator = torch.Generator().manual_seed(5)
    w = nn.Parameter(torch.randn(12, 9, generator=generator))
    left, right = torch.randn(12, 2, generator=generator), torch.randn(2, 9, generator=generator)
    optimizer = SSD([w], lr=0.01)
    w.grad, w.grad_factors = left @ right, (left, right)
    optimizer.step()
    before = w.detach().clone()
    w.grad = torch.randn(12, 9, generator=generator)
    optimizer.step()
    assert torch.allclose(w.detach(), before - 0.01 * svd_step(w.grad), rtol=RTOL, atol=ATOL)


def test_factors_with_wrong_shapes_are_refused():
    w = nn.Parameter(torch.zeros(6, 4))
    w.grad_factors = (torch.zeros(5, 2), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="grad_factors"):
        SSD([w], lr=0.1).step()


def test_lowrank_step_on_a_real_cd_gradient_equals_the_svd_step():
    torch.manual_seed(0)
    model = BernoulliRBM(40, 30)
    data = torch.bernoulli(torch.full((10, 40), 0.4))
    CDEstimator(model, k=1, seed=0).estimate(data)
    grad = model.W.grad.clone()
    before = model.W.detach().clone()
    SSD([model.W], lr=1e-3).step()
    assert torch.allclose(model.W.detach(), before - 1e-3 * svd_step(grad), rtol=RTOL, atol=ATOL)


def test_lowrank_with_factors_of_rank_above_a_side_uses_the_dense_gram_route():
    generator = torch.Generator().manual_seed(6)
    w = nn.Parameter(torch.randn(30, 6, generator=generator))
    left, right = torch.randn(30, 8, generator=generator), torch.randn(8, 6, generator=generator)
    before = w.detach().clone()
    w.grad, w.grad_factors = left @ right, (left, right)
    SSD([w], lr=0.01).step()
    assert torch.allclose(w.detach(), before - 0.01 * svd_step(left @ right), rtol=RTOL, atol=ATOL)


def test_factored_lowrank_step_with_decay_and_projection():
    """Decay scales W before the fused low-rank update; the ‖W‖₂ ≤ R projection runs after it."""
    generator = torch.Generator().manual_seed(7)
    w = nn.Parameter(torch.randn(40, 30, generator=generator))
    left, right = torch.randn(40, 4, generator=generator), torch.randn(4, 30, generator=generator)
    before = w.detach().clone()
    w.grad_factors = (left, right)
    SSD([w], lr=0.01, weight_decay=0.5).step()
    expected = before * (1 - 0.01 * 0.5) - 0.01 * svd_step(left @ right)
    assert torch.allclose(w.detach(), expected, rtol=RTOL, atol=1e-5)
    w.grad_factors = (left, right)
    SSD([w], lr=0.01, max_spectral_norm=1.0).step()
    assert torch.linalg.matrix_norm(w.detach(), 2) <= 1.0 * (1 + 1e-5)


def test_spectral_step_leaves_the_thread_count_as_it_found_it():
    """The k×k factorizations run on one thread; the caller's setting comes back afterwards."""
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(8)
    w = nn.Parameter(torch.randn(30, 20, generator=generator))
    w.grad_factors = (
        torch.randn(30, 4, generator=generator),
        torch.randn(4, 20, generator=generator),
    )
    SSD([w], lr=0.01).step()
    assert torch.get_num_threads() == 2


def test_euclidean_group_takes_an_sgd_step():
    model = Tiny()
    before, grads = snapshot(model), set_grads(model)
    SSD(
        [{"params": [model.W], "geometry": "euclidean"}, {"params": [model.b, model.a]}],
        lr=0.1,
    ).step()
    assert torch.allclose(model.W.detach(), before["W"] - 0.1 * grads["W"])
    g = grads["b"]
    assert torch.allclose(model.b.detach(), before["b"] - 0.1 * g.abs().sum() * g.sign())


def test_max_spectral_norm_keeps_w_in_the_ball():
    model = Tiny()
    optimizer = SSD([model.W], lr=1.0, max_spectral_norm=0.5)
    for seed in range(3):
        set_grads(model, seed)
        optimizer.step()
        assert torch.linalg.matrix_norm(model.W.detach(), 2) <= 0.5 * (1 + 1e-5)


def test_decoupled_weight_decay_scales_before_the_step():
    x = nn.Parameter(torch.tensor([2.0, -4.0]))
    x.grad = torch.tensor([1.0, 1.0])
    SSD([x], lr=0.1, weight_decay=0.5).step()
    assert torch.allclose(x.detach(), torch.tensor([2.0, -4.0]) * 0.95 - 0.1 * 2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "learning rate"),
        ({"lr": 0.1, "method": "qr"}, "method"),
        ({"lr": 0.1, "geometry": "hyperbolic"}, "geometry"),
        ({"lr": 0.1, "momentum": 0.9}, "momentum"),
        ({"lr": 0.1, "max_spectral_norm": -1.0}, "max_spectral_norm"),
        ({"lr": 0.1, "rank": -2}, "rank"),
        ({"lr": 0.1, "preconditioner": "rmsprop", "method": "lowrank"}, "lowrank"),
    ],
)
def test_ssd_validates_its_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SSD([nn.Parameter(torch.zeros(3))], **kwargs)


def test_unsupported_parameters_are_refused():
    cube = nn.Parameter(torch.zeros(2, 2, 2))
    cube.grad = torch.zeros(2, 2, 2)
    with pytest.raises(ValueError, match="matrices"):
        SSD([cube], lr=0.1).step()
    sparse = nn.Parameter(torch.zeros(3, 3))
    sparse.grad = torch.zeros(3, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        SSD([sparse], lr=0.1).step()


# --- SGD ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_matches_torch_sgd(momentum, nesterov):
    ours, theirs = Tiny(), Tiny()
    mine = SGD(ours.parameters(), lr=0.05, momentum=momentum, nesterov=nesterov)
    reference = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum, nesterov=nesterov)
    for seed in range(4):
        set_grads(ours, seed)
        set_grads(theirs, seed)
        mine.step()
        reference.step()
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=RTOL, atol=ATOL)


def test_sgd_validates_its_settings():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="momentum"):
        SGD(params, lr=0.1, momentum=1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="weight_decay"):
        SGD(params, lr=0.1, weight_decay=-1)


# --- preconditioned SSD ---------------------------------------------------------------------


@pytest.mark.parametrize("preconditioner", ["rmsprop", "adam"])
def test_preconditioned_step_matches_its_formula(preconditioner):
    model = Tiny()
    before = snapshot(model)
    grads = set_grads(model)
    optimizer = PreconditionedSSD(
        [model.W, model.b], lr=0.01, preconditioner=preconditioner, betas=(0.9, 0.99), eps=1e-8
    )
    optimizer.step()
    for name in ("W", "b"):
        g = grads[name].double()
        # First step: bias-corrected moments are g (Adam) and g², so
        # D = max(|g|, damping · mean |g|) + eps, with the default damping 0.1.
        scale = (g.abs().clamp_min(0.1 * g.abs().mean()) + 1e-8).rsqrt()
        y = g * scale
        sharp = svd_step(y).double() if name == "W" else y.abs().sum() * y.sign()
        expected = before[name].double() - 0.01 * scale * sharp
        actual = dict(model.named_parameters())[name].detach().double()
        assert torch.allclose(actual, expected, rtol=1e-4, atol=1e-5), name


def test_preconditioned_refuses_lowrank_and_unknown_preconditioners():
    with pytest.raises(ValueError, match="lowrank"):
        PreconditionedSSD([nn.Parameter(torch.zeros(2, 2))], lr=0.1, method="lowrank")
    with pytest.raises(ValueError, match="preconditioner"):
        PreconditionedSSD([nn.Parameter(torch.zeros(2))], lr=0.1, preconditioner="adagrad")


# --- configuration --------------------------------------------------------------------------


def geometry_of(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    return {g["name"]: g.get("geometry", "euclidean") for g in optimizer.param_groups}


def test_hybrids_put_w_in_the_right_geometry():
    ssd_w = build_optimizer(Tiny(), OptimizerConfig("sgd", per_parameter={"W": "ssd"}))
    assert geometry_of(ssd_w) == {"W": "spectral", "b": "euclidean", "a": "euclidean"}
    sgd_w = build_optimizer(Tiny(), OptimizerConfig("ssd", per_parameter={"W": "sgd"}))
    assert geometry_of(sgd_w) == {"W": "euclidean", "b": "spectral", "a": "spectral"}


def test_hybrid_steps_follow_their_geometries():
    # W's override has no per_parameter_lr: it steps at the table's SSD value, not at lr.
    model = Tiny()
    before, grads = snapshot(model), set_grads(model)
    build_optimizer(model, OptimizerConfig("sgd", lr=0.02, per_parameter={"W": "ssd"})).step()
    w_lr = default_lr("bernoulli", "ssd")
    assert w_lr != 0.02
    assert torch.allclose(model.W.detach(), before["W"] - w_lr * svd_step(grads["W"]), atol=1e-5)
    assert torch.allclose(model.b.detach(), before["b"] - 0.02 * grads["b"])


def test_config_builds_the_right_classes_and_defaults():
    assert type(build_optimizer(Tiny(), OptimizerConfig("sgd"))) is SGD
    nesterov = build_optimizer(Tiny(), OptimizerConfig("nesterov"))
    assert all(g["nesterov"] and g["momentum"] == 0.9 for g in nesterov.param_groups)
    ssd = build_optimizer(Tiny(), OptimizerConfig("ssd"))
    assert type(ssd) is SSD and all(g["method"] == "lowrank" for g in ssd.param_groups)
    pre = build_optimizer(Tiny(), OptimizerConfig("ssd-preconditioned", preconditioner="adam"))
    assert type(pre) is PreconditionedSSD
    assert all(g["method"] == "svd" and g["preconditioner"] == "adam" for g in pre.param_groups)


def test_config_decays_and_bounds_only_w():
    optimizer = build_optimizer(
        Tiny(), OptimizerConfig("ssd", weight_decay=0.1, max_spectral_norm=2.0)
    )
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["W"]["weight_decay"] == 0.1 and groups["W"]["max_spectral_norm"] == 2.0
    assert groups["b"]["weight_decay"] == 0.0 and groups["b"]["max_spectral_norm"] is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"name": "adam"}, "name"),
        ({"method": "qr"}, "method"),
        ({"preconditioner": "adagrad"}, "preconditioner"),
        ({"momentum": 1.5}, "momentum"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"rank": -1}, "rank"),
        ({"per_parameter": {"W": "lbfgs"}}, "per_parameter"),
    ],
)
def test_config_errors_name_the_field(fields, named):
    with pytest.raises(ValueError, match=f"OptimizerConfig.{named}"):
        OptimizerConfig(**fields)


def test_unknown_parameter_name_is_refused():
    with pytest.raises(ValueError, match=r"per_parameter.*'V'"):
        build_optimizer(Tiny(), OptimizerConfig("ssd", per_parameter={"V": "sgd"}))


def test_config_round_trips_through_a_dict():
    config = OptimizerConfig("ssd", lr=0.02, per_parameter={"W": "sgd"}, max_spectral_norm=3.0)
    assert OptimizerConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown fields"):
        OptimizerConfig.from_dict({**config.to_dict(), "learning_rate": 1.0})


def test_per_parameter_step_sizes_reach_their_groups():
    config = OptimizerConfig(
        "sgd", lr=0.1, per_parameter={"W": "ssd"}, per_parameter_lr={"W": 1e-3}
    )
    groups = {g["name"]: g for g in build_optimizer(Tiny(), config).param_groups}
    assert groups["W"]["lr"] == 1e-3 and groups["b"]["lr"] == 0.1
    with pytest.raises(ValueError, match=r"OptimizerConfig\.per_parameter_lr"):
        OptimizerConfig(per_parameter_lr={"W": 0.0})
    with pytest.raises(ValueError, match="per_parameter_lr: unknown parameter names"):
        build_optimizer(Tiny(), OptimizerConfig(per_parameter_lr={"V": 0.1}))


def test_needs_dense_gradient_only_without_an_exact_low_rank_step():
    w = nn.Parameter(torch.zeros(100, 60))
    assert not SSD([w], lr=0.1).needs_dense_gradient(w, factor_rank=20)
    assert not SSD([w], lr=0.1).needs_dense_gradient(w, factor_rank=59)
    # rank >= min(V, H): the dense gradient's Gram matrix is the smaller eigenproblem
    assert SSD([w], lr=0.1).needs_dense_gradient(w, factor_rank=60)
    assert SSD([w], lr=0.1, method="svd").needs_dense_gradient(w, factor_rank=20)
    assert SSD([w], lr=0.1, geometry="euclidean").needs_dense_gradient(w, factor_rank=20)


def test_lowrank_in_a_preconditioned_config_means_its_exact_equivalent_svd():
    config = OptimizerConfig("ssd-preconditioned", method="lowrank", per_parameter={"W": "ssd"})
    groups = {g["name"]: g for g in build_optimizer(Tiny(), config).param_groups}
    assert groups["W"]["method"] == "lowrank" and groups["W"]["preconditioner"] is None
    assert groups["b"]["method"] == "svd" and groups["b"]["preconditioner"] == "rmsprop"


@pytest.mark.parametrize("preconditioner", ["rmsprop", "adam"])
def test_preconditioning_damping_bounds_the_step_of_a_rarely_active_coordinate(preconditioner):
    # The l∞ step moves every coordinate by the same norm times D^{-1/2}: a coordinate whose
    # gradient is almost zero (a pixel that is never on) would otherwise get D ≈ eps.
    def step_sizes(damping: float) -> torch.Tensor:
        param = torch.nn.Parameter(torch.zeros(10))
        optimizer = PreconditionedSSD(
            [param], lr=1e-3, preconditioner=preconditioner, damping=damping
        )
        param.grad = torch.ones(10)
        param.grad[0] = 1e-6
        optimizer.step()
        return param.detach().abs()

    damped = step_sizes(0.1)
    # D_0 is floored at 0.1 · mean(D) = 0.1 · 0.9 (nine coordinates at 1, one near 0).
    assert damped[0] / damped[1:].median() == pytest.approx((0.1 * 0.9) ** -0.5, rel=1e-4)
    undamped = step_sizes(0.0)
    assert undamped[0] / undamped[1:].median() > 100  # what the floor prevents


def test_damping_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="damping"):
        PreconditionedSSD([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, damping=2.0)


@pytest.mark.parametrize(
    ("config", "capturable"),
    [
        (OptimizerConfig("sgd", lr=0.05), True),
        (OptimizerConfig("nesterov", lr=0.05), True),
        (OptimizerConfig("ssd", method="newton-schulz"), True),
        (OptimizerConfig("sgd", lr=0.05, method="newton-schulz", per_parameter={"W": "ssd"}), True),
        (OptimizerConfig("ssd"), False),  # exact methods check ranks on the host
        (OptimizerConfig("ssd", method="randomized"), False),
        (OptimizerConfig("ssd", method="newton-schulz", max_spectral_norm=3.0), False),
        (OptimizerConfig("sgd", lr=0.05, max_spectral_norm=3.0), False),
        (
            OptimizerConfig("ssd-preconditioned", method="newton-schulz", preconditioner="adam"),
            False,
        ),
    ],
)
def test_optimizers_say_whether_a_cuda_graph_can_capture_their_step(config, capturable):
    assert build_optimizer(BernoulliRBM(6, 3), config).capturable() is capturable


def test_newton_schulz_steps_from_thin_factors_like_from_the_dense_gradient():
    """Given factors only (the estimator skips the dense gradient), the step iterates in factor
    space; it must land where the dense Newton–Schulz step lands."""
    torch.manual_seed(0)
    data = torch.bernoulli(torch.full((20, 30), 0.3))
    models = [BernoulliRBM(30, 25) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = models[0].W.detach().clone()
    config = OptimizerConfig("ssd", lr=1e-2, method="newton-schulz")
    for model, dense in zip(models, (True, False), strict=True):
        optimizer = build_optimizer(model, config)
        assert optimizer.needs_dense_gradient(model.W, 2 * 5) is False  # rank 10 < 25
        estimator = CDEstimator(model, k=1, seed=3, dense_weight_grad=dense)
        for step in range(3):
            estimator.estimate(data[5 * step : 5 * step + 5])
            optimizer.step()
    # Newton–Schulz rounds its slowest directions differently in the two forms: within 1% of
    # the distance travelled.
    travelled = (models[0].W.detach() - start).norm()
    assert float((models[0].W - models[1].W).detach().norm()) < 1e-2 * float(travelled)
