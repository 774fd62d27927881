"""Packs run the normalized SSD step rule and step-size schedules, each run as its solo run.

The solo references are ordinary :class:`~ssdcore.Trainer` runs with the same model, seed and
configuration. On the CPU every comparison is exact (``torch.equal``, tolerance 0), except the
lowrank step with factors thinner than W, where the pack takes the exact Gram route and the solo
optimizer the exact Cholesky route (within 1e-4 after 20 steps of the normalized rule at lr 0.1,
as the paper rule in ``tests/test_pack.py`` within 1e-5 at lr 0.002); the normalized step length
there is computed as the solo one (float64 from the factors).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore import BernoulliRBM, OptimizerConfig, Trainer
from ssdcore.batched import stacked_copy
from ssdcore.checkpoint import trainer_from_bytes, trainer_to_bytes
from ssdcore.data import synthetic_rbm_data
from ssdcore.optim.polar import polar_newton_schulz
from ssdcore.optim.polar import polar_newton_schulz as packed_newton_schulz
from ssdcore.optim.step_rules import spectral_length
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
from ssdcore.pack.optim import PackedOptimizer, ParameterRule
from ssdcore.schedules import Schedule
from ssdrbm_server.packing import NOT_PACKABLE
from ssdrbm_server.resolver import resolve
from ssdrbm_server.worker.child import packed_summary
from tests.fixtures.pack_threads import one_thread_where_loaded  # noqa: F401 (autouse)
from tests.test_packed_worker import packed_and_solo
from tests.test_worker import SETTINGS, spec

V, H, BATCH = 30, 8, 20
STEPS = 20
PARAMETERS = ("W", "b", "a")


def normalized(lr: float = 0.1, **changes) -> OptimizerConfig:
    return OptimizerConfig("ssd", lr=lr, step_rule="normalized", **changes)


SCHEDULES = [
    Schedule("cosine", floor=0.1, horizon=30, warmup_steps=3),
    Schedule("inverse-time", decay_steps=10),
    Schedule("exponential", decay_rate=0.5, decay_steps=15),
    Schedule(),
]


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return synthetic_rbm_data(V, H, n_samples=400, seed=0)


def model(seed: int, n_visible: int = V, n_hidden: int = H) -> BernoulliRBM:
    return BernoulliRBM(n_visible, n_hidden, generator=torch.Generator().manual_seed(seed))


def trainer(data, config, seed, *, steps=0, batch_size=BATCH, n_hidden=H, **kwargs) -> Trainer:
    solo = Trainer(
        model(seed, data.shape[1], n_hidden),
        data,
        optimizer=config,
        batch_size=batch_size,
        seed=seed,
        **kwargs,
    )
    solo.train_steps(steps)
    return solo


def assert_equal_to_solo(pack: TrainingPack, run: int, solo: Trainer) -> None:
    assert pack.step_counts[run] == solo.step_count
    for name in PARAMETERS:
        assert torch.equal(pack.parameters[name][run], getattr(solo.model, name).detach()), name


def packed(data, configs, seeds, *, n_hidden=H, batch_size=BATCH) -> TrainingPack:
    runs = [
        PackRun(model(s, data.shape[1], n_hidden), c, s)
        for c, s in zip(configs, seeds, strict=True)
    ]
    return TrainingPack(runs, data, batch_size=batch_size)


# --- the normalized rule ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["lowrank", "svd", "newton-schulz"])
def test_normalized_ssd_packed_equals_solo_and_survives_a_checkpoint_round_trip(data, method):
    """Three runs with different step sizes; then run 1 goes out as an ordinary solo checkpoint,
    trains on solo, and comes back into another pack's slot beside another run."""
    configs = [normalized(lr, method=method) for lr in (0.05, 0.1, 0.2)]
    seeds = [0, 1, 2]
    pack = packed(data, configs, seeds)
    pack.train_steps(STEPS)
    for run, (config, seed) in enumerate(zip(configs, seeds, strict=True)):
        assert_equal_to_solo(pack, run, trainer(data, config, seed, steps=STEPS))
    resumed = trainer_from_bytes(run_to_bytes(pack, 1), data)
    pack.train_steps(STEPS)
    resumed.train_steps(STEPS)
    assert_equal_to_solo(pack, 1, resumed)
    other = packed(data, [configs[0], configs[2]], [8, 9])
    insert_bytes(other, 0, trainer_to_bytes(resumed))
    other.train_steps(STEPS)
    resumed.train_steps(STEPS)
    assert_equal_to_solo(other, 0, resumed)


