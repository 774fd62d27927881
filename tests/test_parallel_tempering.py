"""Parallel tempering (ssdcore.tempering): exactness against enumeration, the swap rule's
detailed balance, mixing on a bimodal model, K = 1 equal to PCD bit for bit, exact resume."""

from __future__ import annotations

import itertools
import json
import math

import grpc
import pytest
import torch
from ssdrbm.cli import main as cli_main
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.progress import ProgressState, render_log_line
from ssdrbm.cli.tables import job_details
from ssdrbm.events import Job, Metrics, MetricsEvent
from ssdrbm.spec import training_request
from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore import BernoulliRBM, GaussianRBM, Trainer
from ssdcore.checkpoint import trainer_from_bytes, trainer_to_bytes
from ssdcore.data import synthetic_rbm_data
from ssdcore.gradients import CDEstimator
from ssdcore.pack import pack_trainers
from ssdcore.sampling import RandomSource
from ssdcore.tempering import (
    DEFAULT_MIN_BETA,
    DEFAULT_N_TEMPERATURES,
    MAX_TEMPERATURES,
    ParallelTempering,
    TemperingConfig,
    swap_log_acceptance,
    tempered_log_marginal,
    visible_energy,
)
from ssdrbm_server.worker.runner import run_memory_mb
from tests.fixtures.jobs import tiny_request

pytestmark = pytest.mark.usefixtures("one_thread")


def binary_states(n: int) -> torch.Tensor:
    """All 2^n binary vectors (2^n, n), float32."""
    return torch.tensor(list(itertools.product([0.0, 1.0], repeat=n)))


def random_brbm(n_visible: int, n_hidden: int, scale: float, seed: int) -> BernoulliRBM:
    generator = torch.Generator().manual_seed(seed)
    model = BernoulliRBM(n_visible, n_hidden)
    with torch.no_grad():
        model.W.copy_(scale * torch.randn(n_visible, n_hidden, generator=generator))
        model.b.copy_(torch.randn(n_visible, generator=generator))
        model.a.copy_(torch.randn(n_hidden, generator=generator))
    return model


def brute_force_log_marginal(model: BernoulliRBM, v: torch.Tensor, beta: float) -> torch.Tensor:
    """log Σ_h exp(-β E(v, h)) by enumerating h, in float64: independent of the module's formula."""
    h = binary_states(model.n_hidden).double()  # (2^H, H)
    W, b, a = (p.detach().double() for p in (model.W, model.b, model.a))
    v = v.double()
    neg_energy = (v @ W @ h.t()) + (v @ b).unsqueeze(1) + (h @ a).unsqueeze(0)  # (B, 2^H)
    return torch.logsumexp(beta * neg_energy, dim=1)


def exact_distribution(model: BernoulliRBM, beta: float) -> torch.Tensor:
    """p_β(v) over binary_states(V), by enumeration (float64)."""
    log_p = brute_force_log_marginal(model, binary_states(model.n_visible), beta)
    return torch.softmax(log_p, dim=0)


def state_index(v: torch.Tensor) -> torch.Tensor:
    """Row index of each binary row of v in binary_states (first unit most significant)."""
    n = v.shape[1]
    weights = 2 ** torch.arange(n - 1, -1, -1)
    return (v.round().long() * weights).sum(dim=1)


def sample_histograms(
    model: BernoulliRBM, config: TemperingConfig, n_chains: int, burn_in: int, steps: int
) -> torch.Tensor:
    """Empirical p(v) per temperature (K, 2^V) from `steps` PT steps after `burn_in`."""
    source = RandomSource("cpu", seed=1234)
    sampler = ParallelTempering(config, model, source)
    kernel = model.gibbs_kernel()
    start = torch.rand(n_chains, model.n_hidden, generator=torch.Generator().manual_seed(5)) < 0.5
    visible = torch.empty(n_chains, model.n_visible)
    probs = torch.empty(n_chains, model.n_hidden)
    counts = torch.zeros(sampler.n_temperatures, 2**model.n_visible, dtype=torch.float64)
    for step in range(burn_in + steps):
        sampler.run(kernel, 1, start.float(), visible, probs)
        if step >= burn_in:
            for t, states in enumerate(sampler.visible_states()):
                counts[t] += torch.bincount(state_index(states), minlength=counts.shape[1])
    return counts / counts.sum(dim=1, keepdim=True)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


