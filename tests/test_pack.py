"""Packed training (ssdcore.pack) against the solo code, run by run.

On the CPU every packed kernel computes each run's slice as the solo kernel does and each run
draws from its own solo streams, so the comparisons below are exact (tolerance 0) except where
a different exact algorithm is used on purpose (the packed lowrank step with thin factors:
the Gram route instead of the solo Cholesky route, within 1e-5 after 20 steps).
"""

from __future__ import annotations

import math

import pytest
import torch

from ssdcore import BernoulliRBM, CDEstimator, GaussianRBM, OptimizerConfig, Trainer
from ssdcore.checkpoint import load_trainer_state, trainer_from_bytes, trainer_to_bytes
from ssdcore.data import synthetic_rbm_data
from ssdcore.optim.polar import polar_gram_factors, polar_newton_schulz
from ssdcore.optim.polar import polar_gram_factors as packed_gram_factors
from ssdcore.optim.polar import polar_newton_schulz as packed_newton_schulz
from ssdcore.optim.polar import polar_newton_schulz_factors as packed_newton_schulz_factors
from ssdcore.optim.polar import polar_svd as packed_svd
from ssdcore.pack import (
    PackRun,
    TrainingPack,
    fit_pack,
    insert_bytes,
    insert_trainer,
    pack_key,
    pack_trainers,
    run_to_bytes,
    run_to_trainer,
)
from ssdcore.pack.gradients import PackedCD
from ssdcore.pack.random import PackedRandom
from ssdcore.sampling import RandomSource
from ssdcore.training import _ESTIMATOR_SEED_OFFSET
from tests.fixtures.pack_threads import one_thread_where_loaded  # noqa: F401 (autouse)

V, H, BATCH = 30, 8, 20
STEPS = 20
CONFIGS = {
    "sgd": OptimizerConfig("sgd", lr=0.05),
    "nesterov": OptimizerConfig("nesterov", lr=0.02, momentum=0.8, weight_decay=0.01),
    "ssd": OptimizerConfig("ssd", lr=0.002),
    "ssd-svd": OptimizerConfig("ssd", lr=0.002, method="svd"),
    "ssd-newton-schulz": OptimizerConfig("ssd", lr=0.002, method="newton-schulz"),
    "ssd_W/sgd": OptimizerConfig(
        "sgd", lr=0.05, momentum=0.5, per_parameter={"W": "ssd"}, per_parameter_lr={"W": 0.002}
    ),
}


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return synthetic_rbm_data(V, H, n_samples=400, seed=0)


def model(seed: int, n_hidden: int = H) -> BernoulliRBM:
    return BernoulliRBM(V, n_hidden, generator=torch.Generator().manual_seed(seed))


def solo(data, config, seed, steps=STEPS, n_hidden=H, **kwargs) -> Trainer:
    trainer = Trainer(
        model(seed, n_hidden), data, optimizer=config, batch_size=BATCH, seed=seed, **kwargs
    )
    trainer.train_steps(steps)
    return trainer


def max_difference(pack: TrainingPack, run: int, rbm: BernoulliRBM) -> float:
    return max(
        float((getattr(rbm, name).detach() - pack.parameters[name][run]).abs().max())
        for name in ("W", "b", "a")
    )


# --- batched parts against per-model loops ----------------------------------------------------


@pytest.mark.parametrize("persistent", [False, True])
def test_batched_gibbs_and_gradients_equal_a_loop_of_solo_estimators(data, persistent):
    seeds = [3, 4, 5]
    models = [model(seed) for seed in seeds]
    estimators = [
        CDEstimator(m, k=3, persistent=persistent, seed=s + _ESTIMATOR_SEED_OFFSET)
        for m, s in zip(models, seeds, strict=True)
    ]
    sources = [RandomSource("cpu", s + _ESTIMATOR_SEED_OFFSET) for s in seeds]
    packed = PackedCD(
        3,
        V,
        H,
        BATCH,
        k=3,
        persistent=persistent,
        random=PackedRandom(sources, torch.device("cpu")),
        device=torch.device("cpu"),
    )
    W = torch.stack([m.W.detach() for m in models])
    b = torch.stack([m.b.detach() for m in models])
    a = torch.stack([m.a.detach() for m in models])
    for step in range(3):  # the PCD chains carry over
        batch = torch.stack([data[20 * (step + i) : 20 * (step + i) + BATCH] for i in range(3)])
        packed.estimate(W, b, a, batch)
        for run, (m, estimator) in enumerate(zip(models, estimators, strict=True)):
            estimator.estimate(batch[run])
            assert torch.equal(packed.grad_W[run], m.W.grad)
            assert torch.equal(packed.grad_b[run], m.b.grad)
            assert torch.equal(packed.grad_a[run], m.a.grad)
            if persistent:
                assert torch.equal(packed.chains[run], estimator.chains)