def test_normalized_steps_from_thin_factors_match_solo(data):
    """2B < min(V, H): the solo optimizer takes ‖G‖_F from the gradient's factors (float64),
    k = 2B; Newton–Schulz runs in factor space in both (exact), lowrank in the pack by the Gram
    route (its direction within rounding, its length the solo one)."""
    wide = synthetic_rbm_data(60, 12, n_samples=200, seed=1)
    for method, tolerance in (("newton-schulz", 0.0), ("svd", 0.0), ("lowrank", 1e-4)):
        configs = [normalized(lr, method=method) for lr in (0.05, 0.1)]
        pack = packed(wide, configs, [0, 1], n_hidden=48, batch_size=10)
        pack.train_steps(STEPS)
        for run, config in enumerate(configs):
            solo = trainer(wide, config, run, steps=STEPS, n_hidden=48, batch_size=10)
            difference = max(
                float((pack.parameters[n][run] - getattr(solo.model, n).detach()).abs().max())
                for n in PARAMETERS
            )
            assert difference <= tolerance, method


@pytest.mark.parametrize(
    "config",
    [
        OptimizerConfig(
            "sgd",
            lr=0.05,
            momentum=0.5,
            per_parameter={"W": "ssd"},
            per_parameter_lr={"W": 0.1},
            step_rule="normalized",
        ),
        OptimizerConfig(
            "ssd",
            lr=0.1,
            per_parameter={"W": "sgd"},
            per_parameter_lr={"W": 0.05},
            step_rule="normalized",
        ),
    ],
    ids=["ssd_W/sgd", "sgd_W/ssd"],
)
def test_normalized_hybrids_packed_equal_solo(data, config):
    pack = packed(data, [config, config], [3, 4])
    pack.train_steps(STEPS)
    for run, seed in enumerate((3, 4)):
        assert_equal_to_solo(pack, run, trainer(data, config, seed, steps=STEPS))


def test_the_normalized_length_of_a_large_matrix_is_the_solo_one_on_two_threads():
    """A batched ``sum(dim=(-2, -1))`` over a 784×64 gradient splits each run's reduction across
    threads unlike the solo full sum; the pack sums run by run, so the normalized length and the
    Newton–Schulz norms are the solo ones."""
    generator = torch.Generator().manual_seed(0)
    grads = torch.randn(4, 784, 64, generator=generator)
    factors = (
        torch.randn(4, 784, 20, generator=generator),
        torch.randn(4, 20, 64, generator=generator),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for method in ("svd", "newton-schulz"):
            rule = ParameterRule("spectral", method=method, step_rule="normalized")
            grad = None if method == "newton-schulz" else grads
            nuclear = torch.ones(4)
            packed_length = PackedOptimizer._spectral_length(
                rule, nuclear, grad, factors, grads.shape
            )
            for run in range(4):
                solo_factors = (factors[0][run].clone(), factors[1][run].clone())
                solo_grad = None if grad is None else grads[run].clone()
                solo = spectral_length(
                    nuclear[run], "normalized", solo_grad, solo_factors, (784, 64)
                )
                assert torch.equal(packed_length[run], solo), (method, run)
        direction, nuclear = packed_newton_schulz(stacked_copy(grads))
        for run in range(4):
            solo_polar = polar_newton_schulz(grads[run].clone())
            assert torch.equal(direction[run], solo_polar.direction)
            assert torch.equal(nuclear[run], solo_polar.nuclear_norm)
    finally:
        torch.set_num_threads(threads)


# --- schedules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "base",
    [normalized(), OptimizerConfig("nesterov", lr=0.02, momentum=0.8, weight_decay=0.01)],
    ids=["ssd-normalized", "nesterov-decay"],
)
def test_runs_with_their_own_schedules_and_step_sizes_follow_solo(data, base):
    """Cosine (with warmup), inverse-time, exponential and constant in one pack, each run with
    its own base step size: every step's lr is the solo Trainer's, so the parameters are."""
    configs = [
        OptimizerConfig(**{**base.to_dict(), "lr": base.lr * (1 + run), "schedule": schedule})
        for run, schedule in enumerate(SCHEDULES)
    ]
    seeds = list(range(len(configs)))
    pack = packed(data, configs, seeds)
    pack.train_steps(STEPS)
    for run, (config, seed) in enumerate(zip(configs, seeds, strict=True)):
        solo = trainer(data, config, seed, steps=STEPS)
        assert_equal_to_solo(pack, run, solo)
        assert pack.lr(run) == solo.lr
        assert run_to_trainer(pack, run).lr == solo.lr


