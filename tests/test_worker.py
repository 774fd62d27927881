"""Workers against a real redis-server: jobs end to end in spawned training processes, two
workers sharing a queue, cancel, divergence, SIGTERM release and SIGKILL takeover with resume.

Jobs are tiny (16 visibles, 8 hidden units, a few hundred steps) so that the process start-up
dominates; each test states what it proves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore.checkpoint import model_from_bytes
from ssdcore.optim import OptimizerConfig
from ssdrbm_server.config import Settings
from ssdrbm_server.job_spec import SPEC_VERSION, model_config, optimizer_config
from ssdrbm_server.keys import Keys
from ssdrbm_server.resolver import resolve
from ssdrbm_server.store import (
    CheckpointStore,
    DatasetStore,
    EventStore,
    JobRecord,
    JobState,
    JobStore,
    connect,
)
from ssdrbm_server.store.datasets import DatasetInfo
from ssdrbm_server.worker import Worker
from ssdrbm_server.worker.datasets import DatasetError, Uploaded, prepare
from tests.fixtures.server_process import start_python_m_worker

logger = logging.getLogger(__name__)

TENANT = "team"
WAIT_S = 60.0  # upper bound for a job to reach a state on a loaded machine (not a speed check)
LEASE_S = 1.5  # short leases so that a takeover happens quickly


def spec(
    *,
    steps: int,
    eval_every: int = 10,
    checkpoint_every: int = 20,
    lr: float = 0.05,
    optimizer: int = rbm_pb2.OPTIMIZER_KIND_SSD,
    dataset: rbm_pb2.DatasetRef | None = None,
    gaussian: bool = False,
    variance: int = rbm_pb2.VARIANCE_KIND_DIAGONAL,
    max_backoffs: int | None = None,
) -> rbm_pb2.StartTrainingRequest:
    """A small job on the synthetic dataset (16 visibles)."""
    builtin = rbm_pb2.BuiltinDataset(
        name="synthetic", options={"n_visible": "16", "n_hidden": "4", "n_samples": "400"}
    )
    return rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(
            kind=rbm_pb2.MODEL_KIND_GAUSSIAN if gaussian else rbm_pb2.MODEL_KIND_BERNOULLI,
            n_hidden=8,
            variance=variance if gaussian else rbm_pb2.VARIANCE_KIND_UNSPECIFIED,
        ),
        optimizer=rbm_pb2.OptimizerSpec(kind=optimizer, lr=lr),
        training=rbm_pb2.TrainingSpec(
            batch_size=20,
            steps=steps,
            seed=3,
            checkpoint_every=checkpoint_every,
            max_backoffs=max_backoffs,
        ),
        eval=rbm_pb2.EvalSpec(every=eval_every, validation_fraction=0.2),
        dataset=dataset or rbm_pb2.DatasetRef(builtin=builtin),
    )


SETTINGS = Settings(
    lease_seconds=LEASE_S,
    heartbeat_seconds=0.25,
    worker_poll_ms=200,
    torch_threads=1,
    worker_slots=1,  # one slot per worker here (tests/test_worker_slots.py runs more)
)


def pb_copy(message: rbm_pb2.StartTrainingRequest) -> rbm_pb2.StartTrainingRequest:
    copy = rbm_pb2.StartTrainingRequest()
    copy.CopyFrom(message)
    return copy


def make_worker(redis_url: str, worker_id: str, **overrides) -> Worker:
    """A worker with the test settings (``overrides``: fields to change)."""
    return Worker(SETTINGS.replace(redis_url=redis_url, worker_id=worker_id, **overrides))


class Harness:
    """Stores on one client, plus helpers that wait for a job to get somewhere."""

    def __init__(self, redis_url: str) -> None:
        self.redis = connect(redis_url)
        self.jobs = JobStore(self.redis)
        self.events = EventStore(self.redis)
        self.checkpoints = CheckpointStore(self.redis)
        self.datasets = DatasetStore(self.redis)

    async def submit(self, request: rbm_pb2.StartTrainingRequest) -> str:
        """Resolve the request as StartTraining does, then queue it."""

        async def find_upload(dataset_id: str):
            return await self.datasets.info(TENANT, dataset_id)

        job = await resolve(request, SETTINGS, find_upload)
        return await self.submit_resolved(
            job.spec.SerializeToString(), job.total_steps, job.n_visible
        )

    async def submit_resolved(self, spec: bytes, total_steps: int, n_visible: int = 0) -> str:
        """Queue a spec as it is (the worker uses stored specs verbatim)."""
        job, _ = await self.jobs.submit(
            TENANT,
            spec,
            name="test",
            total_steps=total_steps,
            request_id=None,
            n_visible=n_visible,
        )
        return job.id

    async def wait_for(
        self, job_id: str, done: Callable[[JobRecord], bool], timeout: float = WAIT_S
    ) -> JobRecord:
        deadline = time.monotonic() + timeout
        while True:
            record = await self.jobs.get(TENANT, job_id)
            if done(record):
                return record
            if time.monotonic() > deadline:
                raise AssertionError(f"job never got there; last record: {record}")
            await asyncio.sleep(0.05)

    async def wait_for_state(self, job_id: str, state: JobState) -> JobRecord:
        return await self.wait_for(job_id, lambda r: r.state is state or r.state.is_terminal)

    async def events_of(self, job_id: str) -> list[tuple[str, bytes, int]]:
        """(kind, data, attempt) of every event, in order."""
        return [
            (fields[b"kind"].decode(), fields[b"data"], int(fields[b"attempt"]))
            for _, fields in await self.redis.xrange(Keys().events(job_id))
        ]

    async def metric_steps(self, job_id: str) -> list[tuple[int, int]]:
        """(step, attempt) of every metric event, in order."""
        return [
            (rbm_pb2.Metrics.FromString(data).step, attempt)
            for kind, data, attempt in await self.events_of(job_id)
            if kind == "metrics"
        ]

    async def state_changes(self, job_id: str) -> list[rbm_pb2.StateChange]:
        return [
            rbm_pb2.StateChange.FromString(data)
            for kind, data, _ in await self.events_of(job_id)
            if kind == "state"
        ]


def run_with_workers(
    redis_url: str, worker_ids: list[str], scenario: Callable[..., Awaitable[None]], **overrides
) -> list[Worker]:
    """Run `scenario(harness, workers)` while in-process workers serve the queue (``overrides``:
    settings to change)."""
    workers = [make_worker(redis_url, worker_id, **overrides) for worker_id in worker_ids]

    async def main() -> None:
        harness = Harness(redis_url)
        tasks = [asyncio.create_task(worker.run()) for worker in workers]
        try:
            await scenario(harness, workers)
        finally:
            await asyncio.gather(*(worker.stop(graceful=False) for worker in workers))
            await asyncio.gather(*tasks)
            await harness.redis.aclose()

    asyncio.run(main())
    return workers


def state_names(changes: list[rbm_pb2.StateChange]) -> list[str]:
    return [rbm_pb2.JobState.Name(change.state).removeprefix("JOB_STATE_") for change in changes]


def test_two_workers_share_the_queue_and_run_jobs_end_to_end(redis_url: str) -> None:
    """Two workers on one Redis each take a job: one on the synthetic data set (checked in
    every detail), one a Gaussian RBM on an uploaded array."""

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        rng = np.random.default_rng(0)
        array = rng.normal(size=(200, 16)).astype("<f4")
        info, _ = await h.datasets.put(
            TENANT, shape=array.shape, dtype="float32", name="gauss", data=array.tobytes()
        )
        await asyncio.sleep(0.3)  # both workers are waiting on the queue
        job_id = await h.submit(spec(steps=60))
        uploaded = rbm_pb2.DatasetRef(dataset_id=info.id)
        other = await h.submit(spec(steps=40, gaussian=True, dataset=uploaded, lr=0.01))
        record = await h.wait_for_state(job_id, JobState.SUCCEEDED)
        other_record = await h.wait_for_state(other, JobState.SUCCEEDED)
        assert record.state is JobState.SUCCEEDED, record.error
        assert other_record.state is JobState.SUCCEEDED, other_record.error
        assert {record.worker, other_record.worker} == {"w1", "w2"}

        assert (record.step, record.total_steps, record.n_visible) == (60, 60, 16)
        assert record.attempt == 1 and record.finished_at is not None
        assert await h.metric_steps(job_id) == [(s, 1) for s in range(10, 61, 10)]
        assert state_names(await h.state_changes(job_id)) == ["QUEUED", "RUNNING", "SUCCEEDED"]
        latest = rbm_pb2.Metrics.FromString(record.latest_metrics)
        assert latest.step == 60 and latest.total_steps == 60
        assert latest.log_likelihood_method == rbm_pb2.LOG_LIKELIHOOD_METHOD_EXACT
        assert math.isfinite(latest.log_likelihood) and latest.log_likelihood < 0
        assert latest.spectral_norm > 0 and latest.samples_per_second > 0

        # Finished, the job keeps only its last checkpoint (finished_checkpoints_kept).
        assert await h.checkpoints.list_steps(job_id) == [60]
        checkpoint = await h.checkpoints.latest(job_id)
        model = model_from_bytes(checkpoint.data)
        assert json.loads(checkpoint.config_json) == model.config()
        assert (model.n_visible, model.n_hidden) == (16, 8)
        assert all(torch.isfinite(p).all() for p in model.parameters())

        assert other_record.n_visible == 16 and other_record.total_steps == 40
        config = json.loads((await h.checkpoints.latest(other)).config_json)
        assert config["type"] == "gaussian"

    run_with_workers(redis_url, ["w1", "w2"], scenario)


def test_cancel_stops_a_running_job_and_its_training_process(redis_url: str) -> None:
    """A cancel asked while the job trains: the worker sees it, kills the training process
    before it records CANCELLED, nothing is written after that state, and the checkpoints stay
    usable (how long a cancel takes is measured by `python -m bench.load`)."""
    total = 1_000_000

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        # Spawned children of this process so far (other tests'): the job's is started later.
        others = set(training_processes_of(os.getpid()))
        job_id = await h.submit(spec(steps=total, checkpoint_every=50))
        await h.wait_for(job_id, lambda r: r.checkpoint_step >= 50)
        trainers = set(training_processes_of(os.getpid())) - others
        assert len(trainers) == 1, trainers  # the job's (the worker starts no spare meanwhile)
        flagged = await h.jobs.cancel(TENANT, job_id)
        assert flagged.state is JobState.RUNNING and flagged.cancel_requested
        record = await h.wait_for(job_id, lambda r: r.state.is_terminal)
        assert record.state is JobState.CANCELLED and record.step < total
        assert not any(is_running(pid) for pid in trainers)  # killed before CANCELLED was written
        assert [kind for kind, _, _ in await h.events_of(job_id)][-1] == "state"
        assert state_names(await h.state_changes(job_id)) == ["QUEUED", "RUNNING", "CANCELLED"]
        checkpoint = await h.checkpoints.latest(job_id)  # its checkpoints stay usable
        assert checkpoint.step >= 50 and model_from_bytes(checkpoint.data).n_visible == 16

    workers = run_with_workers(redis_url, ["w1"], scenario)
    assert [outcome for _, outcome in workers[0].jobs_run] == [JobState.CANCELLED.value]


# A Gaussian RBM with unit variances and plain SGD at this step size blows up within its first
# evaluation on the synthetic data (seeded, so always at the same step); a tenth of it trains.
DIVERGING_LR = 2.0


def diverging_spec(*, steps: int, max_backoffs: int | None = None):
    """A Gaussian RBM at DIVERGING_LR, evaluated and checkpointed every 5 steps."""
    return spec(
        steps=steps,
        checkpoint_every=5,
        eval_every=5,
        lr=DIVERGING_LR,
        optimizer=rbm_pb2.OPTIMIZER_KIND_SGD,
        gaussian=True,
        variance=rbm_pb2.VARIANCE_KIND_IDENTITY,
        max_backoffs=max_backoffs,
    )


def test_a_blow_up_fails_the_job_when_backoff_is_off(redis_url: str) -> None:
    """A job that blows up with max_backoffs 0 ends FAILED, the message naming the step, the
    metric and a step size to try; jobs whose data cannot be found or whose spec was not
    resolved fail with their reason too."""

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        job_id = await h.submit(diverging_spec(steps=2000, max_backoffs=0))
        record = await h.wait_for(job_id, lambda r: r.state.is_terminal)
        assert record.state is JobState.FAILED and record.backoffs == 0
        assert "blew up with backoff off" in record.error and "at step 5" in record.error
        assert "reconstruction_error" in record.error
        assert f"try optimizer.lr = {DIVERGING_LR / 10:.3g}" in record.error
        kept = f"step {record.checkpoint_step}" if record.checkpoint_step >= 0 else "none"
        assert f"the last good checkpoint is {kept}" in record.error
        for step in await h.checkpoints.list_steps(job_id):  # only healthy models were saved
            model = model_from_bytes((await h.checkpoints.get(job_id, step)).data)
            assert all(torch.isfinite(p).all() for p in model.parameters())
        assert state_names(await h.state_changes(job_id))[-1] == "FAILED"

        # Jobs that cannot start fail with their reason; the same worker goes on. (StartTraining
        # refuses such specs; these stand for data lost or a spec stored by another version.)
        resolved = await resolve(spec(steps=10), SETTINGS, h.datasets.info)
        missing, unknown, unresolved = (pb_copy(resolved.spec) for _ in range(3))
        lost, _ = await h.datasets.put(TENANT, shape=(4, 8), dtype="uint8", name="", data=bytes(32))
        await h.redis.delete(Keys().dataset(lost.id))  # its record lost; the submit sees the entry
        missing.dataset.dataset_id = lost.id
        unknown.dataset.builtin.name = "imagenet"
        unresolved.spec_version = SPEC_VERSION - 1  # stored by the previous version's resolver
        unresolved.optimizer.ClearField("lr")  # which filled differently: never guessed at
        reasons = []
        for request in (missing, unknown, unresolved):
            failed_id = await h.submit_resolved(request.SerializeToString(), 10)
            failed = await h.wait_for(failed_id, lambda r: r.state.is_terminal)
            assert failed.state is JobState.FAILED
            reasons.append(failed.error)
        assert "dataset" in reasons[0] and "not found" in reasons[0]
        assert "imagenet" in reasons[1]
        assert "spec_version" in reasons[2] and "submit the job again" in reasons[2]
        garbage, _ = await h.jobs.submit(
            TENANT, b"\xff\xff not a spec", name="bad", total_steps=1, request_id=None
        )
        failed = await h.wait_for(garbage.id, lambda r: r.state.is_terminal)
        assert failed.state is JobState.FAILED and "internal error" in failed.error
        assert [outcome for _, outcome in workers[0].jobs_run] == ["FAILED"] * 5

    run_with_workers(redis_url, ["w1"], scenario)


def test_a_blow_up_is_rolled_back_and_trained_on_with_smaller_steps(redis_url: str) -> None:
    """The same blow-up with backoff on: the run goes back to its last good state, every step
    size is divided by the backoff factor, and the job succeeds. The stream says so: a backoff
    event, then metrics from the rollback step on, each step once per side of the event."""

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        job_id = await h.submit(diverging_spec(steps=60))
        record = await h.wait_for(job_id, lambda r: r.state.is_terminal)
        assert record.state is JobState.SUCCEEDED, record.error
        assert record.backoffs >= 1 and record.step == 60
        events = await h.events_of(job_id)
        backoffs = [
            (index, rbm_pb2.Backoff.FromString(data))
            for index, (kind, data, _) in enumerate(events)
            if kind == "backoff"
        ]
        assert len(backoffs) == record.backoffs
        index, first = backoffs[0]
        assert first.backoff == 1 and first.max_backoffs == 3
        assert first.old_lr == DIVERGING_LR and first.new_lr == pytest.approx(DIVERGING_LR / 10)
        assert first.rollback_step < first.step and "reconstruction_error" in first.reason
        # Before the event: only steps up to the rollback; after it, the run from there on.
        steps = [rbm_pb2.Metrics.FromString(d).step for k, d, _ in events[:index] if k == "metrics"]
        assert all(step <= first.rollback_step for step in steps)
        after = [rbm_pb2.Metrics.FromString(d).step for k, d, _ in events[index:] if k == "metrics"]
        assert after == list(range(first.rollback_step + 5, 61, 5))
        checkpoint = await h.checkpoints.latest(job_id)
        model = model_from_bytes(checkpoint.data)
        assert checkpoint.step == 60 and all(torch.isfinite(p).all() for p in model.parameters())

    run_with_workers(redis_url, ["w1"], scenario)


# --- worker processes ----------------------------------------------------------------------


def start_worker_process(redis_url: str, worker_id: str) -> subprocess.Popen[bytes]:
    """`python -m ssdrbm_server.worker` with short leases, as a separate process."""
    return start_python_m_worker(
        redis_url, worker_id=worker_id, lease_seconds=LEASE_S, torch_threads=1, log_level="WARNING"
    )


def training_processes_of(pid: int) -> list[int]:
    """Pids of the live spawned children of `pid` that run training (from /proc), leaving out
    the resource tracker that multiprocessing also starts."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes()
                if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in command:
                    found.append(int(entry.name))
    return found