def test_batched_polar_matches_svd_per_model():
    generator = torch.Generator().manual_seed(0)
    for shape in [(30, 8), (8, 30)]:
        grads = torch.randn(4, *shape, generator=generator)
        left, right, nuclear = packed_gram_factors(grads)
        direction_svd, nuclear_svd = packed_svd(grads)
        direction_ns, nuclear_ns = packed_newton_schulz(grads)
        for run in range(4):
            u, s, vh = torch.linalg.svd(grads[run], full_matrices=False)
            assert torch.allclose(left[run] @ right[run], u @ vh, atol=1e-5)
            assert torch.allclose(direction_svd[run], u @ vh, atol=1e-5)
            assert math.isclose(float(nuclear[run]), float(s.sum()), rel_tol=1e-6)
            assert math.isclose(float(nuclear_svd[run]), float(s.sum()), rel_tol=1e-6)
            # The packed forms repeat the solo functions' arithmetic exactly.
            solo = polar_gram_factors(grads[run])
            assert torch.equal(left[run] @ right[run], solo.left @ solo.right)
            solo_ns = polar_newton_schulz(grads[run])
            assert torch.equal(direction_ns[run], solo_ns.direction)
            assert torch.equal(nuclear_ns[run], solo_ns.nuclear_norm)
    # Newton–Schulz in factor space: the same polynomial as the dense iteration (r=6 < 8, 30).
    factor_left = torch.randn(3, 30, 6, generator=generator)
    factor_right = torch.randn(3, 6, 8, generator=generator)
    left, right, nuclear = packed_newton_schulz_factors(factor_left, factor_right)
    for run in range(3):
        grad = factor_left[run] @ factor_right[run]
        dense = polar_newton_schulz(grad)
        assert torch.allclose(left[run] @ right[run], dense.direction, atol=1e-4)
        assert math.isclose(float(nuclear[run]), float(dense.nuclear_norm), rel_tol=1e-4)


def test_a_non_finite_gradient_gives_that_run_a_nan_step_only():
    grads = torch.randn(3, 30, 8)
    grads[1, 0, 0] = math.inf
    _, _, nuclear = packed_gram_factors(grads)
    assert math.isnan(float(nuclear[1]))
    assert torch.isfinite(nuclear[[0, 2]]).all()


# --- trajectories ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_runs_follow_their_solo_trajectories_exactly(data, name):
    config = CONFIGS[name]
    seeds = [0, 1, 2]
    pack = TrainingPack([PackRun(model(s), config, s) for s in seeds], data, batch_size=BATCH)
    pack.train_steps(STEPS)
    for run, seed in enumerate(seeds):
        trainer = solo(data, config, seed)
        assert max_difference(pack, run, trainer.model) == 0.0
        assert pack.step_counts[run] == trainer.step_count == STEPS


def test_persistent_cd_k_trajectories_equal_solo(data):
    config = CONFIGS["nesterov"]
    pack = TrainingPack(
        [PackRun(model(s), config, s) for s in (0, 1)],
        data,
        batch_size=BATCH,
        cd_k=3,
        persistent=True,
    )
    pack.train_steps(STEPS)
    for run in (0, 1):
        trainer = solo(data, config, run, cd_k=3, persistent=True)
        assert max_difference(pack, run, trainer.model) == 0.0


