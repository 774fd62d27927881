"""Packed training through the worker, against a real redis-server and real training processes.

Compatible jobs queued together are claimed as one pack and trained in one process; each job
stays a job of its own: its lease, fenced writes, metric stream, checkpoints, backoffs and
final state. Each test states what it proves. Jobs are tiny (16 visibles, 8 hidden units);
on the CPU a packed run equals its solo run bit for bit (tests/test_pack.py), so the
comparisons with solo runs below are exact (tolerance 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore.checkpoint import model_from_bytes
from ssdrbm_server.keys import Keys
from ssdrbm_server.packing import NOT_PACKABLE, job_pack_key
from ssdrbm_server.resolver import resolve
from ssdrbm_server.store import JobQueue, JobRecord, JobState, JobStore, LeaseStore
from ssdrbm_server.store.pack_claims import PackClaims
from ssdrbm_server.worker import Worker
from ssdrbm_server.worker.child import packed_summary
from ssdrbm_server.worker.pack_claim import claim_riders, pack_room
from tests.test_store import run
from tests.test_worker import (
    SETTINGS,
    TENANT,
    Harness,
    is_running,
    make_worker,
    new_trainers,
    spec,
    start_worker_process,
    state_names,
    training_processes_of,
    wait_until,
)

SGD = rbm_pb2.OPTIMIZER_KIND_SGD
BLOWING_UP_LR = 20.0  # SGD at this step size saturates every hidden unit within 5 steps


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Worker processes a test starts, killed at its end if still running."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


class PackHarness(Harness):
    """Submits as StartTraining does, pack key included."""

    async def submit(self, request: rbm_pb2.StartTrainingRequest) -> str:
        job = await resolve(request, SETTINGS, self.datasets.info)
        record, _ = await self.jobs.submit(
            TENANT,
            job.spec.SerializeToString(),
            name="packed",
            total_steps=job.total_steps,
            request_id=None,
            n_visible=job.n_visible,
            pack_key=job.pack_key,
        )
        return record.id

    async def final_parameters(self, job_id: str) -> dict[str, torch.Tensor]:
        return model_from_bytes((await self.checkpoints.latest(job_id)).data).state_dict()

    async def wait_done(self, job_id: str) -> JobRecord:
        return await self.wait_for(job_id, lambda r: r.state.is_terminal)


def summary(record: JobRecord) -> str:
    return json.loads(record.runtime)["summary"]


def run_queued(
    redis_url: str,
    requests: list[rbm_pb2.StartTrainingRequest],
    scenario: Callable[[PackHarness, list[str], Worker], Awaitable[None]],
    **overrides,
) -> Worker:
    """Queue every request first, then start one worker (``overrides``: its settings) and run
    ``scenario(harness, job ids, worker)``."""
    worker = make_worker(redis_url, "packer", **overrides)

    async def main() -> None:
        h = PackHarness(redis_url)
        job_ids = [await h.submit(request) for request in requests]
        task = asyncio.create_task(worker.run())
        try:
            await scenario(h, job_ids, worker)
        finally:
            await worker.stop(graceful=False)
            await task
            await h.redis.aclose()

    asyncio.run(main())
    return worker


@dataclass
class TrainedJob:
    """What a test reads of one finished job."""

    record: JobRecord
    metric_steps: list[tuple[int, int]]  # (step, attempt) of each metric event
    checkpoint_steps: list[int]  # the retained checkpoints
    metrics: list[rbm_pb2.Metrics]
    parameters: dict[str, torch.Tensor]  # of the latest checkpoint

    @property
    def summary(self) -> str:
        return summary(self.record)


def packed_and_solo(
    redis_url: str, requests: list[rbm_pb2.StartTrainingRequest]
) -> dict[str, list[TrainedJob]]:
    """Train ``requests`` queued together by a packing worker ("packed") and by one that
    does not pack ("solo"); per job, in request order, what it ended with. Every job must
    succeed."""
    results: dict[str, list[TrainedJob]] = {}

    def collect(label: str) -> Callable[[PackHarness, list[str], Worker], Awaitable[None]]:
        async def scenario(h: PackHarness, job_ids: list[str], worker: Worker) -> None:
            records = [await h.wait_done(job_id) for job_id in job_ids]
            assert all(r.state is JobState.SUCCEEDED for r in records), [r.error for r in records]
            results[label] = [
                TrainedJob(
                    record,
                    await h.metric_steps(record.id),
                    await h.checkpoints.list_steps(record.id),
                    [
                        rbm_pb2.Metrics.FromString(data)
                        for kind, data, _ in await h.events_of(record.id)
                        if kind == "metrics"
                    ],
                    await h.final_parameters(record.id),
                )
                for record in records
            ]

        return scenario

    run_queued(redis_url, requests, collect("packed"), max_pack_size=8)
    run_queued(redis_url, requests, collect("solo"), max_pack_size=1)
    return results


def sgd(steps: int, lr: float = 0.05, **changes) -> rbm_pb2.StartTrainingRequest:
    return spec(steps=steps, lr=lr, optimizer=SGD, **changes)


def test_compatible_jobs_train_as_one_pack_each_equal_to_its_solo_run(redis_url: str) -> None:
    """Four compatible jobs (step sizes differ) and one of another shape, queued together:
    the four train in one pack (their runtime says so), the other alone; each packed job's
    stream, checkpoints and final parameters equal the same job trained solo (which is what
    SSDRBM_MAX_PACK_SIZE=1 does: today's worker), bit for bit."""
    packable = [spec(steps=60, lr=lr) for lr in (0.05, 0.03, 0.02, 0.04)]
    other = spec(steps=60)
    other.model.n_hidden = 6
    requests = [*packable, other]
    keys = set()
    for request in packable:
        resolved = asyncio.run(resolve(request, SETTINGS, _no_uploads))
        keys.add(job_pack_key(resolved.spec, resolved.n_visible))
    assert len(keys) == 1 and "" not in keys
    results = packed_and_solo(redis_url, requests)

    for index, (packed, solo) in enumerate(zip(results["packed"], results["solo"], strict=True)):
        if index < len(packable):
            assert packed.summary.endswith(packed_summary(len(packable)))
        else:
            assert "packed" not in packed.summary  # another shape: trained alone
        assert "packed" not in solo.summary
        assert packed.metric_steps == solo.metric_steps == [(s, 1) for s in range(10, 61, 10)]
        assert packed.checkpoint_steps == solo.checkpoint_steps == [60]
        for name in packed.parameters:
            assert torch.equal(packed.parameters[name], solo.parameters[name]), (index, name)
        for event, solo_event in zip(packed.metrics, solo.metrics, strict=True):
            assert event.reconstruction_error == solo_event.reconstruction_error
            assert event.log_likelihood == solo_event.log_likelihood
            assert event.log_likelihood_method == rbm_pb2.LOG_LIKELIHOOD_METHOD_EXACT


async def _no_uploads(dataset_id: str):
    raise AssertionError("no uploads here")


def test_a_blow_up_or_a_cancel_in_a_pack_leaves_the_other_runs_undisturbed(
    redis_url: str,
) -> None:
    """A pack of five SGD jobs: one blows up with backoff off (FAILED alone, with the solo
    message), one blows up with backoff on (Backoff events, trained on with smaller steps),
    one is cancelled while the pack trains (CANCELLED, nothing written after), and the two
    healthy ones go on to SUCCEEDED with exactly their solo parameters."""
    requests = [
        sgd(60),
        sgd(400),
        sgd(60, lr=BLOWING_UP_LR, max_backoffs=0, eval_every=5, checkpoint_every=5),
        sgd(60, lr=BLOWING_UP_LR, eval_every=5, checkpoint_every=5),
        sgd(1_000_000, checkpoint_every=20),
    ]
    packed: dict[str, dict] = {}

    async def scenario(h: PackHarness, job_ids: list[str], worker: Worker) -> None:
        healthy, long_one, failing, backing_off, cancelled = job_ids
        await h.wait_for(cancelled, lambda r: r.checkpoint_step >= 20)
        running = await h.jobs.get(TENANT, long_one)
        assert running.state is JobState.RUNNING and running.step < 400
        await h.jobs.cancel(TENANT, cancelled)
        cancelled_record = await h.wait_done(cancelled)
        assert cancelled_record.state is JobState.CANCELLED
        events_at_cancel = await h.events_of(cancelled)

        long_record = await h.wait_done(long_one)
        assert long_record.state is JobState.SUCCEEDED, long_record.error
        healthy_record = await h.wait_done(healthy)
        assert healthy_record.state is JobState.SUCCEEDED, healthy_record.error
        assert summary(healthy_record).endswith(packed_summary(5))

        failed = await h.wait_done(failing)
        assert failed.state is JobState.FAILED and failed.backoffs == 0
        assert "blew up with backoff off" in failed.error and "at step 5" in failed.error
        assert f"try optimizer.lr = {BLOWING_UP_LR / 10:.3g}" in failed.error

        backed = await h.wait_done(backing_off)
        assert backed.backoffs >= 1
        backoffs = [
            rbm_pb2.Backoff.FromString(data)
            for kind, data, _ in await h.events_of(backing_off)
            if kind == "backoff"
        ]
        assert len(backoffs) == backed.backoffs
        assert backoffs[0].old_lr == BLOWING_UP_LR
        assert abs(backoffs[0].new_lr - BLOWING_UP_LR / 10) < 1e-9

        await asyncio.sleep(0.5)  # nothing more is written for the cancelled job
        assert await h.events_of(cancelled) == events_at_cancel
        packed["parameters"] = {
            "healthy": await h.final_parameters(healthy),
            "long": await h.final_parameters(long_one),
        }

    run_queued(redis_url, requests, scenario, max_pack_size=8)

    solo: dict[str, dict] = {}

    async def solo_scenario(h: PackHarness, job_ids: list[str], worker: Worker) -> None:
        for job_id in job_ids:
            assert (await h.wait_done(job_id)).state is JobState.SUCCEEDED
        solo["healthy"] = await h.final_parameters(job_ids[0])
        solo["long"] = await h.final_parameters(job_ids[1])

    run_queued(redis_url, requests[:2], solo_scenario, max_pack_size=1)
    for label in ("healthy", "long"):
        for name, value in packed["parameters"][label].items():
            assert torch.equal(value, solo[label][name]), (label, name)


def test_sigkilled_worker_mid_pack_every_job_resumes_with_each_step_once(
    redis_url: str, processes: list[subprocess.Popen[bytes]]
) -> None:
    """SIGKILL a worker process while it trains a pack of three: its training process exits,
    another worker takes the jobs over once their leases lapse (packing them again), each
    resumes from its own checkpoint, and every step is in each job's stream exactly once; the
    resumed models equal uninterrupted solo runs bit for bit."""
    total = 600
    requests = [sgd(total, lr=lr, checkpoint_every=50) for lr in (0.05, 0.04, 0.03)]

    async def main() -> None:
        h = PackHarness(redis_url)
        job_ids = [await h.submit(request) for request in requests]
        doomed = start_worker_process(redis_url, "doomed")
        processes.append(doomed)
        for job_id in job_ids:
            await h.wait_for(job_id, lambda r: 50 <= r.checkpoint_step < r.step < total)
        trainers = training_processes_of(doomed.pid)
        assert len(trainers) == 1  # one training process for the three jobs
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        killed = [await h.jobs.get(TENANT, job_id) for job_id in job_ids]
        assert all(r.worker == "doomed" and r.state is JobState.RUNNING for r in killed)
        assert all(summary(r).endswith(packed_summary(3)) for r in killed)
        await wait_until(lambda: all(not is_running(pid) for pid in trainers), timeout=10)
        survivor = make_worker(redis_url, "survivor")
        task = asyncio.create_task(survivor.run())
        try:
            finals = [await h.wait_done(job_id) for job_id in job_ids]
        finally:
            await survivor.stop(graceful=False)
            await task
        for job_id, before, final in zip(job_ids, killed, finals, strict=True):
            assert final.state is JobState.SUCCEEDED, final.error
            assert final.attempt == 2 and final.worker == "survivor"
            published = await h.metric_steps(job_id)
            assert [step for step, _ in published] == list(range(10, total + 1, 10))
            assert all(attempt == 2 for step, attempt in published if step > before.step)
        resumed = [await h.final_parameters(job_id) for job_id in job_ids]
        await h.redis.aclose()

        solo: list[dict] = []

        async def solo_scenario(h2: PackHarness, ids: list[str], worker: Worker) -> None:
            for job_id in ids:
                assert (await h2.wait_done(job_id)).state is JobState.SUCCEEDED
                solo.append(await h2.final_parameters(job_id))

        await asyncio.to_thread(run_queued, redis_url, requests, solo_scenario, max_pack_size=1)
        for packed_run, solo_run in zip(resumed, solo, strict=True):
            for name, value in packed_run.items():
                assert torch.equal(value, solo_run[name]), name

    asyncio.run(main())


def key_of(request: rbm_pb2.StartTrainingRequest) -> str:
    resolved = asyncio.run(resolve(request, SETTINGS, _no_uploads))
    return resolved.pack_key


def test_the_pack_key_groups_what_one_pack_and_one_data_tensor_can_serve() -> None:
    """Step sizes, momentum, step-size schedules, steps and evaluation spacing may differ within
    a pack; the model shape, batch size, CD-k, persistence, update rule, data, preprocessing and
    split (its seed) may not; full-covariance Gaussian, tempered and centered jobs train alone."""
    base = key_of(sgd(60))
    assert base != NOT_PACKABLE
    same = [sgd(60, lr=0.01), sgd(500, eval_every=5, checkpoint_every=25)]
    momentum = sgd(60)
    momentum.optimizer.momentum = 0.5
    same.append(momentum)
    scheduled = sgd(60)
    scheduled.optimizer.schedule.kind = rbm_pb2.SCHEDULE_KIND_COSINE
    same.append(scheduled)
    assert all(key_of(request) == base for request in same)

    different = []
    for change in (
        lambda r: setattr(r.model, "n_hidden", 6),
        lambda r: setattr(r.training, "batch_size", 40),
        lambda r: setattr(r.training, "cd_k", 2),
        lambda r: setattr(r.training, "persistent", True),
        lambda r: setattr(r.training, "seed", 4),
        lambda r: setattr(r.eval, "validation_fraction", 0.25),
        lambda r: setattr(r.dataset, "preprocess", rbm_pb2.PREPROCESS_BINARIZE),
        lambda r: r.dataset.builtin.options.__setitem__("n_samples", "500"),
        lambda r: setattr(r.optimizer, "kind", rbm_pb2.OPTIMIZER_KIND_SSD),
    ):
        request = sgd(60)
        change(request)
        different.append(key_of(request))
    assert NOT_PACKABLE not in different and len({base, *different}) == len(different) + 1

    alone = [spec(steps=60, gaussian=True, variance=rbm_pb2.VARIANCE_KIND_FULL)]
    centered = sgd(60)
    centered.training.centering.SetInParent()
    alone.append(centered)
    tempered = sgd(60)
    tempered.training.persistent = True
    tempered.training.parallel_tempering.temperatures = 3
    alone.append(tempered)
    assert [key_of(request) for request in alone] == [NOT_PACKABLE] * len(alone)


def test_riders_come_from_the_first_tenant_then_the_rotation_and_spend_no_turn(
    redis_url: str,
) -> None:
    """Tenants a, b, c queue jobs (key K or another): a worker takes a's oldest job (the
    rotation's choice), then riders one per tenant in turn — a's next K job, b's, c's — up to
    the pack's room, so a's backlog does not keep the others' K jobs out; jobs of another key
    stay queued, and c, whose K job rode along, is still served before a, whose turn the
    pack's first job spent."""
    settings = SETTINGS.replace(max_pack_size=4)

    async def scenario(redis) -> None:
        jobs, queue, leases = JobStore(redis), JobQueue(redis), LeaseStore(redis)
        spec_bytes = sgd(60).SerializeToString()
        ids: dict[str, str] = {}
        for name, tenant, key in (
            ("a1", "a", "K"),
            ("a2", "a", "K"),
            ("a3", "a", "K"),
            ("a4", "a", "other"),
            ("b1", "b", "K"),
            ("c1", "c", "other"),
            ("c2", "c", "K"),
            ("c3", "c", "K"),
        ):
            record, _ = await jobs.submit(
                tenant, spec_bytes, name=name, total_steps=60, request_id=None, pack_key=key
            )
            ids[record.id] = name
        [(entry, first_id)] = await queue.read("w1", block_ms=0)
        first = await leases.claim(first_id, "w1", lease_ms=10_000)
        await queue.ack(entry)
        assert first is not None and ids[first_id] == "a1"

        async def claim(job_id: str, takeover: bool) -> object:
            return await leases.claim(job_id, "w1", lease_ms=10_000)

        riders = await claim_riders(
            first,
            settings,
            worker_id="w1",
            queue=queue,
            leases=leases,
            claims=PackClaims(redis),
            claim=claim,
        )
        assert [ids[r.job_id] for r in riders] == ["a2", "b1", "c2"]  # one per tenant in turn
        for rider in riders:
            assert (await jobs.get(rider.record.tenant, rider.job_id)).state is JobState.RUNNING
        assert await queue.rotation() == ["c", "a"]  # b's list is empty; c was not served
        left = []
        for _ in range(4):
            [(entry, job_id)] = await queue.read("w1", block_ms=0)
            left.append(ids[job_id])
            await queue.ack(entry)
        assert left == ["c1", "a3", "c3", "a4"]
        assert await queue.length() == 0

    run(redis_url, scenario)


def test_the_memory_budget_bounds_a_pack() -> None:
    """A pack stops growing at SSDRBM_PACK_MEMORY_MB (each run's estimate summed), and
    SSDRBM_MAX_PACK_SIZE=1 or a job without a pack key means a pack of one."""
    request = sgd(60)
    request.model.n_hidden = 500
    record = JobRecord(
        id="0" * 32,
        tenant=TENANT,
        name="big",
        state=JobState.QUEUED,
        spec=request.SerializeToString(),
        step=0,
        total_steps=60,
        attempt=0,
        error="",
        checkpoint_step=-1,
        worker="",
        created_at=0.0,
        started_at=None,
        finished_at=None,
        n_visible=784,
        latest_metrics=b"",
        cancel_requested=False,
        pack_key="K",
    )
    # 784×500, batch 20: 8 parameter copies and the chains, about 13.2 MB a run
    assert pack_room(record, SETTINGS.replace(pack_memory_mb=64)) == 4
    assert pack_room(record, SETTINGS.replace(pack_memory_mb=10_000)) == SETTINGS.max_pack_size
    assert pack_room(record, SETTINGS.replace(max_pack_size=1)) == 1
    record.pack_key = NOT_PACKABLE
    assert pack_room(record, SETTINGS) == 1


def test_a_solo_checkpoint_resumes_packed_and_a_packed_one_solo(redis_url: str) -> None:
    """Job A trains alone and its worker stops (SIGTERM's graceful stop: checkpoint, release);
    a packing worker resumes A from that solo checkpoint in a pack with job B, and stops too
    (every run checkpointed and released); a worker that does not pack finishes both. Each
    job's stream has every step once, and both end with exactly the parameters of the same
    jobs trained without interruption. The jobs are long enough (a few seconds) that a
    graceful stop requested at step ~80 lands before they end, however fast the machine."""
    total = 4000
    requests = [sgd(total, lr=0.05), sgd(total, lr=0.03)]

    async def stop_when(
        worker: Worker, task: asyncio.Task, h: PackHarness, job_id: str, ready
    ) -> None:
        """Stop ``worker`` gracefully once job ``job_id``'s record satisfies ``ready``."""
        await h.wait_for(job_id, ready)
        await worker.stop(graceful=True)
        await task

    async def main() -> None:
        h = PackHarness(redis_url)
        a = await h.submit(requests[0])
        alone = make_worker(redis_url, "alone", max_pack_size=1)
        task = asyncio.create_task(alone.run())
        await stop_when(alone, task, h, a, lambda r: r.checkpoint_step >= 50)
        first_stop = await h.jobs.get(TENANT, a)
        assert first_stop.state is JobState.QUEUED and "packed" not in summary(first_stop)

        b = await h.submit(requests[1])
        packer = make_worker(redis_url, "packer", max_pack_size=8)
        task = asyncio.create_task(packer.run())
        await h.wait_for(b, lambda r: r.step >= 60)
        running = [await h.jobs.get(TENANT, job_id) for job_id in (a, b)]
        assert all(summary(r).endswith(packed_summary(2)) for r in running)
        await stop_when(packer, task, h, a, lambda r: r.step > first_stop.step + 20)
        second_stop = [await h.jobs.get(TENANT, job_id) for job_id in (a, b)]
        assert all(r.state is JobState.QUEUED for r in second_stop)
        assert all(r.checkpoint_step == r.step for r in second_stop)  # stopped where it stood

        finisher = make_worker(redis_url, "finisher", max_pack_size=1)
        task = asyncio.create_task(finisher.run())
        try:
            finals = [await h.wait_done(job_id) for job_id in (a, b)]
            twins = [await h.submit(request) for request in requests]
            for twin in twins:
                assert (await h.wait_done(twin)).state is JobState.SUCCEEDED
        finally:
            await finisher.stop(graceful=False)
            await task
        for job_id, twin, final in zip((a, b), twins, finals, strict=True):
            assert final.state is JobState.SUCCEEDED, final.error
            assert "packed" not in summary(final)
            published = await h.metric_steps(job_id)
            assert [step for step, _ in published] == list(range(10, total + 1, 10))
            resumed, uninterrupted = (
                await h.final_parameters(job_id),
                await h.final_parameters(twin),
            )
            for name, value in resumed.items():
                assert torch.equal(value, uninterrupted[name]), (job_id, name)
        await h.redis.aclose()

    asyncio.run(main())


def test_a_job_whose_lease_is_lost_leaves_the_pack_and_the_others_finish(redis_url: str) -> None:
    """Another worker takes one job of a running pack over (its lease made to lapse, then a
    claim raises the attempt): the pack writes nothing more for that job — its fencing refuses
    it — while the pack's other jobs train on to SUCCEEDED."""
    requests = [sgd(1_000_000, checkpoint_every=20), sgd(300), sgd(300, lr=0.03)]

    async def scenario(h: PackHarness, job_ids: list[str], worker: Worker) -> None:
        stolen, *others = job_ids
        await h.wait_for(stolen, lambda r: r.checkpoint_step >= 20)
        leases = LeaseStore(h.redis)
        taken = None
        while taken is None:  # the packer may renew the lease between the two writes
            await h.redis.hset(Keys().job(stolen), "lease_deadline", 0)
            taken = await leases.claim(stolen, "thief", lease_ms=60_000)
        assert taken.attempt == 2
        for job_id in others:
            record = await h.wait_done(job_id)
            assert record.state is JobState.SUCCEEDED, record.error
            assert summary(record).endswith(packed_summary(3))
        events = await h.events_of(stolen)
        await asyncio.sleep(1.0)  # the pack's training process has moved on meanwhile
        assert await h.events_of(stolen) == events  # nothing more from the packer
        record = await h.jobs.get(TENANT, stolen)
        assert record.state is JobState.RUNNING and record.worker == "thief"
        assert (stolen, "lost") in worker.jobs_run

    run_queued(redis_url, requests, scenario, max_pack_size=8)


def test_a_crashed_pack_trains_its_jobs_alone_and_only_the_culprit_fails(redis_url: str) -> None:
    """SIGKILL a pack's training process: nothing tells which run caused it, so no job counts
    the failure; each is released and resumes from its checkpoint alone (pack key cleared).
    The job that keeps crashing its process alone (every one of its solo processes killed) then
    FAILS after its own retries (2 here), while its former pack-mates SUCCEED with no failure
    counted, each metric step once in their streams."""
    total = 3000
    requests = [sgd(1_000_000), sgd(total), sgd(total, lr=0.03)]

    async def scenario(h: PackHarness, job_ids: list[str], worker: Worker) -> None:
        known = set(training_processes_of(os.getpid()))  # other tests' spawned processes
        culprit, *mates = job_ids
        for job_id in job_ids:  # the pack trains, each job past its first checkpoint
            await h.wait_for(job_id, lambda r: r.checkpoint_step >= 20)
        [pack_process] = new_trainers(known)
        os.kill(pack_process, signal.SIGKILL)
        known.add(pack_process)
        while not (record := await h.jobs.get(TENANT, culprit)).state.is_terminal:
            if record.state is JobState.RUNNING and record.attempt >= 2:  # alone, not the pack
                for pid in new_trainers(known):
                    os.kill(pid, signal.SIGKILL)
                    known.add(pid)
            await asyncio.sleep(0.05)
        assert record.state is JobState.FAILED and record.child_failures == 2, record
        assert "the training process failed 2 times" in record.error
        for job_id in mates:
            done = await h.wait_done(job_id)
            assert done.state is JobState.SUCCEEDED and done.child_failures == 0, done
            assert not summary(done).endswith(packed_summary(3))  # it finished alone
            changes = await h.state_changes(job_id)
            assert state_names(changes) == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "SUCCEEDED"]
            released = changes[2].message
            assert "training process of its pack" in released and "killed by SIGKILL" in released
            assert "not counted" in released and "trains alone" in released
            steps = [step for step, _ in await h.metric_steps(job_id)]
            assert steps == list(range(10, total + 1, 10))
        for job_id in job_ids:
            assert (await h.jobs.get(TENANT, job_id)).pack_key == NOT_PACKABLE

    run_queued(redis_url, requests, scenario, max_pack_size=8, max_training_process_failures=2)
