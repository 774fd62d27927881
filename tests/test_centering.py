"""Centered RBM training (ssdcore/centering.py) against brute force.

References are float64 and enumerate every hidden state of tiny models: the centered free
energy is written out from the centered energy, its CD objective differentiated by autograd,
and the optimizer step taken in centered coordinates, offsets moved with the bias
reparameterization of Melchior et al. The trainer's float32 path must follow to 2e-5.
"""

from __future__ import annotations

import itertools
import json
import math

import grpc
import numpy as np
import pytest
import torch
from ssdrbm.cli import main as cli_main
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.errors import InvalidArgument
from ssdrbm.spec import training_request
from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore import BernoulliRBM, CDEstimator, GaussianRBM, Trainer
from ssdcore.centering import (
    DEFAULT_SLIDING_FACTOR,
    Centering,
    CenteringConfig,
    centered_gradient,
    scaled_visible,
    to_centered,
)
from ssdcore.checkpoint import load_trainer_state, trainer_from_bytes, trainer_to_bytes
from ssdcore.data import load_mnist, preprocess, synthetic_rbm_data
from ssdcore.evaluation import exact_log_partition
from ssdcore.optim import OptimizerConfig, build_optimizer
from ssdcore.pack import pack_trainers
from ssdrbm_server.tensors import array_to_tensor
from tests.fixtures.jobs import tiny_request

pytestmark = pytest.mark.usefixtures("one_thread")  # small matrices on a shared machine

F64 = torch.float64
# float32 trainer vs float64 reference after a few steps of parameters of size ~1.
TOLERANCE = 2e-5


# --- float64 references --------------------------------------------------------------------


def hidden_states(n_hidden: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product((0.0, 1.0), repeat=n_hidden)), dtype=F64)


def centered_free_energy(v, W, b, a, mu, lam, log_var=None):
    """F_c(v) = -log Σ_h exp(-E_c(v, h)), E_c the centered energy (module docstring);
    ``log_var`` given: the Gaussian RBM with diagonal covariance."""
    h = hidden_states(W.shape[1]) - lam  # (S, H)
    if log_var is None:
        x = v - mu
        neg_energy = (x @ W) @ h.t() + (x @ b)[:, None] + (h @ a)[None, :]
    else:
        precision = torch.exp(-log_var)
        x = v * precision - mu
        quadratic = 0.5 * ((v - b) ** 2 * precision).sum(dim=1)
        neg_energy = (x @ W) @ h.t() - quadratic[:, None] + (h @ a)[None, :]
    return -torch.logsumexp(neg_energy, dim=1)


def autograd(params, offsets, v_data, v_model):
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    W, b, a, *rest = leaves
    mu, lam = offsets
    f_data = centered_free_energy(v_data, W, b, a, mu, lam, *rest)
    f_model = centered_free_energy(v_model, W, b, a, mu, lam, *rest)
    (f_data.mean() - f_model.mean()).backward()
    return [leaf.grad for leaf in leaves]


def polar_step(grad: torch.Tensor) -> torch.Tensor:
    """‖σ(G)‖₁ U Vᵀ over G's nonzero singular values (the S∞ steepest-descent direction)."""
    U, S, Vh = torch.linalg.svd(grad, full_matrices=False)
    keep = S.max() * 1e-10 < S
    return S[keep].sum() * U[:, keep] @ Vh[keep]


def ordinary(params, offsets):
    """(W, b, a, ...) of the ordinary RBM a centered one is: b = b_c - Wλ, a = a_c - Wᵀμ."""
    W, b, a, *rest = params
    mu, lam = offsets
    return [W, b - W @ lam, a - W.t() @ mu, *rest]


def random_bernoulli(n_visible, n_hidden, seed):
    g = torch.Generator().manual_seed(seed)
    model = BernoulliRBM(n_visible, n_hidden, init_std=0.5, generator=g)
    with torch.no_grad():
        model.b.copy_(torch.randn(n_visible, generator=g) * 0.5)
        model.a.copy_(torch.randn(n_hidden, generator=g) * 0.5)
    data = (torch.rand(40, n_visible, generator=g) < 0.3).float()
    return model, data