def test_thin_factor_steps_match_solo_within_rounding(data):
    """With 2B < min(V, H) the solo SSD takes its steps from the gradient's factors: the exact
    Cholesky route (lowrank; the pack takes the exact Gram route) and Newton–Schulz in factor
    space (the same arithmetic in the pack)."""
    wide_v, wide_h, batch = 60, 48, 10  # factor rank 2 × 10 = 20 < min(60, 48)
    wide = synthetic_rbm_data(wide_v, 12, n_samples=200, seed=1)
    for method, tolerance in (("lowrank", 1e-5), ("newton-schulz", 0.0)):
        config = OptimizerConfig("ssd", lr=0.002, method=method)
        models = [
            BernoulliRBM(wide_v, wide_h, generator=torch.Generator().manual_seed(s)) for s in (0, 1)
        ]
        pack = TrainingPack(
            [PackRun(m, config, s) for s, m in enumerate(models)], wide, batch_size=batch
        )
        pack.train_steps(STEPS)
        for run in (0, 1):
            rbm = BernoulliRBM(wide_v, wide_h, generator=torch.Generator().manual_seed(run))
            trainer = Trainer(rbm, wide, optimizer=config, batch_size=batch, seed=run)
            trainer.train_steps(STEPS)
            assert max_difference(pack, run, rbm) <= tolerance, method


def test_a_run_is_the_same_alone_or_with_seven_others(data):
    configs = list(CONFIGS.values())
    target = PackRun(model(7), OptimizerConfig("ssd", lr=0.003), seed=7)
    others = [
        PackRun(model(10 + i), OptimizerConfig("ssd", lr=0.001 * (i + 1)), seed=10 + i)
        for i in range(7)
    ]
    alone = TrainingPack([target], data, batch_size=BATCH)
    crowded = TrainingPack([*others[:3], target, *others[3:]], data, batch_size=BATCH)
    alone.train_steps(STEPS)
    crowded.train_steps(STEPS)
    for name in ("W", "b", "a"):
        assert torch.equal(alone.parameters[name][0], crowded.parameters[name][3])
    assert len(configs) > 1


def test_one_shared_stream_is_reproducible_but_not_the_solo_trajectory(data):
    config = CONFIGS["sgd"]

    def trained() -> TrainingPack:
        runs = [PackRun(model(s), config, s) for s in (0, 1)]
        pack = TrainingPack(runs, data, batch_size=BATCH, independent_streams=False)
        pack.train_steps(STEPS)
        return pack

    first, second = trained(), trained()
    assert torch.equal(first.parameters["W"], second.parameters["W"])
    assert max_difference(first, 0, solo(data, config, 0).model) > 0


def test_a_held_run_stands_still_until_released(data):
    pack = TrainingPack(
        [PackRun(model(s), CONFIGS["sgd"], s) for s in (0, 1)], data, batch_size=BATCH
    )
    pack.train_steps(3)
    pack.hold(1)
    held = pack.parameters["W"][1].clone()
    pack.train_steps(5)
    assert torch.equal(pack.parameters["W"][1], held)
    assert pack.step_counts == [8, 3]
    pack.release(1)
    pack.train_steps(2)
    assert pack.step_counts == [10, 5]
    assert not torch.equal(pack.parameters["W"][1], held)


def test_a_diverging_run_is_frozen_and_reported_and_the_others_go_on(data):
    configs = [CONFIGS["sgd"], OptimizerConfig("sgd", lr=1e38), CONFIGS["sgd"]]
    pack = TrainingPack(
        [PackRun(model(s), c, s) for s, c in enumerate(configs)], data, batch_size=BATCH
    )
    events = pack.train_steps(STEPS)
    assert [event.run for event in events] == [1]
    assert "NaN or Inf" in events[0].what
    assert pack.active == [True, False, True]
    assert all(bool(torch.isfinite(t[1]).all()) for t in pack.parameters.values())
    assert pack.step_counts[1] == events[0].restored_step < STEPS
    for run in (0, 2):
        assert max_difference(pack, run, solo(data, configs[run], run).model) == 0.0


