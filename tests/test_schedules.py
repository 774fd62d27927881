"""Step-size schedules: their values, their composition with the blow-up backoff, exact resume."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ssdcore import BernoulliRBM, OptimizerConfig, Trainer, fit
from ssdcore.checkpoint import trainer_from_bytes, trainer_to_bytes
from ssdcore.data import synthetic_rbm_data
from ssdcore.pack import pack_key
from ssdcore.schedules import Schedule
from ssdcore.step_sizes import default_lr

pytestmark = pytest.mark.usefixtures("one_thread")

N_VISIBLE, N_HIDDEN = 30, 8


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return synthetic_rbm_data(N_VISIBLE, N_HIDDEN, n_samples=400, seed=0)


def make_trainer(data: torch.Tensor, config: OptimizerConfig) -> Trainer:
    torch.manual_seed(0)
    return Trainer(BernoulliRBM(N_VISIBLE, N_HIDDEN), data, optimizer=config, batch_size=40)


# --- values ------------------------------------------------------------------------------------


def test_constant_is_one_everywhere() -> None:
    schedule = Schedule()
    assert schedule.is_constant
    assert [schedule.factor(t) for t in (0, 1, 10**6)] == [1.0, 1.0, 1.0]


def test_exponential_multiplies_by_the_rate_per_decay_steps() -> None:
    schedule = Schedule("exponential", decay_rate=0.5, decay_steps=100)
    assert schedule.factor(0) == 1.0
    assert schedule.factor(100) == pytest.approx(0.5, rel=1e-12)
    assert schedule.factor(250) == pytest.approx(0.5**2.5, rel=1e-12)


def test_inverse_time_halves_at_its_time_constant() -> None:
    schedule = Schedule("inverse-time", decay_steps=50)
    assert schedule.factor(0) == 1.0
    assert schedule.factor(50) == pytest.approx(0.5, rel=1e-12)
    assert schedule.factor(150) == pytest.approx(0.25, rel=1e-12)


def test_cosine_goes_from_one_to_its_floor_and_stays() -> None:
    schedule = Schedule("cosine", floor=0.2, horizon=100)
    assert schedule.factor(0) == 1.0
    assert schedule.factor(50) == pytest.approx(0.6, rel=1e-12)  # halfway: mean of 1 and floor
    assert schedule.factor(100) == pytest.approx(0.2, rel=1e-12)
    assert schedule.factor(1_000) == pytest.approx(0.2, rel=1e-12)
    values = [schedule.factor(t) for t in range(101)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_warmup_rises_linearly_then_the_decay_starts() -> None:
    schedule = Schedule("exponential", decay_rate=0.5, decay_steps=10, warmup_steps=4)
    assert not schedule.is_constant
    assert [schedule.factor(t) for t in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert schedule.factor(14) == pytest.approx(0.5, rel=1e-12)
    assert not Schedule(warmup_steps=3).is_constant


def test_cosine_horizon_comes_from_the_run() -> None:
    schedule = Schedule("cosine", warmup_steps=10)
    assert schedule.needs_horizon
    assert schedule.for_run(110).horizon == 100
    assert Schedule("cosine", horizon=7).for_run(110).horizon == 7
    with pytest.raises(ValueError, match="horizon"):
        schedule.factor(20)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"kind": "step"}, "Schedule.kind"),
        ({"decay_rate": 0.0}, "Schedule.decay_rate"),
        ({"decay_rate": math.nan}, "Schedule.decay_rate"),
        ({"decay_steps": 0}, "Schedule.decay_steps"),
        ({"floor": 1.5}, "Schedule.floor"),
        ({"horizon": -1}, "Schedule.horizon"),
        ({"warmup_steps": 2.5}, "Schedule.warmup_steps"),
    ],
)
def test_bad_fields_are_named(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Schedule(**fields)


def test_round_trips_through_the_optimizer_config() -> None:
    config = OptimizerConfig("ssd", lr=0.1, schedule=Schedule("cosine", floor=0.05, horizon=9))
    again = OptimizerConfig.from_dict(config.to_dict())
    assert again == config and isinstance(again.schedule, Schedule)
    with pytest.raises(ValueError, match="Schedule: unknown fields"):
        OptimizerConfig.from_dict({**config.to_dict(), "schedule": {"kind": "cosine", "tau": 3}})


# --- the trainer applies it ---------------------------------------------------------------------


def test_trainer_steps_at_base_times_schedule_times_backoff(data) -> None:
    schedule = Schedule("inverse-time", decay_steps=5, warmup_steps=2)
    config = OptimizerConfig("sgd", lr=0.1, per_parameter={"W": "ssd"}, schedule=schedule)
    trainer = make_trainer(data, config)
    trainer.set_lr_scale(0.1)  # as one backoff leaves it
    seen = []
    original_step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append({g["name"]: g["lr"] for g in trainer.optimizer.param_groups})
        return original_step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.train_steps(12)
    base = {
        g["name"]: lr
        for g, lr in zip(trainer.optimizer.param_groups, trainer._base_lrs, strict=True)
    }
    for t, lrs in enumerate(seen):
        for name, lr in lrs.items():
            assert lr == pytest.approx(base[name] * schedule.factor(t) * 0.1, rel=1e-12)
    assert trainer.lr == pytest.approx(0.1 * schedule.factor(12) * 0.1, rel=1e-12)
    # The backoff scale stays absolute: setting it again keeps the schedule's factor.
    trainer.set_lr_scale(0.01)
    assert trainer.optimizer.param_groups[1]["lr"] == pytest.approx(
        base["b"] * schedule.factor(12) * 0.01, rel=1e-12
    )


def test_a_schedule_equals_scaling_by_hand_each_step(data) -> None:
    schedule = Schedule("exponential", decay_rate=0.3, decay_steps=4)
    scheduled = make_trainer(data, OptimizerConfig("ssd", lr=3e-3, schedule=schedule))
    by_hand = make_trainer(data, OptimizerConfig("ssd", lr=3e-3))
    scheduled.train_steps(10)
    for t in range(10):
        by_hand.set_lr_scale(schedule.factor(t))
        by_hand.train_steps(1)
    for a, b in zip(scheduled.model.parameters(), by_hand.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fit_backoff_composes_with_the_schedule(data) -> None:
    """A blow-up at lr 1e6 backs off; the history's lr is base × schedule × backoff scale."""
    schedule = Schedule("cosine", floor=0.5)
    torch.manual_seed(0)
    history = fit(
        BernoulliRBM(N_VISIBLE, N_HIDDEN),
        data,
        steps=40,
        batch_size=40,
        optimizer=OptimizerConfig("ssd", lr=1e6, schedule=schedule),
        eval_every=10,
        max_backoffs=100,
    )
    backoffs = [entry for entry in history if entry.get("event") == "backoff"]
    assert backoffs, "lr 1e6 should blow up"
    horizon = schedule.for_run(40)
    for entry in backoffs:
        expected = 1e6 * horizon.factor(entry["rolled_back_to"]) * entry["lr_scale"]
        assert entry["new_lr"] == pytest.approx(expected, rel=1e-12)