# --- the ladder -------------------------------------------------------------------------------


def test_ladders_geometric_linear_and_explicit():
    geometric = TemperingConfig(n_temperatures=4, min_beta=0.125).ladder()
    assert geometric == pytest.approx([1.0, 0.5, 0.25, 0.125])
    linear = TemperingConfig(n_temperatures=5, min_beta=0.2, spacing="linear").ladder()
    assert linear == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    explicit = TemperingConfig(betas=(1.0, 0.7, 0.3))
    assert explicit.ladder() == [1.0, 0.7, 0.3]
    assert (explicit.n_temperatures, explicit.min_beta) == (3, 0.3)
    assert TemperingConfig(n_temperatures=1).ladder() == [1.0]
    for config in (explicit, TemperingConfig(3, 0.4, "linear")):
        assert TemperingConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_temperatures": 0}, "n_temperatures"),
        ({"n_temperatures": MAX_TEMPERATURES + 1}, "n_temperatures"),
        ({"min_beta": 1.0}, "min_beta"),
        ({"min_beta": 0.0}, "min_beta"),
        ({"spacing": "cubic"}, "spacing"),
        ({"betas": (0.9, 0.5)}, "start at 1"),
        ({"betas": (1.0, 0.5, 0.6)}, "strictly decreasing"),
        ({"betas": (1.0, -0.5)}, "> 0"),
    ],
)
def test_bad_ladders_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TemperingConfig(**kwargs)


def test_tempering_needs_persistent_chains():
    model = BernoulliRBM(6, 4)
    with pytest.raises(ValueError, match="persistent=True"):
        CDEstimator(model, persistent=False, tempering=TemperingConfig(3, 0.5))
    data = synthetic_rbm_data(n_visible=6, n_hidden=4, n_samples=50, seed=0)
    with pytest.raises(ValueError, match="persistent=True"):
        Trainer(model, data, optimizer="sgd", batch_size=10, tempering=TemperingConfig(3, 0.5))


# --- exactness --------------------------------------------------------------------------------


def test_tempered_marginal_matches_enumeration():
    """log p̃_β(v) = -β q(v) + Σ softplus(β x) equals log Σ_h exp(-β E(v, h)) (to 1e-4)."""
    model = random_brbm(6, 4, scale=1.5, seed=0)
    v = binary_states(6)
    for beta in (1.0, 0.6, 0.2):
        ours = tempered_log_marginal(model, v, beta).double()
        assert torch.allclose(ours, brute_force_log_marginal(model, v, beta), atol=1e-4)
    assert torch.allclose(tempered_log_marginal(model, v, 1.0), -model.free_energy(v), atol=1e-5)


def test_gaussian_tempered_marginal_matches_enumeration():
    """For the GRBM, q(v) = ½(v-b)ᵀC⁻¹(v-b); the marginal over h matches enumeration."""
    torch.manual_seed(0)
    model = GaussianRBM(3, 4, variance="diagonal")
    with torch.no_grad():
        model.W.normal_()
        model.b.normal_()
        model.a.normal_()
        model.log_var.copy_(torch.tensor([-0.5, 0.0, 0.7]))
    v = torch.randn(20, 3)
    h = binary_states(4)
    precision = torch.exp(-model.log_var.detach())
    for beta in (1.0, 0.4):
        # -E(v, h) = vᵀC⁻¹Wh - ½(v-b)ᵀC⁻¹(v-b) + aᵀh
        quad = 0.5 * ((v - model.b.detach()) ** 2 * precision).sum(dim=1, keepdim=True)
        coupling = (v * precision) @ model.W.detach() @ h.t() + h @ model.a.detach()
        brute = torch.logsumexp(beta * (coupling - quad), dim=1)
        ours = tempered_log_marginal(model, v, beta)
        assert torch.allclose(ours, brute, atol=1e-4)
    assert torch.allclose(visible_energy(model, v), quad.squeeze(1), atol=1e-5)