def test_a_run_resumed_mid_schedule_joins_a_pack_at_its_own_step(data):
    cosine = normalized(schedule=SCHEDULES[0])
    inverse = normalized(0.2, schedule=SCHEDULES[1])
    resumed = trainer(data, cosine, 5, steps=7)  # at step 7 of its schedule
    pack = packed(data, [inverse, inverse], [0, 1])
    pack.train_steps(3)
    insert_trainer(pack, 1, resumed)
    pack.train_steps(STEPS)
    resumed.train_steps(STEPS)
    assert pack.step_counts == [3 + STEPS, 7 + STEPS]
    assert_equal_to_solo(pack, 1, resumed)
    assert_equal_to_solo(pack, 0, trainer(data, inverse, 0, steps=3 + STEPS))
    # Solo trainers at different steps of their schedules, packed together.
    trainers = [
        trainer(data, normalized(0.1, schedule=schedule), s, steps=2 + 4 * s)
        for s, schedule in enumerate(SCHEDULES)
    ]
    together = pack_trainers(trainers)
    together.train_steps(STEPS)
    for run, solo in enumerate(trainers):
        solo.train_steps(STEPS)
        assert_equal_to_solo(together, run, solo)


def test_a_backoff_scales_the_schedule_as_the_solo_trainer_does(data):
    configs = [normalized(schedule=SCHEDULES[0]), normalized(0.2, schedule=SCHEDULES[1])]
    pack = packed(data, configs, [0, 1])
    solos = [trainer(data, config, seed) for seed, config in enumerate(configs)]
    pack.train_steps(10)
    for solo in solos:
        solo.train_steps(10)
    pack.set_lr_scale(1, 0.01)  # two backoffs; base × (factor × 0.01) ≠ (base × factor) × 0.01
    solos[1].set_lr_scale(0.01)
    for _ in range(STEPS):  # the step sizes each step took, as float64 numbers
        pack.train_steps(1)
        for run, solo in enumerate(solos):
            solo.train_steps(1)
            for group in solo.optimizer.param_groups:
                assert pack.optimizer.lr(run, group["name"]) == group["lr"]
    for run, solo in enumerate(solos):
        assert_equal_to_solo(pack, run, solo)
        assert pack.lr(run) == solo.lr


def test_fit_pack_backs_off_a_scheduled_run_with_the_schedules_step_size(data):
    schedule = Schedule("inverse-time", decay_steps=5)
    configs = [
        OptimizerConfig("sgd", lr=0.05, schedule=schedule),
        OptimizerConfig("sgd", lr=1e6, schedule=schedule),
    ]
    pack = packed(data, configs, [0, 1])
    histories = fit_pack(pack, steps=STEPS, eval_every=10, max_backoffs=2, valid_data=data[:100])
    backoff = histories[1][1]
    assert backoff["event"] == "backoff"
    rolled_back_to = backoff["rolled_back_to"]
    assert backoff["new_lr"] == 1e6 * (schedule.factor(rolled_back_to) * 0.1)
    assert_equal_to_solo(pack, 0, trainer(data, configs[0], 0, steps=STEPS, valid_data=data[:100]))


