"""The benchmark suite: its JSON output shape on a quick run, and the correctness of its parts.

Budget: under 60 s on an idle 2-core machine (one `python -m bench all --quick` run, which starts
its own redis-server and gRPC server, plus small in-process checks). No timing is asserted: speed
is what the benchmark reports, not what a test decides.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.reference import ReferenceConfig, ReferenceLoop, ReferenceRBM, cd_chain, spectral_step
from bench.report import Case, Report, Target, read_json_lines, render_text
from bench.timing import interleaved_rounds, peak_tensor_mib, percentile

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICK_RUN_TIMEOUT_S = 240  # a guard against a hang, far above the ~40 s a quick run takes


@pytest.fixture(scope="module")
def quick_records() -> list[dict]:
    """Every JSON record of one `python -m bench all --quick --json --threads 1` run."""
    return quick_run("all")


def quick_run(suite: str) -> list[dict]:
    """Every JSON record of one `python -m bench SUITE --quick --json --threads 1` run.

    One thread: on a busy shared machine, torch's spinning OpenMP threads can make a run several
    times slower, and these tests check the output's shape, not speed.
    """
    completed = subprocess.run(
        [sys.executable, "-m", "bench", suite, "--quick", "--json", "--threads", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=QUICK_RUN_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads(line) for line in completed.stdout.splitlines() if line.strip()]


def _cases(records: list[dict], suite: str) -> list[dict]:
    return [r for r in records if r["kind"] == "case" and r["suite"] == suite]


def _is_positive_number(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_quick_run_starts_with_the_environment(quick_records):
    environment = quick_records[0]
    assert environment["kind"] == "environment"
    assert environment["quick"] is True
    assert environment["torch_threads"] == 1
    assert environment["failed_suites"] == []
    assert {"torch", "torch_threads", "device", "time_utc"} <= environment.keys()
    assert {r["kind"] for r in quick_records} == {"environment", "case", "target"}


def test_core_cases_cover_every_variant_with_ratios(quick_records):
    cases = _cases(quick_records, "core")
    names = {case["name"] for case in cases}
    for model in ("bernoulli", "gaussian"):
        for optimizer in (
            "sgd",
            "nesterov",
            "ssd-svd",
            "ssd-lowrank",
            "ssd-randomized",
            "ssd-newton-schulz",
        ):
            assert f"project/{model}/{optimizer}" in names
        for optimizer in ("sgd", "nesterov", "ssd"):
            assert f"reference/{model}/{optimizer}" in names
    for case in cases:
        assert case["config"]["batch"] == 100
        assert _is_positive_number(case["metrics"]["ms_per_iter"])
        assert case["metrics"]["setup_mib"] >= 0 and case["metrics"]["step_mib"] >= 0
        for ratio in case["ratios"].values():
            assert _is_positive_number(ratio)
        if case["name"].startswith("project/"):
            assert "x_faster_than_reference" in case["ratios"]
        if "/ssd" in case["name"]:
            assert "ssd_over_sgd" in case["ratios"]


def test_sklearn_cases_score_both_implementations(quick_records):
    cases = {case["name"]: case for case in _cases(quick_records, "sklearn")}
    race = cases.pop("ssd-default-cd1-to-sklearn-error")
    assert _is_positive_number(race["metrics"]["sklearn_s"]) and race["metrics"]["ssd_steps"] > 0
    assert set(cases) == {"ssdcore", "sklearn-float64", "sklearn-float32"}
    for case in cases.values():
        assert _is_positive_number(case["metrics"]["s_per_epoch"])
        assert _is_positive_number(case["metrics"]["recon_error"])
        assert case["metrics"]["pseudo_ll"] < 0
    assert _is_positive_number(cases["ssdcore"]["ratios"]["x_faster_than_sklearn-float32"])


def test_service_cases_report_latency_throughput_and_memory(quick_records):
    cases = {case["name"]: case for case in _cases(quick_records, "service")}
    for rpc in ("Reconstruct", "SampleHidden"):
        for batch in (1, 256):
            metrics = cases[f"{rpc} batch {batch}"]["metrics"]
            assert 0 < metrics["p50_ms"] <= metrics["p99_ms"]
    assert _is_positive_number(cases["Reconstruct 16 clients"]["metrics"]["requests_per_s"])
    assert cases["StreamMetrics lag"]["metrics"]["p99_ms"] >= 0
    training = cases["training throughput"]
    assert _is_positive_number(training["metrics"]["idle_samples_per_s"])
    assert _is_positive_number(training["metrics"]["loaded_samples_per_s"])
    memory = cases["server memory"]["metrics"]
    assert _is_positive_number(memory["idle_rss_mib"])
    assert _is_positive_number(memory["busy_rss_mib"])
    pinned = cases.get("training throughput, pinned")
    if len(os.sched_getaffinity(0)) >= 2:  # the pinned variant needs two CPUs to split
        assert pinned["config"]["serving_cpus"] != pinned["config"]["training_cpus"]
        assert _is_positive_number(pinned["metrics"]["loaded_samples_per_s"])
        assert "throughput_lost" in pinned["ratios"]


def test_service_upload_case_reports_redis_stall_and_api_memory(quick_records):
    uploads = [
        c for c in _cases(quick_records, "service") if c["name"].startswith("dataset upload")
    ]
    assert uploads
    for case in uploads:
        metrics = case["metrics"]
        assert _is_positive_number(metrics["upload_s"])
        assert metrics["pings"] > 0
        assert metrics["redis_max_gap_ms"] > 0
        assert _is_positive_number(metrics["api_peak_rss_mib"])
        assert metrics["api_peak_rss_mib"] >= metrics["api_rss_before_mib"] > 0
        assert case["config"]["store_chunk_bytes"] > 0


def test_pack_cases_compare_packed_with_the_same_runs_in_turn(quick_records):
    cases = {case["name"]: case for case in _cases(quick_records, "pack")}
    packed = [name for name in cases if name.endswith("/packed")]
    assert len(packed) >= 2
    for name in packed:
        label = name.removesuffix("/packed")
        assert _is_positive_number(cases[name]["metrics"]["model_iters_per_s"])
        assert _is_positive_number(cases[f"{label}/sequential"]["ratios"]["packed_x_faster"])
        assert cases[name]["config"]["runs"] >= 2
    # Gaussian packs too, on standardized data, as plain cases (the targets are Bernoulli).
    gaussian = [name for name in packed if cases[name]["config"]["rbm"] == "grbm-diagonal"]
    assert {cases[name]["config"]["model"] for name in gaussian} == {"simulation", "mnist"}
    pack_targets = [r["name"] for r in quick_records if r["kind"] == "target"]
    assert not any("grbm" in name for name in pack_targets)


def test_pack_only_keeps_the_matching_configurations():
    from bench import pack

    gaussian = pack.plan(quick=False, cuda=False, only="grbm").configs
    assert {(c.name, c.optimizer) for c in gaussian} == {
        (name, optimizer) for name in ("simulation", "mnist") for optimizer in ("sgd", "ssd")
    }
    assert all(c.variance == "diagonal" and c.target is None for c in gaussian)
    assert {c.n_runs for c in gaussian if c.name == "simulation"} == {32}
    with pytest.raises(ValueError, match="matches no pack configuration"):
        pack.plan(quick=True, cuda=False, only="no such case")


def test_service_pack_case_times_the_packed_sweep_against_one_job_at_a_time(quick_records):
    cases = {case["name"]: case for case in _cases(quick_records, "service-pack")}
    [packed] = [case for name, case in cases.items() if name.endswith("/packed")]
    [alone] = [case for name, case in cases.items() if name.endswith("/one at a time")]
    jobs = packed["config"]["jobs"]
    assert packed["metrics"]["packed_jobs"] == packed["metrics"]["largest_pack"] == jobs
    assert alone["metrics"]["packed_jobs"] == 0 and alone["metrics"]["largest_pack"] == 1
    assert _is_positive_number(packed["metrics"]["wall_s"])
    assert _is_positive_number(packed["ratios"]["packed_x_sooner"])


def test_slicing_case_measures_preemptions_against_slicing_off():
    # Its own quick run (not part of `all`): one worker with 0.5 s slices preempts alice's and
    # bob's jobs back and forth; the same work with slicing off is never preempted.
    records = quick_run("slicing")
    cases = {case["name"]: case for case in _cases(records, "slicing")}
    assert set(cases) == {"off", "slice 0.5 s"}
    assert cases["off"]["metrics"]["preemptions"] == 0
    sliced = cases["slice 0.5 s"]["metrics"]
    assert sliced["preemptions"] >= 1
    assert math.isfinite(sliced["cost_per_preemption_s"])
    assert sliced["release_to_claim_ms"] >= 0
    for case in cases.values():
        assert _is_positive_number(case["metrics"]["steps_per_s"])
        assert _is_positive_number(case["metrics"]["short_first_step_s"])
    assert _is_positive_number(cases["slice 0.5 s"]["ratios"]["throughput_vs_off"])
    [target] = [r for r in records if r["kind"] == "target"]
    assert target["met"] is None and target["why"]


def test_preemption_cost_is_what_the_timeline_spends_besides_training_and_evaluating():
    # Both jobs train 1 ms a step; an evaluation and its write take 50 ms. Alice's job stops
    # at step 250 and takes 20 ms to checkpoint and release, bob's is claimed 10 ms later and
    # takes 30 ms to start from its step 300: the preemption costs 60 ms.
    from ssdrbm.v1 import rbm_pb2 as pb

    from bench.slicing import Point, preemption_costs

    points = {
        "a": [Point(0.15, 100, 0.1), Point(0.30, 200, 0.2), Point(2.0, 300, 0.3)],
        "b": [Point(-1.0, 200, 0.2), Point(0.56, 400, 0.4), Point(0.71, 500, 0.5)],
    }
    running, queued = pb.JOB_STATE_RUNNING, pb.JOB_STATE_QUEUED
    states = [
        (0.0, "a", pb.StateChange(state=running, step=0)),
        (0.37, "a", pb.StateChange(state=queued, step=250, message="preempted: bob waits")),
        (0.38, "b", pb.StateChange(state=running, step=300, message="resuming")),
        (1.8, "a", pb.StateChange(state=running, step=250, message="resuming")),
    ]
    assert preemption_costs(points, states) == pytest.approx([0.06], abs=1e-9)


def test_targets_state_goal_measurement_and_verdict(quick_records):
    targets = [r for r in quick_records if r["kind"] == "target"]
    assert {t["suite"] for t in targets} == {"core", "sklearn", "service", "pack", "service-pack"}
    for target in targets:
        assert target["sense"] in ("<=", ">=")
        assert target["met"] in (True, False, None)
        if target["met"] is None:
            assert target["why"], f"an unmeasured target must say why: {target['name']}"


@pytest.mark.parametrize("model", ["bernoulli", "gaussian"])
def test_reference_gradient_equals_autograd_of_free_energy_difference(model):
    # With the samples fixed, the CD gradient is ∇θ [mean F(v_data) - mean F(v_model)].
    torch.manual_seed(0)
    config = ReferenceConfig(model=model, n_visible=7, n_hidden=5, batch_size=6, cd_k=2)
    rbm = ReferenceRBM(config, device=torch.device("cpu"))
    rbm.W.normal_(0, 0.5)
    rbm.b.normal_(0, 0.5)
    rbm.a.normal_(0, 0.5)
    if rbm.log_var is not None:
        rbm.log_var.normal_(0, 0.3)
    v_data = torch.bernoulli(torch.full((6, 7), 0.5))
    v_model, ph_data, ph_model = cd_chain(rbm, v_data, config.cd_k)
    expected = rbm.gradients(v_data, v_model, ph_data, ph_model)
    params = rbm.parameters()
    for tensor in params.values():
        tensor.requires_grad_(True)
    loss = rbm.free_energy(v_data).mean() - rbm.free_energy(v_model).mean()
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, _), grad in zip(params.items(), grads, strict=True):
        # float32 throughout; 1e-5 absolute covers rounding at these magnitudes.
        torch.testing.assert_close(expected[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_reference_spectral_step_is_nuclear_norm_times_polar_factor():
    torch.manual_seed(0)
    grad = torch.randn(9, 4, dtype=torch.float64)
    step = spectral_step(grad)
    # ⟨G, ‖σ‖₁UVᵀ⟩ = ‖σ‖₁² and the step's singular values all equal ‖σ‖₁.
    nuclear = torch.linalg.svdvals(grad).sum()
    torch.testing.assert_close((grad * step).sum(), nuclear**2)
    torch.testing.assert_close(torch.linalg.svdvals(step), nuclear.expand(4))


@pytest.mark.parametrize("optimizer", ["sgd", "nesterov", "ssd"])
def test_reference_loop_lowers_reconstruction_error(optimizer):
    torch.manual_seed(0)
    prototypes = torch.bernoulli(torch.full((4, 20), 0.5))
    data = prototypes[torch.randint(0, 4, (400,))]
    lr = {"sgd": 0.1, "nesterov": 0.05, "ssd": 0.01}[optimizer]
    config = ReferenceConfig("bernoulli", 20, 8, batch_size=20, optimizer=optimizer, lr=lr)
    loop = ReferenceLoop(config, data, seed=0)

    def error() -> float:
        probs = loop.rbm.hidden_probs(data)
        return float(((data - torch.sigmoid(probs @ loop.rbm.W.T + loop.rbm.b)) ** 2).sum(1).mean())

    before = error()
    for _ in range(200):
        loop.step()
    assert error() < 0.7 * before


def test_percentile_matches_numpy():
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for fraction in (0.0, 0.5, 0.99, 1.0):
        assert percentile(values, fraction) == pytest.approx(np.percentile(values, 100 * fraction))


def test_peak_tensor_memory_sees_a_temporary_allocation():
    def allocate_and_free() -> None:
        block = torch.ones(2**20)  # 4 MiB of float32, freed on return
        del block

    assert peak_tensor_mib(allocate_and_free, torch.device("cpu")) == pytest.approx(4.0, abs=0.1)


def test_interleaved_rounds_report_one_sample_per_round():
    calls = {"a": 0, "b": 0}

    def bump(name: str):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    timings = interleaved_rounds(
        {"a": bump("a"), "b": bump("b")},
        warmup_calls=1,
        calls_per_round=3,
        rounds=4,
        device=torch.device("cpu"),
        units_per_call={"a": 2, "b": 1},
    )
    assert calls == {"a": 13, "b": 13}
    assert all(len(timing.samples_s) == 4 for timing in timings.values())


@pytest.mark.parametrize(
    ("n_hidden", "route"), [(100, "Gram route"), (300, "factored route")], ids=["gram", "factored"]
)
def test_ssd_cost_times_every_piece_against_an_sgd_iteration(n_hidden, route):
    # 784x100 at batch 100: the factors' rank 200 is not below 100, the dense Gram route;
    # 784x300: the factored one.
    from bench import ssd_cost
    from bench.core import Plan, load_datasets

    data = load_datasets(Plan.quick(), torch.device("cpu"))["bernoulli"]
    rows = {name: (ms, ratio) for name, ms, ratio in ssd_cost.measure(n_hidden, 1, 1, data)}
    assert {"sgd iteration", "ssd-lowrank iteration", f"exact polar step ({route})"} <= set(rows)
    assert {"sgd optimizer step", "ssd optimizer step", "fused update W -= c·left@right"} <= set(
        rows
    )
    assert rows["sgd iteration"][1] == 1.0
    assert all(_is_positive_number(ms) and _is_positive_number(r) for ms, r in rows.values())


def test_report_renders_missed_and_unmeasured_targets():
    report = Report(environment={"device": "cpu"})
    report.extend(
        [Case("core", "x", {"size": "2x2"}, {"ms_per_iter": 1.5}, {"ratio": float("nan")})],
        [Target("core", "fast", 2.0, 1.0, "<=", "x"), Target("core", "gpu", None, 1.0, "<=")],
    )
    text = render_text(report)
    assert "MISSED" in text and "not measured" in text
    records = [json.loads(line) for line in report.json_lines()]
    assert records[1]["ratios"]["ratio"] is None  # NaN is not valid JSON
    assert [r["met"] for r in records[2:]] == [False, None]
    assert render_text(read_json_lines(report.json_lines())) == text


def test_service_job_compares_the_service_with_the_library():
    from bench import service_job

    result = service_job.run(quick=True)
    assert result.service_ms_per_step > 0 and result.library_ms_per_step > 0
    # On this CPU the unset polar method ran as the exact low-rank step, and the job says so.
    expected = (
        "newton-schulz (auto on cuda)" if torch.cuda.is_available() else "lowrank (auto on cpu)"
    )
    assert expected in result.runtime


def test_sklearn_race_scores_both_sides_with_the_same_function():
    """scikit-learn's model, moved into ssdcore, scores as scikit-learn's own reconstruction
    says; the SSD side stops at the first chunk that reaches the goal."""
    from sklearn.neural_network import BernoulliRBM as SklearnRBM

    from bench import sklearn_race

    generator = torch.Generator().manual_seed(0)
    train = (torch.rand(200, 12, generator=generator) < 0.3).float()
    valid = train[:50]
    seconds, error = sklearn_race.sklearn_fit(train.numpy(), valid, seed=0)
    assert seconds > 0 and math.isfinite(error)
    reference = SklearnRBM(n_components=sklearn_race.N_HIDDEN, n_iter=10, random_state=0)
    reference.fit(train.numpy())
    hidden = reference.transform(valid.numpy())
    recon = 1 / (1 + np.exp(-(hidden @ reference.components_ + reference.intercept_visible_)))
    assert error == pytest.approx(((recon - valid.numpy()) ** 2).sum(1).mean(), rel=1e-4)
    seconds, steps = sklearn_race.ssd_time_to(math.inf, train, valid, seed=0, max_steps=100)
    assert steps == sklearn_race.CHUNK and seconds > 0
