"""The CUDA code path: the same numerics as on CPU, checked on the GPU itself.

Skipped without a CUDA device. Every check compares against a CPU float64 reference (SVD,
enumeration) or against the CPU run of the same computation, with stated tolerances; the random
streams differ between devices (Philox on CUDA, SFC64 on CPU), so trajectories are compared
within a device and statistics across devices.
"""

from __future__ import annotations

import math

import pytest
import torch

from ssdcore import (
    BernoulliRBM,
    GaussianRBM,
    OptimizerConfig,
    Trainer,
    ais_log_partition,
    exact_log_partition,
    reconstruction_error,
)
from ssdcore.checkpoint import (
    model_from_bytes,
    model_to_bytes,
    trainer_from_bytes,
    trainer_to_bytes,
)
from ssdcore.optim.polar import (
    polar_lowrank_factors,
    polar_newton_schulz,
    polar_randomized,
    polar_svd,
)
from ssdcore.sampling import RandomSource

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def low_rank_gradient(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors (m, k) and (k, n) shaped like a CD weight gradient: 0/1 rows times probabilities."""
    generator = torch.Generator().manual_seed(seed)
    left = torch.bernoulli(torch.full((m, k), 0.3), generator=generator)
    left[:, k // 2 :] *= -1.0
    right = torch.rand(k, n, generator=generator) / k
    return left, right


def reference_polar(grad: torch.Tensor) -> tuple[torch.Tensor, float]:
    """U Vᵀ over the numerical range and ‖σ‖₁, from a float64 SVD on the CPU."""
    u, s, vh = torch.linalg.svd(grad.double().cpu(), full_matrices=False)
    kept = s > s.max() * max(grad.shape) * torch.finfo(torch.float32).eps
    return (u[:, kept] @ vh[kept]), float(s.sum())


@pytest.mark.parametrize("shape", [(120, 30), (30, 120)])
def test_exact_polar_methods_on_cuda_match_the_float64_svd(shape):
    left, right = low_rank_gradient(shape[0], shape[1], k=16)
    grad = left @ right
    expected_direction, expected_norm = reference_polar(grad)
    factored = polar_lowrank_factors(left.to(CUDA), right.to(CUDA))
    dense = polar_svd(grad.to(CUDA))
    for direction, norm in [
        (factored.left @ factored.right, factored.nuclear_norm),
        (dense.direction, dense.nuclear_norm),
    ]:
        assert direction.device.type == "cuda"
        # float32 working precision; the direction has unit singular values, so 1e-4 absolute.
        torch.testing.assert_close(direction.double().cpu(), expected_direction, atol=1e-4, rtol=0)
        assert float(norm) == pytest.approx(expected_norm, rel=1e-5)


def test_approximate_polar_methods_on_cuda_are_close_to_exact():
    left, right = low_rank_gradient(120, 60, k=16)
    grad = (left @ right).to(CUDA)
    expected_direction, expected_norm = reference_polar(grad)
    newton_schulz = polar_newton_schulz(grad)
    randomized = polar_randomized(grad, rank=16, generator=torch.Generator(CUDA).manual_seed(0))
    for approx in (newton_schulz, randomized):
        assert float(approx.nuclear_norm) == pytest.approx(expected_norm, rel=1e-3)
        error = (approx.direction.double().cpu() - expected_direction).norm()
        assert float(error) < 0.05 * math.sqrt(16)  # relative to ‖U Vᵀ‖_F = sqrt(rank)


def test_cuda_bernoulli_draws_have_the_right_frequencies_and_resume_exactly():
    source = RandomSource(CUDA, seed=3)
    probs = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], device=CUDA).repeat(20_000, 1)
    out = torch.empty_like(probs)
    frequencies = source.bernoulli_(probs, out).mean(0).cpu()
    # four standard deviations of a mean of 20 000 draws: at most 4 · sqrt(0.25 / 20 000)
    torch.testing.assert_close(frequencies, probs[0].cpu(), atol=0.0142, rtol=0)
    state = source.state_dict()
    first = source.bernoulli_(probs, out).clone()
    source.load_state_dict(state)
    assert torch.equal(source.bernoulli_(probs, out), first)


def cuda_data(n: int = 600, n_visible: int = 20, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.bernoulli(torch.full((4, n_visible), 0.5), generator=generator)
    labels = torch.randint(0, 4, (n,), generator=generator)
    flips = torch.bernoulli(torch.full((n, n_visible), 0.05), generator=generator)
    return ((prototypes[labels] + flips) % 2).to(CUDA)


@pytest.mark.parametrize(
    "optimizer",
    [
        OptimizerConfig("sgd", lr=0.05),
        OptimizerConfig("ssd", lr=1e-2, method="lowrank"),
        OptimizerConfig("ssd", lr=1e-2, method="newton-schulz"),
        OptimizerConfig("ssd-preconditioned", lr=1e-2, preconditioner="adam"),
    ],
    ids=["sgd", "ssd-lowrank", "ssd-newton-schulz", "ssd-adam"],
)
def test_cuda_training_learns_and_resumes_bit_for_bit(optimizer):
    data = cuda_data()

    def make() -> Trainer:
        torch.manual_seed(0)
        model = BernoulliRBM(data.shape[1], 8).to(CUDA)
        return Trainer(model, data, optimizer=optimizer, batch_size=50, cd_k=2, seed=1)

    straight = make()
    before = reconstruction_error(straight.model, data)
    straight.train_steps(40)
    assert straight.model.W.device.type == "cuda"
    assert reconstruction_error(straight.model, data) < 0.9 * before
    half = make()
    half.train_steps(20)
    resumed = trainer_from_bytes(trainer_to_bytes(half), data, device=CUDA)
    resumed.train_steps(20)
    for (name, p), (_, q) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("variance", ["identity", "diagonal", "full"])
def test_cuda_gaussian_training_keeps_valid_variances(variance):
    generator = torch.Generator().manual_seed(0)
    data = (torch.randn(400, 6, generator=generator) * 0.5 + 1.0).to(CUDA)
    model = GaussianRBM(6, 4, variance=variance).to(CUDA)
    model.init_from_data(data)
    trainer = Trainer(model, data, optimizer=OptimizerConfig("ssd", lr=1e-3), batch_size=40)
    trainer.train_steps(30)
    for name, p in model.named_parameters():
        assert bool(torch.isfinite(p).all()), name
    # the covariance stays positive definite
    assert float(torch.linalg.eigvalsh(model.precision_matrix().detach()).min()) > 0.0


def test_cuda_log_partition_matches_the_cpu_and_ais_agrees():
    torch.manual_seed(0)
    cpu_model = BernoulliRBM(12, 10)
    with torch.no_grad():
        cpu_model.W.normal_(0, 0.5)
        cpu_model.b.normal_(0, 0.5)
        cpu_model.a.normal_(0, 0.5)
    cuda_model = model_from_bytes(model_to_bytes(cpu_model), device=CUDA)
    exact = exact_log_partition(cpu_model)
    assert exact_log_partition(cuda_model) == pytest.approx(exact, rel=1e-10)
    base = cuda_model.b.detach()  # any base is exact in the limit; the model's own is fine here
    ais = ais_log_partition(cuda_model, n_chains=200, n_betas=2000, seed=0, base_visible_bias=base)
    assert abs(ais.log_z - exact) < max(4 * ais.stderr, 0.05)


def test_a_cuda_model_checkpoint_loads_on_the_cpu_unchanged():
    model = GaussianRBM(5, 3, variance="diagonal").to(CUDA)
    restored = model_from_bytes(model_to_bytes(model), device="cpu")
    for (name, p), (_, q) in zip(
        model.named_parameters(), restored.named_parameters(), strict=True
    ):
        assert q.device.type == "cpu"
        assert torch.equal(p.cpu(), q), name


GRAPH_CASES = {
    "sgd": (OptimizerConfig("sgd", lr=0.05), {}),
    "nesterov-pcd": (OptimizerConfig("nesterov", lr=0.05), {"persistent": True}),
    "ssd-newton-schulz": (OptimizerConfig("ssd", lr=1e-2, method="newton-schulz"), {}),
    "hybrid": (
        OptimizerConfig("sgd", lr=0.05, method="newton-schulz", per_parameter={"W": "ssd"}),
        {},
    ),
    "gaussian-diagonal": (
        OptimizerConfig("ssd", lr=1e-3, method="newton-schulz"),
        {"variance": "diagonal"},
    ),
}


def graph_trainer(name: str, data: torch.Tensor, cuda_graph: bool | None) -> Trainer:
    config, options = GRAPH_CASES[name]
    options = dict(options)
    variance = options.pop("variance", None)
    torch.manual_seed(0)
    if variance is None:
        model = BernoulliRBM(data.shape[1], 8)
    else:
        model = GaussianRBM(data.shape[1], 8, variance=variance)
    model = model.to(CUDA)
    return Trainer(
        model,
        data,
        optimizer=config,
        batch_size=50,
        cd_k=3,
        seed=2,
        cuda_graph=cuda_graph,
        **options,
    )


@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_a_cuda_graph_step_repeats_the_eager_step(name):
    data = cuda_data()
    graphed = graph_trainer(name, data, cuda_graph=True)
    eager = graph_trainer(name, data, cuda_graph=False)
    for trainer in (graphed, eager):
        trainer.train_steps(25)  # crosses epoch boundaries (12 batches per epoch)
    assert graphed.graph_replays > 0 and eager.graph_replays == 0
    # Same kernels and the same random offsets: equal up to the odd reordered float32 sum.
    for (name_, p), (_, q) in zip(
        graphed.model.named_parameters(), eager.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name_)
    # a resume re-captures from the restored state and goes on exactly
    resumed = trainer_from_bytes(trainer_to_bytes(graphed), data, device=CUDA)
    graphed.train_steps(10)
    resumed.train_steps(10)
    assert resumed.graph_replays > 0
    for (name_, p), (_, q) in zip(
        graphed.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name_)


def test_steps_that_sync_with_the_host_run_without_a_graph():
    data = cuda_data()
    model = BernoulliRBM(data.shape[1], 8).to(CUDA)
    exact = OptimizerConfig("ssd", lr=1e-2, method="lowrank")
    lowrank = Trainer(model, data, optimizer=exact, batch_size=50)
    assert lowrank.cuda_graph is False
    lowrank.train_steps(5)
    assert lowrank.graph_replays == 0
    with pytest.raises(ValueError, match="cannot be captured"):
        Trainer(model, data, optimizer=exact, cuda_graph=True)


def test_the_automatic_polar_method_on_cuda_is_newton_schulz_in_a_graph():
    data = cuda_data()
    model = BernoulliRBM(data.shape[1], 8).to(CUDA)
    trainer = Trainer(model, data, optimizer="ssd", batch_size=50)
    assert {group["method"] for group in trainer.optimizer.param_groups} == {"newton-schulz"}
    assert trainer.cuda_graph is True


def test_a_cpu_checkpoint_resumes_on_cuda_and_back(caplog):
    """A job moved between a CPU and a GPU worker: the generators reseed from the saved
    states (different kinds of generator), the parameters, chains and data order carry over."""
    data = cuda_data().cpu()
    torch.manual_seed(0)
    cpu = Trainer(BernoulliRBM(data.shape[1], 8), data, optimizer="sgd", batch_size=50, cd_k=2)
    cpu.train_steps(10)
    with caplog.at_level("WARNING"):
        on_gpu = trainer_from_bytes(trainer_to_bytes(cpu), data.to(CUDA), device=CUDA)
    assert "saved on a CPU device" in caplog.text
    torch.testing.assert_close(on_gpu.model.W.cpu(), cpu.model.W, rtol=0, atol=0)
    on_gpu.train_steps(10)
    back = trainer_from_bytes(trainer_to_bytes(on_gpu), data)
    assert back.step_count == 20
    back.train_steps(5)
    assert bool(torch.isfinite(back.model.W).all())