def test_swap_acceptance_satisfies_detailed_balance_by_brute_force():
    """On every pair (v_i, v_j) of a 6-visible model: π(x, y) A(x, y) = π(y, x) A(y, x), with
    π = p_βi ⊗ p_βj from enumeration; the swap kernel then leaves π unchanged. The textbook
    rule with free energies in place of energies does not (checked, to show the test can fail)."""
    model = random_brbm(6, 4, scale=1.5, seed=1)
    beta_i, beta_j = 1.0, 0.45
    v = binary_states(6)
    n = v.shape[0]
    p_i, p_j = exact_distribution(model, beta_i), exact_distribution(model, beta_j)
    pi = p_i.unsqueeze(1) * p_j.unsqueeze(0)  # π[x, y]: v_i = x at β_i, v_j = y at β_j
    rows_x = v.repeat_interleave(n, dim=0)
    rows_y = v.repeat(n, 1)
    x_x, x_y = model.hidden_input(rows_x).detach(), model.hidden_input(rows_y).detach()
    q_x, q_y = visible_energy(model, rows_x), visible_energy(model, rows_y)
    log_ratio = swap_log_acceptance(beta_i, beta_j, q_x, q_y, x_x, x_y).double()
    accept = torch.exp(log_ratio.clamp(max=0.0)).view(n, n)  # A[x, y]
    flow = pi * accept
    assert torch.allclose(flow, flow.t(), rtol=1e-4, atol=1e-12)
    after = pi * (1 - accept) + (pi * accept).t()  # stay, or arrive by a swap of (y, x)
    assert torch.allclose(after, pi, rtol=1e-4, atol=1e-12)

    free_x, free_y = model.free_energy(rows_x).double(), model.free_energy(rows_y).double()
    naive = torch.exp(((beta_i - beta_j) * (free_x - free_y)).clamp(max=0.0)).view(n, n)
    naive_flow = pi * naive
    assert float((naive_flow - naive_flow.t()).abs().max().detach()) > 1e-3


def test_pt_chains_sample_the_exact_tempered_distributions():
    """6×4 BRBM, ladder 1 … 0.3 (4 temperatures), 2000 chains × 40 steps after 40 of burn-in.

    Total variation to the enumerated p_β: below 0.03 at β = 1 and at every tempered β (the
    sampling noise alone is about 0.01 for 80k correlated draws over 64 states), while p_1 and
    p_0.3 are over 0.2 apart, so a chain polluted by its hotter neighbours would fail.
    """
    model = random_brbm(6, 4, scale=1.5, seed=2)
    config = TemperingConfig(n_temperatures=4, min_beta=0.3)
    empirical = sample_histograms(model, config, n_chains=2000, burn_in=40, steps=40)
    for t, beta in enumerate(config.ladder()):
        tv = total_variation(empirical[t], exact_distribution(model, beta))
        assert tv < 0.03, f"β = {beta:.3f}: TV {tv:.4f}"
    assert total_variation(exact_distribution(model, 1.0), exact_distribution(model, 0.3)) > 0.2


GAUSSIAN_PRECISIONS = {
    "identity": torch.eye(2),
    "diagonal": torch.diag(torch.tensor([2.5, 0.6])),
    "full": torch.tensor([[2.0, 0.6], [0.6, 1.0]]),
}


