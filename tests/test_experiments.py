"""Quick variants of every experiment (tiny sizes, few steps), so that the code keeps working.

Budget: about 60 s for the whole file on a 2-core machine. Each test runs an experiment's
`--quick` configuration through the same code path as the full run and checks what it wrote.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments import (
    beyond,
    common,
    convergence,
    freyface,
    grbm,
    large,
    mnist,
    simulation,
    transfer,
    tuning,
)
from experiments.__main__ import main


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The experiments run with one torch thread (see `common.configure_threads`); restore after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pngs_written(directory: Path, names: list[str]) -> None:
    for name in names:
        path = directory / name
        assert path.exists(), f"missing figure {path}"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size <= common.FIGURE_MAX_BYTES


def _finite_recon(rows: list[dict]) -> None:
    for row in rows:
        assert math.isfinite(row["test_recon"]) and row["test_recon"] >= 0, row
        assert math.isfinite(row["train_recon"]) and row["train_recon"] >= 0, row


def test_simulation_quick(tmp_path: Path) -> None:
    summary = simulation.run(tmp_path, quick=True)
    assert len(summary["brbm"]) == 8
    assert len(summary["grbm"]) == 2
    _finite_recon(summary["brbm"] + summary["grbm"])
    # Exact log-probability of binary vectors under a BRBM: a finite value below zero.
    for row in summary["brbm"]:
        assert math.isfinite(row["test_ll"]) and row["test_ll"] < 0, row
    assert all(math.isfinite(row["test_ll"]) for row in summary["grbm"])
    directory = tmp_path / "simulation"
    _pngs_written(
        directory,
        ["fig3ab_brbm_recon.png", "fig3c_grbm_recon.png", "brbm_exact_ll.png", "grbm_exact_ll.png"],
    )
    curves = json.loads((directory / "curves.json").read_text())
    assert {r["label"] for r in curves} >= {"SGD (large)", "SSD_W/SGD (small)", "SSD"}
    # The exact likelihood is taken on the trained models themselves, at half and at the end.
    ll_steps = {r["step"] for r in curves if r["label"] == "SSD" and math.isfinite(r["test_ll"])}
    assert ll_steps == {15, 30}


def test_mnist_quick(tmp_path: Path) -> None:
    summary = mnist.run(tmp_path, quick=True)
    _finite_recon(summary["summary"] + summary["large"])
    timing = {(r["model"], r["optimizer"]): r for r in summary["timing"]}
    assert set(timing) == {
        (model, name)
        for model in ("BRBM", "GRBM")
        for name in ("SGD", "Nesterov", "SSD (svd)", "SSD (lowrank)")
    }
    assert timing[("BRBM", "SGD")]["÷ SGD"] == pytest.approx(1.0)
    assert all(r["s per 1k iterations"] > 0 for r in summary["timing"])
    assert all(math.isfinite(r["test_ll"]) for r in summary["summary"])
    _pngs_written(
        tmp_path / "mnist",
        [
            "fig3d_recon.png",
            "ais_ll.png",
            "fig3e_filters_brbm.png",
            "fig3e_filters_grbm.png",
            "w_histograms.png",
            "fig3f_variances.png",
            "h500.png",
        ],
    )
    assert (tmp_path / "mnist" / "table1_time.md").read_text().startswith("| model | optimizer |")


def test_freyface_quick(tmp_path: Path) -> None:
    summary = freyface.run(tmp_path, quick=True)
    assert [r["run"] for r in summary["summary"]] == [
        "BRBM Nesterov",
        "BRBM SSD",
        "GRBM Nesterov",
        "GRBM SSD",
    ]
    _finite_recon(summary["summary"])
    _pngs_written(tmp_path / "freyface", ["fig4_recon.png", "reconstructions.png"])


def test_beyond_quick(tmp_path: Path) -> None:
    summary = beyond.run(tmp_path, quick=True)
    _finite_recon(summary["adaptive"] + summary["polar_quality"] + summary["pcd"])
    accuracy = {r["method"]: r for r in summary["polar_accuracy"]}
    # svd and the exact low-rank step agree with torch.linalg.svd to float32 precision.
    assert accuracy["svd"]["direction rel. error"] < 1e-3
    assert accuracy["lowrank"]["direction rel. error"] < 1e-3
    assert accuracy["lowrank"]["nuclear norm rel. error"] < 1e-4
    _pngs_written(tmp_path / "beyond", ["adaptive.png", "polar_methods.png", "pcd_vs_cd.png"])


def test_transfer_quick(tmp_path: Path) -> None:
    summary = transfer.run(tmp_path, quick=True)
    rules = transfer.QUICK.grids
    assert len(summary["grid"]) == sum(len(g) for g in rules.values()) * len(transfer.QUICK.sizes)
    assert all(math.isfinite(row["test_ll"]) and row["test_ll"] < 0 for row in summary["grid"])
    for row in summary["grid"]:
        if row["n_hidden"] <= transfer.EXACT_MAX_HIDDEN:  # exact: both "bounds" are the value
            assert row["ll_lower"] == row["test_ll"], row
        else:  # certified pair: the conservative bound sits below (within its noise)
            assert math.isfinite(row["ll_lower"]) and row["ll_lower"] <= row["test_ll"] + 1.0, row
    rows = summary["transfer"]
    assert {(r["rule"], r["n_hidden"]) for r in rows} == {
        (rule, size) for rule in rules for size in transfer.QUICK.sizes
    }
    assert all(row["loss_nats"] >= 0 for row in rows)
    assert (tmp_path / "transfer" / "transfer.md").exists()


def test_large_quick(tmp_path: Path) -> None:
    summary = large.run(tmp_path, quick=True)
    labels = [m.label for m in large.methods(large.QUICK, {})]
    rows = summary["summary"]
    assert [(r["budget"], r["run"]) for r in rows] == [
        (budget, label) for budget in large.BUDGETS for label in labels
    ]
    runs = {(r["budget"], r["run"]): r for r in summary["runs"]}
    _finite_recon(summary["runs"])
    for row in summary["runs"]:
        # every run ends with both certified bounds, the conservative one below the other
        assert math.isfinite(row["ll_upper"]) and math.isfinite(row["ll_lower"]), row
        assert row["ll_lower"] <= row["ll_upper"] + 4 * (row["ll_upper_se"] + row["ll_lower_se"])
    # equal iterations: every run takes them all; equal wall time: a run stops short only once
    # its training time has reached SGD's, and SGD's row is its equal-iterations run
    assert all(runs[("iterations", label)]["steps"] == large.QUICK.steps for label in labels)
    sgd_seconds = runs[("iterations", "SGD")]["train_seconds"]
    assert runs[("wall", "SGD")] == runs[("iterations", "SGD")] | {"budget": "wall"}
    for label in labels[1:]:
        row = runs[("wall", label)]
        assert 1 <= row["steps"] <= large.QUICK.steps
        assert row["steps"] == large.QUICK.steps or row["train_seconds"] >= sgd_seconds, row
    # the normalized rule's step is the library's default, never a value tuned at this size
    assert runs[("iterations", "SSD normalized")]["lr"] == f"{large.NORMALIZED_LR:.3g}"
    _pngs_written(tmp_path / "large", ["recon.png", "ll_bounds.png"])
    assert (tmp_path / "large" / "summary.md").read_text().startswith("| budget | run |")


def test_convergence_quick(tmp_path: Path) -> None:
    summary = convergence.run(tmp_path, quick=True)
    labels = [m.label for m in convergence.methods(convergence.QUICK, {})]
    assert [r["run"] for r in summary["summary"]] == labels
    steps = convergence.QUICK.likelihood_at
    assert {(r["run"], r["step"]) for r in summary["runs"]} == {
        (x, s) for x in labels for s in steps
    }
    ceiling = summary["generator_ll"]
    for row in summary["runs"]:
        # exact values; a fitted model cannot score far above the generator on its own data
        assert math.isfinite(row["test_ll"]) and row["test_ll"] <= ceiling + 0.5, row
    targets = json.loads((tmp_path / "convergence" / "targets.json").read_text())
    assert targets == summary["targets"]
    assert targets["best_baseline"] in labels and targets["generator_ll"] == ceiling
    assert targets["gap_target_met"] == (targets["best_ssd_gap"] <= convergence.QUICK.target_gap)
    _pngs_written(tmp_path / "convergence", ["ll.png"])


def test_convergence_judges_reach_and_gap_on_the_seed_means() -> None:
    methods = [
        convergence.Method("base A", convergence.BASELINE, None),  # type: ignore[arg-type]
        convergence.Method("base B", convergence.BASELINE, None),  # type: ignore[arg-type]
        convergence.Method("ssd slow", convergence.SSD_FAMILY, None),  # type: ignore[arg-type]
        convergence.Method("ssd fast", convergence.SSD_FAMILY, None),  # type: ignore[arg-type]
    ]
    config = dataclasses.replace(convergence.FULL, likelihood_at=(100, 300, 3000), target_steps=300)
    curves = {
        "base A": {100: -40.0, 300: -39.0, 3000: -38.0},
        "base B": {100: -39.0, 300: -38.5, 3000: -37.9},  # the best baseline: -37.9 at the end
        "ssd slow": {100: -39.0, 300: -38.0, 3000: -37.85},  # reaches it only at 3000
        "ssd fast": {100: -38.0, 300: -37.9, 3000: -37.95},  # reaches it at 300, ends lower
    }
    targets = convergence.judge(methods, curves, config, ceiling=-37.6)
    assert targets["best_baseline"] == "base B" and targets["best_baseline_final_ll"] == -37.9
    assert targets["ssd_steps_to_baseline_final"] == {"ssd slow": 3000, "ssd fast": 300}
    assert targets["fastest_ssd"] == "ssd fast" and targets["reach_target_met"]
    assert targets["best_ssd_final"] == "ssd slow"
    assert targets["best_ssd_gap"] == pytest.approx(0.25) and targets["gap_target_met"]
    slower = dict(curves, **{"ssd fast": {100: -38.0, 300: -38.2, 3000: -37.95}})
    assert not convergence.judge(methods, slower, config, ceiling=-37.6)["reach_target_met"]
    assert not convergence.judge(methods, curves, config, ceiling=-37.0)["gap_target_met"]


def test_grbm_quick(tmp_path: Path) -> None:
    summary = grbm.run(tmp_path, quick=True)
    assert [r["run"] for r in summary["mnist"]] == ["GRBM SGD", "GRBM Nesterov", "GRBM SSD"]
    assert [r["run"] for r in summary["freyface"]] == ["GRBM Nesterov", "GRBM SSD"]
    _finite_recon(summary["mnist"] + summary["freyface"])
    _pngs_written(tmp_path / "grbm", ["mnist_grbm.png", "mnist_variances.png", "freyface_grbm.png"])


def test_tuning_quick_leaves_chosen_step_sizes_alone(tmp_path: Path) -> None:
    before = common.STEP_SIZES_PATH.read_bytes() if common.STEP_SIZES_PATH.exists() else None
    summary = tuning.run(tmp_path, quick=True)
    after = common.STEP_SIZES_PATH.read_bytes() if common.STEP_SIZES_PATH.exists() else None
    assert before == after
    chosen = summary["chosen"]
    assert "mnist-grbm/ssd" in chosen and "beyond/pssd-adam" in chosen
    kinds = {s.key: s.model.kind for s in tuning.settings(quick=True)}
    for key, lr in chosen.items():
        setting, optimizer = key.split("/")
        assert lr in tuning.GRIDS[kinds[setting]][optimizer], key
    written = json.loads((tmp_path / "tuning" / "step_sizes.json").read_text())
    assert written["chosen"] == chosen
    # the grids with SGD, Nesterov and SSD (Bernoulli and Gaussian RBMs) train as packs; the
    # "beyond" setting's torch optimizers and preconditioned SSD alone
    assert summary["packed"] is True
    for row in json.loads((tmp_path / "tuning" / "grid.json").read_text()):
        packable = row["setting"] != "beyond"
        assert row["pack"] == (2 if packable else 1), row


def test_only_packed_experiments_take_sequential(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["freyface", "--quick", "--sequential", "--out", str(tmp_path)])
    assert refused.value.code == 2


def test_only_piloted_experiments_take_pilot(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["freyface", "--quick", "--pilot", "--out", str(tmp_path)])
    assert refused.value.code == 2
    # the pilot is the full configuration on fewer seeds, both budgets kept
    assert large.PILOT.seeds == (0,) and large.PILOT.budgets == large.BUDGETS
    assert dataclasses.replace(large.PILOT, seeds=large.FULL.seeds) == dataclasses.replace(
        large.FULL, likelihood_fractions=large.PILOT.likelihood_fractions
    )


def test_large_time_only_runs_sgd_for_the_budget_then_every_configuration_under_it(
    tmp_path: Path,
) -> None:
    summary = large.run(tmp_path, quick=True, time_only=True)
    labels = [m.label for m in large.methods(large.QUICK, {})]
    budgets = [(row["budget"], row["run"]) for row in summary["runs"]]
    assert budgets == [("iterations", "SGD")] + [("wall", label) for label in labels]
    with pytest.raises(SystemExit):
        main(["simulation", "--quick", "--time-only", "--out", str(tmp_path)])


def test_large_runs_a_subset_with_sgd_for_the_time_budget() -> None:
    subset = dataclasses.replace(large.QUICK, only=("SSD normalized",))
    assert [m.label for m in large.methods(subset, {})] == ["SGD", "SSD normalized"]
    with pytest.raises(ValueError, match="SSD typo"):
        large.methods(dataclasses.replace(large.QUICK, only=("SSD typo",)), {})


def test_command_line_writes_run_summary(tmp_path: Path) -> None:
    assert main(["freyface", "--quick", "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "freyface" / "run.json").read_text())
    assert run["quick"] is True and run["wall_seconds"] > 0


def test_markdown_table_and_image_grid() -> None:
    text = common.markdown_table([{"a": 1.23456, "b": math.nan}, {"a": 2.0, "b": "x"}])
    assert text.splitlines() == ["| a | b |", "| --- | --- |", "| 1.235 | — |", "| 2 | x |"]
    grid = common.image_grid(np.arange(12, dtype=np.float32).reshape(3, 4), (2, 2), columns=2)
    assert grid.shape == (6, 6)
    # each tile is scaled to [0, 1] by its own range; gaps and unused tiles are 1
    assert grid[0, 0] == 0.0 and grid[1, 1] == 1.0 and grid[2, :].tolist() == [1.0] * 6