def test_fit_pack_backs_off_one_run_and_leaves_the_others_untouched(data):
    configs = [CONFIGS["sgd"], OptimizerConfig("sgd", lr=1e6), CONFIGS["sgd"]]
    pack = TrainingPack(
        [PackRun(model(s), c, s) for s, c in enumerate(configs)], data, batch_size=BATCH
    )
    valid = data[:100]
    histories = fit_pack(pack, steps=STEPS, eval_every=10, max_backoffs=2, valid_data=valid)
    events = [entry.get("event") for entry in histories[1]]
    assert events == [None, "backoff", "backoff", "failed"]
    assert histories[1][1]["new_lr"] == pytest.approx(1e5)
    failed = histories[1][-1]  # what fit's BlowUpError would say, with the same suggestion
    assert failed["message"].startswith("training blew up after 2 backoffs")
    assert failed["suggested_lr"] == pytest.approx(1e3)
    assert pack.step_counts[1] == histories[1][2]["rolled_back_to"]  # held at its last health
    for run in (0, 2):
        assert [entry["step"] for entry in histories[run]] == [0, 10, 20]
        trainer = solo(data, configs[run], run, valid_data=valid)
        assert max_difference(pack, run, trainer.model) == 0.0
        expected = trainer.evaluate()
        for key in ("reconstruction_error", "train_reconstruction_error", "spectral_norm"):
            assert histories[run][-1][key] == expected[key]


# --- checkpoints ----------------------------------------------------------------------------


def test_checkpoint_round_trip_pack_to_solo_to_pack(data):
    config = CONFIGS["ssd_W/sgd"]  # momentum buffers on the biases: optimizer state matters
    options = {"batch_size": BATCH, "cd_k": 2, "persistent": True}
    runs = [PackRun(model(s), config, s) for s in (0, 1, 2)]
    pack = TrainingPack(runs, data, **options)
    pack.train_steps(STEPS)
    saved = run_to_bytes(pack, 1)
    resumed = trainer_from_bytes(saved, data)  # an ordinary solo checkpoint
    assert resumed.step_count == STEPS
    pack.train_steps(STEPS)
    resumed.train_steps(STEPS)
    assert max_difference(pack, 1, resumed.model) == 0.0
    # ... and back: the solo run continues in another pack's slot 0, beside another run.
    other = TrainingPack(
        [PackRun(model(9), config, 9), PackRun(model(8), config, 8)], data, **options
    )
    insert_bytes(other, 0, trainer_to_bytes(resumed))
    other.train_steps(STEPS)
    pack.train_steps(STEPS)
    assert other.step_counts[0] == pack.step_counts[1] == 3 * STEPS
    for name in ("W", "b", "a"):
        assert torch.equal(other.parameters[name][0], pack.parameters[name][1])


def test_a_packed_run_checkpoint_loads_into_the_trainer_its_job_would_build(data):
    """The service resumes a job by building its Trainer from the spec and loading the
    checkpoint into it, which checks the model config (init_std included) and settings."""
    config = CONFIGS["ssd"]
    pack = TrainingPack(
        [PackRun(BernoulliRBM(V, H, init_std=0.05), config, 5)], data, batch_size=BATCH
    )
    pack.train_steps(STEPS)
    trainer = Trainer(
        BernoulliRBM(V, H, init_std=0.05), data, optimizer=config, batch_size=BATCH, seed=5
    )
    load_trainer_state(trainer, run_to_bytes(pack, 0))
    assert trainer.step_count == STEPS
    assert max_difference(pack, 0, trainer.model) == 0.0


def test_a_solo_run_inserted_at_any_step_continues_as_solo(data):
    config = CONFIGS["nesterov"]
    trainer = solo(data, config, 4, steps=7)
    pack = TrainingPack([PackRun(model(0), config, 0)] * 2, data, batch_size=BATCH)
    pack.train_steps(3)
    insert_trainer(pack, 1, trainer)
    pack.train_steps(STEPS)
    trainer.train_steps(STEPS)
    assert pack.step_counts == [3 + STEPS, 7 + STEPS]
    assert max_difference(pack, 1, trainer.model) == 0.0
    back = run_to_trainer(pack, 1)
    assert (
        back.lr == trainer.lr and back.state_dict()["position"] == trainer.state_dict()["position"]
    )