@pytest.mark.parametrize("variance", list(GAUSSIAN_PRECISIONS))
def test_tempered_gaussian_chain_matches_exact_moments(variance):
    """GRBM at β: v | h ~ N(m, C/β) with m = b + Wh, and p_β(h) ∝ exp(β(aᵀh + ½ mᵀC⁻¹m))
    (complete the square in E = -vᵀC⁻¹Wh + ½(v-b)ᵀC⁻¹(v-b) - aᵀh).

    The sampled mean and covariance of v at β = 1, 0.7 and 0.4 match the exact mixture moments
    within 0.05 (sampling noise ≈ 0.01 at 40k correlated draws), for the identity, a diagonal
    and a full covariance (each its own noise path and visible energy).
    """
    torch.manual_seed(3)
    precision = GAUSSIAN_PRECISIONS[variance]
    model = GaussianRBM(2, 3, variance=variance)
    with torch.no_grad():
        model.W.copy_(torch.tensor([[1.0, -0.5, 0.8], [0.3, 1.2, -0.7]]))
        model.b.copy_(torch.tensor([0.2, -0.4]))
        model.a.copy_(torch.tensor([-0.5, 0.1, -0.3]))
        if variance == "diagonal":
            model.log_var.copy_(-torch.log(torch.diagonal(precision)))
        elif variance == "full":
            model.precision.copy_(precision)
    config = TemperingConfig(betas=(1.0, 0.7, 0.4))
    sampler = ParallelTempering(config, model, RandomSource("cpu", seed=9))
    kernel = model.gibbs_kernel()
    n_chains = 2000
    start = torch.zeros(n_chains, 3)
    visible, probs = torch.empty(n_chains, 2), torch.empty(n_chains, 3)
    draws: list[list[torch.Tensor]] = [[], [], []]
    for step in range(60):
        sampler.run(kernel, 1, start, visible, probs)
        if step >= 40:
            for t, states in enumerate(sampler.visible_states()):
                draws[t].append(states.clone())
    h = binary_states(3)
    means = model.b.detach() + h @ model.W.detach().t()  # (8, 2)
    covariance = torch.linalg.inv(precision)
    for t, beta in enumerate(config.ladder()):
        quadratic = 0.5 * ((means @ precision) * means).sum(1)
        weights = torch.softmax(beta * (h @ model.a.detach() + quadratic), dim=0)
        mean = weights @ means
        second = covariance / beta + (
            weights[:, None, None] * means[:, :, None] * means[:, None, :]
        ).sum(0)
        cov = second - torch.outer(mean, mean)
        samples = torch.cat(draws[t])
        assert torch.allclose(samples.mean(0), mean, atol=0.05), (beta, samples.mean(0), mean)
        assert torch.allclose(samples.T.cov(), cov, atol=0.05), (beta, samples.T.cov(), cov)


# --- mixing -----------------------------------------------------------------------------------


def bimodal_model(n_visible: int = 12, n_hidden: int = 4, strength: float = 2.0) -> BernoulliRBM:
    """E(v, h) = -w Σv Σh + (wH/2) Σv + (wV/2) Σh: two equal modes, all on and all off
    (E = 0 at both), separated by a barrier of order w·V·H/4."""
    model = BernoulliRBM(n_visible, n_hidden)
    with torch.no_grad():
        model.W.fill_(strength)
        model.b.fill_(-strength * n_hidden / 2)
        model.a.fill_(-strength * n_visible / 2)
    return model


def mode_switches(model: BernoulliRBM, config: TemperingConfig, steps: int) -> int:
    """Times the β = 1 chains change mode (mean of v crossing ½ from one side to the other)."""
    n_chains = 200
    sampler = ParallelTempering(config, model, RandomSource("cpu", seed=77))
    kernel = model.gibbs_kernel()
    start = torch.zeros(n_chains, model.n_hidden)  # every chain starts in the "off" mode
    visible, probs = torch.empty(n_chains, model.n_visible), torch.empty(n_chains, model.n_hidden)
    mode = torch.zeros(n_chains, dtype=torch.long)
    switches = 0
    for _ in range(steps):
        sampler.run(kernel, 1, start, visible, probs)
        mean = visible.mean(dim=1)
        now = torch.where(mean > 0.5, 1, torch.where(mean < 0.5, 0, mode))
        switches += int((now != mode).sum())
        mode = now
    return switches


