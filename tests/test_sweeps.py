"""Sweeps over real gRPC and real Redis: many ordinary jobs from one StartSweep, the ranked
leaderboard (GetSweep, StreamSweep), listing and tenancy, cancel, the job quota, successive-halving
early stopping (ASHA) ending the worst runs STOPPED, and the ``ssdrbm sweep`` command.

Jobs are tiny (8 hidden units, 16 visible, 200 synthetic examples, tens of steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.sweeps.rungs import eval_every_for, resolve_rungs
from tests.fixtures.jobs import rpc_error, tiny_request
from tests.fixtures.service import RunningService

WAIT_S = 120.0  # a bound for a loaded 2-core machine, not a speed check
ALPHA, BETA = "alpha-secret-1", "beta-secret-2"


def lr_axis(*values: float) -> pb.SweepAxis:
    return pb.SweepAxis(field="optimizer.lr", values=list(values))


def sweep_request(*axes: pb.SweepAxis, steps: int = 20, **fields) -> pb.StartSweepRequest:
    base = tiny_request(steps=steps)
    base.optimizer.ClearField("lr")
    return pb.StartSweepRequest(base=base, axes=list(axes), **fields)


def follow(stub, sweep_id: str) -> list[pb.SweepUpdate]:
    """Every StreamSweep update until the stream ends."""
    updates = list(stub.StreamSweep(pb.StreamSweepRequest(sweep_id=sweep_id), timeout=WAIT_S))
    assert updates, "the stream sent nothing"
    return updates


def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def idle(service_factory: Callable[..., RunningService]) -> RunningService:
    """A service without a worker: sweeps are created and stay queued."""
    return service_factory(run_worker=False)


# --- points: grid, random, validation -----------------------------------------------------------


def test_grid_has_every_combination_in_axis_order(idle: RunningService) -> None:
    stub = idle.stub()
    kinds = pb.SweepAxis(
        field="optimizer.kind", kinds=[pb.OPTIMIZER_KIND_SSD, pb.OPTIMIZER_KIND_SGD]
    )
    request = sweep_request(lr_axis(1e-3, 3e-3, 1e-2), kinds, seeds=2, validate_only=True)
    sweep = stub.StartSweep(request)
    assert sweep.run_count == len(sweep.runs) == 3 * 2 * 2
    points = [dict(run.point) for run in sweep.runs]
    assert points[0] == {"optimizer.lr": "0.001", "optimizer.kind": "ssd", "training.seed": "1"}
    assert points[1] == {"optimizer.lr": "0.001", "optimizer.kind": "ssd", "training.seed": "2"}
    assert points[-1] == {"optimizer.lr": "0.01", "optimizer.kind": "sgd", "training.seed": "2"}
    assert len({tuple(sorted(p.items())) for p in points}) == 12  # all distinct
    assert sweep.request.rank_metric == "reconstruction_error"  # the default, filled in
    assert not sweep.id and not list(stub.ListJobs(pb.ListJobsRequest()).jobs)  # nothing created


def test_random_points_are_reproducible_by_seed(idle: RunningService) -> None:
    stub = idle.stub()
    axes = [
        pb.SweepAxis(
            field="optimizer.lr", range=pb.SweepRange(low=1e-4, high=1e-1, scale=pb.AXIS_SCALE_LOG)
        ),
        pb.SweepAxis(field="model.n_hidden", range=pb.SweepRange(low=4, high=12)),
        pb.SweepAxis(field="training.cd_k", values=[1, 2]),
    ]

    def points(seed: int) -> list[dict[str, str]]:
        request = sweep_request(
            *axes, mode=pb.SWEEP_MODE_RANDOM, samples=6, seed=seed, validate_only=True
        )
        return [dict(run.point) for run in stub.StartSweep(request).runs]

    first = points(7)
    assert len(first) == 6 and first == points(7)
    assert first != points(8)
    for point in first:
        assert 1e-4 <= float(point["optimizer.lr"]) <= 1e-1
        assert 4 <= int(point["model.n_hidden"]) <= 12
        assert point["training.cd_k"] in {"1", "2"}


def test_a_bad_point_refuses_the_sweep_before_any_job(idle: RunningService) -> None:
    stub = idle.stub()
    error = rpc_error(lambda: stub.StartSweep(sweep_request(lr_axis(0.01, -1.0))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("axes[0]: optimizer.lr = -1 is refused")
    assert "sweep point 1" in error.details()
    assert not list(stub.ListJobs(pb.ListJobsRequest()).jobs)
    assert not list(stub.ListSweeps(pb.ListSweepsRequest()).sweeps)
    for request, field in [
        (sweep_request(pb.SweepAxis(field="training.steps", values=[1])), "axes[0].field"),
        (sweep_request(), "axes"),
        (sweep_request(lr_axis(0.1), rank_metric="accuracy"), "rank_metric"),
        (sweep_request(pb.SweepAxis(field="model.n_hidden", values=[2.5])), "axes[0].values"),
        (
            sweep_request(lr_axis(0.1), early_stopping=pb.EarlyStopping(min_steps=20)),
            "early_stopping.min_steps",
        ),
    ]:
        error = rpc_error(lambda request=request: stub.StartSweep(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert error.details().startswith(field + ":"), error.details()
    assert not list(stub.ListJobs(pb.ListJobsRequest()).jobs)


def test_rungs_and_the_evaluations_at_them() -> None:
    assert resolve_rungs(pb.EarlyStopping(min_steps=10), 100) == ([10, 30, 90], 3)
    assert resolve_rungs(pb.EarlyStopping(min_steps=5, reduction_factor=2), 40) == ([5, 10, 20], 2)
    assert resolve_rungs(pb.EarlyStopping(rungs=[4, 12]), 40) == ([4, 12], 3)
    assert resolve_rungs(pb.EarlyStopping(), 40) == ([], 0)
    assert eval_every_for(0, 50, [10, 30, 90]) == 10  # unset: a divisor of every rung
    assert eval_every_for(5, 50, [10, 30]) == 5
    with pytest.raises(Exception, match=r"base\.eval\.every"):
        eval_every_for(20, 50, [10, 30])


# --- quota and limits ---------------------------------------------------------------------------


def test_a_sweep_beyond_the_job_quota_is_refused_up_front(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False, max_jobs_per_tenant=3, max_sweep_points=5)
    stub = running.stub()
    stub.StartTraining(tiny_request())
    error = rpc_error(lambda: stub.StartSweep(sweep_request(lr_axis(0.01, 0.02, 0.03))))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_jobs_per_tenant" in error.details() and "3 jobs" in error.details()
    assert len(stub.ListJobs(pb.ListJobsRequest()).jobs) == 1  # only the one before
    assert not list(stub.ListSweeps(pb.ListSweepsRequest()).sweeps)
    error = rpc_error(lambda: stub.StartSweep(sweep_request(lr_axis(*range(1, 7)))))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SSDRBM_MAX_SWEEP_POINTS" in error.details()
    sweep = stub.StartSweep(sweep_request(lr_axis(0.01, 0.02)))  # fits beside the one job
    assert len(sweep.runs) == 2


# --- runs as jobs, the leaderboard ---------------------------------------------------------------


def test_every_point_is_a_job_that_succeeds_and_the_board_ranks_them(
    service: RunningService,
) -> None:
    stub = service.stub()
    request = sweep_request(lr_axis(0.002, 0.05), name="lr scan", request_id="scan-1")
    sweep = stub.StartSweep(request)
    assert len(sweep.id) == 32 and sweep.state == pb.SWEEP_STATE_RUNNING
    assert stub.StartSweep(request).id == sweep.id  # the request_id makes a repeat harmless
    assert len(stub.ListJobs(pb.ListJobsRequest()).jobs) == 2
    updates = follow(stub, sweep.id)
    final = updates[-1].sweep
    assert final.state == pb.SWEEP_STATE_SUCCEEDED
    assert [run.rank for run in final.runs] == [1, 2]
    errors = [run.latest_metrics.reconstruction_error for run in final.runs]
    assert errors == sorted(errors) and final.best_job_id == final.runs[0].job_id
    assert [run.rank_value for run in final.runs] == errors
    for run in final.runs:
        job = stub.GetJob(pb.GetJobRequest(job_id=run.job_id))
        assert job.state == pb.JOB_STATE_SUCCEEDED and job.sweep_id == sweep.id
        assert job.step == 20 and job.checkpoint_step == 20
        assert f"{job.spec.optimizer.lr:g}" == run.point["optimizer.lr"]
        assert job.name.startswith("lr scan #")
    # Updates came while runs were going: the board changed between the first and the last.
    assert len(updates) >= 2 and updates[0].sweep != final
