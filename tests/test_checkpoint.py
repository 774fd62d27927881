"""Checkpoints: models round-trip, and a resumed run is bit-for-bit the uninterrupted one (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from ssdcore import BernoulliRBM, GaussianRBM, OptimizerConfig, Trainer
from ssdcore.checkpoint import (
    load_model,
    load_trainer,
    load_trainer_state,
    model_from_bytes,
    model_to_bytes,
    save_model,
    save_trainer,
    trainer_from_bytes,
    trainer_to_bytes,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.bernoulli(torch.full((230, 12), 0.35), generator=generator)  # 4.6 batches/epoch


RUNS = {
    "nesterov-pcd": (OptimizerConfig("nesterov", lr=0.05), {"persistent": True, "cd_k": 2}),
    "ssd-lowrank": (OptimizerConfig("ssd", lr=1e-3), {}),
    "ssd-randomized": (OptimizerConfig("ssd", lr=1e-3, method="randomized", rank=3), {}),
    "ssd-adam-pcd": (
        OptimizerConfig("ssd-preconditioned", lr=1e-3, preconditioner="adam"),
        {"persistent": True},
    ),
    "hybrid-gaussian": (OptimizerConfig("sgd", lr=0.01, per_parameter={"W": "ssd"}), {"gauss": 1}),
}


def make(data: torch.Tensor, name: str) -> Trainer:
    config, options = RUNS[name]
    options = dict(options)
    torch.manual_seed(1)
    if options.pop("gauss", None):
        model = GaussianRBM(12, 5, variance="diagonal")
    else:
        model = BernoulliRBM(12, 5)
    return Trainer(model, data, optimizer=config, batch_size=50, seed=7, **options)


def assert_same_parameters(a: Trainer, b: Trainer) -> None:
    for (name, p), (_, q) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("name", list(RUNS))
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(data, name):
    straight = make(data, name)
    straight.train_steps(12)  # crosses two epoch boundaries
    first_half = make(data, name)
    first_half.train_steps(6)
    blob = trainer_to_bytes(first_half)
    resumed = trainer_from_bytes(blob, data)
    resumed.train_steps(6)
    assert resumed.step_count == 12
    assert_same_parameters(straight, resumed)
    into_existing = make(data, name)
    load_trainer_state(into_existing, blob)
    into_existing.train_steps(6)
    assert_same_parameters(straight, into_existing)


def test_trainer_files_round_trip(tmp_path, data):
    trainer = make(data, "ssd-lowrank")
    trainer.train_steps(4)
    save_trainer(tmp_path / "run.safetensors", trainer)
    loaded = load_trainer(tmp_path / "run.safetensors", data)
    assert loaded.step_count == 4 and loaded.epoch == trainer.epoch
    assert_same_parameters(trainer, loaded)


@pytest.mark.parametrize(
    "model",
    [
        BernoulliRBM(7, 3),
        GaussianRBM(7, 3, variance="identity"),
        GaussianRBM(7, 3, variance="isotropic"),
        GaussianRBM(7, 3, variance="diagonal"),
        GaussianRBM(7, 3, variance="full"),
    ],
    ids=lambda m: getattr(m, "variance", "bernoulli"),
)
def test_models_round_trip_with_their_config(tmp_path, model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(3)) * 0.01)
    loaded = model_from_bytes(model_to_bytes(model))
    assert type(loaded) is type(model) and loaded.config() == model.config()
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    save_model(tmp_path / "m.safetensors", model)
    assert load_model(tmp_path / "m.safetensors").config() == model.config()


def test_model_bytes_are_plain_safetensors_with_a_json_config():
    model = BernoulliRBM(6, 4)
    blob = model_to_bytes(model)
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    assert set(header) == {"__metadata__", "W", "a", "b"}
    assert json.loads(header["__metadata__"]["config"]) == model.config()


def test_garbage_and_wrong_kinds_are_refused(data):
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        model_from_bytes(b"\x80\x04definitely not safetensors")
    model_blob = model_to_bytes(BernoulliRBM(12, 5))
    with pytest.raises(ValueError, match="format"):
        trainer_from_bytes(model_blob, data)
    with pytest.raises(ValueError, match="format"):
        model_from_bytes(trainer_to_bytes(make(data, "ssd-lowrank")))


def test_resuming_with_other_settings_or_data_is_refused(data):
    blob = trainer_to_bytes(make(data, "ssd-lowrank"))
    other = Trainer(BernoulliRBM(12, 5), data, optimizer=OptimizerConfig("sgd"), batch_size=50)
    with pytest.raises(ValueError, match="settings"):
        load_trainer_state(other, blob)
    bigger = Trainer(BernoulliRBM(12, 6), data, optimizer=OptimizerConfig("ssd", lr=1e-3))
    with pytest.raises(ValueError, match="model"):
        load_trainer_state(bigger, blob)
    with pytest.raises(ValueError, match="same data"):
        trainer_from_bytes(blob, data[:200])


def cuda_saved(state: dict) -> dict:
    """A trainer state as a CUDA run saves it: 16-byte Philox generator states, no SFC64 words."""
    philox = torch.tensor([7, 0, 0, 0, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    moved = dict(state, generator=philox.clone())
    moved["estimator"] = {"rng.generator": philox.clone()}
    return moved


def test_a_state_saved_on_another_kind_of_device_resumes_deterministically(data, caplog):
    """CPU and CUDA generators cannot continue each other's streams: the resume reseeds from
    the saved states, with a warning, the same way every time, and training goes on."""
    trainer = make(data, "ssd-lowrank")
    trainer.train_steps(6)
    moved = cuda_saved(trainer.state_dict())
    resumed = []
    for _ in range(2):
        other = make(data, "ssd-lowrank")
        with caplog.at_level("WARNING"):
            other.load_state_dict(moved)
        other.train_steps(4)
        resumed.append(other)
    assert "saved on a CUDA device" in caplog.text
    assert resumed[0].step_count == 10
    assert_same_parameters(resumed[0], resumed[1])