def test_pt_mixes_between_modes_where_pcd_does_not():
    """200 chains × 200 steps on the bimodal model: plain PCD's chains (K = 1) stay in their
    mode (at most 5 switches in all; 0 seen), PT's β = 1 chains (8 temperatures down to 0.05)
    switch thousands of times (about 5700 seen; asserted: at least 1000)."""
    model = bimodal_model()
    plain = mode_switches(model, TemperingConfig(n_temperatures=1), steps=200)
    tempered = mode_switches(model, TemperingConfig(n_temperatures=8, min_beta=0.05), steps=200)
    assert plain <= 5, plain
    assert tempered >= 1000, tempered


# --- the trainer --------------------------------------------------------------------------------


def make_trainer(tempering: TemperingConfig | None, data: torch.Tensor) -> Trainer:
    torch.manual_seed(0)
    model = BernoulliRBM(data.shape[1], 8)
    return Trainer(
        model, data, optimizer="sgd", batch_size=20, persistent=True, cd_k=2, tempering=tempering
    )


def test_one_temperature_is_pcd_bit_for_bit():
    data = synthetic_rbm_data(n_visible=16, n_hidden=6, n_samples=200, seed=4)
    plain = make_trainer(None, data)
    single = make_trainer(TemperingConfig(n_temperatures=1), data)
    plain.train_steps(25)
    single.train_steps(25)
    for (name, p), q in zip(plain.model.named_parameters(), single.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(plain.estimator.chains, single.estimator.chains)
    assert "pt_swap_rate_min" not in single.evaluate()


def test_swap_rates_are_reported_and_in_range():
    data = synthetic_rbm_data(n_visible=16, n_hidden=6, n_samples=200, seed=4)
    trainer = make_trainer(TemperingConfig(n_temperatures=5, min_beta=0.2), data)
    trainer.train_steps(30)
    metrics = trainer.evaluate()
    rates = metrics["pt_swap_rates"]
    assert len(rates) == 4
    assert all(0.0 <= r <= 1.0 for r in rates)
    assert all(r > 0 for r in rates)  # every pair was tried (15 times each) and some swapped
    assert metrics["pt_swap_rate_min"] == min(rates)
    assert metrics["pt_swap_rate_mean"] == pytest.approx(sum(rates) / 4)
    attempts = trainer.estimator.tempering.swap_attempts.tolist()
    assert attempts == [15, 15, 15, 15]


def test_swap_rate_is_the_mean_acceptance():
    """A pair's rate after n ≤ window attempts is accepted swaps / proposed swaps; with a
    ladder of two equal-but-for-rounding temperatures every proposal is accepted."""
    model = random_brbm(6, 4, scale=1.0, seed=6)
    sampler = ParallelTempering(
        TemperingConfig(betas=(1.0, 1.0 - 1e-7)), model, RandomSource("cpu", 1)
    )
    visible, probs = torch.empty(50, 6), torch.empty(50, 4)
    for _ in range(6):
        sampler.run(model.gibbs_kernel(), 1, torch.zeros(50, 4), visible, probs)
    assert sampler.swap_attempts.tolist() == [3]  # even steps only: pair 0 is the one even pair
    assert sampler.swap_rate_list() == pytest.approx([1.0])


def test_checkpoint_resume_is_exact():
    data = synthetic_rbm_data(n_visible=16, n_hidden=6, n_samples=200, seed=4)
    config = TemperingConfig(n_temperatures=4, min_beta=0.3, spacing="linear")
    straight = make_trainer(config, data)
    straight.train_steps(15)
    saved = trainer_to_bytes(straight)
    straight.train_steps(15)
    resumed = trainer_from_bytes(saved, data)
    assert resumed.tempering == config
    resumed.train_steps(15)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    a, b = straight.estimator.tempering, resumed.estimator.tempering
    assert torch.equal(a.chains, b.chains)
    assert torch.equal(a.swap_rates, b.swap_rates)
    assert torch.equal(a.parity, b.parity)
    assert straight.evaluate()["pt_swap_rates"] == resumed.evaluate()["pt_swap_rates"]


def test_resume_with_another_ladder_is_refused():
    data = synthetic_rbm_data(n_visible=16, n_hidden=6, n_samples=200, seed=4)
    trainer = make_trainer(TemperingConfig(n_temperatures=4, min_beta=0.3), data)
    trainer.train_steps(2)
    other = make_trainer(TemperingConfig(n_temperatures=3, min_beta=0.3), data)
    with pytest.raises(ValueError, match="temperatures"):
        other.estimator.load_state_dict(trainer.estimator.state_dict())
    plain = make_trainer(None, data)
    with pytest.raises(ValueError, match="tempering on"):
        plain.estimator.load_state_dict(trainer.estimator.state_dict())


def test_tempered_runs_are_not_packed():
    data = synthetic_rbm_data(n_visible=16, n_hidden=6, n_samples=200, seed=4)
    with pytest.raises(ValueError, match="parallel-tempering run cannot be packed"):
        pack_trainers([make_trainer(TemperingConfig(n_temperatures=3, min_beta=0.5), data)])


def test_gaussian_rbm_trains_with_tempering():
    torch.manual_seed(0)
    data = torch.randn(200, 5)
    model = GaussianRBM(5, 4, variance="diagonal")
    model.init_from_data(data)
    trainer = Trainer(
        model,
        data,
        optimizer="sgd",
        batch_size=20,
        persistent=True,
        tempering=TemperingConfig(n_temperatures=3, min_beta=0.5),
    )
    trainer.train_steps(20)
    metrics = trainer.evaluate()
    assert all(math.isfinite(p.sum().item()) for p in model.parameters())
    assert 0.0 <= metrics["pt_swap_rate_min"] <= 1.0


# --- the service --------------------------------------------------------------------------------


def tempered_request(steps: int, **tempering: object) -> pb.StartTrainingRequest:
    training = pb.TrainingSpec(
        batch_size=20,
        steps=steps,
        seed=1,
        persistent=True,
        parallel_tempering=pb.ParallelTempering(**tempering),
    )
    return tiny_request(training=training)


def test_service_trains_a_tempered_job_and_streams_swap_rates(service_factory):
    stub = service_factory().stub()
    job = stub.StartTraining(tempered_request(30, temperatures=4), timeout=30).job
    tempering = job.spec.training.parallel_tempering
    assert (tempering.temperatures, tempering.min_beta) == (4, DEFAULT_MIN_BETA)
    stream = list(stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=120))
    final = stream[-1].state
    assert final.state == pb.JOB_STATE_SUCCEEDED, final.message
    metrics = [e.metrics for e in stream if e.WhichOneof("event") == "metrics"]
    trained = [m for m in metrics if m.step > 0]
    assert trained and trained[-1].step == 30
    for m in trained:
        assert len(m.pt_swap_rates) == 3
        assert all(0.0 <= rate <= 1.0 for rate in m.pt_swap_rates)
        assert m.HasField("pt_swap_rate_min") and m.HasField("pt_swap_rate_mean")
        assert m.pt_swap_rate_min == pytest.approx(min(m.pt_swap_rates))
    assert trained[-1].pt_swap_rate_mean > 0  # 15 attempts per pair: some swaps happened
    # The CLI shows them: `ssdrbm get` lists the rates, the watch log line the weakest pair.
    record = Job.from_proto(stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=10))
    assert "swap rates" in job_details(record)
    event = MetricsEvent(job.id, "", None, Metrics.from_proto(trained[-1]))
    assert "swap_min=" in render_log_line(ProgressState(job.id), event)


