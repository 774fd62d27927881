"""Trainer and fit on the paper's synthetic data: every optimizer learns, constraints hold,
bad data and divergence fail loudly, metrics carry the service's field names.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import ssdcore
from ssdcore import BernoulliRBM, DivergenceError, GaussianRBM, OptimizerConfig, Trainer, fit
from ssdcore.data import synthetic_rbm_data
from ssdcore.evaluation import exact_log_partition, log_likelihood, saturated_hidden_fraction

pytestmark = pytest.mark.usefixtures("one_thread")

LIBRARY_DOC = Path(__file__).resolve().parents[1] / "docs" / "LIBRARY.md"
N_VISIBLE, N_HIDDEN = 40, 10
STEPS = 120
# Each optimizer must cut the validation reconstruction error by at least this fraction.
REQUIRED_IMPROVEMENT = 0.10


@pytest.fixture(scope="module")
def synthetic() -> tuple[torch.Tensor, torch.Tensor]:
    data = synthetic_rbm_data(N_VISIBLE, N_HIDDEN, n_samples=1200, seed=0)
    return data[:1000], data[1000:]


def make_trainer(data, config: OptimizerConfig, **kwargs) -> Trainer:
    train, valid = data
    torch.manual_seed(0)
    model = kwargs.pop("model", None) or BernoulliRBM(N_VISIBLE, N_HIDDEN)
    options = {"batch_size": 50, "cd_k": 1, "seed": 0, "valid_data": valid, **kwargs}
    return Trainer(model, train, optimizer=config, **options)


OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", lr=0.1),
    "nesterov": OptimizerConfig("nesterov", lr=0.03),
    "ssd-lowrank": OptimizerConfig("ssd", lr=1e-3, method="lowrank"),
    "ssd-svd": OptimizerConfig("ssd", lr=1e-3, method="svd"),
    "ssd-randomized": OptimizerConfig("ssd", lr=1e-3, method="randomized", rank=8),
    "ssd-newton-schulz": OptimizerConfig("ssd", lr=1e-3, method="newton-schulz"),
    "ssd-rmsprop": OptimizerConfig("ssd-preconditioned", lr=1e-3),
    "ssd-adam": OptimizerConfig("ssd-preconditioned", lr=1e-3, preconditioner="adam"),
    "ssd_w/sgd": OptimizerConfig("sgd", lr=0.1, per_parameter={"W": "ssd"}),
    "sgd_w/ssd": OptimizerConfig("ssd", lr=1e-3, per_parameter={"W": "sgd"}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_lowers_reconstruction_error(synthetic, name):
    trainer = make_trainer(synthetic, OPTIMIZERS[name])
    before = trainer.evaluate()["reconstruction_error"]
    trainer.train_steps(STEPS)
    after = trainer.evaluate()["reconstruction_error"]
    assert after < (1 - REQUIRED_IMPROVEMENT) * before, (before, after)


def test_pcd_and_cd_k_train(synthetic):
    trainer = make_trainer(synthetic, OPTIMIZERS["ssd-lowrank"], cd_k=3, persistent=True)
    before = trainer.evaluate()["reconstruction_error"]
    trainer.train_steps(STEPS)
    assert trainer.evaluate()["reconstruction_error"] < (1 - REQUIRED_IMPROVEMENT) * before


@pytest.mark.parametrize("variance", ["diagonal", "isotropic", "full"])
def test_gaussian_variances_stay_valid_through_training(synthetic, variance):
    model = GaussianRBM(N_VISIBLE, N_HIDDEN, variance=variance)
    model.init_from_data(synthetic[0])
    trainer = make_trainer(synthetic, OptimizerConfig("ssd", lr=1e-3), model=model)
    for _ in range(4):
        trainer.train_steps(15)
        if variance == "full":
            precision = model.precision.detach()
            assert torch.equal(precision, precision.T)
            assert torch.linalg.eigvalsh(precision.double()).min() > 0
        else:
            assert torch.isfinite(model.log_variance()).all()
            assert (model.log_variance().exp() > 0).all()


def test_non_finite_data_is_refused(synthetic):
    train, valid = synthetic
    bad = train.clone()
    bad[7, 3] = math.nan
    with pytest.raises(ValueError, match=r"train_data contains NaN or Inf \(first at row 7\)"):
        Trainer(BernoulliRBM(N_VISIBLE, N_HIDDEN), bad)
    bad_valid = valid.clone()
    bad_valid[0, 0] = math.inf
    with pytest.raises(ValueError, match="valid_data"):
        Trainer(BernoulliRBM(N_VISIBLE, N_HIDDEN), train, valid_data=bad_valid)


def test_bad_shapes_and_settings_are_refused(synthetic):
    train, _ = synthetic
    with pytest.raises(ValueError, match="train_data has shape"):
        Trainer(BernoulliRBM(N_VISIBLE + 1, N_HIDDEN), train)
    with pytest.raises(ValueError, match="batch_size"):
        Trainer(BernoulliRBM(N_VISIBLE, N_HIDDEN), train, batch_size=len(train) + 1)


def test_a_step_that_produces_inf_raises_and_leaves_finite_parameters(synthetic):
    # A step size near float32's maximum overflows W within a few steps.
    trainer = make_trainer(synthetic, OptimizerConfig("sgd", lr=0.1))
    trainer.train_steps(3)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 3e38
    with pytest.raises(DivergenceError, match="NaN or Inf"):
        trainer.train_steps(20)
    assert 3 <= trainer.step_count < 23
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_divergence_restores_the_last_checked_parameters(synthetic):
    trainer = make_trainer(synthetic, OptimizerConfig("sgd", lr=0.1))
    trainer.train_steps(3)
    good = [p.detach().clone() for p in trainer.model.parameters()]
    with torch.no_grad():
        trainer.model.W[0, 0] = math.inf  # poisons the next gradient and step
    with pytest.raises(DivergenceError, match="restored to step 3"):
        trainer.train_steps(1)
    assert trainer.step_count == 3
    for restored, expected in zip(trainer.model.parameters(), good, strict=True):
        assert torch.equal(restored.detach(), expected)


def test_evaluate_reports_the_metrics_fields(synthetic):
    trainer = make_trainer(synthetic, OPTIMIZERS["ssd-lowrank"])
    trainer.train_steps(10)
    metrics = trainer.evaluate("exact")
    expected_keys = {
        "step",
        "reconstruction_error",
        "train_reconstruction_error",
        "free_energy_gap",
        "pseudo_log_likelihood",
        "log_likelihood",
        "log_likelihood_stderr",
        "log_likelihood_method",
        "spectral_norm",
        "saturated_hidden_fraction",
        "wall_time_s",
        "samples_per_second",
        "lr",
    }
    assert set(metrics) == expected_keys
    assert metrics["saturated_hidden_fraction"] == saturated_hidden_fraction(
        trainer.model, synthetic[1]
    )
    assert metrics["step"] == 10 and metrics["log_likelihood_method"] == "exact"
    direct = log_likelihood(trainer.model, synthetic[1], exact_log_partition(trainer.model))
    assert metrics["log_likelihood"] == pytest.approx(direct, rel=1e-6)
    assert metrics["spectral_norm"] == pytest.approx(
        float(torch.linalg.matrix_norm(trainer.model.W.detach(), 2)), rel=1e-5
    )
    assert metrics["samples_per_second"] > 0
    ais = trainer.evaluate("ais", ais_chains=64, ais_betas=300)
    assert ais["log_likelihood_method"] == "ais"
    # AIS agrees with the exact value within a generous multiple of its own error.
    assert abs(ais["log_likelihood"] - direct) < 5 * ais["log_likelihood_stderr"] + 0.05
    # ... and reverse AIS's conservative bound sits at or below it (within its own error)
    lower, lower_se = ais["log_likelihood_lower"], ais["log_likelihood_lower_stderr"]
    assert lower - 5 * lower_se - 0.05 <= direct and lower_se >= 0
    assert abs(lower - direct) < 2.0  # a small model: the bounds are tight
    assert "log_likelihood_lower" not in metrics  # exact: no bounds, the value
    with pytest.raises(ValueError, match="log_likelihood"):
        trainer.evaluate("guess")


def test_fit_returns_history_and_honours_the_callback(synthetic):
    train, valid = synthetic
    model = BernoulliRBM(N_VISIBLE, N_HIDDEN)
    history = fit(
        model,
        train,
        steps=40,
        batch_size=50,
        optimizer="ssd",
        lr=1e-3,
        seed=0,
        eval_every=10,
        valid_data=valid,
    )
    assert [m["step"] for m in history] == [0, 10, 20, 30, 40]
    assert all(m["total_steps"] == 40 for m in history)
    assert history[-1]["reconstruction_error"] < history[0]["reconstruction_error"]
    seen = []
    stopped = fit(
        BernoulliRBM(N_VISIBLE, N_HIDDEN),
        train,
        steps=40,
        batch_size=50,
        optimizer="sgd",
        lr=0.1,
        seed=0,
        eval_every=10,
        callback=lambda m: seen.append(m["step"]) or m["step"] < 20,
    )
    assert [m["step"] for m in stopped] == [0, 10, 20] and seen == [0, 10, 20]


def test_same_seed_same_run(synthetic):
    first = make_trainer(synthetic, OPTIMIZERS["ssd-lowrank"])
    second = make_trainer(synthetic, OPTIMIZERS["ssd-lowrank"])
    first.train_steps(25)  # crosses an epoch boundary (1000 rows / 50)
    second.train_steps(25)
    for p, q in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_thin_factors_skip_the_dense_gradient_and_match_the_svd_step(synthetic):
    """With 2B < min(V, H) the estimator gives only factors; the exact step is unchanged."""
    train, _ = synthetic
    runs = {}
    for method in ("lowrank", "svd"):
        torch.manual_seed(0)
        model = BernoulliRBM(N_VISIBLE, 30)
        config = OptimizerConfig("ssd", lr=1e-3, method=method)
        runs[method] = Trainer(model, train, optimizer=config, batch_size=5, seed=0)
        runs[method].train_steps(10)
    assert runs["lowrank"].estimator.dense_weight_grad is False
    assert runs["svd"].estimator.dense_weight_grad is True
    for p, q in zip(
        runs["lowrank"].model.parameters(), runs["svd"].model.parameters(), strict=True
    ):
        assert torch.allclose(p, q, atol=1e-5)


def test_the_library_guides_example_runs():
    """The ```python block under "## Library API" in docs/LIBRARY.md runs as written."""
    text = LIBRARY_DOC.read_text()
    section = text.split("## Library API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    namespace: dict = {}
    exec(compile(code, str(LIBRARY_DOC), "exec"), namespace)
    assert isinstance(namespace["history"], list) and namespace["history"]
    assert isinstance(namespace["model"], ssdcore.RBM)


def test_demo_prints_a_summary_table(capsys):
    from ssdcore import demo

    assert demo.main(["--steps", "20", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "recon before" in out and "test LL" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("SSD", "SGD"))]
    assert len(rows) == 2 and all(" 20 " in row for row in rows)


@pytest.mark.parametrize("method", ["svd", "lowrank", "randomized", "newton-schulz"])
def test_a_spectral_step_on_a_poisoned_gradient_is_divergence(synthetic, method):
    # The factorization inside the spectral step can fail on a non-finite gradient before the
    # parameters show it; the trainer reports that as divergence too, and restores the model.
    trainer = make_trainer(synthetic, OptimizerConfig("ssd", lr=0.01, method=method))
    trainer.train_steps(2)
    good = [p.detach().clone() for p in trainer.model.parameters()]
    with torch.no_grad():
        trainer.model.W[0, 0] = math.inf
    with pytest.raises(DivergenceError, match="restored to step 2"):
        trainer.train_steps(1)
    assert trainer.step_count == 2
    for restored, expected in zip(trainer.model.parameters(), good, strict=True):
        assert torch.equal(restored.detach(), expected)


def test_cuda_graph_is_refused_where_the_step_cannot_be_captured(synthetic):
    train, _ = synthetic
    model = BernoulliRBM(N_VISIBLE, N_HIDDEN)
    assert Trainer(model, train, optimizer="sgd").cuda_graph is False  # CPU: eager steps
    with pytest.raises(ValueError, match=r"cuda_graph=True .* not a CUDA device"):
        Trainer(model, train, optimizer="sgd", cuda_graph=True)
