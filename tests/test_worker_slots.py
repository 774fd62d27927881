"""Slots: one worker process trains several jobs at once, each slot a worker of its own to the
queue and the leases, on its own share of the CPUs.

The slot count's rule is checked as a function of the machine (CPUs, quota, memory, GPU); the
slots themselves with real parts: a real redis-server, `python -m ssdrbm_server.worker
--slots 2` as a process (SIGTERM), and an in-process worker of two slots that resumes the jobs.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ssdcore.checkpoint import model_from_bytes
from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.cpus import format_cpu_list, parse_cpu_list, process_cpus, split_cpus
from ssdrbm_server.resolver import resolve
from ssdrbm_server.store import CheckpointStore, JobRecord, JobState, JobStore
from ssdrbm_server.worker import Worker, slots
from ssdrbm_server.worker.runner import PROCESS_BASE_MB
from ssdrbm_server.worker.slots import MAX_DEFAULT_SLOTS, Machine, default_slot_count
from tests.fixtures.server_process import start_python_m_worker
from tests.test_worker import (
    LEASE_S,
    SETTINGS,
    WAIT_S,
    Harness,
    spec,
    state_names,
    training_processes_of,
    wait_until,
)

GB = 1024
SLOT_MB = PROCESS_BASE_MB + Settings().pack_memory_mb  # what the default sizes a slot for
ROOMY = 1024 * GB  # memory that caps nothing


def machine(cpus: int, *, quota: float | None = None, memory_mb: int | None = ROOMY, gpu=False):
    return Machine(frozenset(range(cpus)), quota, memory_mb, gpu)


@pytest.mark.parametrize(
    ("host", "threads", "expected"),
    [
        (machine(16), 1, 16),  # one slot per CPU at one torch thread per process
        (machine(64), 1, MAX_DEFAULT_SLOTS),  # one event loop supervises them all: capped
        (machine(16), 4, 4),  # SSDRBM_TORCH_THREADS=4: four CPUs per slot
        (machine(16), 32, 1),  # more threads than CPUs: still one slot
        (machine(1), 1, 1),
        (machine(64, quota=3.5), 1, 3),  # a container limited to 3.5 CPUs' time
        (machine(16, memory_mb=16 * GB), 1, 16 * GB // SLOT_MB),  # room for 3 full packs
        (machine(16, memory_mb=2 * GB), 1, 1),  # not even one: one slot, as before slots
        (machine(16, memory_mb=None), 1, 16),  # memory unknown: the CPUs decide
        (machine(16, gpu=True), 1, 1),  # the slots would share the one device
    ],
)
def test_the_default_slot_count_follows_cpus_threads_memory_and_gpu(host, threads, expected):
    assert default_slot_count(host, threads_per_process=threads, slot_memory_mb=SLOT_MB) == expected


def test_a_set_slot_count_wins_and_a_negative_one_is_refused() -> None:
    assert slots.slot_count(Settings(worker_slots=3), machine(16, gpu=True)) == 3
    assert slots.slot_count(Settings(worker_slots=0, torch_threads=2), machine(8)) == 4
    with pytest.raises(ConfigError, match="SSDRBM_WORKER_SLOTS must be 0"):
        Settings.from_env({"SSDRBM_WORKER_SLOTS": "-1"})


def test_slots_get_their_ids_and_a_share_of_the_cpus() -> None:
    host = Machine(frozenset({0, 1, 2, 3, 4, 5, 8}), None, ROOMY, False)
    shares = slots.slot_settings(Settings(worker_slots=3), "host-7", host)
    assert [s.worker_id for s in shares] == ["host-7/0", "host-7/1", "host-7/2"]
    assert [s.training_cpus for s in shares] == ["0-2", "3-4", "5,8"]
    assert {s.torch_threads for s in shares} == {7 // 3}
    # SSDRBM_TORCH_THREADS stays as set; one slot keeps the worker's id and pins nothing new.
    assert {s.torch_threads for s in slots.slot_settings(Settings(torch_threads=1), "h", host)} == {
        1
    }
    [alone] = slots.slot_settings(Settings(worker_slots=1), "host-7", host)
    assert alone == Settings(worker_slots=1, worker_id="host-7")
    # More slots than CPUs: no share is fixed, the scheduler balances them.
    assert split_cpus({0, 1}, 3) == [frozenset({0, 1})] * 3


@pytest.mark.parametrize("cpus", [set(), {0}, {0, 1, 2, 3, 8}, {1, 3, 5}, set(range(64))])
def test_cpu_lists_format_as_they_parse(cpus) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_the_machine_is_read_from_the_cgroup_and_the_devices(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(slots, "_own_cgroup", lambda: tmp_path)
    assert slots.cgroup_cpu_quota() is None  # no cpu.max: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert slots.cgroup_cpu_quota() is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert slots.cgroup_cpu_quota() == 2.5
    (tmp_path / "memory.max").write_text(f"{3 * 1024**3}\n")
    assert slots.memory_mb() == 3 * GB
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not slots.has_gpu()


# --- two slots, real processes ----------------------------------------------------------------

TENANTS = ("alice", "bob")
# Long enough for both jobs to be stopped in the middle: about 2 s here (1-2 ms a step on a
# loaded 2-core machine), both training processes having warmed up before the jobs arrive.
TOTAL = 1000
SIGTERM_AFTER = 30  # steps each job has published when the worker is stopped


def job_spec():
    return spec(steps=TOTAL, eval_every=10, checkpoint_every=TOTAL)


async def no_uploads(_dataset_id: str) -> None:
    return None


async def submit(h: Harness, tenant: str) -> str:
    resolved = await resolve(job_spec(), SETTINGS, no_uploads)
    job, _ = await h.jobs.submit(
        tenant,
        resolved.spec.SerializeToString(),
        name=tenant,
        total_steps=resolved.total_steps,
        request_id=None,
        n_visible=resolved.n_visible,
    )
    return job.id


async def records(jobs: JobStore, ids: dict[str, str]) -> dict[str, JobRecord]:
    return {tenant: await jobs.get(tenant, job_id) for tenant, job_id in ids.items()}


async def wait_for_all(jobs: JobStore, ids: dict[str, str], done) -> dict[str, JobRecord]:
    """The jobs' records once ``done(record)`` holds for all of them in one reading."""
    found: dict[str, JobRecord] = {}

    async def read() -> bool:
        found.update(await records(jobs, ids))
        return all(done(r) for r in found.values())

    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not await read():
        assert asyncio.get_running_loop().time() < deadline, [
            (r.state, r.worker, r.step, r.started_at, r.finished_at) for r in found.values()
        ]
        await asyncio.sleep(0.05)
    return found