def test_a_fresh_pcd_run_joins_a_pack_whose_chains_are_running(data):
    config = CONFIGS["ssd"]
    options = {"batch_size": BATCH, "persistent": True}
    pack = TrainingPack([PackRun(model(s), config, s) for s in (0, 1, 2)], data, **options)
    pack.train_steps(5)
    fresh = Trainer(model(6), data, optimizer=config, seed=6, **options)  # no chains yet
    insert_trainer(pack, 1, fresh)
    pack.train_steps(STEPS)
    fresh.train_steps(STEPS)
    assert max_difference(pack, 1, fresh.model) == 0.0
    assert (
        max_difference(pack, 0, solo(data, config, 0, steps=5 + STEPS, persistent=True).model)
        == 0.0
    )


def test_solo_trainers_packed_together_continue_as_they_would_alone(data):
    configs = [CONFIGS["nesterov"], OptimizerConfig("nesterov", lr=0.01), CONFIGS["nesterov"]]
    trainers = [solo(data, config, seed, steps=3 + seed) for seed, config in enumerate(configs)]
    pack = pack_trainers(trainers)
    assert pack.step_counts == [3, 4, 5]
    pack.train_steps(STEPS)
    for run, trainer in enumerate(trainers):
        trainer.train_steps(STEPS)
        assert max_difference(pack, run, trainer.model) == 0.0


def test_a_run_that_does_not_fit_is_refused_with_the_reason(data):
    pack = TrainingPack([PackRun(model(0), CONFIGS["sgd"], 0)], data, batch_size=BATCH)
    with pytest.raises(ValueError, match="cd_k"):
        insert_trainer(
            pack, 0, Trainer(model(1), data, optimizer=CONFIGS["sgd"], batch_size=BATCH, cd_k=2)
        )
    with pytest.raises(ValueError, match="updates its parameters"):
        insert_trainer(pack, 0, Trainer(model(1), data, optimizer=CONFIGS["ssd"], batch_size=BATCH))
    with pytest.raises(ValueError, match="one shape"):
        TrainingPack([PackRun(model(0)), PackRun(model(1, n_hidden=9))], data)
    with pytest.raises(ValueError, match="variance='full' cannot be packed"):
        TrainingPack([PackRun(GaussianRBM(V, H, "full"))], data)
    with pytest.raises(ValueError, match="max_spectral_norm"):
        TrainingPack([PackRun(model(0), OptimizerConfig("ssd", max_spectral_norm=1.0))], data)


def test_pack_key_groups_compatible_runs():
    config = model(0).config()
    assert pack_key(config, OptimizerConfig("ssd", lr=0.1)) == pack_key(
        config, OptimizerConfig("ssd", lr=0.2)
    )
    assert pack_key(config, "sgd") == pack_key(config, OptimizerConfig("sgd", momentum=0.5))
    assert pack_key(config, "sgd") != pack_key(config, "nesterov")
    assert pack_key(config, "ssd") != pack_key(config, "ssd", cd_k=2)
    with pytest.raises(ValueError, match="cannot be packed"):
        pack_key(GaussianRBM(V, H, "full").config(), "ssd")
    with pytest.raises(ValueError, match="ssd-preconditioned"):
        pack_key(config, "ssd-preconditioned")


# --- CUDA (scripts/gpu-check) -----------------------------------------------------------------

# cuBLAS may pick other kernels for a batch than for one matrix, and a rounding difference can
# flip a Bernoulli draw: on CUDA a packed run follows its solo run closely, not to the bit.
CUDA_TOLERANCE = 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["sgd", "ssd-newton-schulz"])
def test_cuda_pack_replays_a_graph_and_follows_solo(name):
    data = synthetic_rbm_data(V, H, n_samples=400, seed=0).cuda()
    config = CONFIGS[name]
    seeds = [0, 1, 2]
    pack = TrainingPack(
        [PackRun(model(s).cuda(), config, s) for s in seeds], data, batch_size=BATCH
    )
    assert pack.cuda_graph
    pack.train_steps(STEPS)
    assert pack._graphed_step is not None and pack._graphed_step.replays > 0
    for run, seed in enumerate(seeds):
        trainer = Trainer(model(seed).cuda(), data, optimizer=config, batch_size=BATCH, seed=seed)
        trainer.train_steps(STEPS)
        assert max_difference(pack, run, trainer.model) <= CUDA_TOLERANCE
    resumed = trainer_from_bytes(run_to_bytes(pack, 1), data, device="cuda")
    assert resumed.step_count == STEPS
