"""Blow-up detection and step-size backoff: the detector on metric dicts, on real runs that blow
up while staying finite, fit's rollback-and-backoff, and the trainer's step-size scale across a
checkpoint resume.
"""

from __future__ import annotations

import json
import math
import pickle
import re

import pytest
import torch

from ssdcore import BernoulliRBM, DivergenceError, GaussianRBM, OptimizerConfig, Trainer, fit
from ssdcore.blowup import (
    BACKOFF_FACTOR,
    DEFAULT_MAX_BACKOFFS,
    DRIFT_GROWTH,
    RECONSTRUCTION_GROWTH,
    SPECTRAL_NORM_GROWTH,
    STUCK_FRACTION,
    STUCK_NORM_GROWTH,
    BackoffEvent,
    BlowUp,
    BlowUpDetector,
    BlowUpError,
    Recovery,
    blowup_from_error,
    suggested_lr,
)
from ssdcore.checkpoint import trainer_from_bytes, trainer_to_bytes
from ssdcore.data import synthetic_rbm_data
from ssdcore.pack import PackRun, TrainingPack, fit_pack
from ssdcore.step_sizes import default_lr
from tests.test_step_sizes import builtin_dataset, needs_shared_data

pytestmark = pytest.mark.usefixtures("one_thread")


def metrics(step: int, error: float, norm: float = 1.0, stuck: float = 0.0) -> dict:
    return {
        "step": step,
        "reconstruction_error": error,
        "spectral_norm": norm,
        "saturated_hidden_fraction": stuck,
        "wall_time_s": 0.0,
    }


# --- the detector on metric dicts ---------------------------------------------------------------


def test_a_healthy_history_passes_and_sets_the_references():
    detector = BlowUpDetector()
    history = [metrics(0, 600.0, 0.3), metrics(100, 300.0, 5.0), metrics(200, 320.0, 40.0)]
    assert all(detector.observe(m) is None for m in history)
    assert detector.best_reconstruction_error == 300.0 and detector.best_step == 100
    assert detector.spectral_norm_reference == 1.0  # the first ‖W‖₂, floored at 1


def test_growth_over_the_best_so_far_is_a_blow_up_and_names_the_reference():
    detector = BlowUpDetector()
    detector.observe(metrics(0, 402.1))
    blowup = detector.observe(metrics(300, 4.1e26))
    assert blowup == BlowUp(
        300, "reconstruction_error", 4.1e26, 402.1, "growth", "its best so far (step 0)"
    )
    assert blowup.describe() == (
        "reconstruction_error 4.1e+26 at step 300 is 1.02e+24× its best so far (step 0) 402.1"
    )
    # Just under the threshold is no blow-up; a blown-up value never becomes a reference.
    assert detector.observe(metrics(400, 0.99 * RECONSTRUCTION_GROWTH * 402.1)) is None
    assert detector.best_reconstruction_error == 402.1


def test_the_first_evaluation_after_step_zero_is_compared_with_step_zero():
    detector = BlowUpDetector()
    assert detector.observe(metrics(0, 600.0)) is None
    assert detector.observe(metrics(25, 1e9)).metric == "reconstruction_error"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_metrics_are_blow_ups(value):
    detector = BlowUpDetector()
    detector.observe(metrics(0, 10.0))
    blowup = detector.observe({**metrics(5, 10.0), "free_energy_gap": value})
    assert (blowup.metric, blowup.criterion, blowup.reference) == (
        "free_energy_gap",
        "non-finite",
        None,
    )
    assert "not finite" in blowup.describe()


def test_spectral_norm_growth_is_measured_from_the_first_norm_floored_at_one():
    detector = BlowUpDetector()
    detector.observe(metrics(0, 100.0, norm=0.2))
    assert detector.observe(metrics(100, 50.0, norm=0.9 * SPECTRAL_NORM_GROWTH)) is None
    blowup = detector.observe(metrics(200, 50.0, norm=3e4))
    assert (blowup.metric, blowup.value, blowup.reference) == ("spectral_norm", 3e4, 1.0)
    started_large = BlowUpDetector()
    started_large.observe(metrics(0, 100.0, norm=5.0))
    assert started_large.observe(metrics(100, 50.0, norm=3e3)) is None  # 600× of 5


def test_stuck_units_are_a_blow_up_only_with_a_grown_weight_matrix():
    detector = BlowUpDetector()
    detector.observe(metrics(0, 140.0, norm=0.3))
    # All units "on" at a modest ‖W‖₂: a Bernoulli RBM on binarized Frey Face with SGD.
    assert detector.observe(metrics(100, 58.0, norm=15.0, stuck=1.0)) is None
    big = 1.5 * STUCK_NORM_GROWTH
    assert detector.observe(metrics(200, 58.0, norm=big, stuck=0.5 * STUCK_FRACTION)) is None
    blowup = detector.observe(metrics(300, 60.0, norm=big, stuck=1.0))
    assert (blowup.metric, blowup.criterion, blowup.value) == (
        "saturated_hidden_fraction",
        "stuck",
        1.0,
    )
    assert f"‖W‖₂ {big:.3g}" in blowup.describe()


