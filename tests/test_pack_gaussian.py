"""Packs of Gaussian RBMs (identity, isotropic and diagonal variance), each run as its solo run.

The solo references are ordinary :class:`~ssdcore.Trainer` runs of the same model, seed and
configuration. On the CPU every comparison is exact (``torch.equal`` on every parameter, the
variance parameter included, tolerance 0): the packed Gibbs sweeps, gradients, optimizer
steps and variance clamping compute each run's slice as the solo code computes its tensors.
The sizes keep the CD factors (rank 2B) at least as wide as W's short side, except in the test
of the factor route, which uses Newton–Schulz (the one factored step the pack takes as solo).
"""

from __future__ import annotations

import pytest
import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore import BernoulliRBM, GaussianRBM, OptimizerConfig, Trainer
from ssdcore.checkpoint import trainer_from_bytes, trainer_to_bytes
from ssdcore.pack import PackRun, TrainingPack, insert_bytes, pack_key, run_to_bytes
from ssdrbm_server.packing import NOT_PACKABLE
from ssdrbm_server.worker.child import packed_summary
from ssdrbm_server.worker.runner import run_memory_mb
from tests.fixtures.pack_threads import one_thread_where_loaded  # noqa: F401 (autouse)
from tests.test_packed_worker import key_of, packed_and_solo
from tests.test_worker import spec

V, H, BATCH = 30, 8, 20
STEPS = 15
VARIANCES = ("identity", "isotropic", "diagonal")
# Three runs per pack, each with its own step size (and seed).
CONFIGS = {
    "sgd": [OptimizerConfig("sgd", lr=lr) for lr in (0.01, 0.005, 0.02)],
    "nesterov": [
        OptimizerConfig("nesterov", lr=lr, momentum=0.8, weight_decay=0.01)
        for lr in (0.005, 0.002, 0.01)
    ],
    "ssd-paper": [OptimizerConfig("ssd", lr=lr) for lr in (0.001, 0.0005, 0.002)],
    "ssd-normalized": [
        OptimizerConfig("ssd", lr=lr, step_rule="normalized") for lr in (0.01, 0.005, 0.02)
    ],
}
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    """Real-valued data with unequal per-unit means and scales (the variances have to move)."""
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(400, V, generator=generator)
    return noise * torch.linspace(0.5, 2.0, V) + torch.linspace(-1.0, 1.0, V)


def model(data: torch.Tensor, variance: str, seed: int, n_hidden: int = H) -> GaussianRBM:
    rbm = GaussianRBM(V, n_hidden, variance, generator=torch.Generator().manual_seed(seed))
    rbm.init_from_data(data)
    return rbm


def solo(data, variance, config, seed, steps=STEPS, n_hidden=H, **kwargs) -> Trainer:
    trainer = Trainer(
        model(data, variance, seed, n_hidden),
        data,
        optimizer=config,
        batch_size=kwargs.pop("batch_size", BATCH),
        seed=seed,
        **kwargs,
    )
    trainer.train_steps(steps)
    return trainer


def assert_run_equals(pack: TrainingPack, run: int, rbm: GaussianRBM) -> None:
    names = [name for name, _ in rbm.named_parameters()]
    assert sorted(names) == sorted(pack.parameters), names
    for name, parameter in rbm.named_parameters():
        assert torch.equal(pack.parameters[name][run], parameter.detach()), (run, name)


# --- packed == solo ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("variance", VARIANCES)
def test_packed_gaussian_runs_equal_their_solo_runs_bit_for_bit(data, variance, name):
    configs = CONFIGS[name]
    runs = [PackRun(model(data, variance, s), c, s) for c, s in zip(configs, SEEDS, strict=True)]
    pack = TrainingPack(runs, data, batch_size=BATCH)
    pack.train_steps(STEPS)
    for run, (config, seed) in enumerate(zip(configs, SEEDS, strict=True)):
        trainer = solo(data, variance, config, seed)
        assert_run_equals(pack, run, trainer.model)
    if variance == "diagonal":  # the variances were trained, and differ between runs
        start = model(data, variance, 0).log_var.detach()
        assert not torch.equal(pack.parameters["log_var"][0], start)
        assert not torch.equal(pack.parameters["log_var"][0], pack.parameters["log_var"][1])