def is_running(pid: int) -> bool:
    with contextlib.suppress(OSError):
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return False


@pytest.fixture
def processes():
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


async def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


def test_sigkilled_worker_job_resumes_on_another_with_each_step_once(
    redis_url: str, processes: list
) -> None:
    """SIGKILL a worker mid-job: its training process exits, another worker takes the job
    over once the lease lapses, resumes from the checkpoint, and every step is in the metric
    stream exactly once."""
    total = 1000

    async def main() -> None:
        h = Harness(redis_url)
        job_id = await h.submit(spec(steps=total, eval_every=10, checkpoint_every=50))
        doomed = start_worker_process(redis_url, "doomed")
        processes.append(doomed)
        await h.wait_for(job_id, lambda r: r.worker == "doomed")
        survivor = make_worker(redis_url, "survivor")  # idle until the lease lapses
        task = asyncio.create_task(survivor.run())
        try:
            # Killed once a checkpoint exists and later steps were published after it.
            await h.wait_for(job_id, lambda r: 50 <= r.checkpoint_step < r.step < total)
            trainers = training_processes_of(doomed.pid)
            assert len(trainers) == 1
            doomed.send_signal(signal.SIGKILL)
            doomed.wait()
            killed_at = await h.jobs.get(TENANT, job_id)
            await wait_until(lambda: not is_running(trainers[0]), timeout=10)
            final = await h.wait_for_state(job_id, JobState.SUCCEEDED)
            # The same job without interruption, to compare the trained models.
            twin_id = await h.submit(spec(steps=total, eval_every=10, checkpoint_every=50))
            twin = await h.wait_for_state(twin_id, JobState.SUCCEEDED)
        finally:
            await survivor.stop(graceful=False)
            await task
        assert final.state is JobState.SUCCEEDED, final.error
        assert final.attempt == 2 and final.worker == "survivor"
        assert killed_at.state is JobState.RUNNING and killed_at.attempt == 1

        published = await h.metric_steps(job_id)
        assert [step for step, _ in published] == list(range(10, total + 1, 10))
        changes = await h.state_changes(job_id)
        assert state_names(changes) == ["QUEUED", "RUNNING", "RUNNING", "SUCCEEDED"]
        assert changes[2].attempt == 2 and changes[2].step == killed_at.checkpoint_step
        assert all(attempt == 1 for step, attempt in published if step <= killed_at.step)
        assert all(attempt == 2 for step, attempt in published if step > killed_at.step)
        resumed_model = await h.checkpoints.latest(job_id)
        assert resumed_model.attempt == 2 and twin.state is JobState.SUCCEEDED
        # Resuming restores optimizer, chains, random state and data order: bit for bit.
        resumed = model_from_bytes(resumed_model.data).state_dict()
        uninterrupted = model_from_bytes((await h.checkpoints.latest(twin_id)).data).state_dict()
        assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
        await h.redis.aclose()

    asyncio.run(main())


