"""One blow-up recovery rule (ssdcore.blowup.Recovery) for the library and the service.

The same diverging configuration, trained by ``ssdcore.fit`` and by the service (StartTraining,
its worker and training process, a real redis-server), backs off at the same steps to the same
points with the same step sizes, publishes the library's evaluations, and ends with the
library's parameters, bit for bit on the CPU (one torch thread on both sides: the same float32
operations in the same order); so does the job trained in a pack with another. A training
process killed after a backoff rolled the job back between two checkpoints resumes from that
point and still ends with those parameters; one killed before a slow blow-up resumes with the
detector references its checkpoint kept, and backs off where the uninterrupted run does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import pytest
import torch
from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore import fit
from ssdcore.blowup import RECONSTRUCTION_GROWTH, BlowUpError
from ssdcore.checkpoint import model_from_bytes
from ssdcore.models import model_from_config
from ssdcore.models.base import RBM
from ssdrbm_server.config import Settings
from ssdrbm_server.job_spec import EXACT_LL_MAX_HIDDEN, model_config, optimizer_config
from ssdrbm_server.store import JobState
from ssdrbm_server.worker import Worker
from ssdrbm_server.worker.child import packed_summary
from ssdrbm_server.worker.datasets import prepare
from tests.fixtures.service import RunningService
from tests.test_packed_worker import PackHarness, run_queued, summary
from tests.test_service import events, export, states
from tests.test_worker import SETTINGS as WORKER_SETTINGS
from tests.test_worker import TENANT, training_processes_of

pytestmark = pytest.mark.usefixtures("one_thread")

# Plain SGD on a unit-variance Gaussian RBM at this step size, reached over a 30-step warm-up:
# the synthetic data blows it up at step 5 (rolled back to the start) and, ten times smaller,
# at step 40 as the warm-up ramps it (rolled back to step 35, between two checkpoints); a
# hundred times smaller it trains on (seeded: always these steps).
LR, WARMUP = 20.0, 30
EXPECTED_BACKOFFS = [(5, 0), (40, 35)]
# A slow blow-up: SGD at lr 2 reached over a 3,000-step warm-up, evaluated every 10 steps. The
# error is at its best (3.5) around step 100 and then drifts up as the step size grows, until at
# step 2880 it is 10.6× that best: one backoff, to step 2870. Every evaluation from step 1520 on
# is above a tenth of that value, so a detector whose references restarted at a resume point
# there would let the blow-up pass.
SLOW_LR, SLOW_WARMUP, SLOW_EVERY = 2.0, 3000, 10
SLOW_RESUME, SLOW_BACKOFFS = 1600, [(2880, 2870)]
MESSAGES = {"metrics": pb.Metrics, "backoff": pb.Backoff}  # stored event data by kind
WAIT_S = 120.0  # bound for a job to end on a loaded machine (not a speed check)


def diverging_request(
    *,
    steps: int,
    checkpoint_every: int,
    lr: float = LR,
    warmup: int = WARMUP,
    eval_every: int = 5,
) -> pb.StartTrainingRequest:
    builtin = pb.BuiltinDataset(
        name="synthetic", options={"n_visible": "16", "n_hidden": "4", "n_samples": "400"}
    )
    warm_up = pb.StepSizeSchedule(kind=pb.SCHEDULE_KIND_CONSTANT, warmup_steps=warmup)
    return pb.StartTrainingRequest(
        model=pb.ModelSpec(
            kind=pb.MODEL_KIND_GAUSSIAN, n_hidden=8, variance=pb.VARIANCE_KIND_IDENTITY
        ),
        optimizer=pb.OptimizerSpec(kind=pb.OPTIMIZER_KIND_SGD, lr=lr, schedule=warm_up),
        training=pb.TrainingSpec(
            batch_size=20, steps=steps, seed=3, checkpoint_every=checkpoint_every
        ),
        eval=pb.EvalSpec(every=eval_every, validation_fraction=0.2),
        dataset=pb.DatasetRef(builtin=builtin),
    )


def library_run(
    spec: pb.StartTrainingRequest, total_steps: int, settings: Settings
) -> tuple[list[dict[str, Any]], RBM]:
    """``ssdcore.fit`` on a job's resolved spec, its history and model. The data is the job's
    own (the training process's preparation: dataset, preprocessing, validation split, after
    seeding torch with the job's seed) and the model is drawn from the generator state the
    training process draws it from."""
    torch.manual_seed(spec.training.seed)
    data = prepare(spec, settings, None)
    model = model_from_config(model_config(spec, data.n_visible))
    assert spec.model.n_hidden <= EXACT_LL_MAX_HIDDEN  # the service evaluates it exactly
    history = fit(
        model,
        data.train,
        steps=total_steps,
        batch_size=spec.training.batch_size,
        cd_k=spec.training.cd_k,
        persistent=spec.training.persistent,
        optimizer=optimizer_config(spec.optimizer),
        seed=spec.training.seed,
        eval_every=spec.eval.every,
        valid_data=data.valid,
        log_likelihood="exact",
        max_backoffs=spec.training.max_backoffs,
        backoff_factor=spec.training.backoff_factor,
    )
    return history, model


def library_events(history: list[dict[str, Any]]) -> list[tuple]:
    """The history as the service's stream shows it: every evaluation after the one before
    training (which the service does not publish), and every backoff, in order."""
    shown = []
    for entry in history:
        if entry.get("event") == "backoff":
            shown.append(
                (
                    "backoff",
                    entry["step"],
                    entry["rolled_back_to"],
                    entry["old_lr"],
                    entry["new_lr"],
                    entry["backoff"],
                    entry["max_backoffs"],
                    entry["reason"],
                )
            )
        elif entry["step"] > 0:
            shown.append(("metrics", entry["step"], entry["reconstruction_error"], entry["lr"]))
    return shown


def service_events(stream: list[pb.MetricEvent]) -> list[tuple]:
    """A job's metric stream as :func:`library_events` shows the library's history."""
    return stored_events(
        [(e.WhichOneof("event"), getattr(e, e.WhichOneof("event"))) for e in stream]
    )


def stored_events(events: list[tuple[str, Any]]) -> list[tuple]:
    """(kind, message) events, the Backoff and Metrics ones as :func:`library_events` shows
    the library's history."""
    shown = []
    for kind, message in events:
        if kind == "backoff":
            shown.append(
                (
                    "backoff",
                    message.step,
                    message.rollback_step,
                    message.old_lr,
                    message.new_lr,
                    message.backoff,
                    message.max_backoffs,
                    message.reason,
                )
            )
        elif kind == "metrics":
            shown.append(("metrics", message.step, message.reconstruction_error, message.lr))
    return shown


def assert_same_parameters(stub, job: pb.Job, model: RBM) -> None:
    """The job's final checkpoint holds exactly ``model``'s parameters."""
    header, data = export(stub, job.id)
    exported = model_from_bytes(data).state_dict()
    assert header.step == job.total_steps
    for name, value in model.state_dict().items():
        assert torch.equal(exported[name], value), name


def assert_the_library_run(
    stub, job: pb.Job, stream: list[pb.MetricEvent], settings: Settings, backoffs: list
) -> None:
    """The job ended as the uninterrupted library run of its spec does: the expected
    ``backoffs`` (step, rollback step), the same evaluations and Backoff events in its stream,
    the same final parameters."""
    history, model = library_run(job.spec, job.total_steps, settings)
    shown = library_events(history)
    assert [(e[1], e[2]) for e in shown if e[0] == "backoff"] == backoffs
    assert service_events(stream) == shown
    assert_same_parameters(stub, job, model)


def passes_a_detector_restarted_at(
    spec: pb.StartTrainingRequest, settings: Settings, resumed_at: int
) -> bool:
    """Whether the job's first blow-up (the library run's, backoff off) stays within the
    reconstruction-error growth allowed against the best error from ``resumed_at`` on: a
    detector whose references restarted there would not flag it."""
    without_backoff = pb.StartTrainingRequest()
    without_backoff.CopyFrom(spec)
    without_backoff.training.max_backoffs = 0
    with pytest.raises(BlowUpError) as raised:
        library_run(without_backoff, spec.training.steps, settings)
    blowup, history = raised.value.blowup, raised.value.history
    assert blowup is not None and blowup.metric == "reconstruction_error", blowup
    since = [e["reconstruction_error"] for e in history if e["step"] >= resumed_at]
    return blowup.value <= RECONSTRUCTION_GROWTH * min(since)


class PacedTraining:
    """The job's training process (the one child of this test process not in ``known``), held
    still (SIGSTOP) while the test reads the job's record and let go (SIGCONT) between
    readings. Between two readings it trains for a few milliseconds of its own, so however
    loaded the machine, it cannot train far past the moment the test aims at (a window of
    about a thousand steps, half a second on a quiet machine)."""

    def __init__(self, known: set[int]) -> None:
        self.known = known
        self.pid: int | None = None

    def hold(self) -> None:
        if self.pid is None:
            found = [pid for pid in training_processes_of(os.getpid()) if pid not in self.known]
            if not found:
                return  # not started yet: nothing to hold
            assert len(found) == 1, found
            self.pid = found[0]
        os.kill(self.pid, signal.SIGSTOP)

    def release(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        os.kill(self.pid, signal.SIGCONT)  # a stopped process dies once it runs again


def kill_training_process_once(stub, job_id: str, known: set[int], done) -> None:
    """SIGKILL the job's training process (the one not in ``known``) as soon as its record
    satisfies ``done``, reading the record while the process is held still."""
    training = PacedTraining(known)
    deadline = time.monotonic() + WAIT_S
    while True:
        training.hold()
        record = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)
        if done(record) and training.pid is not None:
            break
        training.release()
        assert time.monotonic() < deadline, record
        time.sleep(0.005)
    training.kill()


def ended_after_one_kill(
    stub, job_id: str, *, resumed_at: int
) -> tuple[list[pb.MetricEvent], pb.Job]:
    """The job's stream and record once it ended: SUCCEEDED after one training process
    failure, resumed at step ``resumed_at``."""
    stream = events(stub, job_id)
    job = stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    assert job.training_process_failures == 1
    assert states(stream) == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "SUCCEEDED"]
    resumed = [e.state for e in stream if e.WhichOneof("event") == "state"][3]
    assert resumed.step == resumed_at
    return stream, job