def start_worker(redis_url: str, worker_id: str, heartbeat: Path) -> subprocess.Popen[bytes]:
    """`python -m ssdrbm_server.worker --slots 2` with these settings."""
    return start_python_m_worker(
        redis_url,
        "--slots",
        "2",
        worker_id=worker_id,
        lease_seconds=LEASE_S,
        heartbeat_seconds=0.25,
        torch_threads=1,  # as the resuming worker's, so that the runs compare bit for bit
        worker_heartbeat_file=heartbeat,
        worker_metrics_port=0,
        allow_no_persistence=1,
        log_level="WARNING",
    )


def cpu_ticks(pid: int) -> int:
    """User and system CPU time of a process so far, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def wait_until_idle(pids: list[int]) -> None:
    """Until the processes have used (almost) no CPU for half a second: warmed up and waiting."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        before = [cpu_ticks(pid) for pid in pids]
        await asyncio.sleep(0.5)
        if all(cpu_ticks(pid) - ticks <= 1 for pid, ticks in zip(pids, before, strict=True)):
            return
        assert asyncio.get_running_loop().time() < deadline, "the training processes never idled"


def allowed_cpus(pid: int) -> frozenset[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1].strip())
    raise AssertionError(f"no CPU list for process {pid}")


def test_two_slots_train_two_tenants_at_once_stop_on_sigterm_and_resume_bit_for_bit(
    redis_url: str, tmp_path: Path
) -> None:
    """One worker process with two slots trains a job of each of two tenants at the same time,
    each slot under its own id in its own training process on its own CPUs. SIGTERM: both jobs
    are checkpointed where they stand and QUEUED again, and the process exits 0 and removes its
    heartbeat file. A worker of two slots resumes both and trains an uninterrupted twin (the
    jobs' specs are equal): both SUCCEED with each metric step once, equal bit for bit to it."""
    heartbeat = tmp_path / "worker.beat"

    async def main() -> None:
        h = Harness(redis_url)
        first = start_worker(redis_url, "p1", heartbeat)
        try:
            await wait_until(lambda: len(training_processes_of(first.pid)) == 2)
            trainers = training_processes_of(first.pid)
            await wait_until_idle(trainers)  # warm: the jobs then start together
            ids = {tenant: await submit(h, tenant) for tenant in TENANTS}
            both = await wait_for_all(
                h.jobs,
                ids,
                lambda r: r.state is JobState.RUNNING and r.step >= SIGTERM_AFTER,
            )
            assert {r.worker for r in both.values()} == {"p1/0", "p1/1"}
            assert all(r.step < TOTAL for r in both.values()), "a job ended before the stop"
            assert heartbeat.exists()
            assert sorted(training_processes_of(first.pid)) == sorted(trainers)
            expected = split_cpus(process_cpus(), 2)
            assert sorted(map(allowed_cpus, trainers), key=sorted) == sorted(expected, key=sorted)
            first.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(first.wait, WAIT_S) == 0
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        assert not heartbeat.exists()
        stopped = await records(h.jobs, ids)
        for record in stopped.values():
            assert record.state is JobState.QUEUED, record
            assert SIGTERM_AFTER <= record.checkpoint_step == record.step < TOTAL

        twin_id = await submit(h, "carol")
        resumer = Worker(SETTINGS.replace(redis_url=redis_url, worker_id="p2", worker_slots=2))
        task = asyncio.create_task(resumer.run())
        registry = resumer.metrics.registry
        try:
            await wait_until(lambda: registry.get_sample_value("ssdrbm_worker_busy_slots") == 2)
            assert registry.get_sample_value("ssdrbm_worker_slots") == 2
            done = await wait_for_all(h.jobs, ids, lambda r: r.state.is_terminal)
            twin = (await wait_for_all(h.jobs, {"carol": twin_id}, lambda r: r.state.is_terminal))[
                "carol"
            ]
        finally:
            await resumer.stop(graceful=False)
            await task
        assert registry.get_sample_value("ssdrbm_worker_slots") == 0

        assert twin.state is JobState.SUCCEEDED, twin.error
        checkpoints = CheckpointStore(h.redis)
        uninterrupted = model_from_bytes((await checkpoints.latest(twin_id)).data).state_dict()
        for tenant, job_id in ids.items():
            record = done[tenant]
            assert record.state is JobState.SUCCEEDED, record.error
            assert record.attempt == 2 and record.worker in {"p2/0", "p2/1"}
            changes = await h.state_changes(job_id)
            assert state_names(changes) == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "SUCCEEDED"]
            assert changes[3].step == stopped[tenant].step  # resumed where it was stopped
            steps = [step for step, _ in await h.metric_steps(job_id)]
            assert steps == list(range(10, TOTAL + 1, 10))
            resumed = model_from_bytes((await checkpoints.latest(job_id)).data).state_dict()
            assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
        await h.redis.aclose()

    asyncio.run(main())