@pytest.mark.parametrize("variance", ["isotropic", "diagonal"])
@pytest.mark.parametrize(("cd_k", "persistent"), [(1, True), (3, False), (2, True)])
def test_pcd_and_cd_k_chains_equal_their_solo_chains(data, variance, cd_k, persistent):
    """PCD chains, and CD-k whose solo chain integrates the visible layer out of its
    intermediate sweeps on the CPU (the pack runs those run by run)."""
    config = CONFIGS["ssd-paper"][0]
    pack = TrainingPack(
        [PackRun(model(data, variance, s), config, s) for s in SEEDS[:2]],
        data,
        batch_size=BATCH,
        cd_k=cd_k,
        persistent=persistent,
    )
    pack.train_steps(STEPS)
    for run, seed in enumerate(SEEDS[:2]):
        trainer = solo(data, variance, config, seed, cd_k=cd_k, persistent=persistent)
        assert_run_equals(pack, run, trainer.model)


@pytest.mark.parametrize(("cd_k", "persistent"), [(1, True), (2, False)])
def test_a_pack_estimated_in_chunks_of_runs_equals_solo(data, cd_k, persistent):
    """Three runs estimated two at a time (the last chunk holds one run)."""
    configs = CONFIGS["nesterov"]
    runs = [PackRun(model(data, "diagonal", s), c, s) for c, s in zip(configs, SEEDS, strict=True)]
    pack = TrainingPack(runs, data, batch_size=BATCH, cd_k=cd_k, persistent=persistent)
    pack.estimator.runs_per_chunk = 2
    pack.train_steps(STEPS)
    for run, (config, seed) in enumerate(zip(configs, SEEDS, strict=True)):
        trainer = solo(data, "diagonal", config, seed, cd_k=cd_k, persistent=persistent)
        assert_run_equals(pack, run, trainer.model)


def test_the_variance_gradient_from_the_factors_equals_solo(data):
    """Newton–Schulz with factors thinner than W (2B < H): the solo estimator forms no dense
    gradient and takes the variance gradient's row sums from the factors; so does the pack."""
    config = OptimizerConfig("ssd", lr=0.001, method="newton-schulz")
    pack = TrainingPack(
        [PackRun(model(data, "diagonal", s, n_hidden=25), config, s) for s in SEEDS[:2]],
        data,
        batch_size=5,
    )
    assert not pack.estimator.dense_weight_grad
    pack.train_steps(STEPS)
    for run, seed in enumerate(SEEDS[:2]):
        trainer = solo(data, "diagonal", config, seed, n_hidden=25, batch_size=5)
        assert_run_equals(pack, run, trainer.model)


def test_each_run_is_clamped_to_its_own_variance_bounds(data):
    """Runs with different min_variance share a pack; each run's variances stay in its own
    bounds, as its solo constrain_ keeps them (a step size that drives some to the floor)."""
    config = OptimizerConfig("sgd", lr=0.5)
    floors = (1e-4, 0.5)

    def floored(seed: int, floor: float) -> GaussianRBM:
        rbm = GaussianRBM(V, H, min_variance=floor, generator=torch.Generator().manual_seed(seed))
        rbm.init_from_data(data)
        return rbm

    pairs = list(zip(SEEDS, floors, strict=False))
    pack = TrainingPack([PackRun(floored(s, f), config, s) for s, f in pairs], data)
    pack.train_steps(STEPS)
    for run, (seed, floor) in enumerate(pairs):
        trainer = Trainer(floored(seed, floor), data, optimizer=config, seed=seed)
        trainer.train_steps(STEPS)
        assert_run_equals(pack, run, trainer.model)
    floor = torch.tensor(0.5).log()
    assert torch.equal(pack.parameters["log_var"][1].min(), floor)  # at its own floor