def test_the_library_and_the_service_back_off_alike_and_end_with_the_same_parameters(
    service_factory,
) -> None:
    running: RunningService = service_factory(torch_threads=1, finished_checkpoints_kept=10)
    stub = running.stub()
    job = stub.StartTraining(diverging_request(steps=60, checkpoint_every=20), timeout=30).job
    stream = events(stub, job.id)
    job = stub.GetJob(pb.GetJobRequest(job_id=job.id), timeout=10)
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    assert states(stream) == ["QUEUED", "RUNNING", "SUCCEEDED"] and job.backoffs == 2

    assert_the_library_run(stub, job, stream, running.settings, EXPECTED_BACKOFFS)
    # The rollback to step 35 checkpointed it (checkpoints every 20 steps do not include it),
    # so that a restart would resume from there.
    header, _ = export(stub, job.id, step=35)
    assert header.step == 35


def test_a_training_process_killed_after_a_rollback_between_checkpoints_resumes_from_it(
    service_factory,
) -> None:
    """The second backoff rolls back to step 35, the only checkpoint until step 1500; the
    training process is killed after it. The job resumes from step 35 with its two backoffs
    and ends exactly as the uninterrupted library run: each evaluation and backoff once in
    the stream, the same parameters."""
    known = set(training_processes_of(os.getpid()))  # before the service starts its own
    running: RunningService = service_factory(torch_threads=1)
    stub = running.stub()
    request = diverging_request(steps=3000, checkpoint_every=1500)
    job = stub.StartTraining(request, timeout=30).job
    kill_training_process_once(
        stub, job.id, known, lambda r: r.backoffs == 2 and r.checkpoint_step == 35 and r.step > 35
    )
    stream, job = ended_after_one_kill(stub, job.id, resumed_at=35)
    assert job.backoffs == 2

    assert_the_library_run(stub, job, stream, running.settings, EXPECTED_BACKOFFS)


