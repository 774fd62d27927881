"""The normalized SSD step rule: its formula on every route, SGD's length, its scale across
model sizes, and its place in configs and hybrids.

Steps are compared with the formula computed independently in float64 (rtol 1e-5 in float32).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ssdcore import BernoulliRBM, CDEstimator
from ssdcore.optim import SSD, OptimizerConfig, PreconditionedSSD, build_optimizer
from ssdcore.pack import pack_key
from ssdcore.step_sizes import default_lr

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5
ATOL = 1e-6
LR = 0.05


def normalized_step(grad: torch.Tensor) -> torch.Tensor:
    """(‖G‖_F / √rank) · U Vᵀ over G's range, from a float64 SVD."""
    u, s, vh = torch.linalg.svd(grad.double(), full_matrices=False)
    keep = s > s.max() * 1e-6
    length = s.square().sum().sqrt() / keep.sum().sqrt()
    return (length * (u[:, keep] @ vh[keep])).float()


def factors(m: int, n: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, rank, generator=generator), torch.randn(rank, n, generator=generator)


def matrix(m: int, n: int, seed: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 100)))


@pytest.mark.parametrize("method", ["svd", "lowrank", "newton-schulz", "randomized"])
def test_matrix_step_from_a_dense_gradient(method: str) -> None:
    w = matrix(12, 7, 0)
    before = w.detach().clone()
    left, right = factors(12, 7, 7, 1)
    w.grad = left @ right
    SSD([w], lr=LR, method=method, rank=7, step_rule="normalized").step()
    tolerance = 1e-3 if method == "newton-schulz" else RTOL
    expected = before - LR * normalized_step(left @ right)
    assert torch.allclose(w.detach(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("with_dense", [True, False])
@pytest.mark.parametrize("method", ["lowrank", "newton-schulz"])
def test_matrix_step_from_thin_factors(method: str, with_dense: bool) -> None:
    """The factored routes (factors alone: ‖G‖_F and ‖D‖_F from the factors' Gram matrices)."""
    w = matrix(40, 30, 2)
    before = w.detach().clone()
    # Singular values 1 to 2.5: conditioned well enough for Newton–Schulz to reach its tolerance.
    left, right = factors(40, 30, 4, 3)
    left = torch.linalg.qr(left).Q * torch.tensor([1.0, 1.5, 2.0, 2.5])
    right = torch.linalg.qr(right.mT).Q.mT
    w.grad = (left @ right) if with_dense else None
    w.grad_factors = (left, right)
    SSD([w], lr=LR, method=method, step_rule="normalized").step()
    tolerance = 1e-3 if method == "newton-schulz" else RTOL
    expected = before - LR * normalized_step(left @ right)
    assert torch.allclose(w.detach(), expected, rtol=tolerance, atol=tolerance)


def test_vector_step() -> None:
    x = nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    g = torch.tensor([0.5, -0.25, 0.0, 2.0])
    x.grad = g.clone()
    SSD([x], lr=0.1, step_rule="normalized").step()
    length = (0.25 + 0.0625 + 4.0) ** 0.5 / 3**0.5  # ‖g‖₂ / √(nonzero entries)
    expected = torch.tensor([1.0, -2.0, 3.0, 0.5]) - 0.1 * length * torch.sign(g)
    assert torch.allclose(x.detach(), expected, rtol=RTOL, atol=ATOL)


def test_a_zero_gradient_takes_no_step() -> None:
    w, x = matrix(6, 4, 4), nn.Parameter(torch.ones(5))
    before_w, before_x = w.detach().clone(), x.detach().clone()
    w.grad, x.grad = torch.zeros(6, 4), torch.zeros(5)
    SSD([w, x], lr=1.0, method="svd", step_rule="normalized").step()
    assert torch.equal(w.detach(), before_w) and torch.equal(x.detach(), before_x)


def test_takes_sgds_length_and_descends() -> None:
    """‖ΔW‖_F = lr‖G‖_F·√(rank / k) (k = 9, the largest rank a 20×9 gradient can have): SGD's
    length for a gradient of full rank, less for a deficient one; and ⟨G, ΔW⟩ < 0."""
    for seed, rank in [(5, 1), (6, 3), (7, 9)]:
        left, right = factors(20, 9, rank, seed)
        grad = left @ right
        w = matrix(20, 9, seed)
        before = w.detach().clone()
        w.grad = grad.clone()
        SSD([w], lr=LR, method="svd", step_rule="normalized").step()
        step = (w.detach() - before).double()
        expected = LR * float(grad.double().norm()) * (rank / 9) ** 0.5
        assert float(step.norm()) == pytest.approx(expected, rel=1e-4)
        assert float((grad.double() * step).sum()) < 0


@pytest.mark.parametrize("preconditioner", ["rmsprop", "adam"])
def test_preconditioned_step_uses_the_rule_in_its_rescaled_geometry(preconditioner: str) -> None:
    w = matrix(10, 6, 8)
    before = w.detach().clone()
    grad = torch.randn(10, 6, generator=torch.Generator().manual_seed(9))
    w.grad = grad.clone()
    optimizer = PreconditionedSSD(
        [w], lr=LR, preconditioner=preconditioner, damping=0.0, step_rule="normalized"
    )
    optimizer.step()
    # First step: v̂ = g², so D = |g| + eps and the rescaled gradient is g / sqrt(|g| + eps).
    scale = (grad.abs() + 1e-8).rsqrt()
    expected = before - LR * scale * normalized_step(grad * scale)
    assert torch.allclose(w.detach(), expected, rtol=1e-4, atol=1e-5)


def test_the_paper_rule_is_the_default_and_unchanged() -> None:
    left, right = factors(12, 7, 7, 10)
    steps = []
    for rule in (None, "paper"):
        w = matrix(12, 7, 11)
        w.grad = left @ right
        SSD([w], lr=LR, method="svd", **({} if rule is None else {"step_rule": rule})).step()
        steps.append(w.detach().clone())
    assert torch.equal(steps[0], steps[1])
    with pytest.raises(ValueError, match="step_rule"):
        SSD([matrix(3, 3, 0)], lr=LR, step_rule="bound")


def test_per_unit_move_keeps_sgds_scale_across_n_hidden() -> None:
    """The mechanism of the derivation on real CD gradients: the RMS move of a hidden unit's
    weights, relative to SGD's at the same lr, grows with n_hidden under the paper's rule and
    is 1 under the normalized one."""
    generator = torch.Generator().manual_seed(0)
    prototypes = torch.rand(20, 100, generator=generator)  # a mixture of 20 binary patterns
    choice = torch.randint(0, 20, (400,), generator=generator)
    data = torch.bernoulli(prototypes[choice], generator=generator)
    ratios = {}
    for n_hidden in (8, 128):
        torch.manual_seed(0)
        model = BernoulliRBM(100, n_hidden)
        model.init_from_data(data)
        CDEstimator(model, k=1, seed=0).estimate(data[:200])
        grad = model.W.grad.clone()
        sgd_move = grad.norm(dim=0).pow(2).mean().sqrt()
        for rule in ("paper", "normalized"):
            w = nn.Parameter(torch.zeros_like(grad))
            w.grad = grad.clone()
            SSD([w], lr=1.0, method="svd", step_rule=rule).step()
            move = w.detach().norm(dim=0).pow(2).mean().sqrt()
            ratios[rule, n_hidden] = float(move / sgd_move)
    paper_growth = ratios["paper", 128] / ratios["paper", 8]
    normalized_growth = ratios["normalized", 128] / ratios["normalized", 8]
    assert paper_growth > 3, ratios
    # 1 for a gradient of full rank; the 100×128 CD gradient has rank 99 of 100 here.
    assert normalized_growth == pytest.approx(1.0, rel=1e-2), ratios
    assert ratios["normalized", 8] == pytest.approx(1.0, rel=1e-3), ratios


# --- configs and hybrids ------------------------------------------------------------------------


def test_config_takes_the_rule_and_its_own_default_step() -> None:
    model = BernoulliRBM(8, 5)
    optimizer = build_optimizer(model, OptimizerConfig("ssd", step_rule="normalized"))
    assert {g["step_rule"] for g in optimizer.param_groups} == {"normalized"}
    assert optimizer.param_groups[0]["lr"] == default_lr("bernoulli", "ssd", None, "normalized")
    assert default_lr("bernoulli", "ssd", None, "normalized") != default_lr("bernoulli", "ssd")
    with pytest.raises(ValueError, match=r"OptimizerConfig\.step_rule"):
        OptimizerConfig("ssd", step_rule="bound")
    again = OptimizerConfig.from_dict(OptimizerConfig("ssd", step_rule="normalized").to_dict())
    assert again.step_rule == "normalized"


def test_hybrid_ssd_on_w_sgd_on_biases() -> None:
    """SSD_W/SGD: W takes the normalized spectral step at the rule's default, b and a SGD."""
    model = BernoulliRBM(8, 5)
    config = OptimizerConfig("sgd", per_parameter={"W": "ssd"}, step_rule="normalized")
    groups = {g["name"]: g for g in build_optimizer(model, config).param_groups}
    assert groups["W"]["geometry"] == "spectral" and groups["W"]["step_rule"] == "normalized"
    assert groups["W"]["lr"] == default_lr("bernoulli", "ssd", None, "normalized")
    assert groups["b"]["geometry"] == groups["a"]["geometry"] == "euclidean"
    assert groups["b"]["lr"] == default_lr("bernoulli", "sgd")


def test_packs_keep_the_two_rules_apart() -> None:
    """Packs run the normalized rule (tests/test_pack_rules.py), never beside the paper rule."""
    config = OptimizerConfig("ssd", lr=0.1, step_rule="normalized")
    model = BernoulliRBM(8, 5).config()
    assert pack_key(model, config) != pack_key(model, OptimizerConfig("ssd", lr=0.1))