def test_sigterm_checkpoints_releases_and_exits_cleanly(redis_url: str, processes: list) -> None:
    """SIGTERM: the worker checkpoints the current step, puts the job back in the queue and
    exits 0; the next worker continues from exactly that step."""

    async def main() -> None:
        h = Harness(redis_url)
        job_id = await h.submit(spec(steps=1_000_000, eval_every=10, checkpoint_every=100_000))
        leaving = start_worker_process(redis_url, "leaving")
        processes.append(leaving)
        await h.wait_for(job_id, lambda r: r.worker == "leaving")
        successor = make_worker(redis_url, "successor")
        task = asyncio.create_task(successor.run())
        try:
            await h.wait_for(job_id, lambda r: r.step >= 30)
            leaving.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(leaving.wait, WAIT_S) == 0
            await h.wait_for(job_id, lambda r: r.attempt == 2 and r.step > r.checkpoint_step)
            await h.jobs.cancel(TENANT, job_id)  # no need to train a million steps
            final = await h.wait_for(job_id, lambda r: r.state.is_terminal)
        finally:
            await successor.stop(graceful=False)
            await task
        assert final.state is JobState.CANCELLED and final.worker == "successor"
        changes = await h.state_changes(job_id)
        names = state_names(changes)
        assert names == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "CANCELLED"]
        released, resumed = changes[2], changes[3]
        assert released.attempt == 1 and "stopped" in released.message
        # Saved where it stopped (not at a checkpoint_every boundary), resumed from there.
        assert resumed.attempt == 2 and resumed.step == released.step >= 30
        steps = [step for step, _ in await h.metric_steps(job_id)]
        assert steps == list(range(10, steps[-1] + 1, 10)) and steps[-1] > released.step
        await h.redis.aclose()

    asyncio.run(main())


