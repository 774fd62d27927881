"""experiments/packed.py: runs trained as packs give the records of the same runs trained alone.

On the CPU a packed run follows its solo Trainer bit for bit (ssdcore.pack), so the comparison
is exact: same evaluation steps, same reconstruction errors, same final parameters.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from experiments import common, packed
from experiments.common import EvalPlan, ModelSpec, RunSpec, TorchOptimizer
from ssdcore.data import synthetic_rbm_data
from ssdcore.optim import OptimizerConfig


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plan() -> EvalPlan:
    data = synthetic_rbm_data(n_visible=16, n_hidden=6, n_samples=300, seed=0)
    return EvalPlan(data[:240], data[240:], every=5)


def _spec(lr: float, name: str = "sgd", seed: int = 0, kind: str = "bernoulli") -> RunSpec:
    optimizer = OptimizerConfig(name=name, lr=lr, method="svd" if name == "ssd" else "lowrank")
    return RunSpec(f"{kind}/{name} {lr}", ModelSpec(kind, 6), optimizer, 12, 20, 2, seed=seed)


def _same(packed_result: common.RunResult, solo: common.RunResult) -> None:
    assert packed_result.diverged_at == solo.diverged_at
    strip = [{k: v for k, v in r.items() if k != "train_seconds"} for r in packed_result.records]
    assert strip == [{k: v for k, v in r.items() if k != "train_seconds"} for r in solo.records]
    for name, parameter in solo.model.named_parameters():
        assert torch.equal(getattr(packed_result.model, name), parameter), name


def test_packed_runs_equal_their_solo_runs(plan: EvalPlan) -> None:
    specs = [_spec(0.1), _spec(0.3, seed=1), _spec(1.0), _spec(3e-3, "ssd"), _spec(1e-2, "ssd")]
    results = packed.execute_all(specs, plan)
    assert [r.extra.get("pack_size") for r in results] == [3, 3, 3, 2, 2]
    for spec, result in zip(specs, results, strict=True):
        assert result.spec is spec
        _same(result, common.execute(spec, plan))


def test_a_diverging_run_stops_alone(plan: EvalPlan) -> None:
    specs = [_spec(0.1), _spec(1e38)]
    results = packed.execute_all(specs, plan)
    assert results[1].diverged_at is not None and results[0].diverged_at is None
    assert len(results[0].records) == len(plan.steps(12))
    _same(results[0], common.execute(specs[0], plan))
    solo = common.execute(specs[1], plan)
    assert solo.diverged_at is not None and results[1].diverged_at == solo.diverged_at
    assert len(results[1].records) == len(solo.records)


def test_gaussian_runs_of_one_variance_form_pack_and_equal_their_solo_runs(plan: EvalPlan) -> None:
    def grbm(lr: float, variance: str, seed: int = 0) -> RunSpec:
        model = ModelSpec("gaussian", 6, variance=variance)
        return RunSpec(f"{variance} {lr}", model, OptimizerConfig("sgd", lr=lr), 12, 20, seed=seed)

    specs = [grbm(1e-3, "diagonal"), grbm(3e-3, "diagonal", seed=1), grbm(1e-3, "isotropic")]
    results = packed.execute_all(specs, plan)
    assert [r.extra.get("pack_size") for r in results] == [2, 2, None]
    for spec, result in zip(specs, results, strict=True):
        _same(result, common.execute(spec, plan))


def test_what_cannot_be_packed_runs_alone(plan: EvalPlan) -> None:
    full = ModelSpec("gaussian", 6, variance="full")
    gaussian = RunSpec("grbm", full, OptimizerConfig("sgd", lr=1e-3), 12, 20)
    twin = RunSpec("grbm twin", full, OptimizerConfig("sgd", lr=2e-3), 12, 20)
    centered = RunSpec(
        "c", ModelSpec("bernoulli", 6), OptimizerConfig("sgd"), 12, 20, centered=True
    )
    centered_twin = dataclasses.replace(centered, label="c twin")
    adam = RunSpec("adam", ModelSpec("bernoulli", 6), TorchOptimizer("adam", 1e-3), 12, 20)
    pssd = RunSpec(
        "pssd",
        ModelSpec("bernoulli", 6),
        OptimizerConfig("ssd-preconditioned", lr=1e-3, preconditioner="adam"),
        12,
        20,
    )
    longer = RunSpec("longer", ModelSpec("bernoulli", 6), OptimizerConfig("sgd", lr=0.1), 15, 20)
    shorter = RunSpec("shorter", ModelSpec("bernoulli", 6), OptimizerConfig("sgd", lr=0.3), 10, 20)
    specs = [gaussian, twin, centered, centered_twin, adam, pssd, longer, shorter]
    assert all(len(group) == 1 for group in packed.groups(specs, 16))
    for spec, result in zip(specs, packed.execute_all(specs, plan), strict=True):
        assert result.extra.get("pack_size") is None
        assert math.isfinite(result.final("test_recon")), spec.label