# --- checkpoints, divergence ------------------------------------------------------------------


def test_a_checkpoint_goes_pack_to_solo_to_pack_and_the_run_goes_on_as_solo(data):
    configs = CONFIGS["ssd-normalized"][:2]
    make = [PackRun(model(data, "diagonal", s), c, s) for c, s in zip(configs, SEEDS, strict=False)]
    pack = TrainingPack(make, data, batch_size=BATCH, persistent=True)
    pack.train_steps(STEPS)
    resumed = trainer_from_bytes(run_to_bytes(pack, 1), data)
    assert isinstance(resumed.model, GaussianRBM) and resumed.step_count == STEPS
    resumed.train_steps(STEPS)
    other = TrainingPack(
        [PackRun(model(data, "diagonal", 5), configs[1], 5)],
        data,
        batch_size=BATCH,
        persistent=True,
    )
    insert_bytes(other, 0, trainer_to_bytes(resumed))
    other.train_steps(STEPS)
    reference = solo(data, "diagonal", configs[1], SEEDS[1], steps=3 * STEPS, persistent=True)
    assert other.step_counts[0] == 3 * STEPS
    assert_run_equals(other, 0, reference.model)


def test_a_diverging_run_is_frozen_and_the_others_go_on_unchanged(data):
    configs = [OptimizerConfig("sgd", lr=lr) for lr in (0.01, 1e30, 0.005)]
    runs = [PackRun(model(data, "diagonal", s), c, s) for c, s in zip(configs, SEEDS, strict=True)]
    pack = TrainingPack(runs, data, batch_size=BATCH)
    events = pack.train_steps(STEPS)
    assert [event.run for event in events] == [1] and not pack.active[1]
    assert all(torch.isfinite(t[1]).all() for t in pack.parameters.values())
    for run in (0, 2):
        assert pack.step_counts[run] == STEPS
        assert_run_equals(pack, run, solo(data, "diagonal", configs[run], SEEDS[run]).model)


# --- pack keys ----------------------------------------------------------------------------------


def test_pack_keys_hold_the_model_kind_and_variance_form():
    keys = {v: pack_key(GaussianRBM(V, H, v).config(), "ssd") for v in VARIANCES}
    assert len(set(keys.values())) == len(VARIANCES)
    assert (
        pack_key(GaussianRBM(V, H, "diagonal").config(), OptimizerConfig("ssd", lr=0.3))
        == (keys["diagonal"])
    )
    other_floor = GaussianRBM(V, H, "diagonal", min_variance=0.01).config()
    assert pack_key(other_floor, "ssd") == keys["diagonal"]  # bounds are per run
    assert pack_key(BernoulliRBM(V, H).config(), "ssd") not in keys.values()
    with pytest.raises(ValueError, match="variance='full' cannot be packed"):
        pack_key(GaussianRBM(V, H, "full").config(), "ssd")
    with pytest.raises(ValueError, match="one model kind"):
        TrainingPack(
            [PackRun(GaussianRBM(V, H, "diagonal")), PackRun(GaussianRBM(V, H, "isotropic"))],
            torch.zeros(40, V),
        )


def gaussian_job(lr: float, variance: int = rbm_pb2.VARIANCE_KIND_DIAGONAL):
    return spec(steps=40, lr=lr, gaussian=True, variance=variance)