# --- spec mapping ----------------------------------------------------------------------------


def resolved(request: rbm_pb2.StartTrainingRequest, upload=None) -> rbm_pb2.StartTrainingRequest:
    """``request`` as StartTraining stores it (``upload``: the DatasetInfo of its dataset_id)."""

    async def find_upload(dataset_id: str):
        return upload

    return asyncio.run(resolve(request, SETTINGS, find_upload)).spec


def test_resolved_spec_maps_to_the_model_and_optimizer_configs() -> None:
    request = rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(
            kind=rbm_pb2.MODEL_KIND_GAUSSIAN, variance=rbm_pb2.VARIANCE_KIND_ISOTROPIC, n_hidden=5
        ),
        optimizer=rbm_pb2.OptimizerSpec(
            kind=rbm_pb2.OPTIMIZER_KIND_SGD,
            lr=0.1,
            per_parameter={"W": rbm_pb2.OPTIMIZER_KIND_SSD},
            per_parameter_lr={"W": 1e-3},
            method=rbm_pb2.POLAR_METHOD_NEWTON_SCHULZ,
        ),
        training=rbm_pb2.TrainingSpec(epochs=3, batch_size=30),
    )
    spec = resolved(request)
    assert optimizer_config(spec.optimizer) == OptimizerConfig(
        name="sgd",
        lr=0.1,
        momentum=0.0,
        method="newton-schulz",
        per_parameter={"W": "ssd"},
        per_parameter_lr={"W": 1e-3},
    )
    assert model_config(spec, 12) == {
        "type": "gaussian",
        "n_visible": 12,
        "n_hidden": 5,
        "variance": "isotropic",
        "min_variance": spec.model.min_variance,
    }
    request.optimizer.kind = rbm_pb2.OPTIMIZER_KIND_NESTEROV
    request.optimizer.ClearField("per_parameter")
    request.optimizer.ClearField("per_parameter_lr")
    request.optimizer.ClearField("method")
    config = optimizer_config(resolved(request).optimizer)
    assert config.name == "nesterov" and config.momentum == 0.9  # the resolver's default
    request.optimizer.momentum = 0.0  # an explicit zero is kept, not taken for "unset"
    assert optimizer_config(resolved(request).optimizer).momentum == 0.0