def test_detector_state_is_json_and_round_trips():
    detector = BlowUpDetector()
    for m in (metrics(0, 600.0, 0.3), metrics(100, 250.0, 8.0)):
        detector.observe(m)
    state = json.loads(json.dumps(detector.state_dict()))
    resumed = BlowUpDetector()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == detector.state_dict()
    later = metrics(200, 250.0 * RECONSTRUCTION_GROWTH * 1.1, 9.0)
    assert resumed.observe(later) == detector.observe(later) != None  # noqa: E711
    with pytest.raises(ValueError, match="best_step"):
        BlowUpDetector().load_state_dict({"best_reconstruction_error": 1.0})


def test_suggestions_and_divergence_errors():
    assert suggested_lr(3e-3) == pytest.approx(3e-3 / BACKOFF_FACTOR)
    assert suggested_lr(1.0, 4.0) == 0.25
    for bad in ((0.0,), (math.nan,), (1.0, 1.0)):
        with pytest.raises(ValueError):
            suggested_lr(*bad)
    error = DivergenceError("parameters ['W'] became NaN or Inf by step 7", step=7)
    blowup = blowup_from_error(error, step=5)
    assert (blowup.step, blowup.metric, blowup.criterion) == (7, "parameters", "non-finite")
    assert "by step 7" in blowup.describe()
    assert blowup_from_error(DivergenceError("no step"), step=5).step == 5
    spent = BlowUpError("spent", blowup=blowup, suggested_lr=1e-4)
    copy = pickle.loads(pickle.dumps(spent))  # as a process pool returns a worker's error
    assert (copy.step, copy.suggested_lr, str(copy)) == (7, 1e-4, "spent")
    assert copy.blowup.describe() == blowup.describe()
    assert isinstance(copy, DivergenceError) and DEFAULT_MAX_BACKOFFS >= 1


# --- real runs ----------------------------------------------------------------------------------

STEPS, EVAL_EVERY, N_HIDDEN = 100, 25, 16


def gaussian_fit(dataset: str, optimizer: str, lr: float, **kwargs) -> list[dict]:
    train, valid = builtin_dataset(dataset, "gaussian")
    torch.manual_seed(0)
    model = GaussianRBM(train.shape[1], N_HIDDEN)
    options = {"steps": STEPS, "eval_every": EVAL_EVERY, "valid_data": valid, **kwargs}
    return fit(model, train, optimizer=optimizer, lr=lr, seed=0, **options)


@needs_shared_data
def test_the_frey_face_gaussian_rbm_at_a_too_large_ssd_step_is_detected():
    # Finite all along (the trainer's NaN check passes), yet the error grows by 20+ decades.
    train, valid = builtin_dataset("freyface", "gaussian")
    torch.manual_seed(0)
    trainer = Trainer(
        GaussianRBM(train.shape[1], N_HIDDEN),
        train,
        optimizer=OptimizerConfig("ssd", lr=0.01),
        valid_data=valid,
    )
    detector = BlowUpDetector()
    assert detector.observe(trainer.evaluate()) is None
    trainer.train_steps(EVAL_EVERY)
    after = trainer.evaluate()
    assert all(math.isfinite(p.detach().sum()) for p in trainer.model.parameters())
    blowup = detector.observe(after)
    assert blowup is not None and blowup.step == EVAL_EVERY
    assert blowup.metric == "reconstruction_error" and blowup.value > 1e10 * blowup.reference


@needs_shared_data
def test_fit_backs_off_from_a_step_size_a_hundred_times_too_large():
    lr = 100 * default_lr("gaussian", "sgd")
    history = gaussian_fit("freyface", "sgd", lr)
    backoffs = [entry for entry in history if entry.get("event") == "backoff"]
    assert backoffs, "expected at least one backoff"
    first = backoffs[0]
    assert first["old_lr"] == pytest.approx(lr)
    assert first["new_lr"] == pytest.approx(lr / BACKOFF_FACTOR)
    assert first["rolled_back_to"] < first["step"] and first["rolled_back_to"] % EVAL_EVERY == 0
    assert "reconstruction_error" in first["reason"]
    evaluations = [entry for entry in history if "event" not in entry]
    assert evaluations[-1]["step"] == STEPS
    assert [e["step"] for e in evaluations] == sorted({e["step"] for e in evaluations})
    detector = BlowUpDetector()
    assert all(detector.observe(e) is None for e in evaluations)
    assert evaluations[-1]["reconstruction_error"] < evaluations[0]["reconstruction_error"]