def random_gaussian(n_visible, n_hidden, seed):
    g = torch.Generator().manual_seed(seed)
    model = GaussianRBM(n_visible, n_hidden, "diagonal", init_std=0.3, generator=g)
    with torch.no_grad():
        model.b.copy_(torch.randn(n_visible, generator=g) * 0.5)
        model.a.copy_(torch.randn(n_hidden, generator=g) * 0.5)
        model.log_var.copy_(torch.randn(n_visible, generator=g) * 0.3)
    data = torch.randn(40, n_visible, generator=g) + 0.7
    return model, data


def model_params(model):
    params = [model.W, model.b, model.a]
    if isinstance(model, GaussianRBM):
        params.append(model.log_var)
    return [p.detach().to(F64).clone() for p in params]


# --- the gradient ----------------------------------------------------------------------------


@pytest.mark.parametrize("gaussian", [False, True])
def test_centered_gradient_is_the_chain_rule_of_the_centered_objective(gaussian):
    """Equation (2) applied to the ordinary gradient equals autograd of the centered CD
    objective at the same point; bias and variance gradients are unchanged (float64)."""
    g = torch.Generator().manual_seed(1)
    V, H = 5, 4
    W = torch.randn(V, H, generator=g, dtype=F64) * 0.5
    b_c, a_c = torch.randn(V, generator=g, dtype=F64), torch.randn(H, generator=g, dtype=F64)
    rest = [torch.randn(V, generator=g, dtype=F64) * 0.3] if gaussian else []
    mu, lam = torch.rand(V, generator=g, dtype=F64), torch.rand(H, generator=g, dtype=F64)
    v_data = torch.randn(6, V, generator=g, dtype=F64)
    v_model = torch.randn(6, V, generator=g, dtype=F64)
    if not gaussian:
        v_data, v_model = (v_data > 0).to(F64), (v_model > 0).to(F64)
    centered = [W, b_c, a_c, *rest]
    zeros = (torch.zeros(V, dtype=F64), torch.zeros(H, dtype=F64))

    grad_c = autograd(centered, (mu, lam), v_data, v_model)
    grad = autograd(ordinary(centered, (mu, lam)), zeros, v_data, v_model)

    torch.testing.assert_close(
        centered_gradient(grad[0], grad[1], grad[2], mu, lam), grad_c[0], rtol=0, atol=1e-12
    )
    for ours, theirs in zip(grad[1:], grad_c[1:], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("gaussian", "optimizer", "dense"),
    [
        (False, "sgd", True),
        (False, "ssd", False),  # the exact step from the centered factors, no dense gradient
        (False, "ssd", True),
        (True, "sgd", True),
    ],
)
def test_step_is_the_centered_step_of_melchior_et_al(gaussian, optimizer, dense):
    """Three steps of Centering.step on CD estimates equal the float64 reference: the optimizer
    step on the autograd gradient of the centered objective in centered coordinates (SSD: the
    polar step of ∇W_c, l∞ steps of the biases), then the offsets slid with the biases
    reparameterized, b_c += W(λ' - λ), a_c += Wᵀ(μ' - μ)."""
    V, H, B = 9, 7, 2  # 2B < min(V, H): the low-rank factors are thinner than W
    model, data = (random_gaussian if gaussian else random_bernoulli)(V, H, seed=2)
    nu = 0.3
    centering = Centering(model, CenteringConfig(sliding_factor=nu), data)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # offsets away from the data means, so every term matters
        centering.visible.copy_(torch.rand(V, generator=g))
        centering.hidden.copy_(torch.rand(H, generator=g))
    estimator = CDEstimator(model, k=1, seed=7, dense_weight_grad=dense)
    stepper = build_optimizer(model, OptimizerConfig(name=optimizer, lr=0.05))
    lrs = {group["name"]: group["lr"] for group in stepper.param_groups}
    offsets = (centering.visible.to(F64).clone(), centering.hidden.to(F64).clone())
    W, _, _, *rest = model_params(model)
    b_c, a_c = to_centered(model, *(o.float() for o in offsets))
    params = [W, b_c.to(F64), a_c.to(F64), *rest]
    names = ["W", "b", "a", "log_var"]

    for step in range(3):
        stats = estimator.estimate(data[step * B : (step + 1) * B])
        v_data, v_model = stats.visible_data.to(F64), stats.visible_model.to(F64)
        grads = autograd(params, offsets, v_data, v_model)
        mu, lam = offsets
        x_data = v_data * torch.exp(-params[3]) if gaussian else v_data
        p_data = torch.sigmoid((x_data - mu) @ params[0] + params[2])
        stepped = []
        for name, param, grad in zip(names, params, grads, strict=False):
            if optimizer == "sgd":
                direction = grad
            elif grad.ndim == 2:
                direction = polar_step(grad)
            else:  # Σ w_n (v_n - μ) rounds exact zeros of Σ w_n v_n to ±1e-17: keep them 0
                direction = grad.abs().sum() * torch.sign(grad) * (grad.abs() > 1e-12)
            stepped.append(param - lrs[name] * direction)
        new_mu = (1 - nu) * mu + nu * x_data.mean(dim=0)
        new_lam = (1 - nu) * lam + nu * p_data.mean(dim=0)
        W_new = stepped[0]
        stepped[1] = stepped[1] + W_new @ (new_lam - lam)
        stepped[2] = stepped[2] + W_new.t() @ (new_mu - mu)
        params, offsets = stepped, (new_mu, new_lam)

        centering.step(stats, stepper)
        for ours, theirs in zip(model_params(model), ordinary(params, offsets), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(centering.visible.to(F64), offsets[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(centering.hidden.to(F64), offsets[1], rtol=0, atol=1e-6)


# --- offsets -------------------------------------------------------------------------------


def test_offset_update_leaves_the_distribution_unchanged():
    """Enumerating every (v, h): log p(v) of a centered BRBM is the same before and after an
    offset change with the reparameterization, and equals the ordinary RBM's (ssdcore's
    free energy and exact log Z) that the trainer keeps."""
    g = torch.Generator().manual_seed(3)
    V, H = 4, 3
    W = torch.randn(V, H, generator=g, dtype=F64)
    b_c, a_c = torch.randn(V, generator=g, dtype=F64), torch.randn(H, generator=g, dtype=F64)
    mu, lam = torch.rand(V, generator=g, dtype=F64), torch.rand(H, generator=g, dtype=F64)
    mu2, lam2 = torch.rand(V, generator=g, dtype=F64), torch.rand(H, generator=g, dtype=F64)
    visibles = hidden_states(V)  # every visible state

    def log_p(b, a, mu, lam):
        free = centered_free_energy(visibles, W, b, a, mu, lam)
        return -free - torch.logsumexp(-free, dim=0)

    before = log_p(b_c, a_c, mu, lam)
    after = log_p(b_c + W @ (lam2 - lam), a_c + W.t() @ (mu2 - mu), mu2, lam2)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)
    assert not torch.allclose(log_p(b_c, a_c, mu2, lam2), before)  # without it: another model

    model = BernoulliRBM(V, H)
    with torch.no_grad():
        for target, value in zip(
            (model.W, model.b, model.a), ordinary([W, b_c, a_c], (mu, lam)), strict=True
        ):
            target.copy_(value)
    log_z = float(exact_log_partition(model))
    served = -model.free_energy(visibles.float()).double() - log_z
    torch.testing.assert_close(served, before, rtol=0, atol=1e-5)


def test_initial_offsets_are_the_data_means():
    model, data = random_gaussian(6, 3, seed=4)
    centering = Centering(model, CenteringConfig(), data)
    with torch.no_grad():
        x = scaled_visible(model, data)
        torch.testing.assert_close(centering.visible, x.mean(dim=0))
        torch.testing.assert_close(centering.hidden, model.hidden_probs(data).mean(dim=0))


# --- the trainer -----------------------------------------------------------------------------


def _trainer(model, data, optimizer, centering=None):
    return Trainer(model, data, optimizer=optimizer, batch_size=4, seed=11, centering=centering)


def _models(gaussian):
    if gaussian:
        return random_gaussian(30, 16, seed=6)
    return random_bernoulli(30, 16, seed=6)


@pytest.mark.parametrize(
    ("gaussian", "optimizer"),
    [
        (False, OptimizerConfig(name="sgd", lr=0.05)),
        (False, OptimizerConfig(name="nesterov", lr=0.05)),
        (False, OptimizerConfig(name="ssd", lr=0.01)),  # factored: 2B = 8 < 16
        (True, OptimizerConfig(name="ssd", lr=0.001)),
    ],
    ids=["sgd", "nesterov", "ssd", "grbm-ssd"],
)
def test_zero_offsets_reproduce_the_uncentered_trainer_bit_for_bit(gaussian, optimizer):
    model, data = _models(gaussian)
    twin, _ = _models(gaussian)
    plain = _trainer(model, data, optimizer)
    centered = _trainer(twin, data, optimizer, CenteringConfig(sliding_factor=0.0))
    centered.centering.visible.zero_()
    centered.centering.hidden.zero_()
    plain.train_steps(20)
    centered.train_steps(20)
    for (name, ours), theirs in zip(twin.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs), name


def test_centering_changes_the_trajectory():
    model, data = _models(False)
    twin, _ = _models(False)
    _trainer(model, data, "sgd").train_steps(5)
    _trainer(twin, data, "sgd", CenteringConfig()).train_steps(5)
    assert not torch.equal(model.W, twin.W)


def test_checkpoint_resumes_exactly_and_records_centering():
    model, data = _models(False)
    config = CenteringConfig(sliding_factor=0.05)
    whole = _trainer(model, data, "ssd", config)
    whole.train_steps(30)

    first, _ = _models(False)
    trainer = _trainer(first, data, "ssd", config)
    trainer.train_steps(15)
    resumed = trainer_from_bytes(trainer_to_bytes(trainer), data)
    assert resumed.centering is not None and resumed.centering.config == config
    resumed.train_steps(15)
    for ours, theirs in zip(resumed.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(resumed.centering.hidden, whole.centering.hidden)
    assert torch.equal(resumed.centering.visible, whole.centering.visible)

    other, _ = _models(False)
    uncentered = _trainer(other, data, "ssd")
    with pytest.raises(ValueError, match="centering"):
        load_trainer_state(uncentered, trainer_to_bytes(trainer))


def test_centered_runs_are_not_packed():
    model, data = _models(False)
    with pytest.raises(ValueError, match="centered run cannot be packed"):
        pack_trainers([_trainer(model, data, "sgd", CenteringConfig())])


@pytest.mark.parametrize("factor", [-0.1, 1.5, float("nan"), True, "0.01"])
def test_sliding_factor_is_checked(factor):
    with pytest.raises(ValueError, match="sliding_factor"):
        CenteringConfig(sliding_factor=factor)


def test_centered_sgd_is_not_worse_than_sgd_on_mnist():
    """784×16 BRBMs on 2000 binarized MNIST digits, 150 SGD steps of 20 at lr 0.1 from the same
    start (b = logit of the pixel means), exact log-likelihood of 1000 held-out digits.
    Measured (CPU): plain -183.53, centered -175.10 nats (seed 1: -186.67, -176.37; lr 0.05,
    300 steps: -180.59, -174.76). The assertion only asks for "not worse" (one seed, short run).
    """
    try:
        images = load_mnist()
    except (FileNotFoundError, OSError) as error:
        pytest.skip(f"MNIST not available: {error}")
    data = preprocess(images[:3000], "binarize")
    train, valid = data[:2000], data[2000:]
    results = {}
    for name, centering in (("plain", None), ("centered", CenteringConfig())):
        model = BernoulliRBM(784, 16, generator=torch.Generator().manual_seed(0))
        model.init_from_data(train)
        trainer = Trainer(
            model,
            train,
            optimizer=OptimizerConfig(name="sgd", lr=0.1),
            batch_size=20,
            seed=0,
            valid_data=valid,
            centering=centering,
        )
        trainer.train_steps(150)
        results[name] = trainer.evaluate("exact")["log_likelihood"]
    assert results["centered"] > results["plain"] - 1.0, results


def test_synthetic_fit_runs_centered():
    data = synthetic_rbm_data(n_visible=20, n_hidden=5, n_samples=400, seed=0)
    model = BernoulliRBM(20, 8, generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model, data, optimizer="ssd", batch_size=20, centering=CenteringConfig())
    before = trainer.evaluate("exact")["log_likelihood"]
    trainer.train_steps(100)
    assert trainer.evaluate("exact")["log_likelihood"] > before


# --- the service, the SDK and the CLI ------------------------------------------------------------


def centered_request(steps: int, **centering: object) -> pb.StartTrainingRequest:
    training = pb.TrainingSpec(
        batch_size=20, steps=steps, seed=1, centering=pb.Centering(**centering)
    )
    return tiny_request(training=training)


def test_service_trains_a_centered_job(service_factory):
    """The resolved spec shows centering with ssdcore's sliding factor, the job trains, and its
    stored checkpoint is a centered trainer's (offsets included) around an ordinary model."""
    stub = service_factory().stub()
    job = stub.StartTraining(centered_request(30), timeout=30).job
    assert job.spec.training.HasField("centering")
    assert job.spec.training.centering.sliding_factor == DEFAULT_SLIDING_FACTOR
    stream = list(stub.StreamMetrics(pb.StreamMetricsRequest(job_id=job.id), timeout=120))
    final = stream[-1].state
    assert final.state == pb.JOB_STATE_SUCCEEDED, final.message
    metrics = [e.metrics for e in stream if e.WhichOneof("event") == "metrics"]
    assert metrics[-1].step == 30
    assert all(math.isfinite(m.reconstruction_error) for m in metrics)
    parts = list(stub.ExportModel(pb.ExportModelRequest(job_id=job.id), timeout=30))
    data = b"".join(part.chunk for part in parts if part.WhichOneof("part") == "chunk")
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    if header["format"] == "ssdrbm.trainer.v1":  # the trainer checkpoint as stored
        settings = json.loads(header["settings"])
        assert settings["centering"] == {"sliding_factor": DEFAULT_SLIDING_FACTOR}
    served = stub.Reconstruct(
        pb.ReconstructRequest(job_id=job.id, input=array_to_tensor(np.ones((2, 16), "float32"))),
        timeout=30,
    )
    assert list(served.output.shape) == [2, 16]


def test_uncentered_jobs_leave_centering_unset(service_factory):
    stub = service_factory(run_worker=False).stub()
    request = tiny_request()
    request.validate_only = True
    job = stub.StartTraining(request, timeout=30).job
    assert not job.spec.training.HasField("centering")


@pytest.mark.parametrize("factor", [-0.5, 1.5, float("inf")])
def test_service_refuses_a_bad_sliding_factor_naming_the_field(service_factory, factor):
    stub = service_factory(run_worker=False).stub()
    with pytest.raises(grpc.RpcError) as caught:
        stub.StartTraining(centered_request(10, sliding_factor=factor), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "training.centering.sliding_factor" in caught.value.details()


def test_sdk_request_carries_centering():
    request = training_request(n_hidden=4, centered=True, centering_sliding_factor=0.05)
    assert request.training.centering.sliding_factor == 0.05
    defaults = training_request(n_hidden=4, centered=True)
    assert defaults.training.HasField("centering")
    assert not defaults.training.centering.HasField("sliding_factor")  # the server's default
    assert not training_request(n_hidden=4).training.HasField("centering")
    with pytest.raises(InvalidArgument, match="centered=True"):
        training_request(n_hidden=4, centering_sliding_factor=0.05)


def test_cli_centered_option(service_factory, capsys):
    target = ["--target", service_factory(run_worker=False).target]
    train = [*target, "train", "--hidden", "4", "--dry-run", "--json"]
    assert cli_main([*train, "--centered"]) == ExitCode.OK
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert spec["training"]["centering"] == {"sliding_factor": DEFAULT_SLIDING_FACTOR}
    assert cli_main([*train, "--centered", "--centering-sliding-factor", "0.1"]) == ExitCode.OK
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert spec["training"]["centering"] == {"sliding_factor": 0.1}
    assert cli_main(train) == ExitCode.OK
    assert "centering" not in json.loads(capsys.readouterr().out)["spec"]["training"]