# --- dataset resolution ----------------------------------------------------------------------


def builtin(name: str, preprocess: int = rbm_pb2.PREPROCESS_UNSPECIFIED, **options: str):
    return rbm_pb2.DatasetRef(
        builtin=rbm_pb2.BuiltinDataset(name=name, options=options), preprocess=preprocess
    )


def load(ref: rbm_pb2.DatasetRef, model: int = rbm_pb2.MODEL_KIND_BERNOULLI, uploaded=None):
    """The training data of a resolved job on ``ref`` (validation share 0.1 or 0.25)."""
    info = None
    if uploaded is not None:
        info = DatasetInfo(ref.dataset_id, uploaded.shape, uploaded.dtype, "", len(uploaded.data))
    request = rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(kind=model, n_hidden=2),
        training=rbm_pb2.TrainingSpec(steps=1, batch_size=1),
        eval=rbm_pb2.EvalSpec(validation_fraction=0.25 if uploaded else 0.1),
        dataset=ref,
    )
    return prepare(resolved(request, info), SETTINGS, uploaded)


def test_datasets_load_as_the_resolved_spec_says() -> None:
    # Options are read as the server resolved them: limit 0 (the default it fills in) is all.
    all_mnist = load(builtin("mnist"))
    assert all_mnist.train.shape[0] + all_mnist.valid.shape[0] == 10_000
    mnist = load(builtin("mnist", limit="200"))
    assert mnist.train.shape == (180, 784) and mnist.valid.shape == (20, 784)
    assert set(torch.unique(mnist.train).tolist()) == {0.0, 1.0}  # binarized for a BRBM
    faces = load(builtin("freyface", limit="300"), rbm_pb2.MODEL_KIND_GAUSSIAN)
    assert faces.n_visible == 560
    everything = torch.cat([faces.train, faces.valid])  # standardized per pixel for a GRBM
    assert torch.allclose(everything.mean(0), torch.zeros(560), atol=1e-4)
    scaled = load(
        builtin("freyface", rbm_pb2.PREPROCESS_SCALE, limit="50"), rbm_pb2.MODEL_KIND_GAUSSIAN
    )
    assert float(scaled.train.min()) >= 0.0 and float(scaled.train.max()) <= 1.0
    synthetic = load(builtin("synthetic", n_visible="12", n_samples="50", seed="4"))
    assert synthetic.n_visible == 12 and synthetic.train.shape[0] + synthetic.valid.shape[0] == 50

    # Uploaded uint8 images follow the same rule as the built-in ones.
    uploaded = Uploaded("uint8", (4, 2, 3), bytes(range(0, 240, 10)))
    upload_ref = rbm_pb2.DatasetRef(dataset_id="f" * 64)
    images = load(upload_ref, uploaded=uploaded)
    rows = torch.cat([images.train, images.valid])  # (4, 2, 3) flattened to (4, 6), binarized
    assert rows.shape == (4, 6) and set(torch.unique(rows).tolist()) == {0.0, 1.0}
    upload_ref.preprocess = rbm_pb2.PREPROCESS_NONE
    raw = load(upload_ref, rbm_pb2.MODEL_KIND_GAUSSIAN, uploaded)
    assert sorted(torch.cat([raw.train, raw.valid])[:, 0].tolist()) == [0, 60, 120, 180]

    # Float data outside [0, 1] cannot feed binary units: the job says which preprocessing fits.
    floats = Uploaded("float32", (4, 1), np.array([0, 0.5, 1, 3], "<f4").tobytes())
    with pytest.raises(DatasetError, match="SCALE or BINARIZE"):
        load(rbm_pb2.DatasetRef(dataset_id="e" * 64), uploaded=floats)