@needs_shared_data
def test_without_backoffs_a_blow_up_ends_the_run_naming_step_metric_and_suggestion():
    with pytest.raises(BlowUpError) as raised:
        gaussian_fit("freyface", "ssd", 0.01, max_backoffs=0)
    message = str(raised.value)
    assert re.search(r"reconstruction_error \S+ at step 25 is", message)
    assert "blew up with backoff off (max_backoffs 0)" in message
    assert "its step size was 0.01; try lr = 0.001 or smaller" in message
    assert raised.value.suggested_lr == pytest.approx(1e-3) and raised.value.step == EVAL_EVERY
    assert [m["step"] for m in raised.value.history] == [0]


def test_a_divergence_error_during_fit_is_backed_off_too():
    data = synthetic_rbm_data(20, 5, n_samples=400, seed=0)
    torch.manual_seed(0)
    # Each of these step sizes overflows the Gaussian variances to Inf within a few steps: the
    # trainer's DivergenceError, backed off like any blow-up until the budget is spent.
    with pytest.raises(BlowUpError, match="parameters") as raised:
        fit(GaussianRBM(20, 5), data, steps=40, optimizer="sgd", lr=1e30, eval_every=10)
    backoffs = [e for e in raised.value.history if e.get("event") == "backoff"]
    assert len(backoffs) == DEFAULT_MAX_BACKOFFS
    assert [b["new_lr"] for b in backoffs] == pytest.approx([1e29, 1e28, 1e27])
    # The factor is fit's to choose (the service's training.backoff_factor), BACKOFF_FACTOR
    # when not given.
    torch.manual_seed(0)
    with pytest.raises(BlowUpError, match="each dividing the step sizes by 100") as raised:
        fit(
            GaussianRBM(20, 5),
            data,
            steps=40,
            optimizer="sgd",
            lr=1e30,
            eval_every=10,
            max_backoffs=2,
            backoff_factor=100.0,
        )
    backoffs = [e for e in raised.value.history if e.get("event") == "backoff"]
    assert [b["new_lr"] for b in backoffs] == pytest.approx([1e28, 1e26])
    assert raised.value.suggested_lr == pytest.approx(1e24)
    with pytest.raises(ValueError, match="backoff factor"):
        fit(GaussianRBM(20, 5), data, steps=1, backoff_factor=1.0)


# --- the recovery rule on a trainer -------------------------------------------------------------


def test_a_run_that_ends_far_above_its_best_gets_a_drift_note_naming_best_step_and_fix():
    """The MNIST n_h 200 drift of docs/RESULTS.md §9 in numbers: 339 at step 200, rising under
    the blow-up limit to 2,353. Healthy all the way, so only its end is noted."""
    data = synthetic_rbm_data(20, 5, n_samples=200, seed=0)
    trainer = Trainer(BernoulliRBM(20, 5), data, optimizer=OptimizerConfig("ssd", lr=1e-4))
    recovery = Recovery(lr_setting="optimizer.lr")
    drifting = [(0, 622.0), (200, 339.1), (1000, 682.4), (2000, 2353.0)]
    assert all(recovery.check(metrics(s, e), trainer) is None for s, e in drifting)
    note = recovery.drift(metrics(2000, 2353.0))
    assert note is not None
    for part in ("2353", "6.9×", "339.1", "step 200", "drifted", "train 200 steps", "optimizer.lr"):
        assert part in note, (part, note)
    # just under the factor, or no finite error: nothing to note
    assert recovery.drift(metrics(2000, DRIFT_GROWTH * 339.1 * 0.999)) is None
    assert recovery.drift(metrics(2000, math.nan)) is None
    assert Recovery().drift(metrics(0, 5.0)) is None  # no evaluation yet


@needs_shared_data
def test_fit_warns_of_the_mnist_gaussian_drift_at_the_default_step(caplog):
    """The library's side of the service's drift test (tests/test_default_training.py), on
    docs/RESULTS.md §9's data: the same note, logged as a warning."""
    from experiments.defaults import load_data

    train, valid = load_data("mnist", "gaussian", 2000)
    torch.manual_seed(0)
    model = GaussianRBM(train.shape[1], 200)
    ssd = OptimizerConfig("ssd", lr=default_lr("gaussian", "ssd"))  # the long-run default
    with caplog.at_level("WARNING", logger="ssdcore.training"):
        history = fit(model, train, steps=1400, optimizer=ssd, eval_every=100, valid_data=valid)
    assert not any("event" in entry for entry in history)  # no blow-up on the way
    notes = [r.getMessage() for r in caplog.records if "drifted" in r.getMessage()]
    assert len(notes) == 1 and "(step 200)" in notes[0], notes

    # the same run as a pack of one (the solo run bit for bit) ends with the same note
    caplog.clear()
    torch.manual_seed(0)
    pack = TrainingPack([PackRun(GaussianRBM(train.shape[1], 200), ssd, 0)], train)
    with caplog.at_level("WARNING", logger="ssdcore.pack.fit"):
        fit_pack(pack, steps=1400, eval_every=100, valid_data=valid)
    packed = [r.getMessage() for r in caplog.records if "drifted" in r.getMessage()]
    assert packed == [f"pack run 0: {notes[0]}"]