def test_a_cosine_schedule_without_its_horizon_is_refused_as_solo(data):
    config = normalized(schedule=Schedule("cosine"))
    with pytest.raises(ValueError, match="horizon"):
        packed(data, [config], [0])


# --- pack keys -------------------------------------------------------------------------------


def test_the_step_rule_is_part_of_the_pack_key_and_the_schedule_is_not():
    config = model(0).config()
    scheduled = [normalized(lr, schedule=s) for lr, s in zip((0.1, 0.3), SCHEDULES, strict=False)]
    assert pack_key(config, scheduled[0]) == pack_key(config, scheduled[1])
    assert pack_key(config, scheduled[0]) != pack_key(config, OptimizerConfig("ssd", lr=0.1))
    hybrid = OptimizerConfig("sgd", per_parameter={"W": "ssd"}, step_rule="normalized")
    assert pack_key(config, hybrid) != pack_key(
        config, OptimizerConfig("sgd", per_parameter={"W": "ssd"})
    )


def test_a_pack_refuses_a_run_of_the_other_step_rule(data):
    pack = packed(data, [normalized()], [0])
    with pytest.raises(ValueError, match="updates its parameters"):
        insert_trainer(pack, 0, trainer(data, OptimizerConfig("ssd", lr=0.002), 1))


def _job_key(request: rbm_pb2.StartTrainingRequest) -> str:
    async def no_uploads(dataset_id: str):
        raise AssertionError("no uploads here")

    return asyncio.run(resolve(request, SETTINGS, no_uploads)).pack_key


def test_normalized_scheduled_jobs_share_a_pack_key_and_paper_jobs_do_not():
    def job(lr: float, kind: int, rule: int = rbm_pb2.STEP_RULE_NORMALIZED):
        request = spec(steps=60, lr=lr)
        request.optimizer.step_rule = rule
        request.optimizer.schedule.kind = kind
        return request

    cosine = _job_key(job(0.1, rbm_pb2.SCHEDULE_KIND_COSINE))
    inverse = _job_key(job(0.3, rbm_pb2.SCHEDULE_KIND_INVERSE_TIME))
    paper = _job_key(job(0.1, rbm_pb2.SCHEDULE_KIND_COSINE, rbm_pb2.STEP_RULE_PAPER))
    assert NOT_PACKABLE not in (cosine, inverse, paper)
    assert cosine == inverse != paper


def test_normalized_scheduled_jobs_train_as_one_pack_each_equal_to_its_solo_job(redis_url):
    """Three SSD jobs of the normalized rule with their own step sizes and schedules, queued
    together: one worker trains them as one pack; each job's metric events (the lr in effect
    included) and final parameters equal the same job trained alone (SSDRBM_MAX_PACK_SIZE=1)."""
    requests = []
    for lr, kind in (
        (0.1, rbm_pb2.SCHEDULE_KIND_COSINE),
        (0.2, rbm_pb2.SCHEDULE_KIND_INVERSE_TIME),
        (0.05, rbm_pb2.SCHEDULE_KIND_CONSTANT),
    ):
        request = spec(steps=40, lr=lr)
        request.optimizer.step_rule = rbm_pb2.STEP_RULE_NORMALIZED
        request.optimizer.schedule.kind = kind
        request.optimizer.schedule.decay_steps = 10
        requests.append(request)
    results = packed_and_solo(redis_url, requests)
    lrs = []
    for packed_run, solo_run in zip(results["packed"], results["solo"], strict=True):
        assert packed_run.summary.endswith(packed_summary(3)) and "packed" not in solo_run.summary
        assert [(m.step, m.lr, m.reconstruction_error) for m in packed_run.metrics] == [
            (m.step, m.lr, m.reconstruction_error) for m in solo_run.metrics
        ]
        lrs.append([m.lr for m in packed_run.metrics])
        for name, value in packed_run.parameters.items():
            assert torch.equal(value, solo_run.parameters[name]), name
    assert lrs[0][-1] < lrs[0][0] and lrs[1][-1] < lrs[1][0] and len(set(lrs[2])) == 1