# --- training process failures -------------------------------------------------------------


def new_trainers(known: set[int]) -> list[int]:
    """Live training processes of this test process that are not in ``known``."""
    return [pid for pid in training_processes_of(os.getpid()) if pid not in known]


async def signal_the_trainer(h: Harness, total: int, signum: int) -> tuple[str, int]:
    """Submit a job of ``total`` steps and send ``signum`` to its training process once it has
    trained past a checkpoint; the job's id and the process's pid."""
    known = set(training_processes_of(os.getpid()))  # other tests' spawned processes
    job_id = await h.submit(spec(steps=total, checkpoint_every=50))
    await h.wait_for(job_id, lambda r: 50 <= r.checkpoint_step < r.step)
    trainers = new_trainers(known)
    assert len(trainers) == 1, trainers  # no spare is started while the job runs
    os.kill(trainers[0], signum)
    return job_id, trainers[0]


async def assert_resumed_with_each_step_once(h: Harness, job_id: str, total: int) -> str:
    """The job went QUEUED again after its training process failed, was resumed from a
    checkpoint under the next attempt and published every step once; the release message."""
    changes = await h.state_changes(job_id)
    assert state_names(changes) == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "SUCCEEDED"]
    released, resumed = changes[2], changes[3]
    assert released.attempt == 1 and "failure 1 of 3" in released.message
    assert resumed.attempt == 2 and resumed.step % 50 == 0 and resumed.step >= 50
    steps = [step for step, _ in await h.metric_steps(job_id)]
    assert steps == list(range(10, total + 1, 10))
    return released.message