# --- resume --------------------------------------------------------------------------------------


def test_resume_continues_the_schedule_exactly(data) -> None:
    config = OptimizerConfig(
        "ssd", lr=3e-3, schedule=Schedule("cosine", floor=0.1, horizon=20, warmup_steps=3)
    )
    whole = make_trainer(data, config)
    whole.train_steps(20)
    first = make_trainer(data, config)
    first.train_steps(8)
    first.set_lr_scale(0.5)
    whole_again = make_trainer(data, config)
    whole_again.train_steps(8)
    whole_again.set_lr_scale(0.5)
    whole_again.train_steps(12)
    resumed = trainer_from_bytes(trainer_to_bytes(first), data)
    assert resumed.optimizer_config.schedule == config.schedule
    assert resumed.lr == pytest.approx(first.lr, rel=1e-15)
    resumed.train_steps(12)
    for a, b in zip(resumed.model.parameters(), whole_again.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_of_another_schedule_is_refused(data) -> None:
    trainer = make_trainer(
        data, OptimizerConfig("ssd", lr=3e-3, schedule=Schedule("cosine", horizon=9))
    )
    other = make_trainer(data, OptimizerConfig("ssd", lr=3e-3))
    with pytest.raises(ValueError, match=r"resume with the same optimizer\.schedule"):
        other.load_state_dict(trainer.state_dict())


def test_cosine_without_horizon_is_refused_by_the_trainer(data) -> None:
    with pytest.raises(ValueError, match="horizon"):
        make_trainer(data, OptimizerConfig("ssd", lr=3e-3, schedule=Schedule("cosine")))


def test_a_schedule_does_not_change_the_pack_key() -> None:
    """Packs run each run's own schedule (tests/test_pack_rules.py has the trajectories)."""
    config = OptimizerConfig("ssd", lr=3e-3, schedule=Schedule("exponential"))
    model = BernoulliRBM(N_VISIBLE, N_HIDDEN).config()
    assert pack_key(model, config) == pack_key(model, OptimizerConfig("ssd", lr=3e-3))


# --- through the service -------------------------------------------------------------------------


def test_a_job_with_a_schedule_trains_and_reports_its_step_size(service) -> None:
    """Submitted with a schedule and the normalized rule: the spec shows both (filled in), and
    each metric event carries lr = optimizer.lr × the schedule's factor at its step."""
    from ssdrbm import Client, JobState, MetricsEvent

    with Client(service.target) as client:
        job = client.start_training(
            n_hidden=8,
            dataset="synthetic",
            dataset_options={"n_samples": 500},
            steps=60,
            eval_every=20,
            step_rule="normalized",
            schedule="exponential,0.5,20",
        )
        optimizer = job.spec["optimizer"]
        assert optimizer["step_rule"] == "normalized"
        assert optimizer["schedule"]["kind"] == "exponential"
        assert optimizer["schedule"]["decay_rate"] == 0.5
        done = client.wait(job.id, timeout=120)
        assert done.state is JobState.SUCCEEDED, done.error
        seen = {
            event.metrics.step: event.metrics.lr
            for event in client.stream_metrics(job.id, follow=False)
            if isinstance(event, MetricsEvent)
        }
    assert sorted(seen) == [20, 40, 60]
    base = optimizer["lr"]
    for step, lr in seen.items():
        assert lr == pytest.approx(base * 0.5 ** (step / 20), rel=1e-9), (step, lr)


def test_the_service_fills_and_checks_the_schedule(service) -> None:
    from ssdrbm import Client, InvalidArgument

    with Client(service.target) as client:
        cosine = client.start_training(
            n_hidden=8, steps=50, schedule="cosine", warmup_steps=10, validate_only=True
        )
        schedule = cosine.spec["optimizer"]["schedule"]
        assert int(schedule["horizon"]) == 40  # the job's steps after the warmup
        assert schedule["floor"] == pytest.approx(Schedule().floor)
        plain = client.start_training(n_hidden=8, steps=50, validate_only=True)
        assert plain.spec["optimizer"]["schedule"]["kind"] == "constant"
        assert plain.spec["optimizer"]["step_rule"] == "paper"
        with pytest.raises(InvalidArgument) as bad_floor:
            client.start_training(n_hidden=8, schedule={"kind": "cosine", "floor": 2.0})
        assert "optimizer.schedule.floor" in str(bad_floor.value)
        with pytest.raises(InvalidArgument) as sgd_rule:
            client.start_training(n_hidden=8, optimizer="sgd", step_rule="normalized")
        assert "optimizer.step_rule" in str(sgd_rule.value)


def test_the_cli_sends_the_step_rule_and_the_schedule(service, capsys) -> None:
    import json

    from ssdrbm.cli import main
    from ssdrbm.cli.exit_codes import ExitCode

    target = ["--target", service.target]
    args = ["train", "--hidden", "4", "--steps", "300", "--dry-run", "--json"]
    options = ["--step-rule", "normalized", "--schedule", "cosine,0.05", "--warmup-steps", "100"]
    assert main([*target, *args, *options]) == ExitCode.OK
    optimizer = json.loads(capsys.readouterr().out)["spec"]["optimizer"]
    assert optimizer["step_rule"] == "normalized"
    # the normalized rule's own default for a Bernoulli RBM, for a job of 300 steps
    assert optimizer["lr"] == default_lr("bernoulli", "ssd", None, "normalized", steps=300)
    schedule = optimizer["schedule"]
    assert schedule["kind"] == "cosine" and schedule["floor"] == 0.05
    assert int(schedule["warmup_steps"]) == 100 and int(schedule["horizon"]) == 200
    assert main([*target, *args, "--schedule", "cosine,1,2,3"]) == ExitCode.USAGE