def test_gaussian_jobs_of_one_variance_form_share_a_pack_key():
    diagonal = {key_of(gaussian_job(lr)) for lr in (0.01, 0.02)}
    assert len(diagonal) == 1 and NOT_PACKABLE not in diagonal
    isotropic = key_of(gaussian_job(0.01, rbm_pb2.VARIANCE_KIND_ISOTROPIC))
    identity = key_of(gaussian_job(0.01, rbm_pb2.VARIANCE_KIND_IDENTITY))
    bernoulli = key_of(spec(steps=40, lr=0.01))
    assert NOT_PACKABLE not in (isotropic, identity, bernoulli)
    assert len({*diagonal, isotropic, identity, bernoulli}) == 4
    assert key_of(gaussian_job(0.01, rbm_pb2.VARIANCE_KIND_FULL)) == NOT_PACKABLE


def test_the_memory_estimate_counts_the_variances_and_gaussian_buffers():
    n_visible = 784
    bernoulli = run_memory_mb(spec(steps=40), n_visible)
    by_form = {
        form: run_memory_mb(gaussian_job(0.01, form), n_visible)
        for form in (
            rbm_pb2.VARIANCE_KIND_IDENTITY,
            rbm_pb2.VARIANCE_KIND_ISOTROPIC,
            rbm_pb2.VARIANCE_KIND_DIAGONAL,
            rbm_pb2.VARIANCE_KIND_FULL,
        )
    }
    forms = list(by_form.values())
    assert bernoulli < forms[0] < forms[1] < forms[2] < forms[3]
    # diagonal - isotropic: (V - 1) variances, each in PARAMETER_COPIES copies of 4 bytes
    assert forms[2] - forms[1] == pytest.approx(8 * 4 * (n_visible - 1) / 1e6)


# --- the worker -------------------------------------------------------------------------------


def test_gaussian_jobs_train_as_one_pack_each_equal_to_its_solo_job(redis_url):
    """Two diagonal-variance Gaussian jobs with their own step sizes, queued together: one
    worker trains them as one pack; each job's metrics and final parameters (log_var included)
    equal the same job trained alone (SSDRBM_MAX_PACK_SIZE=1)."""
    requests = [gaussian_job(lr) for lr in (0.01, 0.02)]
    results = packed_and_solo(redis_url, requests)
    for packed_run, solo_run in zip(results["packed"], results["solo"], strict=True):
        assert packed_run.summary.endswith(packed_summary(2)) and "packed" not in solo_run.summary
        assert [(m.step, m.reconstruction_error) for m in packed_run.metrics] == [
            (m.step, m.reconstruction_error) for m in solo_run.metrics
        ]
        assert "log_var" in packed_run.parameters
        for name, value in packed_run.parameters.items():
            assert torch.equal(value, solo_run.parameters[name]), name


# --- CUDA (scripts/gpu-check) -----------------------------------------------------------------

# As for Bernoulli packs (tests/test_pack.py): batched cuBLAS kernels may round otherwise than
# one matrix's, and a rounding difference can flip a hidden draw, so on CUDA a packed run
# follows its solo run closely, not to the bit.
CUDA_TOLERANCE = 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variance", VARIANCES)
def test_cuda_gaussian_pack_replays_a_graph_and_follows_solo(data, variance):
    config = OptimizerConfig("ssd", lr=0.001, method="newton-schulz")
    cuda_data = data.cuda()
    pack = TrainingPack(
        [PackRun(model(data, variance, s).cuda(), config, s) for s in SEEDS],
        cuda_data,
        batch_size=BATCH,
    )
    assert pack.cuda_graph
    pack.train_steps(STEPS)
    assert pack._graphed_step is not None and pack._graphed_step.replays > 0
    for run, seed in enumerate(SEEDS):
        trainer = Trainer(
            model(data, variance, seed).cuda(),
            cuda_data,
            optimizer=config,
            batch_size=BATCH,
            seed=seed,
        )
        trainer.train_steps(STEPS)
        for name, parameter in trainer.model.named_parameters():
            difference = (pack.parameters[name][run] - parameter.detach()).abs().max()
            assert float(difference) <= CUDA_TOLERANCE, (run, name)