def test_a_job_resumed_before_a_slow_blow_up_backs_off_where_the_uninterrupted_run_does(
    service_factory,
) -> None:
    """The slow blow-up at step 2880 passes a detector whose references restart at step 1600,
    the job's first checkpoint; its training process is killed after that checkpoint, before
    the blow-up. Resumed from step 1600 with the detector references the checkpoint kept, the
    job backs off at step 2880 to 2870 as the uninterrupted library run does, and ends with its
    parameters (torch.equal): each evaluation and the backoff once in the stream."""
    known = set(training_processes_of(os.getpid()))  # before the service starts its own
    running: RunningService = service_factory(torch_threads=1)
    stub = running.stub()
    request = diverging_request(
        steps=3500,
        checkpoint_every=SLOW_RESUME,
        lr=SLOW_LR,
        warmup=SLOW_WARMUP,
        eval_every=SLOW_EVERY,
    )
    job = stub.StartTraining(request, timeout=30).job
    kill_training_process_once(stub, job.id, known, lambda r: r.checkpoint_step == SLOW_RESUME)
    # Resumed at step 1600: killed before the blow-up, whose rollback checkpoint came later.
    stream, job = ended_after_one_kill(stub, job.id, resumed_at=SLOW_RESUME)
    assert job.backoffs == 1

    assert passes_a_detector_restarted_at(job.spec, running.settings, SLOW_RESUME)
    assert_the_library_run(stub, job, stream, running.settings, SLOW_BACKOFFS)