BAD_TEMPERING = [
    ({"persistent": False}, "training.parallel_tempering"),
    ({"temperatures": 1}, "training.parallel_tempering.temperatures"),
    ({"temperatures": MAX_TEMPERATURES + 1}, "training.parallel_tempering.temperatures"),
    ({"min_beta": 1.0}, "training.parallel_tempering.min_beta"),
    ({"min_beta": -0.5}, "training.parallel_tempering.min_beta"),
]


def test_service_refuses_bad_tempering_naming_the_field(service_factory):
    stub = service_factory(run_worker=False).stub()
    for change, field in BAD_TEMPERING:
        request = tempered_request(10, temperatures=4)
        if "persistent" in change:
            request.training.persistent = change["persistent"]
        else:
            for name, value in change.items():
                setattr(request.training.parallel_tempering, name, value)
        with pytest.raises(grpc.RpcError) as caught:
            stub.StartTraining(request, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, change
        assert field in caught.value.details(), (change, caught.value.details())


def test_memory_estimate_counts_every_temperature():
    plain = tiny_request(training=pb.TrainingSpec(batch_size=100, persistent=True))
    tempered = tempered_request(10, temperatures=8)
    tempered.training.batch_size = 100
    extra = run_memory_mb(tempered, 784) - run_memory_mb(plain, 784)
    # 8 temperatures × 100 chains × (2·784 + 4·8) floats
    assert extra == pytest.approx(4 * 8 * 100 * (2 * 784 + 4 * 8) / 1e6)


# --- the SDK and the CLI ------------------------------------------------------------------------


def test_sdk_request_and_metrics_carry_tempering():
    request = training_request(n_hidden=4, persistent=True, tempering=6, tempering_min_beta=0.25)
    assert request.training.parallel_tempering.temperatures == 6
    assert request.training.parallel_tempering.min_beta == 0.25
    defaults = training_request(n_hidden=4, persistent=True, tempering=0)
    assert defaults.training.HasField("parallel_tempering")  # on, counts left to the server
    assert not training_request(n_hidden=4).training.HasField("parallel_tempering")
    message = pb.Metrics(step=5, pt_swap_rate_min=0.2, pt_swap_rate_mean=0.3)
    message.pt_swap_rates.extend([0.2, 0.4])
    metrics = Metrics.from_proto(message)
    assert (metrics.pt_swap_rate_min, metrics.pt_swap_rate_mean) == (0.2, 0.3)
    assert metrics.pt_swap_rates == (0.2, 0.4)
    assert Metrics.from_proto(pb.Metrics(step=1)).pt_swap_rate_min is None


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_tempering_option(service_factory, capsys):
    target = ["--target", service_factory(run_worker=False).target]
    train = [*target, "train", "--hidden", "4", "--persistent", "--dry-run", "--json"]
    code, out, _ = run_cli(capsys, *train, "--tempering", "6,0.25")
    assert code == ExitCode.OK
    tempering = json.loads(out)["spec"]["training"]["parallel_tempering"]
    assert tempering == {"temperatures": 6, "min_beta": 0.25}
    code, out, _ = run_cli(capsys, *train, "--tempering", "0")
    tempering = json.loads(out)["spec"]["training"]["parallel_tempering"]
    assert tempering == {"temperatures": DEFAULT_N_TEMPERATURES, "min_beta": DEFAULT_MIN_BETA}
    code, _, err = run_cli(capsys, *train, "--tempering", "6,hot")
    assert code == ExitCode.USAGE and "--tempering expects K[,BETA_MIN]" in err
    code, _, err = run_cli(
        capsys, *target, "train", "--hidden", "4", "--dry-run", "--tempering", "4"
    )
    assert code == ExitCode.USAGE and "training.parallel_tempering" in err and "persistent" in err
