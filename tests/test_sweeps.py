"""Sweeps over real gRPC and real Redis: many ordinary jobs from one StartSweep, the ranked
leaderboard (GetSweep, StreamSweep), listing and tenancy, cancel, the job quota, successive-halving
early stopping (ASHA) ending the worst runs STOPPED, and the ``ssdrbm sweep`` command.

Jobs are tiny (8 hidden units, 16 visible, 200 synthetic examples, tens of steps).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import grpc
import pytest
import redis
from ssdrbm import Client, JobState
from ssdrbm.aio import AsyncClient
from ssdrbm.sweeps import Range, SweepState
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.keys import Keys
from ssdrbm_server.store.connection import connect
from ssdrbm_server.store.records import record_from_hash
from ssdrbm_server.store.rungs import RungGate
from ssdrbm_server.sweeps.rungs import eval_every_for, resolve_rungs
from ssdrbm_server.sweeps.store import SweepStore
from tests.fixtures.console import cli
from tests.fixtures.jobs import float_tensor, rpc_error, tiny_request
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
    seeds_past_the_last_seed = sweep_request(lr_axis(0.1), seeds=2)
    seeds_past_the_last_seed.base.training.seed = 2**64 - 1
    for request, field in [
        (sweep_request(pb.SweepAxis(field="training.steps", values=[1])), "axes[0].field"),
        (sweep_request(), "axes"),
        (sweep_request(lr_axis(0.1), rank_metric="accuracy"), "rank_metric"),
        (sweep_request(pb.SweepAxis(field="model.n_hidden", values=[2.5])), "axes[0].values"),
        (sweep_request(pb.SweepAxis(field="model.n_hidden", values=[1e10])), "axes[0].values"),
        (seeds_past_the_last_seed, "seeds"),
        (
            sweep_request(lr_axis(0.1), early_stopping=pb.EarlyStopping(min_steps=20)),
            "early_stopping.min_steps",
        ),
    ]:
        error = rpc_error(lambda request=request: stub.StartSweep(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert error.details().startswith(field + ":"), error.details()
    assert not list(stub.ListJobs(pb.ListJobsRequest()).jobs)


def test_a_rank_metric_the_runs_never_report_is_refused(idle: RunningService) -> None:
    stub = idle.stub()
    gaussian = sweep_request(lr_axis(0.01), rank_metric="pseudo_log_likelihood")
    gaussian.base.model.kind = pb.MODEL_KIND_GAUSSIAN
    gaussian.base.optimizer.kind = pb.OPTIMIZER_KIND_SGD
    without_ais = sweep_request(lr_axis(0.01), rank_metric="log_likelihood_lower")
    hidden = pb.SweepAxis(field="model.n_hidden", values=[8, 32])  # exact up to 16 hidden
    too_wide = sweep_request(hidden, rank_metric="log_likelihood")
    for request, says in [
        (gaussian, "reports free_energy_gap, log_likelihood, reconstruction_error;"),
        (without_ais, "base.eval.ais adds"),
        (too_wide, "sweep point 1 (model.n_hidden=32)"),
    ]:
        error = rpc_error(lambda request=request: stub.StartSweep(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("rank_metric: "), error.details()
        assert says in error.details(), error.details()
    assert not list(stub.ListSweeps(pb.ListSweepsRequest()).sweeps)
    without_ais.base.eval.ais = True
    for request in [without_ais, sweep_request(hidden, rank_metric="pseudo_log_likelihood")]:
        request.validate_only = True
        assert len(stub.StartSweep(request).runs) == len(request.axes[0].values)


def test_rungs_and_the_evaluations_at_them() -> None:
    assert resolve_rungs(pb.EarlyStopping(min_steps=10), 100) == ([10, 30, 90], 3)
    assert resolve_rungs(pb.EarlyStopping(min_steps=5, reduction_factor=2), 40) == ([5, 10, 20], 2)
    assert resolve_rungs(pb.EarlyStopping(rungs=[4, 12]), 40) == ([4, 12], 3)
    assert resolve_rungs(pb.EarlyStopping(), 40) == ([], 0)
    assert eval_every_for(0, 50, [10, 30, 90]) == 10  # unset: a divisor of every rung
    assert eval_every_for(5, 50, [10, 30]) == 5
    with pytest.raises(Exception, match=r"base\.eval\.every"):
        eval_every_for(20, 50, [10, 30])


def test_a_repeated_start_sweep_finishes_what_a_dead_one_began(idle: RunningService) -> None:
    stub = idle.stub()
    client = redis.Redis.from_url(idle.settings.redis_url)
    keys = Keys(idle.settings.redis_prefix)
    # Died right after reserving its id: the repeat creates the whole sweep under that id.
    client.set(keys.sweep_idempotency("default", "r-1"), "ab" * 16)
    request = sweep_request(lr_axis(0.01, 0.02, 0.03), request_id="r-1")
    sweep = stub.StartSweep(request)
    assert sweep.id == "ab" * 16 and len(sweep.runs) == 3
    # Died before recording its last run: the repeat finds that job by its request id.
    client.rpop(keys.sweep_runs("default", sweep.id))
    assert len(stub.GetSweep(pb.GetSweepRequest(sweep_id=sweep.id)).runs) == 2
    again = stub.StartSweep(request)
    assert sorted(run.job_id for run in again.runs) == sorted(run.job_id for run in sweep.runs)
    assert len(stub.ListJobs(pb.ListJobsRequest()).jobs) == 3
    request.axes[0].values.append(0.04)
    error = rpc_error(lambda: stub.StartSweep(request))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "axes" in error.details()


def test_rung_decisions_are_taken_once_and_survive_a_takeover(redis_url: str) -> None:
    sweep_id = "cd" * 16

    def gate(client, job: str, sweep: str = sweep_id) -> RungGate:
        raw = {b"tenant": b"t", b"state": b"RUNNING", b"sweep_id": sweep.encode()}
        return RungGate(client, Keys(), record_from_hash(job * 32, raw))

    def metrics(value: float) -> bytes:
        return pb.Metrics(step=10, reconstruction_error=value).SerializeToString()

    async def scenario() -> None:
        client = connect(redis_url)
        try:
            await SweepStore(client, Keys()).create(
                "t", sweep_id, name="", request=b"", points=[], rungs=[10, 30], eta=3,
                rank_metric="reconstruction_error",
            )  # fmt: skip
            assert not await gate(client, "a").check(10, metrics(1.0))  # first at the rung
            bad = gate(client, "b")
            assert await bad.check(10, metrics(5.0))  # 2 runs: only the best 1 goes on
            assert "rung step 10" in bad.stop_reason and "best 1 of the 2" in bad.stop_reason
            # Another worker takes the run over and reports the rung again, better this time:
            # the decision stands, and a resume past the rung learns it at its start.
            assert await gate(client, "b").check(10, metrics(0.1))
            assert await gate(client, "b").stopped_at_or_before(15)
            assert not await gate(client, "a").stopped_at_or_before(15)
            assert not await gate(client, "c").check(20, metrics(9.0))  # not a rung step
            assert not await gate(client, "c").check(10, metrics(0.5))  # 3 runs: best of 1
            assert not await gate(client, "d").check(10, metrics(0.7))  # 4 runs: best 2; 2nd
            assert await gate(client, "f").check(10, metrics(2.0))  # 5 runs: best 2; 4th
            assert not await gate(client, "e", sweep="").check(10, metrics(9.0))  # no sweep
        finally:
            await client.aclose()

    asyncio.run(scenario())


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


def test_sweep_streams_count_against_the_stream_limits(
    service_factory: Callable[..., RunningService],
) -> None:
    running = service_factory(run_worker=False, max_streams_per_tenant=1)
    stub = running.stub()
    sweep = stub.StartSweep(sweep_request(lr_axis(0.01)))
    first = stub.StreamSweep(pb.StreamSweepRequest(sweep_id=sweep.id))
    assert next(first).sweep.state == pb.SWEEP_STATE_RUNNING  # open, following
    error = rpc_error(lambda: stub.StreamSweep(pb.StreamSweepRequest(sweep_id=sweep.id)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SSDRBM_MAX_STREAMS_PER_TENANT" in error.details() and "GetSweep" in error.details()
    first.cancel()

    def reopened() -> bool:
        try:
            call = stub.StreamSweep(pb.StreamSweepRequest(sweep_id=sweep.id))
            next(call)
            call.cancel()
            return True
        except grpc.RpcError:
            return False

    wait_for(reopened, "the cancelled stream's slot to be freed")


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


def test_cancel_sweep_cancels_queued_and_running_runs(service: RunningService) -> None:
    stub = service.stub()
    sweep = stub.StartSweep(sweep_request(lr_axis(0.01, 0.02, 0.03), steps=5000))

    def states() -> list[int]:
        return [run.state for run in stub.GetSweep(pb.GetSweepRequest(sweep_id=sweep.id)).runs]

    wait_for(lambda: pb.JOB_STATE_RUNNING in states(), "a running run")
    cancelled = stub.CancelSweep(pb.CancelSweepRequest(sweep_id=sweep.id))
    assert cancelled.cancel_requested
    final = follow(stub, sweep.id)[-1].sweep
    assert final.state == pb.SWEEP_STATE_CANCELLED
    assert [run.state for run in final.runs] == [pb.JOB_STATE_CANCELLED] * 3
    assert all(run.step < 5000 for run in final.runs)


@pytest.mark.parametrize("max_pack_size", [3, 1], ids=["packed", "alone"])
def test_asha_stops_the_worst_runs_at_a_rung_and_the_best_completes(
    idle: RunningService, service_factory: Callable[..., RunningService], max_pack_size: int
) -> None:
    stub = idle.stub()
    # SGD at 0.1 learns within 10 steps; at 1e-6 and 1e-7 the models barely move, so their
    # reconstruction errors rank below it at the first rung. ASHA decides in arrival order, so
    # the order is fixed: the runs are all queued before the one worker starts, it takes them in
    # point order, as one pack whose runs report each step in pack order, or one by one. The
    # good run reaches the rung first (alone: promoted); the others meet its value and stop.
    request = sweep_request(
        lr_axis(0.1, 1e-6, 1e-7),
        steps=40,
        early_stopping=pb.EarlyStopping(min_steps=10, reduction_factor=3),
    )
    request.base.optimizer.kind = pb.OPTIMIZER_KIND_SGD
    sweep = stub.StartSweep(request)
    assert list(sweep.request.early_stopping.rungs) == [10, 30]
    service_factory(max_pack_size=max_pack_size)  # the worker, on the same Redis
    final = follow(stub, sweep.id)[-1].sweep
    assert final.state == pb.SWEEP_STATE_SUCCEEDED
    by_lr = {run.point["optimizer.lr"]: run for run in final.runs}
    best, worse = by_lr["0.1"], [by_lr["1e-06"], by_lr["1e-07"]]
    assert best.state == pb.JOB_STATE_SUCCEEDED and best.step == 40
    assert final.best_job_id == best.job_id
    for run in worse:
        assert run.state == pb.JOB_STATE_STOPPED, run
        assert 10 <= run.step < 30
        job = stub.GetJob(pb.GetJobRequest(job_id=run.job_id))
        assert job.checkpoint_step >= 10  # checkpointed when stopped: its model is served
        stopped = [
            event.state
            for event in stub.StreamMetrics(pb.StreamMetricsRequest(job_id=run.job_id))
            if event.WhichOneof("event") == "state"
        ][-1]
        assert stopped.state == pb.JOB_STATE_STOPPED and "rung step 10" in stopped.message
        output = stub.Reconstruct(
            pb.ReconstructRequest(job_id=run.job_id, input=float_tensor(2, 16), mean_field=True)
        )
        assert list(output.output.shape) == [2, 16]
    # StateChange filters and listings know the new state.
    stopped_jobs = stub.ListJobs(pb.ListJobsRequest(state=pb.JOB_STATE_STOPPED)).jobs
    assert {job.id for job in stopped_jobs} == {run.job_id for run in worse}


@pytest.fixture
def tenants(service_factory: Callable[..., RunningService]) -> RunningService:
    return service_factory(
        run_worker=False, auth_mode="token", auth_tokens=f"{ALPHA}=alpha,{BETA}=beta"
    )


def test_list_sweeps_pages_newest_first_and_tenants_see_only_their_own(
    tenants: RunningService,
) -> None:
    alpha, beta = tenants.stub(token=ALPHA), tenants.stub(token=BETA)
    created = [alpha.StartSweep(sweep_request(lr_axis(0.01), name=f"s{i}")).id for i in range(3)]
    seen, token = [], ""
    while True:
        page = alpha.ListSweeps(pb.ListSweepsRequest(page_size=2, page_token=token))
        assert len(page.sweeps) <= 2
        seen += [sweep.id for sweep in page.sweeps]
        assert all(not sweep.runs and sweep.run_count == 1 for sweep in page.sweeps)
        token = page.next_page_token
        if not token:
            break
    assert seen == created[::-1]
    error = rpc_error(lambda: alpha.ListSweeps(pb.ListSweepsRequest(page_size=1001)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_size" in error.details()

    assert not list(beta.ListSweeps(pb.ListSweepsRequest()).sweeps)
    for call in (
        lambda: beta.GetSweep(pb.GetSweepRequest(sweep_id=created[0])),
        lambda: beta.CancelSweep(pb.CancelSweepRequest(sweep_id=created[0])),
        lambda: beta.StreamSweep(pb.StreamSweepRequest(sweep_id=created[0])),
        lambda: alpha.GetSweep(pb.GetSweepRequest(sweep_id="not-a-sweep")),
    ):
        assert rpc_error(call).code() == grpc.StatusCode.NOT_FOUND
    page_token = alpha.ListSweeps(pb.ListSweepsRequest(page_size=1)).next_page_token
    error = rpc_error(lambda: beta.ListSweeps(pb.ListSweepsRequest(page_token=page_token)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The runs are the tenant's ordinary jobs, tagged with their sweep.
    jobs = alpha.ListJobs(pb.ListJobsRequest()).jobs
    assert sorted(job.sweep_id for job in jobs) == sorted(created)


# --- SDK and CLI --------------------------------------------------------------------------------

TINY = ["--hidden", "8", "--batch-size", "20", "--eval-every", "10", "--dataset", "synthetic"]
TINY += ["--option", "n_visible=16", "--option", "n_hidden=4", "--option", "n_samples=200"]
TINY += ["--validation-fraction", "0.2"]


def test_sdk_starts_streams_lists_and_cancels_sweeps(idle: RunningService) -> None:
    with Client(idle.target) as client:
        dry = client.start_sweep(
            n_hidden=8, steps=20, axes={"lr": [0.01, 0.1], "optimizer": ["ssd", "sgd"]},
            validate_only=True,
        )  # fmt: skip
        assert dry.state is SweepState.UNSPECIFIED and dry.run_count == 4 and not dry.id
        random = client.start_sweep(
            n_hidden=8, steps=20, axes={"lr": Range(1e-3, 1e-1, log=True)}, random=3,
            sample_seed=5, validate_only=True,
        )  # fmt: skip
        assert [run.point for run in random.runs] == [
            run.point
            for run in client.start_sweep(
                n_hidden=8, steps=20, axes={"lr": Range(1e-3, 1e-1, log=True)}, random=3,
                sample_seed=5, validate_only=True,
            ).runs
        ]  # fmt: skip
        sweep = client.start_sweep(
            n_hidden=8, steps=40, axes={"lr.W": [0.01, 0.02]}, seeds=2, name="pp",
            early_stop=(10, 2),
        )  # fmt: skip
        assert sweep.state is SweepState.RUNNING and sweep.rungs == [10, 20]
        assert sweep.reduction_factor == 2 and len(sweep.runs) == 4
        assert {run.point["optimizer.per_parameter_lr.W"] for run in sweep.runs} == {"0.01", "0.02"}
        job = client.get_job(sweep.runs[0].job_id)
        assert job.state is JobState.QUEUED and job.spec["eval"]["every"] == 10  # divides 10, 20
        assert [s.id for s in client.list_sweeps(page_size=1)] == [sweep.id]
        cancelled = client.cancel_sweep(sweep.id)
        assert cancelled.cancel_requested
        boards = list(client.stream_sweep(sweep.id, timeout=WAIT_S))
        assert boards[-1].state is SweepState.CANCELLED and boards[-1].done
        assert {run.state for run in boards[-1].runs} == {JobState.CANCELLED}

    async def asynchronous() -> list[str]:
        async with AsyncClient(idle.target) as client:
            got = await client.get_sweep(sweep.id)
            listed = [s.id async for s in client.list_sweeps()]
            boards = [board async for board in client.stream_sweep(sweep.id)]
            assert boards[-1].state is SweepState.CANCELLED
            return [got.id, *listed]

    assert asyncio.run(asynchronous()) == [sweep.id, sweep.id]


def test_cli_sweep_json_and_watch_against_the_service(service: RunningService, tmp_path) -> None:
    result = cli(service, "sweep", *TINY, "--steps", "20", "--lr", "0.01,0.05", "--json")
    assert result.returncode == 0, result.stderr
    started = json.loads(result.stdout)
    assert started["run_count"] == 2 and started["state"] == "running"

    result = cli(
        service, "sweep", *TINY, "--steps", "20", "--optimizer", "sgd", "--lr", "0.1,1e-6",
        "--name", "watched", "--watch",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sweep_id = lines[0]
    assert lines[1].startswith(f"sweep {sweep_id} watched — succeeded, 2 runs")
    assert lines[2].split()[:5] == ["RANK", "JOB", "STATE", "STEP", "RECONSTRUCTION_ERROR"]
    assert lines[3].split()[0] == "1" and lines[3].split()[-1] == "0.1"  # lr 0.1 ranks first
    assert "succeeded" in lines[3] and "20/20" in lines[3]
    assert f"sweep {sweep_id} succeeded: 2/2 runs ended" in result.stderr

    listing = cli(service, "sweeps", "--json")
    assert listing.returncode == 0, listing.stderr
    assert json.loads(listing.stdout)[0]["id"] == sweep_id
    result = cli(service, "sweep-show", started["id"], "--watch", "--json")
    assert result.returncode == 0, result.stderr
    final = json.loads(result.stdout.splitlines()[-1])["sweep"]
    assert final["state"] == "succeeded" and [run["rank"] for run in final["runs"]] == [1, 2]

    plotted = cli(service, "plot", sweep_id, "--output", str(tmp_path), "--json")
    assert plotted.returncode == 0, plotted.stderr
    assert json.loads(plotted.stdout) == {
        "sweep_id": sweep_id, "files": [str(tmp_path / "sweep.png")]
    }  # fmt: skip
    assert (tmp_path / "sweep.png").stat().st_size > 1000

    bad = cli(service, "sweep", *TINY, "--steps", "20", "--lr", "0.01,-1")
    assert bad.returncode == 2 and "axes[0]: optimizer.lr = -1 is refused" in bad.stderr