def test_a_packed_job_backs_off_as_the_library_and_ends_with_its_parameters(
    redis_url: str,
) -> None:
    """The diverging job packed with a healthy one (the same pack key, another step size):
    its backoffs, evaluations and final parameters are the library run's, bit for bit; the
    healthy run is not disturbed by them (tests/test_packed_worker.py compares such runs with
    their solo runs)."""
    diverging = diverging_request(steps=60, checkpoint_every=20)
    healthy = pb.StartTrainingRequest()
    healthy.CopyFrom(diverging)
    healthy.optimizer.lr = LR / 100
    ended: dict[str, Any] = {}

    async def scenario(h: PackHarness, job_ids: list[str], worker: Worker) -> None:
        records = [await h.wait_done(job_id) for job_id in job_ids]
        assert [r.state for r in records] == [JobState.SUCCEEDED] * 2, [r.error for r in records]
        assert all(json.loads(r.runtime)["summary"].endswith(packed_summary(2)) for r in records)
        record = records[0]
        ended["record"] = record
        ended["events"] = [
            (kind, MESSAGES[kind].FromString(data))
            for kind, data, _ in await h.events_of(record.id)
            if kind in MESSAGES
        ]
        ended["parameters"] = await h.final_parameters(record.id)

    run_queued(redis_url, [diverging, healthy], scenario, max_pack_size=2)
    record = ended["record"]
    spec = pb.StartTrainingRequest.FromString(record.spec)
    history, model = library_run(spec, record.total_steps, WORKER_SETTINGS)
    shown = library_events(history)
    assert [(e[1], e[2]) for e in shown if e[0] == "backoff"] == EXPECTED_BACKOFFS
    assert stored_events(ended["events"]) == shown
    for name, value in model.state_dict().items():
        assert torch.equal(ended["parameters"][name], value), name


def test_a_packed_job_stopped_before_a_slow_blow_up_resumes_packed_and_backs_off_alike(
    redis_url: str,
) -> None:
    """The slow-diverging job packed with a healthy one: their worker stops (SIGTERM's graceful
    stop: every run checkpointed and released) after step 1600, before the blow-up, and
    another packing worker resumes both as a pack, each run with the detector references its
    own checkpoint kept. The diverging job backs off at step 2880 to 2870 as the uninterrupted
    library run does, and ends with its parameters (torch.equal); a detector restarted at the
    step it stopped at would have let that blow-up pass."""
    diverging = diverging_request(
        steps=3500, checkpoint_every=500, lr=SLOW_LR, warmup=SLOW_WARMUP, eval_every=SLOW_EVERY
    )
    healthy = pb.StartTrainingRequest()
    healthy.CopyFrom(diverging)
    healthy.optimizer.lr = SLOW_LR / 100
    ended: dict[str, Any] = {}

    async def stop_after_the_resume_point(h: PackHarness, job_ids: list[str], worker) -> None:
        training = PacedTraining(set())  # the harness's worker runs in this process
        deadline = time.monotonic() + WAIT_S
        while True:
            training.hold()
            if (await h.jobs.get(TENANT, job_ids[0])).step >= SLOW_RESUME:
                break
            training.release()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        stopping = asyncio.ensure_future(worker.stop(graceful=True))
        await asyncio.sleep(0.05)  # the stop request is on its way before the pack trains on
        training.release()
        await stopping
        stopped = [await h.wait_for_state(job_id, JobState.QUEUED) for job_id in job_ids]
        assert all(r.state is JobState.QUEUED and r.backoffs == 0 for r in stopped)
        assert all(summary(r).endswith(packed_summary(2)) for r in stopped)
        ended["job_ids"], ended["stopped_at"] = job_ids, stopped[0].checkpoint_step

    async def finish_packed(h: PackHarness, _: list[str], worker) -> None:
        records = [await h.wait_done(job_id) for job_id in ended["job_ids"]]
        assert [r.state for r in records] == [JobState.SUCCEEDED] * 2, [r.error for r in records]
        assert all(summary(r).endswith(packed_summary(2)) for r in records)  # packed again
        ended["record"] = records[0]
        ended["events"] = [
            (kind, MESSAGES[kind].FromString(data))
            for kind, data, _ in await h.events_of(records[0].id)
            if kind in MESSAGES
        ]
        ended["parameters"] = await h.final_parameters(records[0].id)

    run_queued(redis_url, [diverging, healthy], stop_after_the_resume_point, max_pack_size=2)
    run_queued(redis_url, [], finish_packed, max_pack_size=2)
    record, stopped_at = ended["record"], ended["stopped_at"]
    assert SLOW_RESUME <= stopped_at < SLOW_BACKOFFS[0][1]  # stopped before the blow-up
    spec = pb.StartTrainingRequest.FromString(record.spec)
    assert passes_a_detector_restarted_at(spec, WORKER_SETTINGS, stopped_at)
    history, model = library_run(spec, record.total_steps, WORKER_SETTINGS)
    shown = library_events(history)
    assert [(e[1], e[2]) for e in shown if e[0] == "backoff"] == SLOW_BACKOFFS
    assert stored_events(ended["events"]) == shown
    for name, value in model.state_dict().items():
        assert torch.equal(ended["parameters"][name], value), name