def test_recovery_rolls_back_to_the_last_healthy_evaluation_until_its_budget_is_spent():
    data = synthetic_rbm_data(20, 5, n_samples=400, seed=0)
    torch.manual_seed(0)
    trainer = Trainer(BernoulliRBM(20, 5), data, optimizer=OptimizerConfig("sgd", lr=0.1))
    recovery = Recovery(
        max_backoffs=2,
        factor=4.0,
        lr_setting="optimizer.lr",
        max_backoffs_setting="training.max_backoffs",
    )
    assert recovery.check(trainer.evaluate(), trainer) is None and recovery.healthy_step == 0
    trainer.train_steps(10)
    assert recovery.check(trainer.evaluate(), trainer) is None and recovery.healthy_step == 10
    healthy = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    blowup = BlowUp(15, "reconstruction_error", 1e9, 1.0, "growth", "its best so far")

    events = []
    for _ in range(2):
        trainer.train_steps(5)
        events.append(recovery.recover(blowup, trainer))
        assert trainer.step_count == 10  # back at the last healthy evaluation, every time
        for name, value in trainer.model.state_dict().items():
            assert torch.equal(value, healthy[name])
    assert events == [
        BackoffEvent(15, 10, 0.1, 0.1 / 4, 1 / 4, 1, 2, blowup.describe()),
        BackoffEvent(15, 10, 0.1 / 4, 0.1 / 16, 1 / 16, 2, 2, blowup.describe()),
    ]
    assert events[0].history_entry() == {
        "event": "backoff",
        "step": 15,
        "rolled_back_to": 10,
        "old_lr": 0.1,
        "new_lr": 0.025,
        "lr_scale": 0.25,
        "backoff": 1,
        "max_backoffs": 2,
        "reason": blowup.describe(),
    }
    trainer.train_steps(5)
    with pytest.raises(BlowUpError) as raised:
        recovery.recover(blowup, trainer)
    assert str(raised.value) == (
        "training blew up after 2 backoffs (each dividing the step sizes by 4): "
        f"{blowup.describe()}; its step size was 0.00625; try optimizer.lr = 0.00156 or smaller"
    )
    assert raised.value.suggested_lr == 0.1 / 64 and trainer.step_count == 10
    off = Recovery(max_backoffs=0, max_backoffs_setting="training.max_backoffs")
    assert off.check(trainer.evaluate(), trainer) is None
    with pytest.raises(BlowUpError, match=r"with backoff off \(training.max_backoffs 0\)"):
        off.recover(blowup, trainer)
    # A resumed run starts at the scale of the backoffs it took before.
    assert Recovery(factor=4.0, backoffs=2).lr_scale == 1 / 16
    for bad in ({"factor": 1.0}, {"max_backoffs": -1}, {"backoffs": 1.5}):
        with pytest.raises(ValueError):
            Recovery(**bad)


# --- the step-size scale ------------------------------------------------------------------------


def test_set_lr_scale_is_absolute_and_survives_a_checkpoint_resume():
    data = synthetic_rbm_data(30, 6, n_samples=400, seed=0)
    config = OptimizerConfig("sgd", per_parameter={"W": "ssd"})

    def trainer() -> Trainer:
        torch.manual_seed(0)
        return Trainer(BernoulliRBM(30, 6), data, optimizer=config, batch_size=50, seed=0)

    base = {g["name"]: g["lr"] for g in trainer().optimizer.param_groups}
    first = trainer()
    first.set_lr_scale(0.01)
    first.set_lr_scale(0.01)  # idempotent
    assert {g["name"]: g["lr"] for g in first.optimizer.param_groups} == pytest.approx(
        {name: 0.01 * lr for name, lr in base.items()}
    )
    assert first.lr == pytest.approx(0.01 * default_lr("bernoulli", "sgd"))
    first.train_steps(10)
    resumed = trainer_from_bytes(trainer_to_bytes(first), data)
    assert resumed.lr_scale == 0.01  # the checkpoint carries the scale
    resumed.set_lr_scale(0.01)  # what the service does after resuming: no change
    first.train_steps(10)
    resumed.train_steps(10)
    for p, q in zip(first.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="scale"):
        first.set_lr_scale(0.0)