def test_a_sigkilled_training_process_is_retried_from_the_checkpoint(redis_url: str) -> None:
    """SIGKILL the training process mid-job (as the OOM killer would): the job is not FAILED
    but released and resumed from its last checkpoint in a fresh process; it SUCCEEDS with
    every metric step once and the crash counted in `child_failures`."""
    total = 2000

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        job_id, _ = await signal_the_trainer(h, total, signal.SIGKILL)
        final = await h.wait_for(job_id, lambda r: r.state.is_terminal)
        assert final.state is JobState.SUCCEEDED, final.error
        assert final.child_failures == 1 and final.attempt == 2 and final.step == total
        message = await assert_resumed_with_each_step_once(h, job_id, total)
        assert "killed by SIGKILL" in message and "resumes from the last checkpoint" in message

    workers = run_with_workers(redis_url, ["w1"], scenario)
    assert [outcome for _, outcome in workers[0].jobs_run] == ["released", "SUCCEEDED"]


def test_a_training_process_killed_too_often_fails_the_job_with_its_memory(
    redis_url: str,
) -> None:
    """SIGKILL every training process the job gets: after the bound (2 here) the job ends
    FAILED, saying how often, the signal, that it is likely out of memory and how much the
    model needs."""

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        known = set(training_processes_of(os.getpid()))
        job_id = await h.submit(spec(steps=1_000_000, checkpoint_every=50))
        while not (record := await h.jobs.get(TENANT, job_id)).state.is_terminal:
            if record.state is JobState.RUNNING:
                for pid in new_trainers(known):  # a spare not yet given the job is not counted
                    os.kill(pid, signal.SIGKILL)
                    known.add(pid)
            await asyncio.sleep(0.05)
        assert record.state is JobState.FAILED and record.child_failures == 2
        assert "the training process failed 2 times" in record.error
        assert "killed by SIGKILL" in record.error and "likely out of memory" in record.error
        assert re.search(r"needs about \d+ MB", record.error), record.error
        assert "SSDRBM_MAX_TRAINING_PROCESS_FAILURES" in record.error
        names = state_names(await h.state_changes(job_id))
        assert names == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "FAILED"]

    run_with_workers(redis_url, ["w1"], scenario, max_training_process_failures=2)


def test_a_hung_training_process_is_killed_and_the_job_retried(redis_url: str) -> None:
    """SIGSTOP the training process (hung: no progress, no heartbeat): after the heartbeat
    deadline (short here) the worker kills it and the job resumes from its checkpoint in a
    fresh process and SUCCEEDS, every metric step once."""
    total = 2000

    async def scenario(h: Harness, workers: list[Worker]) -> None:
        job_id, victim = await signal_the_trainer(h, total, signal.SIGSTOP)
        try:
            final = await h.wait_for(job_id, lambda r: r.state.is_terminal)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the worker should have killed it
                os.kill(victim, signal.SIGKILL)
        assert final.state is JobState.SUCCEEDED, final.error
        assert final.child_failures == 1 and final.attempt == 2
        message = await assert_resumed_with_each_step_once(h, job_id, total)
        assert "killed as hung" in message and "SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS" in message

    run_with_workers(redis_url, ["w1"], scenario, child_heartbeat_timeout_seconds=4.0)
